"""The admin API's pull and rm over real HTTP: the engine layer on fakes, the hub the
local stand-in (tests/fake_hub.py) spoken to by the real huggingface_hub client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gatewayd.adapters.events import EventHub
from gatewayd.adapters.hub import HuggingFaceHub
from gatewayd.adapters.kv_cache import KvCache
from gatewayd.adapters.learned_memory import RAM_FILE_NAME, LearnedMemory
from gatewayd.adapters.model_files import load_catalog
from gatewayd.core.config import ModelConfig
from gatewayd.core.engine_units import EngineLayout
from gatewayd.http import admin_api, router
from gatewayd.http.middleware import error_middleware
from gatewayd.service.engine_manager import EngineManager
from gatewayd.service.pulls import Puller
from gatewayd.service.reload import Reloader
from tests.fake_hub import FakeHub, serve_hub
from tests.fakes import dispatcher_for, engine_manager_on_fakes
from tests.http.test_front_door import _gateway, chat
from tests.unit.test_pulls import FILES, REPO

Client = TestClient[web.Request, web.Application]


@dataclass
class Api:
    client: Client
    mgr: EngineManager
    models: Path
    hub: FakeHub


async def api_on(tmp_path: Path, hub_url: str, **config: Any) -> tuple[Client, EngineManager]:
    mgr, _, _ = engine_manager_on_fakes(tmp_path, **config)
    app = web.Application(middlewares=[error_middleware])
    app[admin_api.ENGINES] = mgr
    app[admin_api.EVENTS] = events = EventHub()
    app[admin_api.RELOADER] = reloader = Reloader(
        read=lambda: (mgr.config, load_catalog(mgr.config)), engines=mgr,
        dispatcher=dispatcher_for(mgr),
        read_models=lambda: (mgr.config, load_catalog(mgr.config)))
    app[admin_api.PULLER] = Puller(
        hub=HuggingFaceHub(endpoint=hub_url), models_dir=lambda: mgr.config.models_dir,
        catalog=mgr.catalog, rescan=reloader.rescan_models, publish=events.publish)
    router.install(app)
    return TestClient(TestServer(app)), mgr


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[Api]:
    hub = FakeHub()
    hub.publish(REPO, FILES)
    async with serve_hub(hub) as url:
        # models_dir is where the fakes' model files a, b, c lie: found there, not configured
        client, mgr = await api_on(tmp_path, url, models_dir=tmp_path)
        async with client:
            yield Api(client=client, mgr=mgr, models=tmp_path, hub=hub)
            await client.app[admin_api.PULLER].close()
        await mgr.close()


async def until_done(c: Client, name: str) -> dict[str, Any]:
    deadline = asyncio.get_running_loop().time() + 30
    while True:
        pulls = (await (await c.get("/admin/pulls")).json())["pulls"]
        mine = [p for p in pulls if p["model"] == name]
        if mine and mine[0]["state"] not in ("downloading", "verifying"):
            found: dict[str, Any] = mine[0]
            return found
        assert asyncio.get_running_loop().time() < deadline, pulls
        await asyncio.sleep(0.05)


async def test_a_pulled_model_is_listed_once_whole(api: Api) -> None:
    c = api.client
    resp = await c.post("/admin/models/pull", json={"source": f"{REPO}:Q4_K_M"})
    assert resp.status == 202
    pull = (await resp.json())["pull"]
    assert pull["model"] == "Tiny-Q4_K_M" and pull["state"] == "downloading"
    assert pull["files"][0]["path"] == "Tiny-Q4_K_M.gguf"
    status = await (await c.get("/admin/status")).json()
    assert [p["model"] for p in status["pulls"]] == ["Tiny-Q4_K_M"]
    assert (await until_done(c, "Tiny-Q4_K_M"))["state"] == "done"
    models = (await (await c.get("/admin/models")).json())["models"]
    assert "Tiny-Q4_K_M" in [m["id"] for m in models]   # no reload, no restart
    again = await c.post("/admin/models/pull", json={"source": f"{REPO}:Q4_K_M"})
    assert again.status == 200 and (await again.json())["pull"]["state"] == "done"


@pytest.mark.parametrize("body,status,code", [
    ({}, 400, "invalid_request"),
    ({"source": 7}, 400, "invalid_request"),
    ({"source": "not a repo"}, 400, "invalid_model_source"),
    # a pattern's "$" takes a trailing newline: these reached the hub client (500)
    ({"source": f"{REPO}\n:Q4_K_M"}, 400, "invalid_model_source"),
    ({"source": f"{REPO}@main\n:Q4_K_M"}, 400, "invalid_model_source"),
    ({"source": "org/a..b"}, 400, "invalid_model_source"),
    ({"source": f"{REPO}:Q4_K_M", "mmproj": "yes"}, 400, "invalid_request"),
    ({"source": f"{REPO}:Q4_K_M", "name": "../up"}, 400, "invalid_model_source"),
    ({"source": "org/absent"}, 404, "hub_repo_not_found"),
    ({"source": f"{REPO}:IQ1_S"}, 404, "hub_file_not_found"),
    ({"source": f"{REPO}:Q4_K_M", "name": "a"}, 409, "model_exists"),
])
async def test_pull_errors_are_openai_shaped(api: Api, body: dict[str, Any], status: int,
                                             code: str) -> None:
    resp = await api.client.post("/admin/models/pull", json=body)
    assert resp.status == status
    error = (await resp.json())["error"]
    assert error["code"] == code and error["message"] and error["type"]


async def test_without_a_models_dir_there_is_nowhere_to_pull_to(tmp_path: Path) -> None:
    hub = FakeHub()
    hub.publish(REPO, FILES)
    async with serve_hub(hub) as url:
        client, mgr = await api_on(tmp_path, url)
        async with client:
            resp = await client.post("/admin/models/pull", json={"source": REPO})
            assert resp.status == 409
            assert (await resp.json())["error"]["code"] == "models_dir_unusable"
        await mgr.close()


async def test_rm_refuses_a_running_model_unless_forced(api: Api) -> None:
    c = api.client
    assert (await c.post("/admin/engines/start", json={"model": "a"})).status == 200
    resp = await c.post("/admin/models/remove", json={"model": "a"})
    assert resp.status == 409 and (await resp.json())["error"]["code"] == "model_in_use"
    assert (api.models / "a.gguf").exists()
    resp = await c.post("/admin/models/remove", json={"model": "a", "force": True})
    assert resp.status == 200, await resp.text()
    out = await resp.json()
    assert out["removed"] == "a" and out["stopped_engine"] and out["freed_bytes"] == 3 << 20
    assert not (api.models / "a.gguf").exists()
    assert "a" not in api.mgr.catalog
    assert api.mgr.registry.get("a") is None or api.mgr.registry.get("a").state.value == "stopped"  # type: ignore[union-attr]
    resp = await c.post("/admin/models/remove", json={"model": "a"})
    assert resp.status == 404


async def test_rm_takes_the_kv_cache_and_the_learned_memory_with_it(tmp_path: Path) -> None:
    kv_cache = KvCache(tmp_path / "state" / "kv-cache", 64 << 20)
    learned, learned_ram = LearnedMemory(tmp_path / "state"), \
        LearnedMemory(tmp_path / "state", RAM_FILE_NAME)
    async with serve_hub(FakeHub()) as url:
        client, mgr = await api_on(tmp_path, url, models_dir=tmp_path, kv_cache=kv_cache,
                                   learned=learned, learned_ram=learned_ram)
        async with client:
            a_dir, b_dir = (kv_cache.directory(EngineLayout.for_model(m).instance)
                            for m in ("a", "b"))
            for d in (a_dir, b_dir):
                d.mkdir(parents=True)
                (d / "slot0.bin").write_bytes(b"kv")
            learned.record("a-setup", "a", 700)
            learned_ram.record("a-setup", "a", 900)
            learned.record("b-setup", "b", 500)
            resp = await client.post("/admin/models/remove", json={"model": "a"})
            assert resp.status == 200, await resp.text()
            assert not a_dir.exists() and (b_dir / "slot0.bin").exists()
            assert learned.get("a-setup") is None and learned_ram.get("a-setup") is None
            assert learned.get("b-setup") == 500
            assert LearnedMemory(tmp_path / "state").get("a-setup") is None   # on disk too
            await client.app[admin_api.PULLER].close()
        await mgr.close()


async def test_rm_of_a_pulled_model_deletes_its_folder(api: Api) -> None:
    c = api.client
    await c.post("/admin/models/pull", json={"source": f"{REPO}:Q4_K_M"})
    await until_done(c, "Tiny-Q4_K_M")
    resp = await c.post("/admin/models/remove", json={"model": "Tiny-Q4_K_M"})
    assert resp.status == 200 and (await resp.json())["freed_bytes"] >= 1 << 20
    assert not (api.models / "Tiny-Q4_K_M").exists()
    assert "Tiny-Q4_K_M" not in api.mgr.catalog


async def test_rm_of_a_model_being_pulled_stops_the_pull(api: Api) -> None:
    c = api.client
    api.hub.throttle_bps = 256 * 1024
    await c.post("/admin/models/pull", json={"source": f"{REPO}:Q8_0"})
    resp = await c.post("/admin/models/remove", json={"model": "Tiny-Q8_0"})
    assert resp.status == 200 and (await resp.json())["cancelled_pull"]
    assert (await until_done(c, "Tiny-Q8_0"))["state"] == "cancelled"
    assert not (api.models / "Tiny-Q8_0").exists()


async def test_rm_leaves_a_configured_model_to_the_configuration(tmp_path: Path) -> None:
    hub = FakeHub()
    async with serve_hub(hub) as url:
        client, mgr = await api_on(tmp_path, url, models_dir=tmp_path, models=(
            ModelConfig(name="a", path=tmp_path / "a.gguf"),))
        async with client:
            resp = await client.post("/admin/models/remove", json={"model": "a"})
            assert resp.status == 409
            assert (await resp.json())["error"]["code"] == "model_not_removable"
            assert (tmp_path / "a.gguf").exists()
        await mgr.close()


async def test_a_configured_source_is_pulled_by_its_first_start(tmp_path: Path) -> None:
    hub = FakeHub()
    hub.publish(REPO, FILES)
    async with serve_hub(hub) as url:
        client, mgr = await api_on(tmp_path, url, models_dir=tmp_path, load_timeout_s=1.0,
                                   models=(ModelConfig(name="fresh", path=None,
                                                       source=f"{REPO}:Q4_K_M"),
                                           ModelConfig(name="slow", path=None,
                                                       source=f"{REPO}:Q8_0")))
        async with client:
            # the catalog as the gateway loads it: the configured models without files
            await client.app[admin_api.RELOADER].rescan_models()
            listed = {m["id"]: m for m in (await (await client.get("/admin/models")).json())
                      ["models"]}
            assert listed["fresh"]["downloaded"] is False and listed["fresh"]["path"] is None
            resp = await client.post("/admin/engines/start", json={"model": "fresh"})
            assert resp.status == 200, await resp.text()
            assert (await resp.json())["engine"]["state"] == "ready"
            assert (tmp_path / "fresh" / "Tiny-Q4_K_M.gguf").read_bytes() \
                == FILES["Tiny-Q4_K_M.gguf"]
            listed = {m["id"]: m for m in (await (await client.get("/admin/models")).json())
                      ["models"]}
            assert listed["fresh"]["downloaded"] is True
            # longer than the wait for a load (1 s here): 503 with the ETA, and it goes on
            hub.throttle_bps = 512 * 1024
            resp = await client.post("/admin/engines/start", json={"model": "slow"})
            assert resp.status == 503
            assert (await resp.json())["error"]["code"] == "model_downloading"
            assert 1 <= int(resp.headers["Retry-After"]) <= 30
            hub.throttle_bps = None
            assert (await until_done(client, "slow"))["state"] == "done"
            await client.app[admin_api.PULLER].close()
        await mgr.close()


async def test_the_first_request_for_a_configured_source_pulls_it_then_is_answered(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the whole app (build_app): the request waits for the download, then is
    relayed to the engine started on the pulled file; the record says so."""
    hub = FakeHub()
    hub.publish(REPO, FILES)
    async with serve_hub(hub) as url:
        monkeypatch.setenv("HF_ENDPOINT", url)   # read by the app's hub client
        async for gw in _gateway(tmp_path, (), models_dir=tmp_path, models=(
                ModelConfig(name="c", path=None, source=f"{REPO}:Q4_K_M"),)):
            (tmp_path / "c.gguf").unlink()   # c is the configured one, not yet here
            await gw.client.app[admin_api.RELOADER].rescan_models()
            assert not gw.engines.catalog.resolve("c").config.downloaded
            resp = await gw.client.post("/v1/chat/completions", json=chat("c"))
            assert resp.status == 200, await resp.text()
            assert gw.engines.catalog.resolve("c").path == tmp_path / "c" / "Tiny-Q4_K_M.gguf"
            assert [r.path for r in gw.fakes["c"].requests] == ["/v1/chat/completions"]


def test_rm_of_a_split_model_in_models_dir_takes_all_its_parts(tmp_path: Path) -> None:
    from gatewayd.service.model_removal import _owned_paths
    parts = [tmp_path / f"Big-Q8_0-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    others = [tmp_path / "Big-Q8_0-00001-of-00002.gguf", tmp_path / "Big-Q4_0.gguf"]
    for p in (*parts, *others):
        p.write_bytes(b"GGUF")
    assert _owned_paths(parts[0], tmp_path) == parts
    assert _owned_paths(others[1], tmp_path) == [others[1]]
    assert _owned_paths(parts[0], tmp_path / "elsewhere") is None


async def test_rm_of_a_path_is_no_model_and_removes_nothing_outside(api: Api) -> None:
    """Issue 50: once a pull had made .pull/, rm of '../../somewhere/x' deleted
    somewhere/x/ and somewhere/x.json beside models_dir."""
    c = api.client
    await c.post("/admin/models/pull", json={"source": f"{REPO}:Q4_K_M"})
    await until_done(c, "Tiny-Q4_K_M")
    somewhere = api.models.parent / "somewhere"
    (somewhere / "x").mkdir(parents=True)
    (somewhere / "x.json").write_text("{}")
    for name in ("../../somewhere/x", "../x", f"/{somewhere}/x", "..", "x\n"):
        resp = await c.post("/admin/models/remove", json={"model": name})
        assert resp.status == 404, await resp.text()
        assert (await resp.json())["error"]["code"] == "model_not_found"
    assert (somewhere / "x").is_dir() and (somewhere / "x.json").exists()


async def test_rm_leaves_a_variants_base_and_pull_will_not_take_a_variants_name(
        tmp_path: Path) -> None:
    """A model that a configured variant names stays (the configuration would no longer
    load without it); a pull cannot land under a variant's name."""
    hub = FakeHub()
    hub.publish(REPO, FILES)
    async with serve_hub(hub) as url:
        client, mgr = await api_on(tmp_path, url, models_dir=tmp_path,
                                   variants={"fast": {"variant_of": "a"}})
        async with client:
            resp = await client.post("/admin/models/remove", json={"model": "a"})
            body = await resp.json()
            assert resp.status == 409 and "variant(s) fast" in body["error"]["message"]
            assert (tmp_path / "a.gguf").exists()
            resp = await client.post("/admin/models/pull",
                                     json={"source": f"{REPO}:Q4_K_M", "name": "FAST"})
            assert resp.status == 409, await resp.text()
            assert (await resp.json())["error"]["code"] == "model_exists"
            await client.app[admin_api.PULLER].close()
        await mgr.close()
