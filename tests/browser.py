"""Headless Chromium driven over the DevTools protocol, for tests of the status page.

Debian's `chromium` (scripts/setup installs it) is started with its own throwaway
profile and a debugging port it chooses; the page is driven through one
websocket (aiohttp's client), so no driver package is needed. Script errors and
console errors on the page are collected, so a test can assert there were none.
The browser is ended by its PID when the test is done.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

from tests.harness.plugin import unavailable

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class PageError(AssertionError):
    pass


class Page:
    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self._ws = ws
        self._ids = itertools.count(1)
        self._answers: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.errors: list[str] = []        # uncaught exceptions and console.error calls
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        async for msg in self._ws:
            if msg.type is not aiohttp.WSMsgType.TEXT:
                continue
            data = json.loads(msg.data)
            if "id" in data and data["id"] in self._answers:
                self._answers.pop(data["id"]).set_result(data)
            elif data.get("method") == "Runtime.exceptionThrown":
                details = data["params"]["exceptionDetails"]
                self.errors.append(details.get("exception", {}).get("description")
                                   or details.get("text", "exception"))
            elif data.get("method") == "Runtime.consoleAPICalled" \
                    and data["params"].get("type") == "error":
                self.errors.append(" ".join(str(a.get("value", a.get("description")))
                                            for a in data["params"].get("args", [])))

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        call_id = next(self._ids)
        answer = asyncio.get_running_loop().create_future()
        self._answers[call_id] = answer
        await self._ws.send_str(json.dumps({"id": call_id, "method": method,
                                            "params": params}))
        data = await asyncio.wait_for(answer, 30)
        if "error" in data:
            raise PageError(f"{method}: {data['error']}")
        return data.get("result", {})  # type: ignore[no-any-return]

    async def evaluate(self, expression: str) -> Any:
        result = await self.send("Runtime.evaluate", expression=expression,
                                 returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise PageError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def goto(self, url: str) -> None:
        await self.send("Page.navigate", url=url)
        await self.wait_for("document.readyState === 'complete' && location.href === "
                            + json.dumps(url), what=f"{url} to load")

    async def wait_for(self, expression: str, *, timeout: float = 15,
                       what: str = "the page") -> Any:
        """Poll a JavaScript expression until it is truthy (a deadline, never a sleep)."""
        deadline = time.monotonic() + timeout
        value = None
        while time.monotonic() < deadline:
            value = await self.evaluate(expression)
            if value:
                return value
            await asyncio.sleep(0.05)
        raise PageError(f"timed out after {timeout}s waiting for {what} ({expression} "
                        f"is {value!r}); page errors: {self.errors}")

    async def screenshot(self, path: Path) -> Path:
        shot = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(shot["data"]))
        return path

    async def close(self) -> None:
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


def chromium_path() -> str:
    for name in CHROMIUM_NAMES:
        if found := shutil.which(name):
            return found
    unavailable("no chromium: scripts/setup installs Debian's chromium package")


@contextlib.asynccontextmanager
async def browser_page(width: int = 1100, height: int = 800) -> AsyncIterator[Page]:
    """A fresh headless Chromium with one page of the given viewport."""
    profile = tempfile.mkdtemp(prefix="chromium-")
    proc = await asyncio.create_subprocess_exec(
        chromium_path(), "--headless=new", "--no-sandbox", "--disable-gpu",
        "--no-first-run", "--no-default-browser-check", "--disable-extensions",
        "--hide-scrollbars",   # the whole width is the page (screenshots, phone widths)
        "--remote-debugging-port=0", f"--user-data-dir={profile}", "about:blank",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    session = aiohttp.ClientSession()
    page: Page | None = None
    try:
        assert proc.stderr is not None
        port = None
        async with asyncio.timeout(30):
            while port is None:
                line = (await proc.stderr.readline()).decode()
                if not line:
                    raise PageError("chromium exited before it listened")
                if found := re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", line):
                    port = int(found.group(1))
        async with session.get(f"http://127.0.0.1:{port}/json/list") as resp:
            targets = await resp.json()
        url = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
        ws = await session.ws_connect(url, max_msg_size=0)
        page = Page(ws)
        await page.send("Runtime.enable")
        await page.send("Page.enable")
        await page.send("Emulation.setDeviceMetricsOverride", width=width, height=height,
                        deviceScaleFactor=1, mobile=width < 600)
        yield page
    finally:
        if page is not None:
            await page.close()
        await session.close()
        if proc.returncode is None:
            os.kill(proc.pid, signal.SIGTERM)   # ours, by PID
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                os.kill(proc.pid, signal.SIGKILL)
                await proc.wait()
        shutil.rmtree(profile, ignore_errors=True)


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) of a PNG file, from its IHDR chunk; fails for anything else."""
    data = path.read_bytes()
    if not data.startswith(PNG_SIGNATURE) or data[12:16] != b"IHDR":
        raise AssertionError(f"{path} is not a PNG image")
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
