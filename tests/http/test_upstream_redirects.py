"""A remote upstream's redirect is its answer, never followed: the request (its body, the
gateway's key for that upstream) goes to the upstream configured and nowhere else."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web
from aiohttp.test_utils import TestServer

from gatewayd.core.upstreams import UpstreamConfig
from tests.http.test_front_door import _gateway, chat


async def test_a_redirect_of_an_upstream_reaches_the_client_and_is_not_followed(
        tmp_path: Path) -> None:
    elsewhere_saw: list[str] = []

    async def elsewhere(request: web.Request) -> web.Response:
        elsewhere_saw.append(request.path)
        return web.json_response({"choices": []})

    other = web.Application()
    other.router.add_route("*", "/{tail:.*}", elsewhere)
    async with TestServer(other) as there:
        async def models(request: web.Request) -> web.Response:
            return web.json_response({"data": [{"id": "big"}]})

        async def moved(request: web.Request) -> web.Response:
            raise web.HTTPTemporaryRedirect(str(there.make_url("/v1/chat/completions")))

        box = web.Application()
        box.router.add_get("/v1/models", models)
        box.router.add_post("/v1/chat/completions", moved)
        async with TestServer(box) as here:
            url = str(here.make_url("/v1"))
            async for gw in _gateway(tmp_path, (), upstreams=(
                    UpstreamConfig("box", url, models=("big",), api_key="box-key"),)):
                resp = await gw.client.post("/v1/chat/completions", json=chat("big"))
                await resp.read()
                assert resp.status == 307
                assert "Location" not in resp.headers   # not an answer header we pass on
                assert elsewhere_saw == []
