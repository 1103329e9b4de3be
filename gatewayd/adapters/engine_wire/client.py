"""HTTP/1.1 to the local engines over their unix sockets, spoken by hand: the proxy's
client (the gateway's own short looks use exchange.py).

aiohttp's ClientSession was most of the CPU the gateway spent per request over a bare proxy
(a ClientRequest with its auto headers, trace hooks, a timer per read, a StreamReader), and
it cost more on each streamed event too (docs/benchmarks.md, "Figures behind choices in the
code"). An engine is a known peer on a private socket (llama-server, whisper-server behind
the launcher), so this speaks just what they answer (framing.py) with:

- requests with a body of known length (the gateway has read the client's body);
- keep-alive: per socket a LIFO pool of idle connections (pool.py), each reused within
  `keepalive_s` (llama-server closes them after 5 s) and never after the engine said
  `Connection: close`; a request that finds its reused connection closed by the engine
  before any byte of the answer is sent once more on a new connection;
- at most `limit` connections per socket at once, the rest waiting their turn (pool.py);
- timeouts: connecting (a dead socket fails at once anyway), and reading
  (connection.py's read timer);
- flow control (connection.py).
Remote upstreams (TLS, redirects, any server) keep aiohttp's client.
"""

from __future__ import annotations

import asyncio
import collections
import json
from collections.abc import Callable, Iterable, MutableMapping

from multidict import CIMultiDict

from gatewayd.adapters.engine_wire.connection import Connection
from gatewayd.adapters.engine_wire.errors import (
    AnswerTooLarge,
    ConnectionsBusy,
    ConnectionsQueueFull,
    EngineConnectionError,
)
from gatewayd.adapters.engine_wire.exchange import exchange
from gatewayd.adapters.engine_wire.framing import request_head
from gatewayd.adapters.engine_wire.pool import Pool
from gatewayd.core import errors
from gatewayd.core.config import GatewayConfig

__all__ = ["AnswerTooLarge", "ConnectionsBusy", "ConnectionsQueueFull", "EngineClient",
           "EngineConnectionError", "EngineResponse", "learn_parallel_slots"]


class EngineResponse:
    """An engine's answer: status and headers at once, the body as it arrives."""

    def __init__(self, conn: Connection, pool: Pool, status: int, reason: str,
                 headers: CIMultiDict[str]) -> None:
        self._conn = conn
        self._pool: Pool | None = pool    # holds one of its connections until done
        self.status = status
        self.reason = reason
        self.headers = headers

    async def read(self, limit: int | None = None) -> bytes:
        """The whole body; AnswerTooLarge (the connection closed) past limit bytes."""
        parts = []
        size = 0
        while data := await self._conn.read_some():
            size += len(data)
            if limit is not None and size > limit:
                self.close()
                raise AnswerTooLarge(f"the engine's answer is over {limit} bytes")
            parts.append(data)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def read_some(self) -> bytes:
        """The next piece of the body: whatever has arrived since the last (one streamed
        event per piece while the engine writes them one at a time); b"" at its end."""
        return await self._conn.read_some()

    def relay_to(self, sink: Callable[[bytes], None],
                 chunk_sink: Callable[[bytes, int], bool] | None = None) -> None:
        """From now on each piece of the body goes to sink the moment it arrives, from the
        connection's data_received: no task wakes up per piece (a streamed event costs
        the relay ~a third less CPU). What was buffered goes to it first. sink must not
        raise; it calls hold() to stop the flow while its own output drains.

        chunk_sink, if given, is offered each read that is exactly one whole chunk of a
        chunked body, framing and all, with its data's size (a stream's usual read: one
        event, one chunk). It returns True if it took the chunk, False to have its data go
        to sink as any other piece. A relay whose output is framed the same way sends it
        on as it came, instead of taking the framing off here and putting it back on."""
        self._conn.set_sink(sink, chunk_sink)

    def hold(self) -> None:
        """Stop reading from the engine, and wake wait_end (sink's output is full)."""
        self._conn.hold()

    async def wait_end(self) -> bool:
        """With a sink: True once the body is complete, False when woken by hold() (drain
        the output, then resume()). Raises what ended the body otherwise."""
        return await self._conn.wait_end()

    def resume(self) -> None:
        self._conn.resume()

    def release(self) -> None:
        """Done with it: a complete answer on a reusable connection goes back to the pool,
        anything else is closed. Idempotent."""
        self._conn.finish()
        self._give_back_connection()

    def close(self) -> None:
        """Drop the connection now (the client left: the engine stops generating)."""
        self._conn.abort()
        self._give_back_connection()

    def _give_back_connection(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.release()


class EngineClient:
    """Connections to engine sockets, created on first use."""

    def __init__(self, read_timeout_s: float, *, connect_timeout_s: float = 10.0,
                 keepalive_s: float = 4.0, queue_timeout_s: float | None = None,
                 queue_limit: int = GatewayConfig.queue_limit) -> None:
        self.read_timeout_s = read_timeout_s
        # requests waiting for a socket's connections, unless set_queue_limit said otherwise
        self.queue_limit = queue_limit
        # answers refused by a bound, by which (the metrics' llm_gateway_bounded)
        self.refused: collections.Counter[str] = collections.Counter()
        # the longest wait for one of an engine's connections (the limit's queue); the
        # client has heard nothing meanwhile, as in a silence of the engine's
        self.queue_timeout_s = read_timeout_s if queue_timeout_s is None else queue_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.keepalive_s = keepalive_s
        self._pools: dict[str, Pool] = {}

    def set_limit(self, socket: str, limit: int | None) -> None:
        """At most limit connections to socket at once (None: no limit); requests beyond
        it wait here, first come first served."""
        pool = self._pool(socket)
        pool.limit = None if limit is None else max(1, limit)
        pool.admit()

    def set_queue_limit(self, socket: str, queue_limit: int | None) -> None:
        """At most queue_limit requests waiting for socket's connections (None: the
        client's queue_limit); one more is refused at once (ConnectionsQueueFull)."""
        self._pool(socket).queue_limit = queue_limit

    def limit(self, socket: str) -> int | None:
        pool = self._pools.get(socket)
        return pool.limit if pool else None

    def in_use(self, socket: str) -> int:
        pool = self._pools.get(socket)
        return pool.busy if pool else 0

    def waiting(self, socket: str) -> int:
        pool = self._pools.get(socket)
        return len(pool.waiters) if pool else 0

    def pooled(self, socket: str) -> bool:
        """Whether idle keep-alive connections to socket are kept."""
        pool = self._pools.get(socket)
        return pool is not None and any(conn.open for conn in pool.idle)

    async def request(self, socket: str, method: str, target: str,
                      headers: Iterable[tuple[str, str]], body: bytes, *,
                      reuse: bool = True) -> EngineResponse:
        """Send one request and wait for the answer's head. reuse=False: a connection of
        its own, closed at the end (llama-server closes after every stream anyway).
        Raises ConnectionsBusy when no connection came free for queue_timeout_s,
        EngineConnectionError, or TimeoutError when no byte came in time."""
        pool = self._pool(socket)
        head = request_head(method, target, headers, len(body),
                             body_expected=bool(body) or method in ("POST", "PUT", "PATCH"))
        queue_limit = self.queue_limit if pool.queue_limit is None else pool.queue_limit
        await pool.acquire(self.queue_timeout_s, queue_limit)
        try:
            unsent = True   # no try went out to a process so far
            for attempt in (1, 2):
                conn = pool.idle_connection() if reuse and attempt == 1 else None
                reused = conn is not None
                if conn is None:
                    try:
                        conn = await self._connect(socket, pool)
                    except EngineConnectionError as e:
                        # reached no process if the reused connection's try did not either
                        # (it was written into an end already closed); else sent once
                        e.connect = unsent
                        raise
                conn.reusable = reuse
                try:
                    conn.send(head, body, method)
                    status, reason, answer_headers = await conn.head()
                except EngineConnectionError as e:
                    conn.abort()
                    if reused and e.fresh:
                        unsent = e.connect
                        continue   # the engine had closed it: once more, on a new one
                    raise
                except BaseException:
                    conn.abort()
                    raise
                return EngineResponse(conn, pool, status, reason, answer_headers)
            raise AssertionError("unreachable")
        except BaseException:
            pool.release()
            raise

    async def ask(self, socket: str, target: str, body: bytes, *, limit: int
                  ) -> tuple[int, bytes]:
        """POST a JSON body to target and read the answer whole (a batch line's request):
        (status, body). Raises the core's errors, as the proxy would answer them:
        EngineUnavailable (reached_no_process where no process got the request),
        QueueFull or EngineBusy, EngineFailed where the answer broke off, AnswerTooLarge
        past limit bytes."""
        try:
            answer = await self.request(socket, "POST", target,
                                        (("Content-Type", "application/json"),), body)
        except ConnectionsQueueFull as e:
            raise errors.QueueFull(f"the engine is busy: {e}", retry_after=5) from e
        except ConnectionsBusy as e:
            raise errors.EngineBusy(f"the engine is busy: {e}", retry_after=5) from e
        except (EngineConnectionError, TimeoutError, OSError) as e:
            unavailable = errors.EngineUnavailable(f"the engine did not take the request: {e}")
            unavailable.reached_no_process = isinstance(e, EngineConnectionError) and e.connect
            raise unavailable from e
        try:
            return answer.status, await answer.read(limit)
        except AnswerTooLarge as e:
            raise errors.AnswerTooLarge(f"the engine answered with more than {limit} bytes "
                                        "(max_answer_mb): refused") from e
        except (EngineConnectionError, TimeoutError, OSError) as e:
            raise errors.EngineFailed(f"the engine stopped in the middle of the answer: "
                                      f"{e or type(e).__name__}") from e
        finally:
            answer.release()

    async def _connect(self, socket: str, pool: Pool) -> Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_unix_connection(
                    lambda: Connection(pool, self.read_timeout_s), socket)
        except TimeoutError:
            raise EngineConnectionError(f"connecting to {socket} timed out", fresh=True,
                                        connect=True) from None
        except OSError as e:
            raise EngineConnectionError(f"cannot connect to {socket}: {e.strerror or e}",
                                        fresh=True, connect=True) from e
        return conn

    def _pool(self, socket: str) -> Pool:
        pool = self._pools.get(socket)
        if pool is None:
            pool = self._pools[socket] = Pool(self.keepalive_s, None, self.refused)
        return pool

    def forget(self, socket: str) -> None:
        """The engine behind socket is gone: close its idle connections now (they would
        hold descriptors until the engine's side times out)."""
        pool = self._pools.pop(socket, None)
        if pool is not None:
            pool.close_idle()

    async def close(self) -> None:
        for pool in self._pools.values():
            pool.close_idle()
        self._pools.clear()


PROPS_TIMEOUT_S = 5.0


async def learn_parallel_slots(client: EngineClient, socket: str, *,
                               known: MutableMapping[str, int] | None = None,
                               setup: str = "") -> int | None:
    """How many requests a llama engine serves at once (GET /props: total_slots); one more
    than that is the limit of the gateway's connections to it. More would only queue
    inside llama-server, where idle keep-alive connections hold its HTTP threads (at c=64
    its p99 went to seconds); the queue is then the gateway's, first come first served.
    The one more keeps a request waiting inside, so a freed parallel slot starts the next at
    once instead of idling a round trip; llama-server has parallel slots + 2 HTTP threads, so one
    stays free for /health, /metrics and /slots. None, and no limit, when the engine does
    not say (an old build, whisper).

    known: parallel slot counts learned before, by engine setup (settings and binary): an engine
    started again as it was before has as many, and is not asked (a round trip on
    the cold start's path, to an engine that has just loaded)."""
    if known is not None and (parallel := known.get(setup)) is not None:
        client.set_limit(socket, parallel + 1)
        return parallel
    try:
        status, body = await exchange(socket, "GET", "/props", timeout=PROPS_TIMEOUT_S)
        parallel = json.loads(body).get("total_slots") if status == 200 else None
    except (TimeoutError, EngineConnectionError, OSError, ValueError, AttributeError):
        return None
    if not isinstance(parallel, int) or isinstance(parallel, bool) or parallel < 1:
        return None
    client.set_limit(socket, parallel + 1)
    if known is not None:
        known[setup] = parallel
    return parallel
