"""The official SDKs against the real gateway and real engines: every endpoint they
reach, plain and streamed, and the errors they raise (unknown model, no model, a model
of the wrong kind). The exceptions the SDKs raise are the assertions; the call records
are read back for the usage of every stream format."""

from __future__ import annotations

import os
import signal
import urllib.request
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import GatewayFactory
from tests.integration.gateway_helpers import (
    GatewayService,
    speech_wav,
    toml_str,
    unit_property,
    whisper_model_config,
)
from tests.integration.test_front_door_e2e import LONG, client, records, start

pytestmark = [pytest.mark.systemd, pytest.mark.engine]


def claude(gw: GatewayService) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0, timeout=120)


def usage_of(rows: list[dict[str, Any]], endpoint: str, stream: int) -> tuple[Any, Any]:
    (row,) = [r for r in rows if r["endpoint"] == endpoint and r["stream"] == stream
              and r["status"] == 200]
    assert row["outcome"] == "ok", row
    return row["prompt_tokens"], row["completion_tokens"]


def test_anthropic_sdk_messages_plain_streamed_counted_and_its_errors(
        gateway: GatewayService) -> None:
    start(gateway, "tiny-alpha", "tiny-beta")
    sdk = claude(gateway)
    message = sdk.messages.create(model="tiny-alpha", max_tokens=5,
                                  messages=[{"role": "user", "content": "hello there"}])
    assert message.type == "message" and message.content[0].type == "text"
    assert message.usage.output_tokens == 5 and message.usage.input_tokens > 0
    with sdk.messages.stream(model="tiny-beta", max_tokens=4,
                             messages=[{"role": "user", "content": "hi"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.usage.output_tokens == 4 and final.stop_reason == "max_tokens"
    counted = sdk.messages.count_tokens(model="tiny-alpha",
                                        messages=[{"role": "user", "content": "hello there"}])
    assert counted.input_tokens > 0

    with pytest.raises(anthropic.NotFoundError) as nf:
        sdk.messages.create(model="no-such-model", max_tokens=2,
                            messages=[{"role": "user", "content": "x"}])
    assert nf.value.status_code == 404
    assert nf.value.body["error"]["type"] == "not_found_error"
    assert "tiny-alpha" in nf.value.body["available_models"]
    with pytest.raises(anthropic.BadRequestError) as br:   # two engines ready: which one?
        sdk.messages.create(model="", max_tokens=2, messages=[{"role": "user", "content": "x"}])
    assert br.value.body["error"]["type"] == "invalid_request_error"

    rows = records(gateway, 4, endpoint="/v1/messages")   # 2 answered, 2 refused
    assert usage_of(rows, "/v1/messages", 0) == (message.usage.input_tokens, 5)
    assert usage_of(rows, "/v1/messages", 1) == (final.usage.input_tokens, 4)


def test_openai_sdk_responses_usage_recorded_and_its_errors(gateway: GatewayService) -> None:
    start(gateway, "tiny-alpha", "tiny-beta")
    oa = client(gateway)
    plain = oa.responses.create(model="tiny-alpha", input="hello there", max_output_tokens=4)
    assert plain.status == "completed" and plain.usage and plain.usage.output_tokens == 4
    events = list(oa.responses.create(model="tiny-alpha", input="hello there",
                                      max_output_tokens=3, stream=True))
    completed = events[-1]
    assert completed.type == "response.completed", [e.type for e in events]
    assert completed.response.usage and completed.response.usage.output_tokens == 3
    with pytest.raises(openai.NotFoundError) as nf:
        oa.responses.create(model="no-such-model", input="x")
    assert nf.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as br:
        oa.chat.completions.create(model="", messages=[{"role": "user", "content": "x"}])
    assert br.value.code == "model_required"
    rows = records(gateway, 3, endpoint="/v1/responses")   # 2 answered, 1 refused
    assert usage_of(rows, "/v1/responses", 0) == (plain.usage.input_tokens, 4)
    assert usage_of(rows, "/v1/responses", 1) == (completed.response.usage.input_tokens, 3)


def test_rerank_by_the_header_and_kinds_kept_apart(
        gateway_factory: GatewayFactory, tiny_reranker: Path) -> None:
    """A reranker is known by its GGUF header (rank pooling): no `kind` in the config.
    /v1/rerank and /v1/reranking reach its llama-server --rerank; a chat model asked to
    rerank, or the reranker asked to chat, is a 400 that says why."""
    gw = gateway_factory(extra=(f"[models.rerank]\npath = {toml_str(str(tiny_reranker))}\n"
                                "threads = 1\n"))
    oa = client(gw)
    assert (oa.models.retrieve("rerank").model_extra or {})["kind"] == "rerank"
    docs = ["hello world", "tiny model", "garbage"]
    for path in ("/rerank", "/reranking"):   # the SDK's base URL ends in /v1
        ranked: Any = oa.post(path, cast_to=object, body={
            "model": "rerank", "query": "hello", "documents": docs})
        assert sorted(r["index"] for r in ranked["results"]) == [0, 1, 2], ranked
        assert all(isinstance(r["relevance_score"], float) for r in ranked["results"])
    with pytest.raises(openai.BadRequestError) as br:
        oa.chat.completions.create(model="rerank",
                                   messages=[{"role": "user", "content": "x"}])
    assert "is a rerank model" in str(br.value)
    with pytest.raises(openai.BadRequestError) as br:
        oa.post("/rerank", cast_to=object, body={"model": "tiny-alpha", "query": "q",
                                                 "documents": ["d"]})
    assert 'kind = "rerank"' in str(br.value)
    with pytest.raises(anthropic.BadRequestError):      # in Anthropic's dialect too
        claude(gw).messages.create(model="rerank", max_tokens=2,
                                   messages=[{"role": "user", "content": "x"}])
    rows = records(gw, 2, endpoint="/v1/rerank")     # one answered, one refused
    assert sorted((r["status"], r["model"] or "") for r in rows) == [(200, "rerank"),
                                                                     (400, "")]


def test_translation_reaches_whisper_as_a_translation(
        gateway_factory: GatewayFactory, whisper_server: Path, tiny_whisper: Path,
        tmp_path: Path) -> None:
    gw = gateway_factory(extra=whisper_model_config(whisper_server, tiny_whisper))
    wav = speech_wav(tmp_path / "speech.wav")
    oa = client(gw)
    with wav.open("rb") as f:
        translated = oa.audio.translations.create(
            model="whisper-tiny", file=("speech.wav", f, "audio/wav"),
            response_format="verbose_json", extra_body={"temperature_inc": 0})
    assert (translated.model_extra or {})["task"] == "translate"   # whisper's own word
    with wav.open("rb") as f:
        transcribed = oa.audio.transcriptions.create(
            model="whisper-tiny", file=("speech.wav", f, "audio/wav"),
            response_format="verbose_json", extra_body={"temperature_inc": 0})
    assert (transcribed.model_extra or {})["task"] == "transcribe"
    with pytest.raises(openai.BadRequestError) as br, wav.open("rb") as f:
        oa.audio.translations.create(model="tiny-alpha", file=("speech.wav", f, "audio/wav"))
    assert "is a chat model" in str(br.value)


def test_engine_killed_mid_stream_makes_each_sdk_raise(
        gateway_factory: GatewayFactory, tiny_models: dict[str, Path]) -> None:
    """A Responses stream and an Anthropic stream that the engine breaks off end with their
    own format's error event, which the SDKs raise on (the status was 200 already)."""
    gw = gateway_factory(extra=LONG.format(path=toml_str(str(tiny_models["alpha"]))))
    start(gw, "long")

    def kill_after_3(events: Any) -> None:
        pid = gw.engines()["long"]["pid"]
        for n, _ in enumerate(events):
            if n == 3:
                os.kill(pid, signal.SIGKILL)

    with pytest.raises(openai.APIError) as oa_err:
        kill_after_3(client(gw).responses.create(model="long", input="go", stream=True,
                                                 max_output_tokens=60000))
    assert "engine stopped in the middle" in str(oa_err.value)
    gw.wait_engine("long", lambda e: e["state"] == "ready" and e["restarts"] == 1)
    with pytest.raises(anthropic.APIStatusError) as an_err, claude(gw).messages.stream(
            model="long", max_tokens=60000,
            messages=[{"role": "user", "content": "go"}]) as stream:
        kill_after_3(stream)
    assert "engine stopped in the middle" in str(an_err.value)
    rows = records(gw, 2, model="long")
    assert sorted(r["endpoint"] for r in rows) == ["/v1/messages", "/v1/responses"]
    assert all(r["outcome"] == "engine_failed" and r["status"] == 200 for r in rows), rows


def test_metrics_from_systemd_and_the_engines_own(gateway: GatewayService) -> None:
    """A scrape after real traffic: the call counted, the engine's memory and CPU read from
    systemd's accounting of its unit, and llama-server's own metrics labelled by model."""
    start(gateway, "tiny-alpha")
    client(gateway).chat.completions.create(
        model="tiny-alpha", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    # and a stream: llama-server's own chunks (one per event, lowercase hex) are what the
    # relay passes on as they came
    streamed = client(gateway).chat.completions.create(
        model="tiny-alpha", messages=[{"role": "user", "content": "hi"}], max_tokens=64,
        stream=True)
    assert sum(1 for c in streamed if c.choices and c.choices[0].delta.content) >= 1
    records(gateway, 2, model="tiny-alpha")
    with urllib.request.urlopen(gateway.url + "/admin/metrics?engines=1", timeout=30) as resp:
        text = resp.read().decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    model = (("model", "tiny-alpha"),)
    assert samples[("llm_gateway_requests_total", (
        ("endpoint", "/v1/chat/completions"), ("model", "tiny-alpha"), ("status", "200")))] == 2
    assert samples[("llm_gateway_tokens_total", (("kind", "completion"), *model))] == 3 + 64
    # systemd's own figures for the unit; where its cgroup accounting has none (a cgroup
    # v1 host gives the container no memory controller), the metric is absent, never 0
    unit = gateway.engines()["tiny-alpha"]["unit"]
    for metric, prop, scale in (("llm_gateway_engine_memory_bytes", "MemoryCurrent", 1),
                                ("llm_gateway_engine_cpu_seconds_total", "CPUUsageNSec", 1e9)):
        told = unit_property(unit, prop)
        if told.isdigit():
            assert 0 < samples[(metric, model)] <= 2 * int(told) / scale, (metric, told)
        else:
            assert (metric, model) not in samples, (metric, told)
    assert samples[("llm_gateway_engine_state", (*model, ("state", "ready")))] == 1
    assert samples[("llamacpp_prompt_tokens_total", model)] > 0     # llama-server's own


def test_api_keys_with_both_sdks_the_cli_and_a_reload(
        tmp_path: Path, gateway_factory: GatewayFactory) -> None:
    """Keys on: each SDK's own header (OpenAI: Authorization: Bearer; Anthropic: x-api-key)
    gets in, a wrong key or model is refused with the SDK's own exception, the CLI uses an
    admin key from its environment, and a reload revokes one key and admits another."""
    from gatewayd.core.auth import digest
    app, ops, late = "sk-llmgw-app-e2e", "sk-llmgw-ops-e2e", "sk-llmgw-late-e2e"

    def table(name: str, key: str, models: str, scopes: str) -> str:
        return (f'[keys.{name}]\nsha256 = "{digest(key)}"\nmodels = {models}\n'
                f"scopes = {scopes}\n")
    keys = tmp_path / "keys.toml"
    ops_table = table("ops", ops, '["*"]', '["admin"]')
    keys.write_text(table("app", app, '["tiny-alpha"]', '["inference"]') + ops_table)
    gw = gateway_factory(extra=f"[auth]\nkeys_file = {toml_str(str(keys))}\n")

    sdk = openai.OpenAI(base_url=gw.url + "/v1", api_key=app, max_retries=0, timeout=120)
    answer = sdk.chat.completions.create(model="tiny-alpha", max_tokens=2,
                                         messages=[{"role": "user", "content": "hi"}])
    assert answer.usage is not None and answer.usage.completion_tokens == 2
    assert [m.id for m in sdk.models.list()] == ["tiny-alpha"]
    with pytest.raises(openai.PermissionDeniedError) as denied:
        sdk.chat.completions.create(model="tiny-beta", max_tokens=2,
                                    messages=[{"role": "user", "content": "hi"}])
    assert denied.value.code == "model_not_allowed"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gw.url + "/v1", api_key="sk-wrong", max_retries=0).models.list()

    message = anthropic.Anthropic(base_url=gw.url, api_key=app, max_retries=0).messages.create(
        model="tiny-alpha", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert message.usage.output_tokens == 2
    with pytest.raises(anthropic.AuthenticationError):
        claude(gw).messages.create(model="tiny-alpha", max_tokens=2,
                                   messages=[{"role": "user", "content": "hi"}])

    assert gw.cli("status").returncode == 1          # no key: the admin API says no
    gw.api_key = ops
    assert gw.cli("status").returncode == 0
    keys.write_text(table("late", late, '["*"]', '["inference"]') + ops_table)
    code, plan = gw.api("POST", "/admin/reload")
    assert code == 200, plan
    with pytest.raises(openai.AuthenticationError):
        sdk.models.list()                              # revoked by the reload
    late_sdk = openai.OpenAI(base_url=gw.url + "/v1", api_key=late, max_retries=0)
    assert {m.id for m in late_sdk.models.list()} >= {"tiny-alpha", "tiny-beta"}
    rows = records(gw, 3)
    assert {r["api_key"] for r in rows if r["status"] in (200, 403)} >= {"app"}
