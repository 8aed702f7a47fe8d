"""RabbitMQ streams (the ``rabbitmq_stream`` plugin) as a replayable source.

A stream is a log: a consumer's progress is one stored offset, not per-message
acks. ackflow stores it only through an :class:`~ackflow.core.offsets.OffsetTracker`:
the stored offset never passes a message still in flight or waiting for a retry,
so a restart (or a new consumer with the same name) processes every message that
was not settled again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import heapq
import logging
import queue as queue_mod
import threading
import time
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from ackflow import faults
from ackflow.core.errors import ConfigError, SourceGone
from ackflow.core.ledger import Failure
from ackflow.core.offsets import OffsetTracker
from ackflow.core.policy import RetryPolicy
from ackflow.core.settlement import Delivery, Settlement
from ackflow.sources.base import Source

log = logging.getLogger("ackflow.sources.stream")


class StreamMissing(Exception):
    """The stream does not exist (at start: a ConfigError; later: wait, then stop)."""


class RabbitMQStreamSource(Source):
    """Consume ``stream`` as the named consumer ``consumer``.

    It starts after the consumer's stored offset, or, for a consumer without one,
    at ``offset``: ``"first"``, ``"last"``, ``"next"``, an offset number, or a
    ``datetime`` (messages stored from then on). After every settlement the
    committed offset (everything below it acked or dead-lettered) is stored on the
    broker (as its last offset, ``committed - 1``). Offsets the stream skips are
    declared gaps; a message still in flight holds the stored offset back.

    Failed messages are retried after the policy's backoff (kept in memory; a restart
    reads them from the stream again) and, once given up, go to the flow's error sink:
    a stream source needs ``flow.on_error(sink)``, since a log cannot dead-letter one
    message. A dead letter counts as settled once the error sink wrote it.

    A lost connection (a broker restart) or a changed stream (its leader moved) is
    noticed by rstream's close handler: ``connected`` turns False, and the engine's
    thread reconnects with backoff (0.5 s doubling to ``reconnect_max_s``) and
    subscribes again at the committed offset. An offset is the stream's, not the
    connection's: what was in flight settles as usual and the stored offset is written
    on the new connection; nothing already in memory is handed out twice, and nothing
    unsettled is skipped. A stream missing for ``gone_timeout_s`` (deleted) stops the
    run with :class:`~ackflow.core.errors.SourceGone`.
    """

    def __init__(
        self,
        host: str,
        port: int,
        stream: str,
        consumer: str,
        *,
        username: str = "guest",
        password: str = "guest",
        vhost: str = "/",
        offset: str | int | datetime = "first",
        format: str = "json",
        policy: RetryPolicy | None = None,
        reconnect_max_s: float = 10.0,
        gone_timeout_s: float = 60.0,
        heartbeat_s: int = 20,
        name: str | None = None,
    ) -> None:
        super().__init__(format=format, name=name or f"stream:{stream}")
        if not consumer:
            raise ConfigError(
                "RabbitMQ stream source: consumer= names the consumer whose "
                "offset is stored; it must not be empty"
            )
        if isinstance(offset, str) and offset not in ("first", "last", "next"):
            raise ConfigError(
                f"offset must be 'first', 'last', 'next', a number or a datetime, got {offset!r}"
            )
        self.host, self.port, self.stream, self.consumer = host, port, stream, consumer
        self.username, self.password, self.vhost = username, password, vhost
        self.offset = offset
        self.policy = policy or RetryPolicy()
        self._window = 10_000
        self._error_sink = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._consumer: Any = None
        self._inbox: queue_mod.Queue[tuple[int, bytes]] = queue_mod.Queue()
        self._tracker: OffsetTracker | None = None
        self._last_seen = -1
        self._bodies: dict[int, bytes] = {}
        self._retry: list[tuple[float, int, int]] = []  # (due, offset, delivery count)
        self._stored = -1
        self.error: BaseException | None = None
        self.reconnect_max_s, self.gone_timeout_s = reconnect_max_s, gone_timeout_s
        self.heartbeat_s = heartbeat_s
        self.reconnects = 0
        self._connected = False
        self._lost_why = ""
        self._down_since: float | None = None
        self._missing_since: float | None = None
        self._next_connect = 0.0
        self._backoff = 0.5
        self._gen = 0
        self._lost_gen = -1
        self._pending: concurrent.futures.Future[tuple[int, int]] | None = None

    def configure(self, *, max_inflight: int, error_sink: bool, keepalive_s: float = 30.0) -> None:
        self._window = max_inflight
        self._error_sink = error_sink

    # -- the consumer's thread ------------------------------------------------------------

    def _run(self, coro: Any, timeout: float = 30) -> Any:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def open(self) -> int:
        if not self._error_sink:
            raise ConfigError(
                f"source {self.name!r}: a stream cannot dead-letter one message: "
                "give the flow an error sink with .on_error(sink)"
            )
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ackflow-stream", daemon=True)
        self._thread.start()
        try:
            start_at, self._stored = self._run(self._subscribe(None))
        except ConfigError:
            self.close()
            raise
        except Exception as e:  # noqa: BLE001 - a clear message at start
            self.close()
            raise ConfigError(
                f"source {self.name!r}: cannot consume stream {self.stream!r} on "
                f"{self.host}:{self.port}: {type(e).__name__}: {e}"
            ) from None
        self._connected = True
        if start_at >= 0:
            self._tracker = OffsetTracker(start=start_at)
            self._last_seen = start_at - 1
            if self._stored >= 0:
                log.info(
                    "source %r: resuming %s after stored offset %d", self.name, self.stream, self._stored
                )
        return 0

    async def _subscribe(self, committed: int | None) -> tuple[int, int]:
        """Connect and subscribe (the loop's thread). The first time: after the stored
        offset, else at ``offset``. After a lost connection: at ``committed`` (the first
        offset not settled, as the engine's thread saw it), so that nothing unsettled is
        skipped; what is already in memory (in flight, waiting for a retry, received) is
        not handed out twice (``pull`` skips offsets up to the last one received).
        Returns the first offset known to come (-1: not known yet) and the broker's
        stored offset (-1: none)."""
        from rstream import Consumer as StreamConsumer
        from rstream import ConsumerOffsetSpecification, OffsetNotFound, OffsetType

        self._gen += 1
        gen = self._gen  # a late close of an older consumer is not this one's

        def closed(info: Any) -> None:
            if gen == self._gen:
                self._on_closed(getattr(info, "reason", info), gen)

        self._consumer = StreamConsumer(
            self.host,
            self.port,
            username=self.username,
            password=self.password,
            vhost=self.vhost,
            heartbeat=self.heartbeat_s,
            on_close_handler=closed,
        )
        await self._consumer.start()
        if not await self._consumer.stream_exists(self.stream):
            raise StreamMissing(f"stream {self.stream!r} does not exist on {self.host}:{self.port}")
        try:
            stored = await self._consumer.query_offset(self.stream, self.consumer)
        except OffsetNotFound:
            stored = -1
        if committed is not None:  # a reconnection: from the committed offset
            start_at = committed
            spec = ConsumerOffsetSpecification(OffsetType.OFFSET, start_at)
        elif stored >= 0:
            spec = ConsumerOffsetSpecification(OffsetType.OFFSET, stored + 1)
            start_at = stored + 1
        else:
            start_at = -1
            if isinstance(self.offset, datetime):
                spec = ConsumerOffsetSpecification(OffsetType.TIMESTAMP, int(self.offset.timestamp() * 1000))
            elif isinstance(self.offset, int):
                spec = ConsumerOffsetSpecification(OffsetType.OFFSET, self.offset)
                start_at = self.offset
            else:
                kind = {"first": OffsetType.FIRST, "last": OffsetType.LAST, "next": OffsetType.NEXT}[
                    self.offset
                ]
                spec = ConsumerOffsetSpecification(kind, None)
        await self._consumer.subscribe(
            self.stream,
            self._on_message,
            offset_specification=spec,
            subscriber_name=self.consumer,
            initial_credit=4,
        )
        return start_at, stored

    async def _resubscribe(self, committed: int | None) -> tuple[int, int]:
        """Close the old consumer and subscribe anew (the loop's thread), each step
        bounded in time; a consumer that failed half way is closed again."""
        old, self._consumer = self._consumer, None
        if old is not None:
            try:
                await asyncio.wait_for(old.close(), 5)
            except Exception as e:  # noqa: BLE001 - it is dead already
                log.debug("source %r: closing the old stream consumer: %s", self.name, e)
        try:
            return await asyncio.wait_for(self._subscribe(committed), 15)
        except BaseException:
            failed, self._consumer = self._consumer, None
            if failed is not None:
                try:
                    await asyncio.wait_for(failed.close(), 5)
                except Exception:  # noqa: BLE001 - it failed already
                    pass
            raise

    def _on_closed(self, why: Any, gen: int | None = None) -> None:
        """The connection died, or the stream's metadata changed (deleted, its leader
        moved): rstream's close handler (the loop's thread, ``gen``: of which consumer),
        a failed store or a silent connection. The engine's thread reconnects."""
        self._lost_gen = gen if gen is not None else self._gen
        if self._connected:
            self._connected = False
            self._lost_why = str(why)

    @property
    def connected(self) -> bool:
        return self._connected

    @property
    def retries_waiting(self) -> int:
        return len(self._retry)

    def _reconnect(self) -> None:
        """Connect again with backoff, from ``pull`` on the engine's thread, which it
        never blocks: the reconnection runs on the consumer's thread and is looked at on
        the next pulls. A stream that stays missing for ``gone_timeout_s`` stops the run
        (:class:`SourceGone`)."""
        now = time.monotonic()
        if self._down_since is None:
            self._down_since = now
            log.warning(
                "source %r: lost the stream connection to %s:%d (%s); reconnecting from committed offset %d",
                self.name,
                self.host,
                self.port,
                self._lost_why,
                self.committed,
            )
        fut = self._pending
        if fut is None:
            if now >= self._next_connect:
                assert self._loop is not None
                self._pending = asyncio.run_coroutine_threadsafe(
                    self._resubscribe(self.committed if self._tracker is not None else None), self._loop
                )
            return
        if not fut.done():
            return
        self._pending = None
        try:
            faults.point("source.reconnect")
            start_at, stored = fut.result()
            if self._lost_gen == self._gen:
                raise ConnectionError(f"the new connection was lost at once ({self._lost_why})")
        except Exception as e:  # noqa: BLE001 - retried with backoff
            self._next_connect = time.monotonic() + self._backoff
            self._backoff = min(self.reconnect_max_s, self._backoff * 2)
            if isinstance(e, StreamMissing):
                self._missing_since = self._missing_since or now
                if now - self._missing_since >= self.gone_timeout_s:
                    raise SourceGone(
                        f"source {self.name!r}: {e} any more (deleted?), for "
                        f"{now - self._missing_since:.0f} s; stopping. Offsets up to "
                        f"{self.committed - 1} were committed"
                    ) from None
            else:
                self._missing_since = None
            log.warning(
                "source %r: cannot reconnect to %s:%d yet: %s: %s",
                self.name,
                self.host,
                self.port,
                type(e).__name__,
                e,
            )
            return
        if self._tracker is None and start_at >= 0:
            self._tracker = OffsetTracker(start=start_at)
            self._last_seen = start_at - 1
        self._stored = stored
        self._connected = True
        self.reconnects += 1
        log.warning(
            "source %r: reconnected to %s:%d after %.1f s; reading %s from offset %d",
            self.name,
            self.host,
            self.port,
            time.monotonic() - self._down_since,
            self.stream,
            self.committed,
        )
        self._down_since = self._missing_since = None
        self._backoff = 0.5
        self._store(force=True)

    def _check_heartbeat(self) -> None:
        """A connection that went silent (no frame, not even a heartbeat, for three
        heartbeat intervals: a broker frozen, a half-open TCP connection) is a lost one.
        rstream itself only logs a warning then, and would wait for ever."""
        client = getattr(self._consumer, "_clients", {}).get(self.stream)
        beat = getattr(client, "_heartbeat", 0)
        last = getattr(client, "_last_heartbeat", 0.0)
        if beat and last and time.monotonic() - last > 3 * beat:
            self._on_closed(
                f"no frame from the broker for {time.monotonic() - last:.0f} s (heartbeat {beat} s)"
            )

    async def _on_message(self, body: Any, ctx: Any) -> None:
        while self._inbox.qsize() >= self._window:  # backpressure: stop taking credits
            await asyncio.sleep(0.01)
        self._inbox.put((ctx.offset, bytes(body)))

    # -- pulling -------------------------------------------------------------------------

    def pull(self, max_messages: int, timeout: float) -> list[Delivery]:
        if self._connected:
            self._check_heartbeat()
        if not self._connected and self._loop is not None:
            self._reconnect()
        out: list[Delivery] = []
        now = time.monotonic()
        while self._retry and self._retry[0][0] <= now and len(out) < max_messages:
            _, off, count = heapq.heappop(self._retry)
            if off in self._bodies:
                assert self._tracker is not None
                self._tracker.pulled(off)
                out.append(self._delivery(off, self._bodies[off], count))
        deadline = now + timeout
        if not out and len(self._bodies) >= self._window:
            # Bounded memory: messages waiting for a retry keep their bodies and count
            # against the window; read nothing new until one settles or comes due.
            due = self._retry[0][0] if self._retry else deadline
            time.sleep(max(0.0, min(deadline, due) - now))
            return out
        while len(out) < max_messages and len(self._bodies) < self._window:
            try:
                left = deadline - time.monotonic()
                off, body = (
                    self._inbox.get(timeout=left) if left > 0 and not out else self._inbox.get_nowait()
                )
            except queue_mod.Empty:
                break
            if off <= self._last_seen:
                continue  # delivered again after a resubscription: already handed out
            if self._tracker is None:  # a new consumer: the log starts where it starts
                self._tracker = OffsetTracker(start=off)
            elif off > self._last_seen + 1:
                self._tracker.gap(self._last_seen + 1, off)  # never coming
            self._last_seen = off
            if not self._tracker.pulled(off):
                continue
            self._bodies[off] = body
            out.append(self._delivery(off, body, 1))
        return out

    def _delivery(self, offset: int, body: bytes, count: int) -> Delivery:
        return Delivery(0, f"{self.stream}@{offset}", body, {"offset": str(offset)}, count, handle=offset)

    # -- settling --------------------------------------------------------------------------

    @property
    def committed(self) -> int:
        """The first offset not settled (stored on the broker as ``committed - 1``)."""
        return self._tracker.committed if self._tracker is not None else self._stored + 1

    def status(self) -> dict[str, object]:
        """The committed offset, the last offset received, and ``lag``: offsets received
        but not committed yet (the stream's own end is not asked for)."""
        committed = self.committed
        return {
            "kind": "RabbitMQ stream",
            "server": f"{self.host}:{self.port}",
            "stream": self.stream,
            "consumer": self.consumer,
            "committed_offset": committed,
            "last_offset_received": self._last_seen,
            "lag": max(0, self._last_seen + 1 - committed) + self._inbox.qsize(),
            "retries_waiting": len(self._retry),
            "connected": self._connected,
            "reconnects": self.reconnects,
        }

    def ack(self, deliveries: Sequence[Delivery]) -> None:
        assert self._tracker is not None or not deliveries
        for d in deliveries:
            off = int(d.handle)  # type: ignore[call-overload]
            self._bodies.pop(off, None)
            self._tracker.settled(off)  # type: ignore[union-attr]
        self._store()

    def _store(self, *, force: bool = False) -> None:
        """Store the committed offset on the broker (``committed - 1``). Not while the
        connection is down: it is stored after the reconnection (``force``: even if
        stored already, the broker's copy may be older). A store that fails is a lost
        connection; the offset stays committed in memory."""
        last = self.committed - 1
        if (last > self._stored or (force and last >= 0)) and self._connected and self._consumer is not None:
            try:
                faults.point("stream.store_offset")
                self._run(self._consumer.store_offset(self.stream, self.consumer, last), timeout=10)
            except Exception as e:  # noqa: BLE001 - stored again after the reconnection
                self._on_closed(f"storing offset {last}: {type(e).__name__}: {e}")
                return
            self._stored = last

    def fail(self, failures: Sequence[tuple[Delivery, Failure]]) -> list[Settlement]:
        self.nack(failures)  # given-up messages went to the error sink before this
        return [Settlement.NACKED] * len(failures)

    def nack(self, failures: Sequence[tuple[Delivery, Failure]]) -> None:
        now = time.monotonic()
        for d, _ in failures:
            off = int(d.handle)  # type: ignore[call-overload]
            heapq.heappush(
                self._retry, (now + self.policy.delay_after(d.delivery_count), off, d.delivery_count + 1)
            )

    def release(self, deliveries: Sequence[Delivery]) -> None:
        now = time.monotonic()
        for d in deliveries:
            heapq.heappush(self._retry, (now, int(d.handle), d.delivery_count))  # type: ignore[call-overload]

    def close(self) -> None:
        self._connected = False
        self._gen += 1
        loop, self._loop = self._loop, None
        if loop is None:
            return
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            try:
                asyncio.run_coroutine_threadsafe(consumer.close(), loop).result(10)
            except Exception as e:  # noqa: BLE001 - unsettled messages are read again
                log.warning("source %r: closing the stream consumer: %s", self.name, e)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(10)
