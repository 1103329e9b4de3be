"""The answer to a relayed request, as the relay (http/proxy) reads it.

Local engines (engine_client's EngineResponse) and remote upstreams (remote_client's
_ClientAnswer, over aiohttp) both hand one back, so one relay serves both. It lives
here, not beside the relay, because the adapters that make answers may not import
http/.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol


class Answer(Protocol):
    """An answer on its way back: its head is in, its body is read as it comes."""

    @property
    def status(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    async def read(self, limit: int | None = None) -> bytes:
        """The whole body; past limit bytes an error (engine_client's AnswerTooLarge, or
        remote_client's AnswerPastLimit), the connection closed."""
        ...

    async def read_some(self) -> bytes:
        """The next piece of the body as it arrives; b"" at its end."""
        ...

    def release(self) -> None: ...

    def close(self) -> None: ...
