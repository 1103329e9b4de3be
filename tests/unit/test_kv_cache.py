"""The KV cache kept across a stop: which engines keep one, how it reaches llama-server's
command line, and the rules of the KV cache directory (a stamp of the engine's settings, a
size bound, failures that are counted and never raised)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from gatewayd.adapters.kv_cache import STAMP, KvCache
from gatewayd.adapters.metrics import GatewayMetrics, Snapshot
from gatewayd.core.catalog import Model
from gatewayd.core.config import Backend, GatewayConfig, ModelConfig, ModelKind
from gatewayd.core.engine_units import (
    EngineLayout,
    keeps_kv_cache,
    server_argv,
    settings_stamp,
)


def _model(**settings: object) -> Model:
    config = ModelConfig(name="m", path=Path("/m.gguf"), **settings)  # type: ignore[arg-type]
    return Model(id="m", config=config, names=frozenset({"m"}))


def test_llama_chat_engines_keep_it_unless_told_not_to() -> None:
    assert keeps_kv_cache(_model())
    assert not keeps_kv_cache(_model(kv_cache_save=False))
    assert not keeps_kv_cache(_model(kind=ModelKind.EMBEDDING))
    assert not keeps_kv_cache(_model(backend=Backend.WHISPER))
    layout = EngineLayout.for_model("m")
    argv = server_argv(_model(), layout, "/bin/ls", slot_save_path="/var/kv/m")
    assert argv[argv.index("--slot-save-path") + 1] == "/var/kv/m"
    assert "--slot-save-path" not in server_argv(_model(), layout, "/bin/ls")


def _slot(where: Path, slot_id: int, size: int, age_s: float) -> Path:
    path = where / f"slot-{slot_id}.bin"
    path.write_bytes(b"\0" * size)
    then = path.stat().st_mtime - age_s
    os.utime(path, (then, then))
    return path


def test_files_of_another_engine_setup_are_dropped_and_the_size_is_bounded(
        tmp_path: Path) -> None:
    cache = KvCache(tmp_path / "kv", max_bytes=250)
    stamp = settings_stamp(_model(), GatewayConfig())
    where = cache.prepare("m", stamp)
    kept = _slot(where, 0, 100, age_s=0)
    assert cache.prepare("m", stamp) == where and kept.exists()   # same engine: kept
    other = settings_stamp(_model(ctx_size=512), GatewayConfig())
    assert other != stamp
    cache.prepare("m", other)                                      # another context size
    assert not kept.exists() and (where / STAMP).read_text().strip() == other

    old, mid, new = (_slot(where, i, 100, age_s=age) for i, age in ((0, 30), (1, 20), (2, 10)))
    cache._bound(where)
    assert not old.exists() and mid.exists() and new.exists()      # oldest first, to 250 B


def test_an_engine_that_does_not_answer_is_counted_not_raised(tmp_path: Path) -> None:
    cache = KvCache(tmp_path / "kv", max_bytes=1 << 20)
    where = cache.prepare("m", "stamp")
    _slot(where, 0, 10, age_s=0)
    missing = str(tmp_path / "no-engine.sock")
    assert asyncio.run(cache.save("m", missing, "m")) == 0
    assert asyncio.run(cache.restore("m", missing, "m")) == 0
    assert cache.counts == {("save", "failed"): 1, ("restore", "failed"): 1}
    text = GatewayMetrics().render(Snapshot(kv_cache=cache.counts), {}).decode()
    assert 'llm_gateway_kv_cache_operations_total{action="save",result="failed"} 1.0' in text
    assert 'llm_gateway_kv_cache_operations_total{action="restore",result="ok"} 0.0' in text


async def test_the_kv_caches_of_models_no_longer_configured_are_deleted(
        tmp_path: Path) -> None:
    """At a reload (and at the start: the same EngineManager call) the directories of
    models that left the configuration go, files and all; the others stay as they are.
    Nothing else would ever restore or bound them."""
    from gatewayd.adapters.model_files import load_catalog
    from gatewayd.core.model_facts import GgufFacts
    from gatewayd.service.reload import Reloader
    from tests.fakes import dispatcher_for, engine_manager_on_fakes

    cache = KvCache(tmp_path / "kv-cache", 1 << 30)
    mgr, units, _ = engine_manager_on_fakes(tmp_path, kv_cache=cache)
    for model_id in ("a", "b", "c", "gone"):
        where = cache.prepare(units.layout(model_id).instance, "stamp")
        (where / "slot-0.bin").write_bytes(b"kv")
    assert await mgr.hooks.drop_unconfigured_kv_caches() == ["gone"]   # as at a start
    assert sorted(p.name for p in cache.root.iterdir()) == ["a", "b", "c"]

    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    new_config = GatewayConfig(state_dir=tmp_path / "state", models=(
        ModelConfig(name="a", path=tmp_path / "a.gguf"),))
    dispatcher = dispatcher_for(mgr)
    reloader = Reloader(read=lambda: (new_config, load_catalog(
        new_config, lambda path: GgufFacts(path=str(path), file_size=4))),
        engines=mgr, dispatcher=dispatcher)
    await reloader.reload()
    assert [p.name for p in cache.root.iterdir()] == ["a"]
    assert (cache.root / "a" / "slot-0.bin").read_bytes() == b"kv"
    assert cache.counts["prune", "removed"] == 3
    metrics = GatewayMetrics()
    text = metrics.render(Snapshot(bounded={"kv_cache_unconfigured": 3})).decode()
    assert 'llm_gateway_bounded_total{bound="kv_cache_unconfigured"} 3.0' in text
    await reloader.close()
    await dispatcher.close()
