"""`llm-gateway chat`, `embed` and `transcribe` (the playground from a terminal) against
the gateway's real HTTP stack with fake engines."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from gatewayd import cli
from gatewayd.cli_play import stream_figures
from gatewayd.core.config import Backend, ModelKind
from tests.http.test_front_door import _gateway


def test_the_figures_are_the_pages() -> None:
    """tests/js/console_core.test.js holds the page's streamFigures to the same numbers."""
    f = stream_figures(1.0, 1.25, 3.25, 21, 5)
    assert f == {"ttft_ms": 250.0, "tokens": 21, "tokens_per_s": 10.0}
    assert stream_figures(0, 0.1, 0.3, None, 3)["tokens"] == 3
    assert stream_figures(0, None, None, None, 0) == {"ttft_ms": None, "tokens": 0,
                                                      "tokens_per_s": None}


async def test_chat_streams_transcribe_prints_and_a_refusal_is_an_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLM_GATEWAY_CONFIG", str(tmp_path / "absent.toml"))
    server = {"backend": Backend.OPENAI, "command": ("/usr/bin/server", "{socket}")}
    async for gw in _gateway(tmp_path, ("a",), models_config={
            "b": {"kind": ModelKind.EMBEDDING}, "c": {**server, "kind": ModelKind.AUDIO}}):
        url = str(gw.client.make_url("")).rstrip("/")

        def run(*argv: str, url: str = url) -> asyncio.Future[int]:
            return asyncio.ensure_future(asyncio.to_thread(cli.main, ["--url", url, *argv]))

        assert await run("chat", "a", "hello there", "--max-tokens", "6",
                         "--temperature", "0.2") == 0
        out, err = capsys.readouterr()
        assert out == " w0 w1 w2 w3 w4 w5\n"
        assert err.startswith("time to first token ") and ", 6 tokens, " in err, err
        sent = json.loads(gw.fakes["a"].requests[-1].body)
        assert sent["stream"] is True and sent["max_tokens"] == 6 and sent["temperature"] == 0.2
        assert sent["messages"] == [{"role": "user", "content": "hello there"}]
        rows = await gw.records(1)
        assert rows[0]["endpoint"] == "/v1/chat/completions" and rows[0]["stream"] == 1

        audio = tmp_path / "hello.wav"
        audio.write_bytes(b"RIFF....WAVE")
        assert await run("transcribe", "c", str(audio)) == 0
        assert capsys.readouterr().out == " hello from c\n\n"
        seen = gw.fakes["c"].requests[-1]
        assert seen.path == "/v1/audio/transcriptions"
        assert b'filename="hello.wav"' in seen.body and b"RIFF....WAVE" in seen.body

        # this fake serves no embeddings: the engine's refusal, as an error
        assert await run("embed", "b", "some text") == 1
        assert "501: This server does not support embeddings" in capsys.readouterr().err
        assert await run("chat", "nope", "hi") == 1
        assert "nope" in capsys.readouterr().err
