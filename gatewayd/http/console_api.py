"""What the status page's charts read: GET /admin/series. A thin handler: the window
parsed and placed in time (core.series), the records aggregated in a thread
(adapters.record_series)."""

from __future__ import annotations

import time

from aiohttp import web

from gatewayd.adapters import record_series
from gatewayd.core import series
from gatewayd.http.admin_api import ENGINES
from gatewayd.http.auth import query_of


async def call_series(request: web.Request) -> web.Response:
    """?window=15m|1h|24h (default 1h), ?model=NAME (its id as records name it)."""
    q = query_of(request)
    frame = series.frame(series.window(q.get("window")), time.time())
    answer = await record_series.load(request.app[ENGINES].config.records_file, frame,
                                      q.get("model"))
    return web.json_response(answer)
