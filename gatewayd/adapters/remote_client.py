"""A request to a remote upstream through its aiohttp session, and its answer as an
`Answer` (adapters/answer), so that the relay serves it as it serves an engine's.

The session itself, one per upstream, is adapters/remote_upstreams'.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

import aiohttp

from gatewayd.adapters.answer import Answer

# what sending to an upstream or reading its answer raises when it is not there, breaks
# off or speaks nonsense (beside TimeoutError and OSError)
REMOTE_ERRORS = (aiohttp.ClientError,)


def never_connected(error: BaseException | None) -> bool:
    """The upstream could not be connected to at all (refused, no route, connect timeout):
    the upstream is down, not just this request failed."""
    return isinstance(error, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError))


def to_remote(session: aiohttp.ClientSession, method: str, url: str,
              headers: Mapping[str, str], body: bytes) -> Callable[[], Awaitable[Answer]]:
    """Outgoing.send for a remote upstream, through its aiohttp session."""
    async def send() -> Answer:
        for attempt in (1, 2):
            try:
                return _ClientAnswer(await session.request(
                    method, url, data=body or None, headers=headers, allow_redirects=False))
            except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError) as e:
                # a pooled keep-alive connection the upstream had just closed: once more,
                # on a new connection (a refused connect is not asked twice)
                if attempt == 2 or isinstance(e, aiohttp.ClientConnectorError):
                    raise
        raise AssertionError("unreachable")
    return send


class _ClientAnswer:
    """aiohttp's ClientResponse as an Answer."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status = response.status
        self.headers: Mapping[str, str] = response.headers

    async def read(self, limit: int | None = None) -> bytes:
        response = self._response
        if limit is None:
            return await response.read()
        if (response.content_length or 0) > limit:   # said at once: nothing read
            response.close()
            raise AnswerPastLimit(limit)
        parts: list[bytes] = []
        size = 0
        while data := await response.content.readany():
            size += len(data)
            if size > limit:
                response.close()
                raise AnswerPastLimit(limit)
            parts.append(data)
        return b"".join(parts)

    async def read_some(self) -> bytes:
        return await self._response.content.readany()

    def release(self) -> None:
        self._response.release()

    def close(self) -> None:
        self._response.close()


class AnswerPastLimit(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"the answer is over {limit} bytes")
