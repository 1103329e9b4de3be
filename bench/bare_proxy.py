"""The floor: a bare aiohttp reverse proxy to one engine socket, no features (~50 lines).

Like the gateway, it sends a request once more, on a new connection, when the pooled
keep-alive connection it took had just been closed by llama-server (it ends them after
its keep-alive limit): without that, the floor failed runs with HTTP 500 now and then.
The retries are counted (GET /bare/retries), so the benchmark can report them. It runs
on the event loop the gateway runs on (uvloop where installed).

    python -m bench.bare_proxy --socket /run/llm-engine-x/engine.sock --port 18602
    python -m bench.bare_proxy --socket ...    # on systemd's socket (socket activation)

Socket-activated, it is the floor of the gateway's activation too: Python, aiohttp and
uvloop imported, an app built, the first request answered (GET /bare/retries, which needs
no engine), with nothing of the gateway's.

`/bare/refused` is its refusal: aiohttp's own 404 (web.HTTPNotFound), the floor of any
refusal an aiohttp gateway answers (bench/refusals.py).
"""

from __future__ import annotations

import argparse
import os
import socket

from gatewayd.adapters.client_tls import deferred_ca_loading
from gatewayd.adapters.event_loop import event_loop_factory  # the floor on the gateway's loop

# aiohttp reads the system's CA bundle into two TLS contexts at import (~100 ms each here);
# the gateway defers that (gatewayd/adapters/client_tls.py) and so does its floor: no TLS here
with deferred_ca_loading():
    import aiohttp
    from aiohttp import web

HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


POOLED = web.AppKey("pooled", aiohttp.ClientSession)
ONESHOT = web.AppKey("oneshot", aiohttp.ClientSession)


def build(socket: str) -> web.Application:
    counts = {"retries": 0}

    async def start(app: web.Application) -> None:
        # limit=0: no bound on the engine's connections (aiohttp's default, 100 at once,
        # would queue a crowd's streams here: the floor does nothing a proxy need not do)
        app[POOLED] = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=socket, limit=0))
        app[ONESHOT] = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=socket, force_close=True, limit=0))

    async def stop(app: web.Application) -> None:
        await app[POOLED].close()
        await app[ONESHOT].close()

    async def retries(request: web.Request) -> web.Response:
        return web.json_response(counts)

    async def refused(request: web.Request) -> web.Response:
        raise web.HTTPNotFound()

    async def send(session: aiohttp.ClientSession, request: web.Request,
                   body: bytes) -> aiohttp.ClientResponse:
        for attempt in (1, 2):
            try:
                return await session.request(request.method, "http://engine" + request.path_qs,
                                             data=body,
                                             headers={"Content-Type": "application/json"})
            except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
                if attempt == 2:
                    raise
                counts["retries"] += 1
                # on a new connection, as the gateway does: another pooled one may have been
                # closed by the engine too (a full run died of that: HTTP 500 from here)
                session = app[ONESHOT]
        raise AssertionError("unreachable")

    async def proxy(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        session = app[ONESHOT] if b'"stream": true' in body or b'"stream":true' in body \
            else app[POOLED]
        async with await send(session, request, body) as up:
            if up.headers.get("Content-Type", "").startswith("text/event-stream"):
                resp = web.StreamResponse(status=up.status,
                                          headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                try:
                    async for chunk in up.content.iter_any():
                        await resp.write(chunk)
                except (ConnectionResetError, aiohttp.ClientConnectionResetError):
                    pass   # the client left (the gateway does the same, quietly)
                return resp
            data = await up.read()
            return web.Response(body=data, status=up.status, headers={
                k: v for k, v in up.headers.items() if k.lower() not in HOP})

    app = web.Application(client_max_size=1024**3)
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_get("/bare/retries", retries)
    app.router.add_route("*", "/bare/refused", refused)
    app.router.add_route("*", "/{tail:.*}", proxy)
    return app


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--port", type=int,
                    help="where to listen; without it, on the socket systemd passes (fd 3: "
                         "socket activation, as the gateway's llm-gateway.socket)")
    a = ap.parse_args()
    factory = event_loop_factory()
    loop = factory() if factory else None
    if a.port is not None:
        web.run_app(build(a.socket), host="127.0.0.1", port=a.port, access_log=None,
                    print=None, loop=loop)
    elif os.environ.get("LISTEN_FDS") == "1" and os.environ.get("LISTEN_PID") == str(os.getpid()):
        web.run_app(build(a.socket), sock=socket.socket(fileno=3), access_log=None,
                    print=None, loop=loop)
    else:
        ap.error("--port, or a socket from systemd (LISTEN_FDS=1)")
