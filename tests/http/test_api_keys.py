"""API keys over real HTTP against fake engines: both header styles, both dialects'
refusals, scopes, allowed models, the record, and keys never reaching an engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gatewayd.core.auth import KeyRing, digest, parse_keys
from tests.http.test_front_door import Gateway, _gateway, chat

USER, ADMIN, ONLY_B = "sk-llmgw-user-key", "sk-llmgw-admin-key", "sk-llmgw-only-b"


def ring() -> KeyRing:
    return parse_keys({"keys": {
        "user": {"sha256": digest(USER)},                       # defaults: *, inference
        "ops": {"sha256": digest(ADMIN), "scopes": ["admin"]},
        "b-only": {"sha256": digest(ONLY_B), "models": ["B"]},  # an alias of b
    }}, "test")


@pytest.fixture
async def gw(tmp_path: Path) -> AsyncIterator[Gateway]:
    async for g in _gateway(tmp_path, ("a", "b"), api_keys=ring()):
        yield g


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_no_key_or_a_wrong_one_is_401_in_the_callers_dialect(gw: Gateway) -> None:
    resp = await gw.client.post("/v1/chat/completions", json=chat("a"))
    body = await resp.json()
    assert resp.status == 401 and body["error"]["code"] == "missing_api_key"
    assert resp.headers["WWW-Authenticate"].startswith("Bearer")
    resp = await gw.client.post("/v1/chat/completions", json=chat("a"),
                                headers=bearer("sk-llmgw-guess"))
    assert resp.status == 401 and (await resp.json())["error"]["code"] == "invalid_api_key"
    resp = await gw.client.post("/v1/messages", json={
        "model": "a", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
        headers={"x-api-key": "wrong"})
    body = await resp.json()
    assert resp.status == 401 and body["type"] == "error"
    assert body["error"]["type"] == "authentication_error"
    assert (await gw.client.get("/health")).status == 200        # liveness stays open
    assert gw.fakes["a"].requests == [] or all(
        r.path != "/v1/chat/completions" for r in gw.fakes["a"].requests)


async def test_either_header_style_is_accepted_and_never_forwarded(gw: Gateway) -> None:
    resp = await gw.client.post("/v1/chat/completions", json=chat("a"), headers=bearer(USER))
    assert resp.status == 200, await resp.text()
    resp = await gw.client.post("/v1/messages", json={
        "model": "a", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
        headers={"x-api-key": USER, "anthropic-version": "2023-06-01"})
    assert resp.status == 200, await resp.text()
    seen = [r.headers for r in gw.fakes["a"].requests]
    assert len(seen) == 2
    assert all("Authorization" not in h and "X-Api-Key" not in h
               and "authorization" not in h and "x-api-key" not in h for h in seen)
    rows = await gw.records(2)
    assert {r["api_key"] for r in rows} == {"user"}


async def test_models_and_scopes_are_enforced(gw: Gateway) -> None:
    resp = await gw.client.post("/v1/chat/completions", json=chat("a"), headers=bearer(ONLY_B))
    body = await resp.json()
    assert resp.status == 403 and body["error"]["code"] == "model_not_allowed", body
    assert "'b-only' may not use the model 'a'" in body["error"]["message"]
    resp = await gw.client.post("/v1/chat/completions", json=chat("b"), headers=bearer(ONLY_B))
    assert resp.status == 200
    listed = await (await gw.client.get("/v1/models", headers=bearer(ONLY_B))).json()
    assert [m["id"] for m in listed["data"]] == ["b"]
    assert (await gw.client.get("/v1/models/a", headers=bearer(ONLY_B))).status == 403
    # inference keys do not reach the admin API, admin keys not the models
    resp = await gw.client.get("/admin/status", headers=bearer(USER))
    assert resp.status == 403 and (await resp.json())["error"]["code"] == "scope_not_allowed"
    assert (await gw.client.get("/admin/status", headers=bearer(ADMIN))).status == 200
    resp = await gw.client.post("/v1/chat/completions", json=chat("a"), headers=bearer(ADMIN))
    assert resp.status == 403
    rows = await gw.records(2)
    refused = [r for r in rows if r["status"] == 403]
    assert refused and refused[0]["api_key"] == "b-only"
    assert refused[0]["error_code"] == "model_not_allowed"


async def test_a_model_the_gateway_chooses_is_checked_against_the_key_too(
        tmp_path: Path) -> None:
    """No model named: the gateway chooses one (the one ready engine for inference; for
    GET /props default_model, else the first ready engine). A key limited to other
    models gets no answer of that one either."""
    async for gw in _gateway(tmp_path, ("a",), api_keys=ring(), default_model="a"):
        for resp in (await gw.client.post("/v1/chat/completions", json=chat(),
                                          headers=bearer(ONLY_B)),
                     await gw.client.get("/props", headers=bearer(ONLY_B))):
            body = await resp.json()
            assert resp.status == 403 and body["error"]["code"] == "model_not_allowed", body
        assert gw.fakes["a"].requests == []
        resp = await gw.client.post("/v1/chat/completions", json=chat(), headers=bearer(USER))
        assert resp.status == 200 and (await resp.json())["model"] == "a"
