"""The floor: a bare aiohttp reverse proxy to one engine socket, no features (~40 lines).

    python -m bench.bare_proxy --socket /run/llm-engine-x/engine.sock --port 18602
"""

from __future__ import annotations

import argparse

import aiohttp
from aiohttp import web

HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


def build(socket: str) -> web.Application:
    async def start(app: web.Application) -> None:
        app["pooled"] = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=socket))
        app["oneshot"] = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=socket, force_close=True))

    async def stop(app: web.Application) -> None:
        await app["pooled"].close()
        await app["oneshot"].close()

    async def proxy(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        session = app["oneshot"] if b'"stream": true' in body or b'"stream":true' in body \
            else app["pooled"]
        async with session.request(request.method, "http://engine" + request.path_qs,
                                   data=body, headers={"Content-Type": "application/json"}) as up:
            if up.headers.get("Content-Type", "").startswith("text/event-stream"):
                resp = web.StreamResponse(status=up.status,
                                          headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
                return resp
            data = await up.read()
            return web.Response(body=data, status=up.status, headers={
                k: v for k, v in up.headers.items() if k.lower() not in HOP})

    app = web.Application(client_max_size=1024**3)
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_route("*", "/{tail:.*}", proxy)
    return app


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--port", type=int, required=True)
    a = ap.parse_args()
    web.run_app(build(a.socket), host="127.0.0.1", port=a.port, access_log=None, print=None)
