"""Kafka topics, read as a consumer group, as a source.

A partition is a log: a group's progress in it is one committed offset. ackflow commits
only through one :class:`~ackflow.core.offsets.OffsetTracker` per partition, so the
committed offset never passes a message that is in flight or waiting for a retry, and
offsets that are never delivered (compacted away, transaction markers, retention) are
gaps that never hold a commit back.

Threads: one consumer thread owns the client (librdkafka's polling, the group's
rebalance callbacks, pause/resume and commits). The engine's thread pulls from what it
fetched and settles; settling only updates the trackers, and the consumer thread commits
what became contiguous. When the engine holds ``max_inflight`` messages the consumer
thread pauses every assigned partition, and keeps polling (the group must see the
member alive): nothing fetched is ever dropped to make room.

Rebalances (kafka_rebalance.py): revoked partitions' messages in flight get
``revoke_timeout_s`` to settle before the settled prefix is committed and the
partitions let go; no queue of unsettled messages is ever cleared as if settled.
Blocks (kafka_blocks.py): a partition's first deliveries go to the engine as one.

Retries: a failed message is retried after the policy's backoff (its body held in
memory); its delivery count is written to a small SQLite file (``attempts_path``) so
that it survives a restart: a poison message at a partition's head reaches
``max_deliveries`` and goes to the flow's error sink (a log cannot dead-letter one
message: the flow needs ``.on_error(sink)``), and only then may the commit pass it.
"""

from __future__ import annotations

import heapq
import logging
import os
import re
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, cast

from ackflow import faults
from ackflow.core.errors import ConfigError, SourceGone
from ackflow.core.ledger import Failure
from ackflow.core.offsets import OffsetTracker
from ackflow.core.policy import RetryPolicy
from ackflow.core.secrets import redact
from ackflow.core.settlement import Delivery, Settlement
from ackflow.sources import kafka_blocks as kb
from ackflow.sources import kafka_rebalance as rebalance
from ackflow.sources.base import BlockSize, Source
from ackflow.sources.kafka_attempts import Attempts, Partition, open_attempts
from ackflow.sources.kafka_messages import dead_letter, delivery_headers, message_key

log = logging.getLogger("ackflow.sources.kafka")

#: consumer settings ackflow owns (a user's ``config`` may not change them)
OWNED = {"enable.auto.commit": False, "enable.auto.offset.store": False}
#: defaults a user's ``config`` may change: a member that stops polling for
#: ``max.poll.interval.ms`` is dropped from the group (the consumer thread keeps polling,
#: so this only bounds a stuck process); short timeouts make joins and rebalances quick
DEFAULTS: dict[str, Any] = {
    "auto.offset.reset": "earliest",
    "session.timeout.ms": 6000,
    "heartbeat.interval.ms": 500,
    "max.poll.interval.ms": 10000,
    "partition.assignment.strategy": "cooperative-sticky",
}


class _Part:
    """What the source knows of one assigned partition."""

    def __init__(self, gen: int) -> None:
        self.gen = gen  # which assignment: a delivery of an earlier one settles nothing here
        self.tracker: OffsetTracker | None = None  # made at the first offset fetched
        self.last_seen = -1
        self.inbox: deque[Any] = deque()  # fetched, not handed out yet
        self.committed = -1  # the offset last committed by this source
        self.revoking = False
        # the offsets handed out before this assignment read the partition, by an
        # earlier run or another process on this machine (committed, high): redeliveries
        self.handed_before = (0, -1)


class KafkaSource(Source):
    """Consume ``topics`` as a member of consumer group ``group``.

    ``bootstrap``: ``host:port[,host:port]``. ``config``: more librdkafka consumer
    settings (``security.protocol``, ``sasl.*``, fetch sizes, ``auto.offset.reset``
    for a group without a committed offset: ``earliest`` by default). Commits are
    ackflow's only (auto-commit and the automatic offset store are off).

    A message's identity is ``topic/partition@offset``: unique within the topic's life.
    A topic deleted and created again under the same name starts its offsets at 0, and
    its messages then have the identities of the old topic's: a keyed sink would take
    them for the old rows. Use a new topic name (or clear the sink's keys).

    The headers of a delivery are ``topic``, ``partition``, ``offset``, ``timestamp``
    (ms), ``key`` (the message key, where it is UTF-8 text) and the message's own
    headers that are UTF-8 text (``headers_field=`` puts them in a column).

    Delivery counts survive restarts in ``attempts_path`` (SQLite, one per machine), or,
    with ``attempts_dsn=`` (a PostgreSQL DSN), in two tables every process of the group
    shares: a partition that moves to another process keeps its counts.
    """

    def __init__(
        self,
        bootstrap: str,
        topics: str | Sequence[str],
        group: str,
        *,
        format: str = "json",
        policy: RetryPolicy | None = None,
        config: dict[str, Any] | None = None,
        attempts_path: str | None = None,
        attempts_dsn: str | None = None,
        revoke_timeout_s: float = 5.0,
        headers_field: str | None = None,
        dead_letter_topic: str | None = None,
        gone_timeout_s: float = 120.0,
        name: str | None = None,
    ) -> None:
        topic_list = [topics] if isinstance(topics, str) else list(topics)
        super().__init__(format=format, name=name or f"kafka:{','.join(topic_list)}")
        if not bootstrap or not topic_list or not all(topic_list) or not group:
            raise ConfigError("Kafka source: bootstrap=, topics= and group= must not be empty")
        clash = sorted(set(config or {}) & (set(OWNED) | {"group.id", "bootstrap.servers"}))
        if clash:
            raise ConfigError(
                f"Kafka source: config= may not set {clash}: ackflow commits "
                "offsets itself; give bootstrap= and group= as arguments"
            )
        if not revoke_timeout_s > 0:
            raise ConfigError(f"revoke_timeout_s must be > 0, got {revoke_timeout_s!r}")
        self.bootstrap, self.topics, self.group = bootstrap, topic_list, group
        self.policy = policy or RetryPolicy()
        self.config = {
            **DEFAULTS,
            **(config or {}),
            **OWNED,
            "group.id": group,
            "bootstrap.servers": bootstrap,
        }
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", group)
        self.attempts_path = attempts_path or os.path.join(".ackflow", f"kafka-{safe}.db")
        self.attempts_dsn = attempts_dsn  # counts shared by the group's processes
        self.revoke_timeout_s = revoke_timeout_s
        self.headers_field = headers_field
        self.dead_letter_topic = dead_letter_topic
        self._producer: Any = None
        self._window = 10_000
        self._error_sink = False
        self._lock = threading.Condition()
        self._parts: dict[Partition, _Part] = {}
        # handed out, not settled: (partition, offset) -> (assignment, body, headers)
        self._bodies: dict[tuple[Partition, int], tuple[int, bytes, dict[str, str]]] = {}
        # due, partition, offset, delivery count, assignment
        self._retry: list[tuple[float, Partition, int, int, int]] = []
        self._assignments = 0
        self._consumer: Any = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._paused: set[Partition] = set()  # partitions this source paused
        self._attempts: Attempts | None = None
        self.error: BaseException | None = None
        self._up = True
        self._down_since = 0.0
        self._next_probe = 0.0
        self.gone_timeout_s = gone_timeout_s
        self._down_codes: set[int] = set()
        self.reconnects = 0
        self.rebalances = 0
        self.given_up = 0  # in flight when their partition was revoked past the bound
        self._use_blocks = False  # first deliveries of a partition as one (kafka_blocks.py)
        self._blocks: dict[tuple[Partition, int], kb.KafkaBlock] = {}  # by first offset
        self._in_blocks = 0  # the messages of those
        self.block_size = BlockSize(kb.BLOCK_MESSAGES)

    @property
    def header_fields(self) -> tuple[str | None, ...]:
        return (self.headers_field,)

    def configure(self, *, max_inflight: int, error_sink: bool, keepalive_s: float = 30.0) -> None:
        self._window = max_inflight
        self._error_sink = error_sink

    def _store(self) -> Attempts:
        assert self._attempts is not None, "the source is not open"
        return self._attempts

    # -- the consumer thread ---------------------------------------------------------------

    def open(self) -> int:
        if not self._error_sink and self.dead_letter_topic is None:
            raise ConfigError(
                f"source {self.name!r}: a Kafka partition cannot dead-letter one "
                "message: give the source dead_letter_topic='...' or the flow "
                "an error sink with .on_error(sink)"
            )
        try:
            from confluent_kafka import Consumer, Producer
        except ImportError:
            raise ConfigError(
                "the Kafka source needs confluent-kafka: pip install 'ackflow[kafka]'"
            ) from None
        self._attempts = open_attempts(self.name, self.group, self.attempts_path, self.attempts_dsn)
        try:
            from confluent_kafka import KafkaError

            self._down_codes = {KafkaError._ALL_BROKERS_DOWN, KafkaError._TRANSPORT}
            self._consumer = Consumer({**self.config, "error_cb": self._on_error}, logger=log)
            meta = self._consumer.list_topics(timeout=15)  # the brokers answer, or a clear error
        except Exception as e:  # noqa: BLE001 - a clear message at start
            raise ConfigError(
                f"source {self.name!r}: cannot reach Kafka at "
                f"{redact(self.bootstrap)}: {type(e).__name__}: {e}"
            ) from None
        if self.dead_letter_topic is not None:
            if self.dead_letter_topic not in meta.topics:
                self._consumer.close()
                raise ConfigError(
                    f"source {self.name!r}: dead_letter_topic "
                    f"{self.dead_letter_topic!r} does not exist; create it first"
                )
            self._producer = Producer(
                {"bootstrap.servers": self.bootstrap, "enable.idempotence": True, "acks": "all"}
            )
        self._consumer.subscribe(
            self.topics, on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_lost
        )
        self._thread = threading.Thread(target=self._poll_loop, name="ackflow-kafka", daemon=True)
        self._thread.start()
        return 0

    def _poll_loop(self) -> None:
        from confluent_kafka import KafkaException

        try:
            while not self._stop.is_set():
                self._backpressure()
                self._fetched(self._consumer.consume(500, 0.1))
                if not self._up:
                    self._probe()
                try:
                    self._commit()
                except KafkaException as e:
                    err = e.args[0] if e.args else None
                    if err is not None and err.fatal():
                        raise
                    # the brokers are away (a restart): the settled prefix stays in
                    # memory and is committed once they answer; nothing moves meanwhile
                    self._down("commit", err.str() if err is not None else str(e))
                    time.sleep(0.2)
        except BaseException as e:  # noqa: BLE001 - the engine's thread raises it
            log.error("source %r: the Kafka consumer thread failed: %s: %s", self.name, type(e).__name__, e)
            self.error = e
            with self._lock:
                self._lock.notify_all()

    def _on_error(self, err: Any) -> None:
        """librdkafka's error callback (the consumer thread): a fatal error stops the
        run; every broker being down marks the source disconnected until a message or
        a commit gets through (librdkafka reconnects by itself)."""
        if err.fatal():
            self.error = RuntimeError(f"Kafka: {err.str()}")
        elif err.code() in self._down_codes:
            self._down("connection", err.str())

    def _probe(self) -> None:
        """While the brokers seem away, ask for metadata about once a second: an answer
        means they are back (with nothing to fetch and nothing to commit, no message or
        commit would say so). Away for ``gone_timeout_s``: the run stops (SourceGone)."""
        now = time.monotonic()
        if now < self._next_probe:
            return
        self._next_probe = now + 1.0
        try:
            self._consumer.list_topics(timeout=2)
        except Exception:  # noqa: BLE001 - still away
            if now - self._down_since >= self.gone_timeout_s:
                raise SourceGone(
                    f"source {self.name!r}: Kafka at {redact(self.bootstrap)} "
                    f"has not answered for {now - self._down_since:.0f} s; "
                    "stopping (unsettled offsets are read again)"
                ) from None
            return
        self._back()

    def _down(self, what: str, why: str) -> None:
        if self._up:
            self._up = False
            self._down_since = time.monotonic()
            log.warning(
                "source %r: Kafka is unreachable (%s: %s); settled offsets are committed when it answers",
                self.name,
                what,
                why,
            )

    def _back(self) -> None:
        if not self._up:
            self._up = True
            self.reconnects += 1
            log.warning("source %r: Kafka answers again", self.name)

    def _held(self) -> int:
        return len(self._bodies) + self._in_blocks + sum(len(p.inbox) for p in self._parts.values())

    def _backpressure(self) -> None:
        """Pause every assigned partition while the engine holds the window's worth of
        messages (in flight, waiting for a retry, or fetched and not handed out)."""
        with self._lock:
            full = self._held() >= self._window
            tps = set(self._parts)
        self._paused &= tps  # revoked or lost: not ours to resume
        change = tps - self._paused if full else set(self._paused)
        if not change:
            return
        from confluent_kafka import TopicPartition

        parts = [TopicPartition(t, p) for t, p in sorted(change)]
        (self._consumer.pause if full else self._consumer.resume)(parts)
        if full:
            self._paused |= change
        else:
            self._paused.clear()

    def _fetched(self, messages: list[Any]) -> None:
        """Put what one ``consume`` returned into its partitions' inboxes (one lock for
        the lot: the engine's thread takes it per pull)."""
        good = []
        for m in messages:
            err = m.error()
            if err is None:
                good.append(m)
            elif err.fatal():
                raise RuntimeError(f"Kafka: {err.str()}")
            else:
                log.debug("source %r: %s", self.name, err.str())
        if not good:
            return
        self._back()
        with self._lock:
            for m in good:
                part = self._parts.get((m.topic(), m.partition()))
                if part is not None and not part.revoking:  # else not ours (any more)
                    part.inbox.append(m)
            self._lock.notify_all()

    def _commit(self, only: Sequence[Partition] | None = None) -> None:
        """Commit each partition's contiguous settled prefix that moved (the consumer
        thread; synchronously, so that a revoke commits before it returns)."""
        from confluent_kafka import TopicPartition

        self._skip_unseen()
        with self._lock:
            due = [
                (tp, p.tracker.committed)
                for tp, p in self._parts.items()
                if p.tracker is not None
                and p.tracker.committed > p.committed
                and (only is None or tp in only)
            ]
        if not due:
            return
        faults.point("kafka.before_commit")
        self._consumer.commit(offsets=[TopicPartition(t, p, off) for (t, p), off in due], asynchronous=False)
        self._back()
        faults.point("kafka.after_commit")
        with self._lock:
            for tp, off in due:
                part = self._parts.get(tp)
                if part is not None:
                    part.committed = max(part.committed, off)
                self._store().forget(tp, off)

    def _skip_unseen(self) -> None:
        """Offsets the client moved past without returning a message (transaction
        markers, aborted records, compacted ones at the end of what was fetched) are
        gaps: the client's position is past them, and nothing of them is waiting."""
        from confluent_kafka import TopicPartition

        with self._lock:
            idle = [tp for tp, p in self._parts.items() if not p.inbox and not p.revoking]
            if not idle:
                return
            for pos in self._consumer.position([TopicPartition(t, p) for t, p in idle]):
                part = self._parts.get((pos.topic, pos.partition))
                if part is None or pos.offset < 0:
                    continue
                if part.tracker is None:  # moved without a message in this assignment (a
                    # partition holding only markers or aborted records since its commit):
                    # nothing before the position is ours to settle; commit it once. (The
                    # client resets the position on assign: never one of an earlier
                    # assignment, see test_the_client_forgets_the_position_on_assign)
                    handed = self._store().handed((pos.topic, pos.partition))  # may raise:
                    part.tracker = OffsetTracker(start=pos.offset)  # nothing changed then
                    part.last_seen = pos.offset - 1
                    part.handed_before = handed
                    continue
                if pos.offset > part.last_seen + 1:
                    part.tracker.gap(part.last_seen + 1, pos.offset)
                    part.last_seen = pos.offset - 1

    def _on_assign(self, consumer: Any, partitions: list[Any]) -> None:
        with self._lock:
            for tp in partitions:
                if (tp.topic, tp.partition) not in self._parts:
                    self._assignments += 1
                    self._parts[(tp.topic, tp.partition)] = _Part(self._assignments)
            self.rebalances += 1
        log.info(
            "source %r: assigned %s", self.name, ", ".join(f"{tp.topic}[{tp.partition}]" for tp in partitions)
        )

    def _on_revoke(self, consumer: Any, partitions: list[Any]) -> None:
        rebalance.revoke(self, [(tp.topic, tp.partition) for tp in partitions])

    def _on_lost(self, consumer: Any, partitions: list[Any]) -> None:
        rebalance.lost(self, [(tp.topic, tp.partition) for tp in partitions])

    # -- the engine's thread ---------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """False until the group first assigned partitions (joining takes a few seconds:
        a run is not idle meanwhile), and after the consumer failed."""
        return self.error is None and self.rebalances > 0 and self._up

    @property
    def retries_waiting(self) -> int:
        return len(self._retry)

    def pull(self, max_messages: int, timeout: float) -> list[Delivery]:
        if isinstance(self.error, SourceGone):
            raise self.error
        if self.error is not None:
            raise ConfigError(
                f"source {self.name!r}: the Kafka consumer failed: {type(self.error).__name__}: {self.error}"
            )
        out: list[Delivery] = []
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                now = time.monotonic()
                while self._retry and self._retry[0][0] <= now and len(out) < max_messages:
                    _, tp, off, count, gen = heapq.heappop(self._retry)
                    part = self._parts.get(tp)
                    entry = self._bodies.get((tp, off))
                    if (
                        part is not None
                        and part.tracker is not None
                        and part.gen == gen
                        and not part.revoking
                        and entry is not None
                        and entry[0] == gen
                    ):
                        part.tracker.pulled(off)
                        out.append(
                            Delivery(
                                0, message_key(tp, off), entry[1], entry[2], count, handle=(tp, off, gen)
                            )
                        )
                highs: dict[Partition, int] = {}
                taken = len(out)  # messages (a block is several)
                for tp, part in self._parts.items():
                    offs: list[int] = []  # first deliveries, for blocks
                    ms: list[Any] = []
                    while part.inbox and taken < max_messages and not part.revoking:
                        m = part.inbox[0]
                        n = self._take(tp, part, m)  # (raising: still there)
                        part.inbox.popleft()
                        if n is None:
                            continue
                        taken += 1
                        highs[tp] = off = part.last_seen
                        if n == 1 and self._use_blocks:
                            offs.append(off)
                            ms.append(m)
                        else:
                            out.append(self._single(tp, off, m, part.gen, n))
                    if offs:
                        out += kb.make(self, tp, part.gen, offs, ms)
                if out:  # counted before they are handed out: a message whose
                    # processing kills the process has its delivery counted too
                    again = [(*_handle(d)[:2], d.delivery_count) for d in out if d.delivery_count > 1]
                    self._store().record_pull(again, highs)
                if out or self._stop.is_set() or now >= deadline:
                    return out
                self._lock.wait(min(0.05, deadline - now))

    def _take(self, tp: Partition, part: _Part, m: Any) -> int | None:
        """Track fetched message ``m`` as handed out (then ``part.last_seen`` is its
        offset) and return its delivery count; None if it was handed out already."""
        off = int(m.offset())
        if off <= part.last_seen:
            return None  # fetched again after a seek: already handed out
        # the delivery counts first: a store that fails (a database away) leaves nothing
        # changed, so the commit can never pass this message as a gap
        low, high = part.handed_before if part.tracker is not None else self._store().handed(tp)
        before = self._store().get(tp, off) if low <= off <= high else 0
        if part.tracker is None:  # the partition's reading starts at its committed offset
            part.tracker = OffsetTracker(start=off)
            part.committed = off
            part.handed_before = (low, high)
        elif off > part.last_seen + 1:
            part.tracker.gap(part.last_seen + 1, off)  # never delivered: a gap
        part.last_seen = off
        if not part.tracker.pulled(off):
            return None
        # handed out before this assignment: its recorded count, else that one delivery
        return max(before, 1) + 1 if low <= off <= high else 1

    def _single(self, tp: Partition, off: int, m: Any, gen: int, count: int) -> Delivery:
        body = m.value() or b""
        headers = delivery_headers(tp, off, m)
        self._bodies[(tp, off)] = (gen, body, headers)
        return Delivery(0, message_key(tp, off), body, headers, count, handle=(tp, off, gen))

    def use_blocks(self, on: bool) -> bool:
        self._use_blocks = on and self.headers_field is None  # (headers are made per delivery)
        return self._use_blocks

    def split(self, blocks: Sequence[Delivery]) -> None:
        """A block's messages come again one by one, each a first delivery."""
        with self._lock:
            held = kb.again(self, blocks)
        if held:  # (not for a block let go with its partition: it split nothing here)
            self.block_size.split(held)

    def _keeps(self, tp: Partition, gen: int) -> bool:
        """Whether a message of assignment ``gen`` of ``tp`` may wait here for another
        try (not once its partition is revoking or gone: the new owner reads it)."""
        part = self._parts.get(tp)
        return part is not None and part.gen == gen and not part.revoking

    def _mine(self, tp: Partition, off: int, gen: int) -> bool:
        """Whether this delivery is the one the source holds for its offset (not one of
        an earlier assignment of the partition, given up at a revoke)."""
        entry = self._bodies.get((tp, off))
        return entry is not None and entry[0] == gen

    @property
    def committed(self) -> dict[str, int]:
        """Per assigned partition (``topic[p]``), the first offset not settled."""
        with self._lock:
            return {
                f"{t}[{p}]": part.tracker.committed
                for (t, p), part in self._parts.items()
                if part.tracker is not None
            }

    def status(self) -> dict[str, object]:
        with self._lock:
            parts = {
                f"{t}[{p}]": {
                    "committed": part.committed,
                    "settled_to": (part.tracker.committed if part.tracker is not None else None),
                    "last_fetched": part.last_seen,
                    "waiting": len(part.inbox),
                }
                for (t, p), part in sorted(self._parts.items())
            }
        return {
            "kind": "Kafka",
            "bootstrap": redact(self.bootstrap),
            "group": self.group,
            "topics": self.topics,
            "partitions": parts,
            "paused": bool(self._paused),
            "retries_waiting": len(self._retry),
            "rebalances": self.rebalances,
            "connected": self.connected,
            "reconnects": self.reconnects,
            "given_up_at_revoke": self.given_up,
        }

    def ack(self, deliveries: Sequence[Delivery]) -> list[Delivery]:
        """Settle; returns the deliveries let go with their partition meanwhile (their
        ack commits nothing here: the new owner reads them again)."""
        stale = []
        with self._lock:
            n = 0
            for d in deliveries:
                if d.parts is not None:
                    k = kb.acked(self, d)
                    n += k
                    if not k:
                        stale.append(d)
                    continue
                tp, off, gen = _handle(d)
                if not self._mine(tp, off, gen):
                    stale.append(d)  # its partition was revoked meanwhile
                    continue
                del self._bodies[(tp, off)]
                part = self._parts.get(tp)
                if part is not None and part.tracker is not None:
                    part.tracker.settled(off)
            self._lock.notify_all()
        if n:
            self.block_size.acked(n)
        return stale

    def fail(self, failures: Sequence[tuple[Delivery, Failure]]) -> list[Settlement]:
        """Retry by the policy. With ``dead_letter_topic``, a message given up is
        produced there (``acks=all``, headers: its identity, topic, partition, offset,
        step, error, deliveries) and counts as settled only once its delivery report
        came back; one that could not be produced is retried. (With an error sink,
        given-up messages went there before this.)"""
        if self._producer is None:
            self.nack(failures)
            return [Settlement.NACKED] * len(failures)
        states, retry, dead = self.by_policy(failures)
        stuck = dead_letter(self, dead)
        self.nack([*retry, *((d, f) for d, f in dead if d.key in stuck)])
        return [
            Settlement.NACKED if d.key in stuck else state
            for (d, _), state in zip(failures, states, strict=True)
        ]

    def nack(self, failures: Sequence[tuple[Delivery, Failure]]) -> None:
        now = time.monotonic()
        with self._lock:
            kb.again(self, [d for d, _ in failures if d.parts is not None], 2)  # (never: split)
            for d, _ in failures:
                if d.parts is not None:
                    continue
                tp, off, gen = _handle(d)
                if not self._mine(tp, off, gen):
                    continue  # its partition was revoked meanwhile
                self._store().record(tp, off, d.delivery_count)
                if not self._keeps(tp, gen):  # revoking: not kept for a retry here
                    del self._bodies[(tp, off)]
                    continue
                heapq.heappush(
                    self._retry,
                    (now + self.policy.delay_after(d.delivery_count), tp, off, d.delivery_count + 1, gen),
                )

    def release(self, deliveries: Sequence[Delivery]) -> None:
        now = time.monotonic()
        with self._lock:
            kb.again(self, [d for d in deliveries if d.parts is not None])  # one by one
            for d in deliveries:
                if d.parts is not None:
                    continue
                tp, off, gen = _handle(d)
                if not self._mine(tp, off, gen):
                    continue
                if self._keeps(tp, gen):
                    heapq.heappush(self._retry, (now, tp, off, d.delivery_count, gen))
                else:  # revoking: the new owner reads it
                    del self._bodies[(tp, off)]

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(30)
            if not self._thread.is_alive():
                self._thread = None
        consumer = self._consumer
        if consumer is not None and self._thread is not None:  # still polling: hands off
            log.warning(
                "source %r: the consumer thread did not stop; closing without a "
                "last commit (unsettled offsets are read again)",
                self.name,
            )
            consumer = None
        if consumer is not None:
            try:
                if self.error is None:
                    self._commit()
            except Exception as e:  # noqa: BLE001 - uncommitted messages are read again
                log.warning("source %r: last commit failed: %s", self.name, e)
            try:  # leaves the group; its revoke callback commits and waits for nothing
                consumer.close()  # (the run has settled or given back what it held)
            except Exception as e:  # noqa: BLE001
                log.warning("source %r: closing the Kafka consumer: %s", self.name, e)
            self._consumer = None
        producer, self._producer = self._producer, None
        if producer is not None:
            producer.flush(10)  # nothing is pending: fail() waited for its reports
        if self._attempts is not None:
            self._attempts.close()
            self._attempts = None


def _handle(d: Delivery) -> tuple[Partition, int, int]:
    """A delivery's partition, offset and assignment (the handle this source gave it)."""
    return cast(tuple[Partition, int, int], d.handle)
