"""Another site's page cannot use the console or hold the gateway's resources (issue 50):
in a real headless Chromium, a page on another origin frames /admin/ and points <img>
tags at a journal follow and the event feed. Two defences, each shown on its own: the
gate refuses a request from another site that has no allowed Origin (Sec-Fetch-Site),
and the console's Content-Security-Policy (frame-ancestors 'none') keeps it out of any
frame even where the gate let it through."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gatewayd.http import admin_api, auth
from tests.browser import Page, browser_page
from tests.http.test_front_door import _gateway

pytestmark = pytest.mark.slow


async def framing_site(gateway_url: str) -> AsyncIterator[str]:
    """A page of another origin (another port: another origin, the same site) that frames
    the console and asks for a journal follow and the event feed as images."""
    html = (f'<html><body><iframe id="f" src="{gateway_url}/admin/" width="800" '
            'height="600"></iframe>'
            + "".join(f'<img src="{gateway_url}{p}">' for p in (
                "/admin/engines/logs?model=a&follow=1", "/admin/events", "/admin/logs?follow=1"))
            + "</body></html>")

    async def page(_: web.Request) -> web.Response:
        return web.Response(text=html, content_type="text/html")
    app = web.Application()
    app.router.add_get("/", page)
    server = TestServer(app)
    await server.start_server()
    try:
        yield str(server.make_url("/"))
    finally:
        await server.close()


async def frame_title(page: Page) -> str | None:
    """The document.title inside the iframe (None while it has no document of its own),
    read through DevTools, which may look across origins."""
    tree = (await page.send("Page.getFrameTree"))["frameTree"]
    children = tree.get("childFrames") or []
    if not children:
        return None
    frame = children[0]["frame"]
    if frame.get("unreachableUrl") or frame["url"].startswith("chrome-error:"):
        return "(blocked)"
    world = await page.send("Page.createIsolatedWorld", frameId=frame["id"])
    result = await page.send("Runtime.evaluate", expression="document.readyState + '|' + "
                             "document.title", contextId=world["executionContextId"],
                             returnByValue=True)
    state, _, title = str(result["result"].get("value")).partition("|")
    return title if state == "complete" else None


@pytest.mark.parametrize("gate", ["gate and policy", "policy alone"])
async def test_another_sites_page_can_neither_frame_the_console_nor_hold_a_follow(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gate: str) -> None:
    if gate == "policy alone":   # the gate's check off: the page's own headers must hold
        monkeypatch.setattr(auth, "CROSS_SITE", frozenset())
    async for gw in _gateway(tmp_path, ("a",)):
        journals = gw.client.app[admin_api.JOURNALS]
        follow, asked = journals.follow, list[Any]()

        async def counted(*args: Any, asked: list[Any] = asked, follow: Any = follow) -> Any:
            asked.append(args)
            return await follow(*args)
        monkeypatch.setattr(journals, "follow", counted)
        url = str(gw.client.make_url("")).rstrip("/")
        async for site in framing_site(url):
            async with browser_page() as page:
                await page.goto(site)
                title = None
                for _ in range(300):   # a deadline of 300 looks, 50 ms apart
                    title = await frame_title(page)
                    if title is not None:
                        break
                    await page.evaluate("new Promise(r => setTimeout(r, 50))")
                # whatever the frame holds (the gate's error, or Chromium's blocked page),
                # it is not the console
                assert title in ("(blocked)", ""), title
                settled = await page.evaluate(
                    "Promise.all([...document.images].map(i => i.decode().then("
                    "() => 'shown', () => 'not shown')))")
                assert settled == ["not shown"] * 3
        if gate == "gate and policy":
            assert asked == []    # no journalctl was started for another site's page
