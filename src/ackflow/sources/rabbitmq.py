"""RabbitMQ queues (classic and quorum) as a source, with manual acks.

One thread owns the connection: the engine's, which calls every method here.
Settlements handed in from any other thread are queued and carried out by the
owner on its next call (pull, ack, keepalive), never on the caller's thread.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import math
import queue as queue_mod
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

from ackflow import faults
from ackflow.core.errors import ConfigError
from ackflow.core.ledger import Failure
from ackflow.core.policy import RetryPolicy
from ackflow.core.secrets import redact
from ackflow.core.settlement import Delivery, Settlement
from ackflow.sources import rabbitmq_blocks as blocks
from ackflow.sources.base import BlockSize, Source
from ackflow.sources.rabbitmq_keys import (
    PREFETCH_MAX,
    RETRY_KEYS_MAX,
    SEEN_MAX,
    UNNAMED,
    handle_of,
    header_count,
    header_text,
    message_key,
    retry_key,
)
from ackflow.sources.rabbitmq_queue import (
    QueueMissing,
    connect,
    give_up_held_dead,
    gone_check,
    hold_dead,
    lose_connection,
    publish_dead_letters,
    publish_held_dead,
    reconsume,
)

log = logging.getLogger("ackflow.sources.rabbitmq")

#: Acks of messages younger than an unsettled one are held this long, so that the
#: older one's settlement lets them all go in one ``multiple=True`` frame; then they go
#: one by one.
ACK_HOLD_S = 1.0


class RabbitMQSource(Source):
    """Consume ``queue`` with manual acks; ack only what the flow wrote.

    * Prefetch follows the engine's in-flight window, or this source's share of it in a
      ``merge`` (``prefetch=`` lowers it, never raises it past the window). A
      window past AMQP's prefetch cap of 65 535 is split over several consumers on the
      one channel (``consumer_prefetch``), so that the broker keeps the whole window
      coming (with one consumer, a window of 75 000 was filled to 65 535 and the batches
      were cut smaller).
    * Acks use ``multiple=True`` for runs of acked tags that are the oldest unsettled
      ones on the channel. The acks of messages younger than an unsettled one (a younger
      batch finished first) are held until the older one is settled, so that one frame
      carries them all, and sent one by one after ``ACK_HOLD_S`` (1 s) at the latest, or
      at close. A held ack is of a message already written: if the channel dies first,
      the broker delivers it again (as after a crash between write and ack).
    * A failed message is nacked with ``requeue=True`` after the policy's backoff (it
      stays in flight meanwhile), and dead-lettered once the policy gives it up (or a
      quorum queue's ``delivery_limit`` is reached). Dead letters go, in this order of
      choice: to the flow's error sink (``flow.on_error``: the source only acks them),
      to ``dead_letter_exchange`` (a copy with provenance headers ``x-ackflow-step``,
      ``-error``, ``-deliveries``, ``-queue``, published with confirms, then the
      original is acked), or, with ``reject_to_dlx=True``, rejected without requeue
      into the queue's own dead-letter exchange (``x-death`` headers). Without any of
      them the source refuses to start, rather than drop poison messages.
    * Delivery counts: on quorum queues the broker's ``x-delivery-count`` of a
      redelivery; on classic queues (and when the type cannot be learned) ackflow
      counts deliveries of each message id in memory (a restart starts from the
      ``redelivered`` flag: 2). A producer's ``x-delivery-count`` header is never read.
    * Connection loss or a broker restart: ackflow reconnects with backoff. Deliveries
      from the dead channel are handed back to the engine as lost (the broker delivers
      them again; the report counts them as ``redelivered``); a tag of an old channel
      is never acked or nacked on a new one.
    * Nothing is declared unless ``declare=True`` (a durable queue with
      ``arguments``); a missing queue is an error at start.
    * ``headers_field="meta"`` adds the message's headers (strings) to its row as
      ``meta``: with the sink's ``headers_column="meta"`` they are carried downstream.
    """

    def __init__(
        self,
        url: str,
        queue: str,
        *,
        format: str = "json",
        policy: RetryPolicy | None = None,
        prefetch: int | None = None,
        declare: bool = False,
        arguments: dict[str, Any] | None = None,
        dead_letter_exchange: str | None = None,
        dead_letter_routing_key: str | None = None,
        reject_to_dlx: bool = False,
        delivery_limit: int | None = None,
        reconnect_max_s: float = 10.0,
        headers_field: str | None = None,
        dlx_by_policy: bool = False,
        gone_timeout_s: float = 60.0,
        consumer: str = "process",
        name: str | None = None,
    ) -> None:
        super().__init__(format=format, name=name or f"rabbitmq:{queue}")
        if not queue:
            raise ConfigError("RabbitMQ source: queue name is empty")
        if consumer not in ("process", "inline"):
            raise ConfigError(f"RabbitMQ source: consumer must be 'process' or 'inline', got {consumer!r}")
        #: where pika runs: a process of its own ("process", see rabbitmq_remote) or the driver
        self.consumer = consumer
        if prefetch is not None and not 0 < prefetch <= PREFETCH_MAX:
            raise ConfigError(f"RabbitMQ source: prefetch must be 1..65535, got {prefetch}")
        self.url = url
        self.queue = queue
        self.policy = policy or RetryPolicy()
        self.prefetch = prefetch
        self.declare = declare
        self.arguments = dict(arguments or {})
        self.dead_letter_exchange = dead_letter_exchange
        self.dead_letter_routing_key = dead_letter_routing_key
        self.reject_to_dlx = reject_to_dlx
        self.dlx_by_policy = dlx_by_policy
        limit = delivery_limit if delivery_limit is not None else self.arguments.get("x-delivery-limit")
        self.delivery_limit = int(limit) if limit is not None else None
        self.reconnect_max_s = reconnect_max_s
        self.gone_timeout_s = gone_timeout_s
        self.headers_field = headers_field
        # consumers the broker cancelled (basic.cancel), and since when it has been so
        self._cancelled: set[str] = set()
        self._cancelled_since: float | None = None
        self._missing_since: float | None = None
        self._next_consume = 0.0
        self._gone_backoff = 0.5
        #: "classic", "quorum", "stream", or "unknown" (learned at the first connection)
        self.queue_type = "unknown"
        self._consumer_tags: list[str] = []
        self._unsent: list[Delivery] = []  # acked by the engine, never sent: they come again
        self._stopped_consuming = False
        self._window = 10_000
        self._error_sink = False
        self._owner: int | None = None
        self._conn: Any = None
        self._ch: Any = None
        self._gen = 0  # the channel generation; a handle is (generation, delivery tag)
        self._buffer: collections.deque[Delivery] = collections.deque()
        self._outstanding: dict[int, Delivery] = {}  # tags unsettled on this channel, in order
        self._lost: list[Delivery] = []
        self._delayed: list[tuple[float, int, int, int]] = []  # (due, seq, gen, tag): nacks
        #: (due, seq, tries, delivery, failure): dead letters the exchange refused, for
        #: messages a give-back would make the broker drop: held, published again
        self._dead_again: list[tuple[float, int, int, Delivery, Failure]] = []
        self._late_dead: list[tuple[Delivery, Failure]] = []  # published since: take_dead_lettered
        self._seq = 0
        self._inbox: queue_mod.Queue[tuple[str, list[Any]]] = queue_mod.Queue()
        self._seen: collections.OrderedDict[str, int] = collections.OrderedDict()
        #: give-backs (releases) per message since its last delivery: a give-back is not a
        #: delivery ackflow spent, so the next delivery's count leaves it out
        self._backs: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._retry_keys: collections.OrderedDict[Any, str] = collections.OrderedDict()
        self._next_connect = 0.0
        self._backoff = 0.5
        self.stats = collections.Counter[str]()  # acks, multiple_acks, nacks, rejects, ...
        # acks of deliveries younger than an unsettled one, not yet sent (see ACK_HOLD_S)
        self._held_acks: set[int] = set()
        self._held_since = 0.0
        self._sent_before_loss: set[int] = set()
        # delivery ids without a message_id: a random prefix of this source object and a
        # count (a uuid4 per message cost the driver 4 µs a message)
        self._unnamed_prefix = f"{UNNAMED}{uuid.uuid4().hex[:16]}-"
        self._unnamed = itertools.count(1)
        # blocks (rabbitmq_blocks): the block of each (generation, tag) in one; a split
        # block's deliveries, pulled one by one; messages not acked of a block (unacked())
        self._use_blocks = False
        self._block_of: dict[tuple[int, int], Delivery] = {}
        self._again: collections.deque[Delivery] = collections.deque()
        self._unacked: dict[int, int] = {}
        self._unsent_n: dict[int, int] = {}
        self.block_size = BlockSize(blocks.BLOCK_MESSAGES)

    # -- connection ------------------------------------------------------------------

    def configure(self, *, max_inflight: int, error_sink: bool, keepalive_s: float = 30.0) -> None:
        self._window = max_inflight
        self._error_sink = error_sink

    @property
    def where(self) -> str:
        return redact(self.url)

    def open(self) -> int:
        if not (self._error_sink or self.dead_letter_exchange or self.reject_to_dlx):
            raise ConfigError(
                f"source {self.name!r}: say where dead letters go: flow.on_error(sink), "
                "dead_letter_exchange='...', or reject_to_dlx=True (if the queue has an "
                "x-dead-letter-exchange); ackflow will not drop poison messages"
            )
        self._owner = threading.get_ident()
        try:
            connect(self)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - a clear message at start
            raise ConfigError(
                f"source {self.name!r}: cannot connect to {self.where}: {type(e).__name__}: {redact(str(e))}"
            ) from None
        return 0

    @property
    def broker_counts(self) -> bool:
        """True when the broker's own ``x-delivery-count`` may be read (quorum queues)."""
        return self.queue_type == "quorum"

    def _on_message(self, ch: Any, method: Any, props: Any, body: bytes) -> None:
        """pika's consumer callback (``consumer="inline"``)."""
        self._deliver("", method.delivery_tag, method.redelivered, props.message_id, props.headers, body)

    def _deliver(
        self, consumer: str, tag: int, redelivered: bool, message_id: Any, raw: Any, body: bytes
    ) -> None:
        """One delivery of the channel: pika's callback in the driver, or the consumer
        process's forward (``rabbitmq_remote``)."""
        raw = raw if isinstance(raw, dict) else {}
        headers = {header_text(k): header_text(v) for k, v in raw.items()}
        key = message_key(message_id, self._next_unnamed)
        # A quorum queue writes x-delivery-count on each redelivery; a first delivery (and
        # any message of another queue type) carries the producer's header, if any, which
        # must not count (a header of 0 kept a poison message alive forever)
        before = header_count(raw.get("x-delivery-count")) if self.broker_counts and redelivered else None
        seen_key = retry_key(message_id, body)
        backs = self._backs.pop(seen_key, 0)  # given back by this process: not spent
        if before is not None:  # quorum queue: deliveries before this one; the broker
            count = before + 1  # spends one per give-back too, and drops at its limit
        else:  # counted here, by message id or body digest
            count = max(self._seen.get(seen_key, 0) + 1 - backs, 1)
            if redelivered and not backs:
                count = max(count, 2)
            self._seen[seen_key] = count
            self._seen.move_to_end(seen_key)
            if len(self._seen) > SEEN_MAX:
                self._seen.popitem(last=False)
        handle = (self._gen, tag)
        self._retry_keys[handle] = seen_key
        if len(self._retry_keys) > RETRY_KEYS_MAX:
            self._retry_keys.popitem(last=False)
        d = Delivery(0, key, body, headers, count, handle=handle)
        self._outstanding[tag] = d
        self._buffer.append(d)

    @property
    def _callback(self) -> Any:
        return self._deliver if self.consumer == "process" else self._on_message

    def _next_unnamed(self) -> str:
        return f"{self._unnamed_prefix}{next(self._unnamed)}"

    def _lose_connection(self, why: BaseException) -> None:
        """The channel is gone: everything on it is the broker's again."""
        lose_connection(self, why)

    def _ensure(self) -> bool:
        if self._ch is not None:
            return True
        if time.monotonic() < self._next_connect:
            return False
        try:
            faults.point("source.reconnect")
            connect(self)
            return True
        except Exception as e:  # noqa: BLE001 - retried with backoff
            gone_check(self, isinstance(e, QueueMissing), "after a reconnection")
            log.warning("source %r: cannot reconnect to %s yet: %s", self.name, self.where, redact(str(e)))
            self._next_connect = time.monotonic() + self._backoff
            self._backoff = min(self.reconnect_max_s, self._backoff * 2)
            return False

    def _consume(self, n: int, tags: list[str]) -> None:
        for _ in range(n):
            tags.append(self._ch.basic_consume(self.queue, self._callback, auto_ack=False))

    def _broker(self, fn: Any, *args: Any, **kw: Any) -> bool:
        """Run one broker operation; on a connection error, handle the loss."""
        from pika.exceptions import AMQPError

        try:
            fn(*args, **kw)
            return True
        except (AMQPError, OSError, AttributeError, faults.InjectedFault) as e:
            self._lose_connection(e)
            return False

    # -- the owner's work ----------------------------------------------------------------

    def _is_owner(self) -> bool:
        return self._owner is None or threading.get_ident() == self._owner

    def _service(self) -> None:
        """Carry out settlements handed in by other threads, and due nacks."""
        while True:
            try:
                op, items = self._inbox.get_nowait()
            except queue_mod.Empty:
                break
            getattr(self, op)(items)
        now = time.monotonic()
        if self._held_acks and now - self._held_since >= ACK_HOLD_S:
            self._send_acks(force=True)
        while self._delayed and self._delayed[0][0] <= now:
            _, _, gen, tag = heapq.heappop(self._delayed)
            if gen == self._gen and self._ch is not None and tag in self._outstanding:
                self._settle_tags([tag], "nack")
        if self._dead_again and self._dead_again[0][0] <= now and self._ch is not None:
            publish_held_dead(self, now)

    @property
    def dead_letters_held(self) -> int:
        return len(self._dead_again)

    def take_dead_lettered(self) -> list[tuple[Delivery, Failure]]:
        late, self._late_dead = self._late_dead, []
        return late

    def pull(self, max_messages: int, timeout: float) -> list[Delivery]:
        deadline = time.monotonic() + timeout
        self._service()
        reconsume(self)
        if self._again:  # a split block's deliveries first, one by one
            return [self._again.popleft() for _ in range(min(max_messages, len(self._again)))]
        while len(self._buffer) < max_messages:
            if not self._ensure():
                time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
            else:
                left = max(0.0, deadline - time.monotonic())
                self._broker(self._conn.process_data_events, time_limit=min(left, 0.05))
            if time.monotonic() >= deadline:
                break
        out: list[Delivery] = []
        while self._buffer and len(out) < max_messages:
            out.append(self._buffer.popleft())
        return blocks.make(self, out) if self._use_blocks and len(out) > 1 else out

    def status(self) -> dict[str, object]:
        return {
            "kind": "RabbitMQ queue",
            "url": self.where,
            "queue": self.queue,
            "retries_waiting": self.retries_waiting,
            "dead_letters_held": len(self._dead_again),
            "buffered": len(self._buffer) + len(self._again),
            "unsettled_on_channel": len(self._outstanding),
            "dead_letters_refused": self.stats["dead_letters_refused"],
            "connected": self.connected,
            "cancelled_by_broker": self.stats["cancelled_by_broker"],
        }

    @property
    def connected(self) -> bool:
        """A channel, and no consumer the broker cancelled waiting to consume again."""
        return self._ch is not None and not self._cancelled

    @property
    def retries_waiting(self) -> int:
        """Failed deliveries whose nack waits for its backoff, or whose refused dead
        letter waits to be published again (held on the channel)."""
        return len(self._delayed) + len(self._dead_again)

    def take_lost(self) -> list[Delivery]:
        lost, self._lost = self._lost, []
        return lost

    def take_unsent_acks(self) -> list[Delivery]:
        """(How many of a block's messages were not sent: :meth:`unacked`.)"""
        unsent, self._unsent = self._unsent, []
        blocks.remember(self, self._unsent_n)
        self._unsent_n = {}
        return unsent

    def _current(self, deliveries: Sequence[Delivery]) -> tuple[list[int], list[Delivery]]:
        """Split into tags of the current channel and stale deliveries."""
        tags, stale = [], []
        for d in deliveries:
            if self._live(d):
                tags.append(handle_of(d)[1])
            else:
                stale.append(d)
        if stale:
            self.stats["stale"] += len(stale)
            log.warning(
                "source %r: %d settlements for deliveries of a closed channel are "
                "dropped; the broker delivers those messages again",
                self.name,
                len(stale),
            )
        return tags, stale

    def _settle_tags(self, tags: list[int], how: str) -> set[int]:
        """Ack (runs of the oldest unsettled tags with multiple=True), nack with requeue,
        or reject without requeue. Returns the tags the broker took; the rest were on a
        channel that died meanwhile (the broker delivers them again)."""
        done: set[int] = set()
        if how == "ack":
            wanted = {t for t in tags if t in self._outstanding}
            if wanted and not self._held_acks:
                self._held_since = time.monotonic()
            self._held_acks |= wanted
            sent = self._send_acks(force=False)
            if sent is not None:
                return wanted
            # the channel died: of these, only what went out before is done
            return wanted & self._sent_before_loss
        for tag in tags:
            if how == "nack":
                ok = self._call("rabbitmq.nack", "basic_nack", delivery_tag=tag, requeue=True)
            else:
                ok = self._call("rabbitmq.nack", "basic_reject", delivery_tag=tag, requeue=False)
            if not ok:
                return done
            self._outstanding.pop(tag, None)
            done.add(tag)
            self.stats[how + "s"] += 1
            blocks.forget(self, [tag])
        if self._held_acks:  # an older tag is settled: held acks may go now
            self._send_acks(force=False)
        return done

    def _send_acks(self, *, force: bool) -> set[int] | None:
        """Send held acks: the run of the oldest unsettled tags in one ``multiple=True``
        frame; with ``force``, the rest one by one. Returns the tags sent, or None if the
        channel died meanwhile (then ``_sent_before_loss`` holds what went out)."""
        held = self._held_acks
        sent: set[int] = set()
        self._sent_before_loss = sent
        head = 0  # the oldest unsettled tags, as long as all of them are held
        last = 0
        for tag in self._outstanding:  # oldest first
            if tag not in held:
                break
            head += 1
            last = tag
        if head:
            if not self._call("rabbitmq.ack", "basic_ack", delivery_tag=last, multiple=True):
                return None
            done = list(itertools.islice(self._outstanding, head))
            for tag in done:
                del self._outstanding[tag]
                held.discard(tag)
                sent.add(tag)
            blocks.forget(self, done)
            self.stats["multiple_acks"] += 1
        if force:
            for tag in sorted(held):
                if not self._call("rabbitmq.ack", "basic_ack", delivery_tag=tag):
                    return None
                self._outstanding.pop(tag, None)
                held.discard(tag)
                sent.add(tag)
                self.stats["acks"] += 1
                blocks.forget(self, [tag])
        return sent

    def _call(self, point: str, method: str, **kw: Any) -> bool:
        """One call on the current channel; False (and the loss handled) if the channel is
        gone or the connection drops during it."""
        if self._ch is None:
            return False
        return self._broker(self._faulty, point, getattr(self._ch, method), **kw)

    @staticmethod
    def _faulty(point: str, fn: Any, **kw: Any) -> None:
        faults.point(point)
        fn(**kw)

    # -- settlement ------------------------------------------------------------------------

    def ack(self, deliveries: Sequence[Delivery]) -> list[Delivery]:
        if not self._is_owner():
            self._inbox.put(("_ack_now", list(deliveries)))
            return []
        return self._ack_now(deliveries)

    def _ack_now(self, deliveries: Sequence[Delivery]) -> list[Delivery]:
        if self._use_blocks:
            self.block_size.acked(sum(d.messages for d in deliveries))
            if any(d.parts is not None for d in deliveries):
                stale, counts = blocks.regroup(deliveries, self._ack_tags(blocks.expand(deliveries)))
                blocks.remember(self, counts)
                return stale
        return self._ack_tags(deliveries)

    def _ack_tags(self, deliveries: Sequence[Delivery]) -> list[Delivery]:
        self._forget(deliveries)
        tags, stale = self._current(deliveries)
        if tags:
            done = self._settle_tags(tags, "ack")
            if len(done) < len(tags):
                # the connection died mid-way: what was not acked comes back from the broker
                live = {id(d) for d in stale}
                stale += [d for d in deliveries if id(d) not in live and handle_of(d)[1] not in done]
        return stale

    def exhausted(self, delivery: Delivery) -> bool:
        if self.delivery_limit is not None and delivery.delivery_count > self.delivery_limit:
            return True
        return self.policy.exhausted(delivery.delivery_count)

    def _forget(self, deliveries: Sequence[Delivery]) -> None:
        """Settled deliveries are never given back: their retry keys go (memory follows
        the window, not the stream's length)."""
        for d in deliveries:
            self._retry_keys.pop(d.handle, None)

    def fail(self, failures: Sequence[tuple[Delivery, Failure]]) -> list[Settlement]:
        self._forget([d for d, _ in failures])
        out = []
        retry, dead = [], []
        for d, f in failures:
            if not self._live(d):
                out.append(Settlement.RELEASED)
            elif self.exhausted(d):
                dead.append((d, f))
                out.append(Settlement.DEAD_LETTERED)
            else:
                retry.append((d, f))
                out.append(Settlement.NACKED)
        self._schedule_nacks(retry, backoff=True)  # may lose the connection: checked below
        refused, lost = self._dead_letter(dead)
        for i, (d, _) in enumerate(failures):
            if id(d) in lost:
                out[i] = Settlement.RELEASED
            elif id(d) in refused:
                out[i] = Settlement.NACKED
        return out

    def _live(self, d: Delivery) -> bool:
        """Its channel is the current one and its tag is still unsettled there."""
        gen, tag = handle_of(d)
        return gen == self._gen and self._ch is not None and tag in self._outstanding

    def _schedule_nacks(self, failures: Sequence[tuple[Delivery, Failure]], backoff: bool) -> None:
        now = time.monotonic()
        for d, _ in failures:
            gen, tag = handle_of(d)
            delay = self.policy.delay_after(d.delivery_count) if backoff else 0.0
            self._seq += 1
            heapq.heappush(self._delayed, (now + delay, self._seq, gen, tag))
        if self._is_owner():
            self._service()

    def _dead_letter(self, dead: list[tuple[Delivery, Failure]]) -> tuple[set[int], set[int]]:
        """Dead-letter. Returns the ids of deliveries that could not be (they are nacked
        instead) and of those whose channel died first (the broker delivers them again)."""
        if not dead:
            return set(), set()
        lost = {id(d) for d, _ in dead if not self._live(d)}  # a nack above lost the channel
        dead = [(d, f) for d, f in dead if id(d) not in lost]
        if self.dead_letter_exchange:
            refused, alive = publish_dead_letters(self, dead)
            if not alive:  # the connection died: the broker delivers them all again
                return refused, lost | {id(x) for x, _ in dead}
            ok = [d for d, _ in dead if id(d) not in refused]
            lost |= {id(d) for d in self._ack_now(ok)}
            last = {id(d) for d in self.unreleasable([d for d, _ in dead if id(d) in refused])}
            hold_dead(self, [(d, f) for d, f in dead if id(d) in last], 1)
            self._schedule_nacks(
                [(d, f) for d, f in dead if id(d) in refused and id(d) not in last], backoff=True
            )
            self.stats["dead_letters"] += len(ok)
            return refused, lost
        tags, _ = self._current([d for d, _ in dead])
        done = self._settle_tags(tags, "reject")
        for d, f in dead:
            if handle_of(d)[1] not in done:
                lost.add(id(d))
                continue
            log.warning(
                "source %r: message %s rejected to the queue's dead-letter exchange after %d deliveries: %s",
                self.name,
                d.key,
                d.delivery_count,
                f,
            )
        return set(), lost

    def nack(self, failures: Sequence[tuple[Delivery, Failure]]) -> None:
        self._schedule_nacks(failures, backoff=True)

    def release(self, deliveries: Sequence[Delivery]) -> None:
        """``basic.nack`` with requeue. On a quorum queue (RabbitMQ 3.10) every give-back
        counts as a delivery (a nack, a reject, a closed channel or a cancelled consumer
        alike, measured): see :meth:`unreleasable`. On a classic queue ackflow's own count
        leaves a give-back out: the message's next delivery counts as the one it gave
        back (a quorum queue's count is the broker's, which spends one)."""
        deliveries = blocks.expand(deliveries)
        for d in deliveries:
            k = self._retry_keys.pop(d.handle, None)
            if k is not None:
                self._backs[k] = self._backs.get(k, 0) + 1
                if len(self._backs) > SEEN_MAX:
                    self._backs.popitem(last=False)
        self._schedule_nacks([(d, Failure("release", "")) for d in deliveries], backoff=False)

    def stop_consuming(self) -> list[Delivery]:
        """Cancel the consumers (before a release: a message given back while they
        consume comes straight back to them, and on a quorum queue the closing channel
        then spends one more of its deliveries); return the deliveries received but not
        pulled yet, for the engine to settle. Deliveries that arrive while the cancel is
        under way are given back by pika (``basic.reject`` with requeue): on a quorum
        queue each of those spends a delivery too."""
        if not self._is_owner():
            return []
        if self._stopped_consuming:  # (a block split in the stop's drain: its deliveries)
            left = [d for d in self._again if self._live(d)]
            self._again.clear()
            return left
        self._stopped_consuming = True
        if self._ch is not None:  # what arrived already reaches the buffer first
            self._broker(self._conn.process_data_events, time_limit=0)
        for tag in self._consumer_tags:
            if self._ch is None or not self._broker(self._ch.basic_cancel, tag):
                break
        self._consumer_tags = []
        if self._ch is not None:  # what came before the cancel (the consumer process's)
            self._broker(self._conn.process_data_events, time_limit=0)
        self._cancelled.clear()  # nothing to consume again: the run is ending
        self._cancelled_since = None
        left = [d for d in (*self._again, *self._buffer) if self._live(d)]
        self._buffer.clear()
        self._again.clear()
        return left

    def unreleasable(self, deliveries: Sequence[Delivery]) -> list[Delivery]:
        """On a quorum queue with a delivery limit, the deliveries past it: a give-back
        would make the broker drop them (or dead-letter them without provenance)."""
        limit = self.delivery_limit
        if not self.broker_counts or limit is None:
            return []
        return [  # (a block holds first deliveries only, and none where one is the last)
            d
            for d in deliveries
            if d.parts is None and self._live(d) and self.exhausted(d) and d.delivery_count > limit
        ]

    def use_blocks(self, on: bool) -> bool:
        limit = self.delivery_limit
        self._use_blocks = on and self.headers_field is None and (limit is None or limit >= 1)
        return self._use_blocks

    def split(self, blocks_: Sequence[Delivery]) -> None:
        blocks.split(self, blocks_)

    def unacked(self, delivery: Delivery) -> int:
        if delivery.parts is None:
            return delivery.messages
        return self._unacked.get(id(delivery), delivery.messages)

    def keepalive(self, deliveries: Sequence[Delivery]) -> None:
        if self._ch is not None:
            self._broker(self._conn.process_data_events, time_limit=0)
        self._service()
        reconsume(self)

    def close(self) -> None:
        self._service()
        if self._dead_again and self._ch is not None:  # one last try, whatever is due
            publish_held_dead(self, math.inf)
        give_up_held_dead(self, "were still refused when the source closed")
        if self._held_acks and self._ch is not None:
            self._send_acks(force=True)
        if self._again and self._ch is not None:  # a split block's, never pulled again
            self.release(list(self._again))
            self._again.clear()
            self._service()
        conn, self._conn, self._ch = self._conn, None, None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # noqa: BLE001 - unsettled messages return to the queue
                pass
