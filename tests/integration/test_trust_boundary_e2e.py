"""The trust boundary end to end: the gateway (a service of the container's systemd) in
front of a real llama-server, tried with no key, another model's key, an inference key
and an admin key, from a foreign Host and Origin, on every engine route of the route
table and on paths spelled to slip past it. The witness is the engine itself: its slot
files' folder stays empty and its parallel slots untouched until an admin key asks."""

from __future__ import annotations

import http.client
import json
from pathlib import Path
from typing import Any

import pytest

from gatewayd.core.auth import digest
from gatewayd.core.routes import ROUTES, Answerer, Caller
from tests.integration.conftest import GatewayFactory
from tests.integration.gateway_helpers import GatewayService, toml_str

pytestmark = [pytest.mark.systemd, pytest.mark.engine]

APP, OPS = "sk-llmgw-app-boundary", "sk-llmgw-ops-boundary"


def send(gw: GatewayService, method: str, target: str, body: Any = None, *,
         key: str | None = None, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """One request written as given (http.client does not normalise the path)."""
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=60)
    head = {"Content-Type": "application/json", **(headers or {})}
    if key:
        head["Authorization"] = f"Bearer {key}"
    data = body if isinstance(body, bytes) else (json.dumps(body).encode()
                                                 if body is not None else None)
    try:
        conn.request(method, target, body=data, headers=head)
        resp = conn.getresponse()
        text = resp.read()
    finally:
        conn.close()
    try:
        return resp.status, json.loads(text)
    except ValueError:
        return resp.status, text.decode(errors="replace")


def chat(model: str) -> dict[str, Any]:
    return {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


def slot_files(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "state" / "kv-cache").glob("*/*"))


def test_no_caller_without_the_right_key_reaches_a_real_engine(
        gateway_factory: GatewayFactory, tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(
        f'[keys.app]\nsha256 = "{digest(APP)}"\nmodels = ["tiny-alpha"]\n'
        f'scopes = ["inference"]\n[keys.ops]\nsha256 = "{digest(OPS)}"\nscopes = ["admin"]\n')
    gw = gateway_factory(extra=f"[auth]\nkeys_file = {toml_str(str(keys))}\n")
    gw.api_key = OPS
    assert send(gw, "POST", "/v1/chat/completions", chat("tiny-alpha"), key=APP)[0] == 200
    erase_me = send(gw, "GET", "/slots?model=tiny-alpha", key=OPS)
    assert erase_me[0] == 200 and erase_me[1][0]["id"] == 0, erase_me
    before = slot_files(tmp_path)

    # every admin route an engine answers: refused to all but the admin key
    for route in ROUTES:
        if route.access is not Caller.ADMIN or route.answerer is Answerer.GATEWAY:
            continue
        path = route.path.replace("{n}", "0")
        for method in sorted(route.methods - {"HEAD"}):
            target = f"{path}?model=tiny-alpha&action=save"
            for key, want in ((None, 401), ("sk-llmgw-wrong", 401), (APP, 403)):
                status, body = send(gw, method, target, {"filename": "stolen.bin"}, key=key)
                assert status == want, (method, target, key, status, body)
    # paths spelled to slip past the table, with the admin key even
    for target in ("/load", "/%73lots/0?action=save&model=tiny-alpha",
                   "/v1/models/../../slots/0?action=save&model=tiny-alpha",
                   "/v1/..%2fslots?model=tiny-alpha", "//slots?model=tiny-alpha",
                   "/SLOTS?model=tiny-alpha", "/slots/0/?action=save&model=tiny-alpha"):
        for method in ("GET", "POST"):
            status, body = send(gw, method, target, {"filename": "stolen.bin"}, key=OPS)
            assert status in (404, 405), (method, target, status, body)
    # a web page: another origin, a rebinding Host, a text/plain "simple" request
    for headers in ({"Origin": "http://attacker.example"},
                    {"Host": "attacker.example"},
                    {"Content-Type": "text/plain"}):
        for target, key in (("/slots/0?action=save&model=tiny-alpha", OPS),
                            ("/v1/chat/completions", APP)):
            status, body = send(gw, "POST", target, {**chat("tiny-beta"),
                                                     "filename": "stolen.bin"},
                                key=key, headers=headers)
            assert status in (403, 415, 421), (headers, target, status, body)
    # another model's key, and a model the key may not use: nothing started
    status, body = send(gw, "POST", "/v1/chat/completions", chat("tiny-beta"), key=APP)
    assert status == 403 and body["error"]["code"] == "model_not_allowed"
    assert "tiny-beta" not in gw.engines()
    assert slot_files(tmp_path) == before, "a refused request reached the engine"

    # the witness can see: the admin key saves a parallel slot, and the file is there
    status, body = send(gw, "POST", "/slots/0?action=save&model=tiny-alpha",
                        {"filename": "by-ops.bin"}, key=OPS)
    assert status == 200, body
    assert "by-ops.bin" in slot_files(tmp_path)
    # and the engine's raw headers (llama-server allows any origin) never reach a client
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(chat("tiny-alpha")),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {APP}"})
    resp = conn.getresponse()
    resp.read()
    conn.close()
    assert resp.status == 200
    assert resp.getheader("Access-Control-Allow-Origin") is None
