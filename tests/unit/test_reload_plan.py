"""What a configuration reload changes (core.reload), and `llm-gateway check`."""

from __future__ import annotations

from pathlib import Path

import pytest

from gatewayd import cli
from gatewayd.adapters.model_files import load_catalog
from gatewayd.core.catalog import Catalog
from gatewayd.core.config import GatewayConfig, ModelConfig, parse_config
from gatewayd.core.errors import ConfigError, ConfigInvalid, ModelNotLoaded
from gatewayd.core.model_facts import GgufFacts
from gatewayd.core.reload import plan_reload
from gatewayd.service.reload import Reloader
from tests.fakes import dispatcher_for, engine_manager_on_fakes


def _facts(path: Path) -> GgufFacts:
    return GgufFacts(path=str(path), file_size=4)


def _file(path: Path, size: int = 4) -> Path:
    path.write_bytes(b"GGUF".ljust(size, b"\0"))
    return path


def test_only_what_changes_the_engine_restarts_it(tmp_path: Path) -> None:
    a, b, c, d = (_file(tmp_path / f"{n}.gguf") for n in "abcd")
    old_config = GatewayConfig(models=(
        ModelConfig(name="a", path=a), ModelConfig(name="b", path=b),
        ModelConfig(name="c", path=c), ModelConfig(name="d", path=d)))
    new_config = GatewayConfig(listen_port=9999, max_engines=9, models=(
        ModelConfig(name="a", path=a, aliases=("alfa",), pin=True, max_concurrency=2),
        ModelConfig(name="b", path=b, threads=3),
        ModelConfig(name="d", path=d, env={"X": "1"}),
        ModelConfig(name="e", path=_file(tmp_path / "e.gguf"))))
    old, new = load_catalog(old_config, _facts), load_catalog(new_config, _facts)
    plan = plan_reload(old_config, new_config, old, new, running=["a", "b", "c", "d"])
    assert plan.kept == ("a",)              # aliases, pinning, limits: same process
    assert plan.restart == ("b", "d")       # its command line, its environment
    assert plan.removed == ("c",) and plan.added == ("e",)
    assert plan.needs_restart == ("listen_port",)   # max_engines applies in place


def test_a_replaced_file_or_server_restarts_the_engine(tmp_path: Path) -> None:
    a = _file(tmp_path / "a.gguf")
    config = GatewayConfig(models=(ModelConfig(name="a", path=a),))
    old = load_catalog(config, _facts)
    _file(a, size=64)                          # the file was replaced by another
    assert plan_reload(config, config, old, load_catalog(config, _facts),
                       running=["a"]).restart == ("a",)
    other_server = GatewayConfig(models=config.models, llama_server="/opt/llama-server")
    assert plan_reload(config, other_server, old, old, running=["a"]).restart == ("a",)
    assert plan_reload(config, config, old, old, running=[]).restart == ()


def test_adapters_restart_their_engine_and_variants_are_added_and_removed_in_place(
        tmp_path: Path) -> None:
    a, sql = _file(tmp_path / "a.gguf"), _file(tmp_path / "sql.gguf")
    old_config = parse_config({"models": {"a": {"path": str(a)},
                                          "fast": {"variant_of": "a"}}})
    new_config = parse_config({"models": {"a": {"path": str(a), "adapters": {"sql": str(sql)}},
                                          "cold": {"variant_of": "a"}}})
    old, new = load_catalog(old_config, _facts), load_catalog(new_config, _facts)
    plan = plan_reload(old_config, new_config, old, new, running=["a"])
    assert plan.restart == ("a",)       # its engine loads the adapter at its start
    assert plan.added == ("a:sql", "cold") and plan.removed == ("fast",)
    same = plan_reload(new_config, new_config, new, new, running=["a"])
    assert same.kept == ("a",) and same.added == same.removed == ()


def test_check_validates_without_a_gateway(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "models").mkdir()
    _file(tmp_path / "models" / "m.gguf")
    good = tmp_path / "good.toml"
    good.write_text(f'models_dir = "{tmp_path / "models"}"\nllama_server = "/nonexistent"\n')
    assert cli.main(["--config", str(good), "check"]) == 0
    out = capsys.readouterr().out
    assert "ok, 1 model(s): m" in out and "warning:" in out and "/nonexistent" in out
    bad = tmp_path / "bad.toml"
    bad.write_text('max_engines = "many"\n')
    assert cli.main(["--config", str(bad), "check"]) == 1
    assert "max_engines" in capsys.readouterr().err


async def test_a_refused_reload_changes_nothing_and_a_good_one_applies_in_place(
        tmp_path: Path) -> None:
    mgr, _, _ = engine_manager_on_fakes(tmp_path)
    dispatcher = dispatcher_for(mgr)
    notes: list[str] = []
    before = list(mgr.catalog.ids)

    def broken() -> tuple[GatewayConfig, Catalog]:
        raise ConfigError("gateway.toml: max_engines must be a positive integer")
    reloader = Reloader(read=broken, engines=mgr, dispatcher=dispatcher, notify=notes.append)
    with pytest.raises(ConfigInvalid, match="max_engines"):
        await reloader.reload()
    assert mgr.catalog.ids == before and mgr.config.max_engines == 4
    assert notes[0].startswith("RELOADING=1") and "reload refused" in notes[-1]

    new_config = GatewayConfig(max_engines=7, state_dir=tmp_path / "state", models=(
        ModelConfig(name="fresh", path=_file(tmp_path / "fresh.gguf")),))
    reloader = Reloader(read=lambda: (new_config, load_catalog(new_config, _facts)),
                        engines=mgr, dispatcher=dispatcher, notify=notes.append)
    plan = await reloader.reload()
    assert mgr.catalog.ids == ["fresh"]
    # the dispatcher holds the same catalog, replaced in place: it knows the new model
    with pytest.raises(ModelNotLoaded) as not_loaded:
        await dispatcher.acquire("fresh", autoload=False)
    assert "not in the catalog" not in not_loaded.value.message
    assert mgr.config.max_engines == 7 and plan.added == ("fresh",)
    assert notes[-1].startswith("READY=1\nSTATUS=reloaded")
    await reloader.close()
    await dispatcher.close()


async def test_every_reload_ends_with_ready_whatever_fails(tmp_path: Path) -> None:
    """systemd leaves the `reloading` state only on READY=1: an unreadable models
    directory is a refusal, and even an unforeseen error ends with READY=1."""
    mgr, _, _ = engine_manager_on_fakes(tmp_path)
    dispatcher = dispatcher_for(mgr)
    notes: list[str] = []

    def unreadable() -> tuple[GatewayConfig, Catalog]:
        raise PermissionError(13, "Permission denied", "/srv/models")
    with pytest.raises(ConfigInvalid, match="Permission denied"):
        await Reloader(read=unreadable, engines=mgr, dispatcher=dispatcher,
                       notify=notes.append).reload()
    assert notes[-1].startswith("READY=1\nSTATUS=reload refused")

    def broken() -> tuple[GatewayConfig, Catalog]:
        raise RuntimeError("unforeseen")
    with pytest.raises(RuntimeError):
        await Reloader(read=broken, engines=mgr, dispatcher=dispatcher,
                       notify=notes.append).reload()
    assert notes[-2].startswith("RELOADING=1") and notes[-1].startswith("READY=1\nSTATUS=")
    await dispatcher.close()
