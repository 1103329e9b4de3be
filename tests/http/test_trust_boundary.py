"""The trust boundary, tried as an attacker would, over real HTTP against fake engines and
a fake upstream that record every request they get (the witnesses).

- an attack matrix generated from the route table (core/routes.py): every route and
  method (and methods it does not list), by every credential (none, a wrong key, another
  model's key, an inference key, an admin key), with the admin API public and not;
- paths spelled to slip past a table (case, percent-encoding, dot segments, doubled
  slashes) and hypothesis-generated ones: 404, and nothing reaches an engine;
- a web page: a foreign Host (DNS rebinding) or Origin is refused before anything runs,
  keys or no keys; a "simple" text/plain POST is refused; allowed origins get CORS;
- the findings of issue 33, one test each.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gatewayd.core.auth import KeyRing, digest, parse_keys
from gatewayd.core.query import QUERIES
from gatewayd.core.routes import ROUTES, TABLE, Body, Caller, Route
from gatewayd.core.upstreams import UpstreamConfig
from tests.fake_engine import MARK
from tests.fake_upstream import FakeUpstream
from tests.http.test_front_door import Gateway, _gateway, chat

USER, OPS, ONLY_B = "sk-llmgw-user", "sk-llmgw-ops", "sk-llmgw-only-b"
CREDENTIALS: dict[str, str | None] = {"none": None, "wrong": "sk-llmgw-guess",
                                      "only-b": ONLY_B, "inference": USER, "admin": OPS}
OTHER_METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH")


def ring() -> KeyRing:
    return parse_keys({"keys": {
        "user": {"sha256": digest(USER)},
        "ops": {"sha256": digest(OPS), "scopes": ["admin"]},
        "b-only": {"sha256": digest(ONLY_B), "models": ["b"]},
    }}, "test")


def seen(gw: Gateway) -> list[tuple[str, str]]:
    """Every request any fake engine got from a client (the gateway's own are not kept)."""
    return [(name, r.path) for name, fake in gw.fakes.items() for r in fake.requests]


def concrete(route: Route) -> str:
    return route.path.replace("{n}", "0").replace("{id}", "a").replace("{key}", "x1")


def request_for(route: Route, method: str, key: str | None) -> dict[str, Any]:
    """aiohttp request arguments that would reach model a's engine if let through."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    # ?model=a where the route may take it: the gateway's own admin routes (and the Batch
    # API's) take only the parameters core/query lists for them
    takes_model = not route.typed_query or "model" in QUERIES.get(route.path, {})
    kw: dict[str, Any] = {"headers": headers,
                          "params": {"model": "a"} if takes_model else {}}
    if method in ("GET", "HEAD"):
        return kw
    if route.body is Body.MULTIPART:
        form = aiohttp.FormData()
        form.add_field("model", "a")
        form.add_field("file", b"RIFF....", filename="a.wav", content_type="audio/wav")
        kw["data"] = form
    else:
        kw["json"] = {**chat("a"), "query": "q", "documents": ["d"], "input": "hi",
                      "content": "hi", "model": "a"}
    return kw


def expected(route: Route, method: str, credential: str, admin_public: bool) -> set[int]:
    """The answers the gate may give (a let-through request: anything but the gate's)."""
    if method not in TABLE.methods(concrete(route)):
        return {405}
    if route.access is Caller.PUBLIC:
        return {200, 204}
    if route.access is Caller.ADMIN:
        if not admin_public:
            return {404}
        if route.keyless:
            return {200}
        return {401} if credential in ("none", "wrong") else \
            {403} if credential != "admin" else LET_THROUGH
    if credential in ("none", "wrong"):
        return {401}
    if credential == "admin":
        return {403}                      # an admin key has no inference scope
    if credential == "only-b" and route.path not in ("/v1/models", "/v1/models/{id}") \
            and route.answerer.value != "gateway":
        return {403}                      # model a is not its model
    if credential == "only-b" and route.path == "/v1/models/{id}":
        return {403}
    return LET_THROUGH


# a request the gate let through: whatever the engine or handler answered, never the gate's
LET_THROUGH = {200, 204, 400, 404, 409, 501, 502, 503}


def is_gate_answer(status: int, body: dict[str, Any]) -> bool:
    code = (body.get("error") or {}).get("code")
    return status in (401, 403, 405, 415, 421) or code in (
        "not_found", "admin_not_public", "scope_not_allowed", "model_not_allowed")


@pytest.fixture(params=[True, False], ids=["admin-public", "admin-private"])
async def gw(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Gateway]:
    async for g in _gateway(tmp_path, ("a", "b"), api_keys=ring(),
                            admin_public=request.param):
        yield g


async def test_the_attack_matrix_every_route_method_and_credential(gw: Gateway) -> None:
    admin_public = gw.engines.config.admin_public
    # a reload let through re-reads the configuration: this gateway has no file, so its
    # settings (admin_public among them) become the defaults; it goes last
    for route in sorted(ROUTES, key=lambda r: r.path == "/admin/reload"):
        path = concrete(route)
        for method in sorted(set(route.methods) | set(OTHER_METHODS)):
            if method in TABLE.methods(path) and route not in _routes_for(path, method):
                continue      # this method is another route's (GET /props vs POST /props)
            for credential, key in CREDENTIALS.items():
                before = seen(gw)
                async with gw.client.request(method, path, **request_for(route, method, key)
                                             ) as resp:
                    # the event feed follows for ever: its head says enough
                    if resp.content_type == "text/event-stream":
                        text = ""
                        resp.close()     # not back to the pool with the feed still coming
                    else:
                        text = await resp.text()
                body = json.loads(text) if text.startswith("{") else {}
                want = expected(route, method, credential, admin_public)
                where = f"{method} {path} with {credential} key: {resp.status} {text[:300]}"
                assert resp.status in want, where
                if want is LET_THROUGH:
                    assert not is_gate_answer(resp.status, body), where
                else:     # refused: nothing reached an engine
                    assert seen(gw) == before, where


def _routes_for(path: str, method: str) -> list[Route]:
    found = TABLE.find(path)
    return [r for r in (found[0] if found else []) if method in r.methods]


SLIPPERY = ["/ADMIN/status", "/Admin/status", "/V1/chat/completions", "/v1/chat/completions/",
            "//v1/chat/completions", "/v1//chat/completions", "/v1/chat%2Fcompletions",
            "/v1/..%2fadmin/status", "/v1/%2e%2e/slots", "/%2e%2e/slots", "/health/../slots",
            "/./slots", "/slots/-1", "/slots/0x1", "/slots/1/2", "/slots%2F0", "/load",
            "/v1/files/x/y", "/v1/fine_tuning/jobs", "/admin/../slots", "/props/", "/metrics/",
            "/v1/models/../../slots", "/lora-adapters/x", "/%73lots"]


async def raw(gw: Gateway, method: str, target: str, headers: dict[str, str] | None = None,
              body: bytes = b"") -> tuple[int, dict[str, Any], str]:
    """A request written byte for byte (no client normalises its path)."""
    reader, writer = await asyncio.open_connection(gw.client.host, gw.client.port)
    head = {"Host": f"127.0.0.1:{gw.client.port}", "Content-Length": str(len(body)),
            "Connection": "close", **(headers or {})}
    writer.write(f"{method} {target} HTTP/1.1\r\n".encode("latin-1") + b"".join(
        f"{k}: {v}\r\n".encode("latin-1") for k, v in head.items()) + b"\r\n" + body)
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    status_line, _, rest = data.partition(b"\r\n")
    head_block, _, payload = rest.partition(b"\r\n\r\n")
    text = payload.decode(errors="replace")
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = {}
    return int(status_line.split()[1]), parsed, head_block.decode("latin-1")


@pytest.mark.parametrize("target", SLIPPERY)
async def test_paths_spelled_to_slip_past_the_table_reach_nothing(tmp_path: Path,
                                                                  target: str) -> None:
    async for gw in _gateway(tmp_path, ("a",), api_keys=ring(), admin_public=True):
        for key in (None, USER, OPS):
            for method in ("GET", "POST"):
                headers = {"Content-Type": "application/json"}
                if key:
                    headers["Authorization"] = f"Bearer {key}"
                status, body, _ = await raw(gw, method, target + "?model=a", headers,
                                            json.dumps(chat("a")).encode())
                assert status in (404, 405), (method, target, key, status, body)
                assert body["error"]["code"] in ("not_found", "method_not_allowed")
        assert seen(gw) == []


@settings(max_examples=150, deadline=None, derandomize=False,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.lists(st.sampled_from(["v1", "V1", "admin", "slots", "props", "..", ".", "",
                                      "%2e", "%2f", "%2F", "0", "chat", "completions",
                                      "metrics", "load", "health", "models", "a", "%00",
                                      "lora-adapters", "tokenize", "?", "#"]),
                     min_size=1, max_size=5))
async def test_any_path_outside_the_table_is_a_404_that_reaches_no_engine(
        gw_plain: Gateway, path: list[str]) -> None:
    target = "/" + "/".join(path)
    found = TABLE.find(_decoded(target))
    status, body, _ = await raw(gw_plain, "POST", target,
                                {"Content-Type": "application/json"},
                                json.dumps(chat("zzz-none")).encode())
    if found is None:
        assert status in (400, 404), (target, status, body)
        assert seen(gw_plain) == [], target


def _decoded(target: str) -> str:
    from urllib.parse import unquote
    return unquote(target.split("?", 1)[0].split("#", 1)[0])


@pytest.fixture
async def gw_plain(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Gateway]:
    """Keys off, the default install: no model named in the body (zzz-none) exists, so a
    path let through answers 404 model_not_found without reaching an engine either."""
    async for g in _gateway(tmp_path_factory.mktemp("plain"), ("a",), admin_public=False):
        yield g


# -- a web page in the user's browser --------------------------------------------------

async def test_a_rebinding_page_with_a_foreign_host_gets_nothing(gw_plain: Gateway) -> None:
    for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                         ("GET", "/health"), ("GET", "/admin/status")):
        status, body, _ = await raw(gw_plain, method, path, {
            "Host": "attacker.example:8080", "Content-Type": "application/json"},
            json.dumps(chat("a")).encode())
        assert status == 421 and body["error"]["code"] == "host_not_allowed", (path, body)
    assert seen(gw_plain) == []
    # names that are this gateway: loopback names and addresses, with or without a port
    for host in ("localhost", "localhost:8080", "127.0.0.1", "[::1]:8080", "app.localhost"):
        status, _, _ = await raw(gw_plain, "GET", "/health", {"Host": host})
        assert status == 200, host


async def test_a_page_of_another_origin_is_refused_before_anything_runs(
        tmp_path: Path) -> None:
    """Keys off on loopback (the default): a page's fetch would run a chat and start
    engines. Refused with 403 before the engine is started, preflight or not."""
    async for gw in _gateway(tmp_path, (), admin_public=True):
        evil = {"Origin": "http://attacker.example", "Content-Type": "text/plain"}
        for path in ("/v1/chat/completions", "/admin/engines/start"):
            status, body, _ = await raw(gw, "POST", path, evil,
                                        json.dumps(chat("a")).encode())
            assert status == 403 and body["error"]["code"] == "origin_not_allowed", body
        status, _, head = await raw(gw, "OPTIONS", "/v1/chat/completions", {
            "Origin": "http://attacker.example", "Access-Control-Request-Method": "POST"})
        assert status == 403 and "access-control-allow-origin" not in head.lower()
        assert gw.units.log == [] and seen(gw) == []         # no engine was started
        # the "simple request" without an Origin (an old browser, a form): not JSON, 415
        status, body, _ = await raw(gw, "POST", "/v1/chat/completions",
                                    {"Content-Type": "text/plain"},
                                    json.dumps(chat("a")).encode())
        assert status == 415 and body["error"]["code"] == "unsupported_media_type"
        assert gw.units.log == []
        # the status page's own calls (same origin) go through
        own = {"Origin": f"http://127.0.0.1:{gw.client.port}"}
        status, body, _ = await raw(gw, "GET", "/admin/status", own)
        assert status == 200, body


async def test_allowed_origins_get_cors_and_others_do_not(tmp_path: Path) -> None:
    app_origin = "https://app.example"
    async for gw in _gateway(tmp_path, ("a",), allowed_origins=(app_origin,)):
        status, _, head = await raw(gw, "OPTIONS", "/v1/chat/completions", {
            "Origin": app_origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert status == 204
        lowered = head.lower()
        assert f"access-control-allow-origin: {app_origin}" in lowered
        assert "access-control-allow-methods: post" in lowered
        status, body, head = await raw(gw, "POST", "/v1/chat/completions", {
            "Origin": app_origin, "Content-Type": "application/json"},
            json.dumps(chat("a")).encode())
        assert status == 200 and body["model"] == "a"
        assert f"access-control-allow-origin: {app_origin}" in head.lower()
        # the engine's own CORS headers (llama-server allows any origin) never pass
        assert "*" not in [line.split(":", 1)[1].strip() for line in head.lower().splitlines()
                           if line.startswith("access-control-allow-origin")]
        # a page may read when to retry and whose an error is (a browser hides both else)
        status, _, head = await raw(gw, "POST", "/v1/chat/completions", {
            "Origin": app_origin, "Content-Type": "application/json"},
            json.dumps(chat("nope")).encode())
        assert status == 404
        assert "access-control-expose-headers: retry-after, llm-gateway-error-source" \
            in head.lower()
        status, _, _ = await raw(gw, "POST", "/v1/chat/completions", {
            "Origin": "https://other.example", "Content-Type": "application/json"},
            json.dumps(chat("a")).encode())
        assert status == 403


# -- the findings of issue 33, one by one ----------------------------------------------

async def test_finding_1_a_keyless_post_to_an_open_path_reaches_no_engine(
        tmp_path: Path) -> None:
    async for gw in _gateway(tmp_path, (), api_keys=ring()):
        for path in ("/health", "/favicon.ico"):
            resp = await gw.client.post(path, params={"model": "a"}, json=chat("a"))
            assert resp.status == 405, path
        assert gw.units.log == [] and seen(gw) == []   # no engine: none to restore either


async def test_finding_2_engine_admin_paths_need_the_admin_scope(tmp_path: Path) -> None:
    async for gw in _gateway(tmp_path, ("a", "b"), api_keys=ring(), admin_public=True):
        for key in (USER, ONLY_B):
            h = {"Authorization": f"Bearer {key}"}
            for method, path in (("POST", "/slots/0?action=save&model=b"),
                                 ("POST", "/slots/0?action=erase&model=b"),
                                 ("GET", "/slots?model=b"), ("POST", "/props?model=b"),
                                 ("POST", "/lora-adapters?model=b"), ("GET", "/metrics?model=b")):
                resp = await gw.client.request(method, path, headers=h,
                                               json={"filename": "../../x.bin"})
                assert resp.status == 403, (key, method, path)
                assert (await resp.json())["error"]["code"] == "scope_not_allowed"
        assert seen(gw) == []
        resp = await gw.client.get("/props", params={"model": "b"},
                                   headers={"Authorization": f"Bearer {ONLY_B}"})
        assert resp.status == 200                  # reading the engine's settings: inference
        resp = await gw.client.post("/slots/0", params={"model": "b", "action": "erase"},
                                    headers={"Authorization": f"Bearer {OPS}"}, json={})
        assert resp.status == 404 and seen(gw)[-1] == ("b", "/slots/0?model=b&action=erase")
    async for gw in _gateway(tmp_path, ("a",), admin_public=False):   # keys off, default
        resp = await gw.client.post("/slots/0", params={"action": "save"},
                                    json={"filename": "x"})
        assert resp.status == 404 and (await resp.json())["error"]["code"] == "admin_not_public"
        assert seen(gw) == []


async def test_finding_3_an_upstream_gets_only_listed_paths_and_headers(
        tmp_path: Path) -> None:
    box = FakeUpstream("box", models=["big"], key="upstream-key")
    await box.start()
    secret_url = box.url.replace("://", "://user:hunter2@")
    try:
        async for gw in _gateway(tmp_path, (), upstreams=(
                UpstreamConfig(name="box", url=box.url, models=("big",),
                               api_key="upstream-key", health_interval_s=0.2),)):
            for method, path in (("DELETE", "/v1/files/x?model=big"),
                                 ("GET", "/v1/files?model=big"),
                                 ("POST", "/v1/..%2f..%2fadmin?model=big"),
                                 ("PUT", "/v1/chat/completions?model=big")):
                status, _, _ = await raw(gw, method, path,
                                         {"Content-Type": "application/json"}, b"{}")
                # (the Batch API's /v1/files is the gateway's own: never relayed, and its
                # typed query takes no model)
                assert status in (400, 404, 405), (method, path, status)
            assert box.requests == []
            resp = await gw.client.post("/v1/chat/completions", json=chat("big"), headers={
                "Cookie": "session=s3cr3t", "OpenAI-Organization": "org-x",
                "OpenAI-Project": "proj-x", "X-Forwarded-For": "10.0.0.1",
                "Authorization": "Bearer client-key", "OpenAI-Beta": "assistants=v2"})
            assert resp.status == 200
            sent = {k.lower(): v for k, v in box.requests[-1].headers.items()}
            for name in ("cookie", "openai-organization", "openai-project", "x-forwarded-for"):
                assert name not in sent, name
            assert sent["authorization"] == "Bearer upstream-key"
            assert sent["openai-beta"] == "assistants=v2"
        async for gw in _gateway(tmp_path, (), admin_public=True, upstreams=(
                UpstreamConfig(name="down", url=secret_url.replace(str(box.port), "9"),
                               models=("big",), health_interval_s=0.2,
                               connect_timeout_s=0.5),)):
            for _ in range(50):
                resp = await gw.client.post("/v1/chat/completions", json=chat("big"))
                text = await resp.text()
                assert "hunter2" not in text and "user:" not in text, text
                if resp.status == 503:
                    break
                await asyncio.sleep(0.05)
            shown = await (await gw.client.get("/admin/status")).text()
            assert "hunter2" not in shown and "127.0.0.1:9" in shown
    finally:
        await box.stop()


async def test_finding_6_inference_callers_learn_nothing_beyond_their_models(
        tmp_path: Path) -> None:
    async for gw in _gateway(tmp_path, (), api_keys=ring(), admin_public=True):
        only_b = {"Authorization": f"Bearer {ONLY_B}"}
        resp = await gw.client.post("/v1/chat/completions", json=chat("nope"), headers=only_b)
        assert resp.status == 403          # a name outside its list: as for a real model
        resp = await gw.client.post("/v1/embeddings", json={"model": "a", "input": "x"},
                                    headers=only_b)
        body = await resp.json()           # a is a chat model: the 400 would say so
        assert resp.status == 403 and body["error"]["code"] == "model_not_allowed"
        assert "chat" not in body["error"]["message"]
        resp = await gw.client.get("/v1/models/a", headers=only_b)
        assert resp.status == 403
        user = {"Authorization": f"Bearer {USER}"}
        resp = await gw.client.post("/v1/chat/completions", json=chat("nope"), headers=user)
        assert (await resp.json())["available_models"] == ["a", "b", "c"]
        # an engine that fails: the caller is told, the journal's lines are the admin's
        gw.units.fail_start = "no such file"
        resp = await gw.client.post("/v1/chat/completions", json=chat("b"), headers=only_b)
        body = await resp.json()
        assert resp.status >= 500 and "log_tail" not in json.dumps(body), body
        # ... with the cause its lines say, in a fixed sentence (the fake journal's
        # "error loading model"), not their words
        assert body["error"]["failure"]["cause"]["code"] == "model_load", body
        assert "its server could not load the model" in body["error"]["message"]
        assert "llm-engine-b.service: error loading model" not in json.dumps(body)
        engines = await (await gw.client.get(
            "/admin/engines", headers={"Authorization": f"Bearer {OPS}"})).json()
        failed = [e for e in engines["engines"] if e["model"] == "b"]
        assert failed and failed[0]["failure"]["log_tail"], engines
        assert failed[0]["failure"]["cause"]["code"] == "model_load"


async def test_an_oversized_head_is_a_431_in_the_callers_dialect(
        gw_plain: Gateway, caplog: pytest.LogCaptureFixture) -> None:
    body = json.dumps(chat("a")).encode()
    for path, shape in (("/v1/chat/completions", "openai"), ("/v1/messages", "anthropic")):
        status, answer, _ = await raw(gw_plain, "POST", path, {
            "Content-Type": "application/json", "X-Big": "x" * 9000}, body)
        assert status == 431, answer
        error = answer["error"]
        assert (answer.get("type") == "error") is (shape == "anthropic")
        assert "X-Big" in error["message"] or "x-big" in error["message"].lower()
        status, answer, _ = await raw(gw_plain, "POST", path, {
            "Content-Type": "application/json",
            **{f"X-Many-{i}": "y" * 4000 for i in range(10)}}, body)  # 40 KiB
        assert status == 431
    assert seen(gw_plain) == [] and "Traceback" not in caplog.text
    status, _, _ = await raw(gw_plain, "POST", "/v1/chat/completions",
                             {"Content-Type": "application/json"}, body)
    assert status == 200                                       # and it serves on


async def test_the_admin_socket_serves_admin_routes_only(tmp_path: Path) -> None:
    """The matrix's other listener: on the admin socket (its peer is this test's user,
    the gateway's own) every inference route is a 404 that reaches no engine, whatever the
    key; the admin and public routes are served without one."""
    import tempfile

    from aiohttp import web

    from gatewayd.adapters import admin_socket
    from gatewayd.http.auth import ACCESS
    with tempfile.TemporaryDirectory(prefix="as", dir="/tmp") as d:   # sun_path: 108 bytes
        path = Path(d) / "admin.sock"
        async for gw in _gateway(tmp_path, ("a", "b"), api_keys=ring(), admin_public=False):
            runner = gw.client.server.runner
            assert runner is not None
            await web.SockSite(runner, admin_socket.bind(path, None)).start()
            gw.client.app[ACCESS].admin_socket = str(path)
            connector = aiohttp.UnixConnector(path=str(path))
            async with aiohttp.ClientSession(connector=connector) as session:
                # the reload (the defaults: no file) would take the catalog's models away
                # from the routes after it: it goes last
                for route in sorted(ROUTES, key=lambda r: r.path == "/admin/reload"):
                    for method in sorted(route.methods - {"HEAD"}):
                        for key in (None, USER, OPS):
                            kw = request_for(route, method, key)
                            async with session.request(
                                    method, "http://localhost" + concrete(route), **kw) as resp:
                                if resp.content_type == "text/event-stream":
                                    resp.close()
                                else:
                                    await resp.read()
                            where = f"{method} {route.path} key={key}: {resp.status}"
                            relayed = resp.headers.get(MARK) is not None   # an engine's
                            if route.access is Caller.INFERENCE:
                                assert resp.status == 404 and not relayed, where
                            elif route.engine:
                                assert relayed, where
                            else:
                                assert resp.status not in (401, 403, 404, 405, 421), where
            assert all(path.startswith(("/slots", "/props", "/lora-adapters", "/metrics"))
                       for _, path in seen(gw)), seen(gw)


async def test_a_json_route_takes_json_only_whatever_a_form_can_send(tmp_path: Path) -> None:
    """The three content types a page may POST without a preflight (a form's two and
    text/plain), and any other non-JSON type, are a 415 before the body is read: a
    cross-site form never reaches an engine, even one whose Origin a browser left out."""
    async for gw in _gateway(tmp_path, ("a",)):
        body = json.dumps(chat("a")).encode()
        for kind in ("application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                     "text/plain", "application/xml", "application/octet-stream"):
            status, answer, _ = await raw(gw, "POST", "/v1/chat/completions",
                                          {"Content-Type": kind}, body)
            assert status == 415, (kind, answer)
            assert answer["error"]["code"] == "unsupported_media_type"
        assert seen(gw) == []
        for kind in ("application/json", "application/json; charset=utf-8",
                     "application/vnd.example+json"):
            status, answer, _ = await raw(gw, "POST", "/v1/chat/completions",
                                          {"Content-Type": kind}, body)
            assert status == 200, (kind, answer)


@pytest.mark.parametrize("method,path,fetch,status", [
    # an <img> or <script> of another site's page: no Origin, only Sec-Fetch-Site
    ("GET", "/admin/engines/logs?model=a&follow=1", ("cross-site", "no-cors", "image"), 403),
    ("GET", "/admin/events", ("same-site", "no-cors", "script"), 403),
    ("GET", "/v1/models", ("cross-site", "no-cors", "script"), 403),
    ("GET", "/admin/", ("cross-site", "navigate", "iframe"), 403),       # framed
    ("GET", "/admin/logs?follow=1", ("cross-site", "navigate", "document"), 403),
    # a link to the status page or /health from elsewhere still opens it
    ("GET", "/admin/", ("cross-site", "navigate", "document"), 200),
    ("GET", "/health", ("cross-site", "navigate", "document"), 200),
    # the page's own requests, and a user typing the address
    ("GET", "/admin/status", ("same-origin", "cors", "empty"), 200),
    ("GET", "/admin/status", ("none", "navigate", "document"), 200),
])
async def test_a_request_from_another_sites_page_needs_an_allowed_origin(
        tmp_path: Path, method: str, path: str, fetch: tuple[str, str, str],
        status: int) -> None:
    site, mode, dest = fetch
    async for gw in _gateway(tmp_path, ("a",)):
        headers = {"Sec-Fetch-Site": site, "Sec-Fetch-Mode": mode, "Sec-Fetch-Dest": dest}
        async with gw.client.request(method, path, headers=headers) as resp:
            # (a follow let through never ends: its head says enough)
            assert resp.status == status, (resp.status, resp.content_type)
            if status == 403:
                assert (await resp.json())["error"]["code"] == "cross_site_request"


async def test_an_allowed_origins_page_may_follow_with_its_origin(tmp_path: Path) -> None:
    async for gw in _gateway(tmp_path, ("a",), allowed_origins=("https://tools.example",)):
        async with gw.client.get("/admin/events", headers={
                "Origin": "https://tools.example", "Sec-Fetch-Site": "cross-site",
                "Sec-Fetch-Mode": "cors"}) as resp:
            assert resp.status == 200 and resp.content_type == "text/event-stream"
            resp.close()


async def test_the_console_is_served_with_a_policy_that_runs_only_its_own_scripts(
        tmp_path: Path) -> None:
    async for gw in _gateway(tmp_path, ()):
        resp = await gw.client.get("/admin/")
        page = await resp.read()
        assert resp.headers["X-Frame-Options"] == "DENY"
        assert resp.headers["X-Content-Type-Options"] == "nosniff"
        assert resp.headers["Referrer-Policy"] == "no-referrer"
        policy = dict(d.strip().split(" ", 1) for d in
                      resp.headers["Content-Security-Policy"].split(";"))
        assert policy["frame-ancestors"] == "'none'" and policy["default-src"] == "'none'"
        assert policy["connect-src"] == "'self'"
        scripts = re.findall(rb"<script>(.*?)</script>", page, re.S)
        assert len(scripts) == 2
        assert policy["script-src"].split() == [
            "'sha256-" + base64.b64encode(hashlib.sha256(s).digest()).decode() + "'"
            for s in scripts]
