from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gatewayd import cli


def test_models_names_each_model_whose_header_could_not_be_read(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    row = {"backend": "llama", "quantization": None, "context_length": None,
           "size_bytes": 64}
    models = [{**row, "id": "good", "path": "/m/good.gguf", "header_error": None},
              {**row, "id": "broken", "path": "/m/broken.gguf",
               "header_error": "not a GGUF file (bad magic)"}]

    def call(url: str, method: str, path: str, body: Any = None) -> Any:
        assert (method, path) == ("GET", "/admin/models")
        return {"models": models}

    monkeypatch.setattr(cli, "call", call)
    monkeypatch.setenv("LLM_GATEWAY_CONFIG", str(tmp_path / "absent.toml"))
    assert cli.main(["--url", "http://gateway", "models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["ID", "BACKEND", "QUANTIZATION", "CONTEXT_LENGTH",
                                "SIZE_BYTES", "PATH"]
    assert [line.split()[0] for line in lines[1:3]] == ["good", "broken"]
    assert lines[3:] == ["broken: cannot read the GGUF header: not a GGUF file (bad magic)"]
