from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import make_tiny_model
import pytest

from gatewayd.adapters.model_files import discover, load_catalog
from gatewayd.core.config import GatewayConfig, ModelConfig
from gatewayd.core.errors import ConfigError, ModelNotFound
from gatewayd.core.model_facts import GgufFacts


def _touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF")
    return path


def _facts(names: dict[str, str]) -> Callable[[Path], GgufFacts]:
    def read(path: Path) -> GgufFacts:
        facts = GgufFacts(path=str(path), file_size=4)
        if path.name in names:
            facts.metadata["general.name"] = names[path.name]
        return facts
    return read


def test_discover_files_and_subdirectories(tmp_path: Path) -> None:
    _touch(tmp_path / "qwen.gguf")
    _touch(tmp_path / "mmproj-stray.gguf")          # a projector alone is not a model
    _touch(tmp_path / ".hidden.gguf")
    _touch(tmp_path / "big-00001-of-00002.gguf")
    _touch(tmp_path / "big-00002-of-00002.gguf")    # later split parts are not models
    _touch(tmp_path / "llava" / "llava-q4.gguf")
    _touch(tmp_path / "llava" / "mmproj-f16.gguf")
    (tmp_path / "notes.txt").write_text("x")
    found = {m.name: m for m in discover(tmp_path)}
    assert set(found) == {"qwen", "big-00001-of-00002", "llava"}
    assert found["llava"].path == tmp_path / "llava" / "llava-q4.gguf"
    assert found["llava"].mmproj == tmp_path / "llava" / "mmproj-f16.gguf"
    assert found["qwen"].mmproj is None


def test_subdirectory_with_two_models_is_a_clear_error(tmp_path: Path) -> None:
    _touch(tmp_path / "mixed" / "a.gguf")
    _touch(tmp_path / "mixed" / "b.gguf")
    with pytest.raises(ConfigError, match="several models"):
        discover(tmp_path)


def test_every_name_resolves_case_insensitively(tmp_path: Path) -> None:
    _touch(tmp_path / "Qwen2.5-7B-Q4_K_M.gguf")
    _touch(tmp_path / "llava" / "llava-q4.gguf")
    config = GatewayConfig(models_dir=tmp_path, models=(
        ModelConfig(name="chat", path=_touch(tmp_path / "elsewhere" / "c.gguf"),
                    aliases=("GPT-4o",)),))
    catalog = load_catalog(config, _facts({"Qwen2.5-7B-Q4_K_M.gguf": "Qwen2.5 7B Instruct"}))
    qwen = "Qwen2.5-7B-Q4_K_M"
    for name in (qwen, "qwen2.5-7b-q4_k_m.GGUF", "QWEN2.5 7b instruct"):
        assert catalog.resolve(name).id == qwen
    for name in ("llava", "LLAVA-Q4", "llava-q4.gguf"):
        assert catalog.resolve(name).id == "llava"
    for name in ("chat", "gpt-4o", "c.gguf", "c"):
        assert catalog.resolve(name).id == "chat"


def test_unknown_name_lists_available_models(tmp_path: Path) -> None:
    _touch(tmp_path / "a.gguf")
    catalog = load_catalog(GatewayConfig(models_dir=tmp_path), _facts({}))
    with pytest.raises(ModelNotFound) as err:
        catalog.resolve("gpt-5")
    assert err.value.status == 404
    assert err.value.body()["error"]["available_models"] == ["a"]


def test_two_models_claiming_one_alias_is_an_error_naming_both(tmp_path: Path) -> None:
    config = GatewayConfig(models=(
        ModelConfig(name="one", path=_touch(tmp_path / "1.gguf"), aliases=("fast",)),
        ModelConfig(name="two", path=_touch(tmp_path / "2.gguf"), aliases=("FAST",))))
    with pytest.raises(ConfigError, match=r"'one' .*'two' .*claim the name 'fast'"):
        load_catalog(config, _facts({}))


def test_alias_colliding_with_another_models_file_name(tmp_path: Path) -> None:
    _touch(tmp_path / "llama.gguf")
    config = GatewayConfig(models_dir=tmp_path, models=(
        ModelConfig(name="other", path=_touch(tmp_path / "x" / "o.gguf"), aliases=("llama",)),))
    with pytest.raises(ConfigError, match="both claim the name 'llama'"):
        load_catalog(config, _facts({}))


def test_shared_gguf_name_is_ambiguous_not_fatal(tmp_path: Path) -> None:
    _touch(tmp_path / "m-q4.gguf")
    _touch(tmp_path / "m-q8.gguf")
    catalog = load_catalog(GatewayConfig(models_dir=tmp_path),
                            _facts({"m-q4.gguf": "Mistral 7B", "m-q8.gguf": "Mistral 7B"}))
    assert catalog.resolve("m-q8").id == "m-q8"
    with pytest.raises(ModelNotFound, match=r"ambiguous.*m-q4, m-q8"):
        catalog.resolve("mistral 7b")


def test_explicit_entry_wins_over_the_discovered_file(tmp_path: Path) -> None:
    path = _touch(tmp_path / "a.gguf")
    catalog = load_catalog(GatewayConfig(models_dir=tmp_path, models=(
        ModelConfig(name="alpha", path=path),)), _facts({}))
    assert catalog.ids == ["alpha"]
    assert catalog.resolve("a").id == "alpha"


def test_catalog_reads_real_gguf_facts(tmp_path: Path) -> None:
    make_tiny_model.write_model(str(tmp_path / "tiny.gguf"), "Tiny Thing", seed=3, f16=True)
    model = load_catalog(GatewayConfig(models_dir=tmp_path)).resolve("tiny thing")
    info = model.describe()
    assert info["architecture"] == "llama" and info["context_length"] == 2048
    assert info["quantization"] == "F16" and info["general_name"] == "Tiny Thing"
    assert info["size_bytes"] == (tmp_path / "tiny.gguf").stat().st_size
    assert info["header_error"] is None


def test_an_unreadable_header_is_described(tmp_path: Path) -> None:
    (tmp_path / "broken.gguf").write_bytes(b"NOPE" + bytes(60))
    info = load_catalog(GatewayConfig(models_dir=tmp_path)).resolve("broken").describe()
    assert info["header_error"] == "not a GGUF file (bad magic)"
    assert info["architecture"] is None


def test_explicit_models_in_one_directory_coexist(tmp_path: Path) -> None:
    """The parent directory is a name only of a model that is a subdirectory of
    models_dir: two explicit models in /srv/m are not both 'm'."""
    config = GatewayConfig(models_dir=tmp_path / "library", models=(
        ModelConfig(name="a", path=_touch(tmp_path / "m" / "a.gguf")),
        ModelConfig(name="b", path=_touch(tmp_path / "m" / "b.bin"))))
    (tmp_path / "library").mkdir()
    catalog = load_catalog(config, _facts({}))
    assert catalog.ids == ["a", "b"]
    with pytest.raises(ModelNotFound):
        catalog.resolve("m")
    config = GatewayConfig(models_dir=tmp_path / "library")
    _touch(tmp_path / "library" / "qwen" / "model.gguf")
    assert "qwen" in load_catalog(config, _facts({})).get("qwen").names  # type: ignore[union-attr]


def test_the_catalog_reads_headers_only_and_tensor_tables_wait_until_an_estimate(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A socket-activated gateway's first answer waits for the catalog: the tensor table
    (behind the tokenizer arrays) is read for the memory estimate, once per file."""
    from gatewayd.adapters import model_files
    make_tiny_model.write_model(str(tmp_path / "tiny.gguf"), "tiny", seed=3)
    reads: list[bool] = []
    real = model_files.read_gguf_facts  # type: ignore[attr-defined]

    def counted(path: Any, **kw: Any) -> GgufFacts:
        reads.append(bool(kw.get("tensors")))
        return real(path, **kw)
    monkeypatch.setattr(model_files, "read_gguf_facts", counted)
    model = load_catalog(GatewayConfig(models_dir=tmp_path)).resolve("tiny")
    assert reads == [False] and model.facts is not None and model.facts.tensors is None
    tables = model_files.TensorTables()
    first = tables.estimate(model, gpu=False)
    again = tables.estimate(model, gpu=True)
    assert reads == [False, True]                       # read once, then kept
    assert first is not None and again is not None
    assert first.ram_mib > 0 and first.vram_mib == 0 and again.vram_mib > 0
    (tmp_path / "tiny.gguf").write_bytes((tmp_path / "tiny.gguf").read_bytes() + b"\0" * 64)
    tables.estimate(model, gpu=False)                   # the file changed: read again
    assert reads == [False, True, True]


def test_a_sourced_model_has_its_file_once_pulled_into_its_folder(tmp_path: Path) -> None:
    config = GatewayConfig(models_dir=tmp_path, models=(
        ModelConfig(name="tiny", path=None, source="org/Tiny-GGUF:Q8_0"),))
    before = load_catalog(config, _facts({}))
    assert before.ids == ["tiny"] and not before.resolve("tiny").config.downloaded
    assert before.resolve("tiny").describe()["downloaded"] is False
    weights = _touch(tmp_path / "tiny" / "Tiny-Q8_0.gguf")
    projector = _touch(tmp_path / "tiny" / "mmproj-Tiny-f16.gguf")
    after = load_catalog(config, _facts({}))
    tiny = after.resolve("tiny")
    assert after.ids == ["tiny"]           # its folder is its file, not a second model
    assert tiny.path == weights and tiny.config.mmproj == projector
    assert tiny.config.downloaded and tiny.size_bytes == 8
