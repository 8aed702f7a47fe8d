"""RabbitMQ queues (classic and quorum) as a source, with manual acks.

One thread owns the connection: the engine's, which calls every method here.
Settlements handed in from any other thread are queued and carried out by the
owner on its next call (pull, ack, keepalive), never on the caller's thread.
"""

from __future__ import annotations

import collections
import hashlib
import heapq
import itertools
import logging
import queue as queue_mod
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, cast

from ackflow import faults
from ackflow.core.errors import ConfigError, SourceGone
from ackflow.core.ledger import Failure
from ackflow.core.policy import RetryPolicy
from ackflow.core.secrets import redact
from ackflow.core.settlement import Delivery, Settlement
from ackflow.sources.base import Source

log = logging.getLogger("ackflow.sources.rabbitmq")

#: Headers ackflow puts on a message it dead-letters (its provenance).
PROVENANCE = ("x-ackflow-step", "x-ackflow-error", "x-ackflow-deliveries", "x-ackflow-queue")


#: Prefix of the key of a message published without a ``message_id``: unique to that one
#: delivery, so a redelivery of it is a new identity (at-least-once for keyed sinks).
UNNAMED = "delivery:"


#: Acks of messages younger than an unsettled one are held this long, so that the
#: older one's settlement lets them all go in one ``multiple=True`` frame; then they go
#: one by one.
ACK_HOLD_S = 1.0
# AMQP's prefetch count is 16 bits: a window past it is split over several consumers
PREFETCH_MAX = 65535
#: message ids whose delivery count a classic queue's source remembers (and their
#: give-backs), the most recent ones; older ones are forgotten (a redelivery of one then
#: counts from the broker's ``redelivered`` flag: 2)
SEEN_MAX = 100_000
#: deliveries whose retry key is kept for a give-back (the most recent)
RETRY_KEYS_MAX = 200_000
MAX_CONSUMERS = 16


class QueueMissing(ConfigError):
    """The queue does not exist (at start: the run does not start; later: wait for it,
    up to ``gone_timeout_s``)."""


def consumer_prefetch(window: int) -> tuple[int, int]:
    """``(consumers, prefetch each)`` that keep up to ``window`` deliveries in flight:
    one consumer while the window fits one prefetch count, else the fewest that hold it
    (at most ``MAX_CONSUMERS``), each with an equal share, their sum never over it."""
    consumers = min(MAX_CONSUMERS, max(1, -(-window // PREFETCH_MAX)))
    return consumers, max(1, min(PREFETCH_MAX, window // consumers))


def message_key(message_id: Any, unnamed: Callable[[], str] | None = None) -> str:
    """A message's identity: its ``message_id`` property (the producer's promise that it
    names this message alone), else an id unique to this delivery (``unnamed()``, or a
    random one). Never derived from the body: two distinct messages may carry the same
    bytes. A ``message_id`` that starts like an unnamed key (``delivery:``) or like this
    escape (``id:``) gets ``id:`` before it, so that no producer can name the key of an
    unnamed delivery (the keys are visible in keyed sinks).

    >>> message_key("order-1"), message_key("delivery:x-1"), message_key("id:7")
    ('order-1', 'id:delivery:x-1', 'id:id:7')
    """
    if isinstance(message_id, str) and message_id:
        if message_id.startswith((UNNAMED, "id:")):
            return "id:" + message_id
        return message_id
    return unnamed() if unnamed is not None else UNNAMED + uuid.uuid4().hex


def producer_id(key: str) -> str | None:
    """The ``message_id`` the producer gave the message keyed ``key`` (None for an
    unnamed delivery): what a dead letter carries on, so that it is the same message.

    >>> [producer_id(message_key(m)) for m in ("order-1", "id:7", "delivery:x")]
    ['order-1', 'id:7', 'delivery:x']
    >>> producer_id(message_key(None, lambda: "delivery:abc-1")) is None
    True
    """
    if key.startswith("id:"):
        return key[3:]
    return None if key.startswith(UNNAMED) else key


def retry_key(message_id: Any, body: bytes) -> str:
    """What delivery counts of a classic queue are remembered by: the message id, else a
    digest of the body (identical bodies share a count; they fail alike)."""
    if isinstance(message_id, str) and message_id:
        return "id:" + message_id
    return "sha256:" + hashlib.sha256(body).hexdigest()[:32]


def header_count(value: Any) -> int | None:
    """A producer or broker header read as a count: an int, or None if it is not one
    (headers are outside bytes: a bad value is ignored, never raised)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if 0 <= value < 2**31 else None
    if isinstance(value, bytes | str):
        text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
        text = text.strip()
        if text.isdigit() and len(text) < 10:
            return int(text)
    return None


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

    def __init__(self, url: str, queue: str, *, format: str = "json",
                 policy: RetryPolicy | None = None, prefetch: int | None = None,
                 declare: bool = False, arguments: dict[str, Any] | None = None,
                 dead_letter_exchange: str | None = None, dead_letter_routing_key: str | None = None,
                 reject_to_dlx: bool = False, delivery_limit: int | None = None,
                 reconnect_max_s: float = 10.0, headers_field: str | None = None,
                 dlx_by_policy: bool = False, gone_timeout_s: float = 60.0,
                 name: str | None = None) -> None:
        super().__init__(format=format, name=name or f"rabbitmq:{queue}")
        if not queue:
            raise ConfigError("RabbitMQ source: queue name is empty")
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
        limit = delivery_limit if delivery_limit is not None else self.arguments.get(
            "x-delivery-limit")
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

    # -- connection ------------------------------------------------------------------

    def configure(self, *, max_inflight: int, error_sink: bool,
                  keepalive_s: float = 30.0) -> None:
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
                "x-dead-letter-exchange); ackflow will not drop poison messages")
        self._owner = threading.get_ident()
        try:
            self._connect()
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - a clear message at start
            raise ConfigError(f"source {self.name!r}: cannot connect to {self.where}: "
                              f"{type(e).__name__}: {redact(str(e))}") from None
        return 0

    def _connect(self) -> None:
        import pika
        from pika.exceptions import ChannelClosedByBroker

        params = pika.URLParameters(self.url)
        params.connection_attempts = 1
        params.socket_timeout = 5
        params.blocked_connection_timeout = 60
        conn = pika.BlockingConnection(params)
        try:
            ch = conn.channel()
            try:
                if self.declare:
                    ch.queue_declare(self.queue, durable=True, arguments=self.arguments or None)
                else:
                    ch.queue_declare(self.queue, passive=True)
            except ChannelClosedByBroker as e:
                if e.reply_code == 404:
                    raise QueueMissing(f"source {self.name!r}: queue {self.queue!r} does not "
                                       f"exist on {self.where}; create it or pass "
                                       "declare=True") from None
                raise ConfigError(f"source {self.name!r}: cannot use queue {self.queue!r}: "
                                  f"{e.reply_text}") from None
            if self._gen == 0:
                self._learn_queue_type(conn)
            if self._gen == 0 and not self._error_sink:
                self._check_dead_letter_route(conn)
            if self.dead_letter_exchange:
                ch.confirm_delivery()
            # never past the window (or this source's share of a merged flow's): law 6
            consumers, prefetch = ((1, min(self.prefetch, self._window)) if self.prefetch
                                   else consumer_prefetch(self._window))
            ch.basic_qos(prefetch_count=prefetch)  # per consumer (AMQP's global=False)
            ch.add_on_cancel_callback(self._on_cancelled)
            tags = []
            for _ in range(0 if self._stopped_consuming else consumers):
                # one channel: one space of delivery tags
                tags.append(ch.basic_consume(self.queue, self._on_message, auto_ack=False))
        except BaseException:
            conn.close()
            raise
        self._conn, self._ch = conn, ch
        self._consumer_tags = tags
        self._cancelled.clear()
        self._cancelled_since = self._missing_since = None
        self._gen += 1
        self._backoff = 0.5
        if self._gen > 1:
            log.warning("source %r: reconnected to %s", self.name, self.where)

    def _learn_queue_type(self, conn: Any) -> None:
        """Quorum queues count deliveries themselves (``x-delivery-count`` on each
        redelivery); on any other queue that header is whatever the producer wrote, and
        ackflow counts. AMQP cannot read the type: it is learned from the broker's
        refusals (see ``amqp_probe``); if that fails, ackflow counts (never trusts)."""
        from ackflow.sources.amqp_probe import queue_argument

        given = self.arguments.get("x-queue-type") if self.declare else None
        if given is not None:
            self.queue_type = str(given)
            return
        if self.declare:  # declared with no type: classic
            self.queue_type = "classic"
            return
        learned = queue_argument(conn, self.queue, "x-queue-type")
        if not learned.known:
            log.warning("source %r: could not learn the type of queue %r (%s); delivery "
                        "counts are ackflow's own (a producer's x-delivery-count header is "
                        "never read)", self.name, self.queue, redact(learned.why)[:200])
            self.queue_type = "unknown"
            return
        self.queue_type = str(learned.value) if learned.value is not None else "classic"
        if self.queue_type == "quorum" and self.delivery_limit is None:
            limit = queue_argument(conn, self.queue, "x-delivery-limit", numeric=True)
            if limit.known and isinstance(limit.value, int):
                self.delivery_limit = limit.value
        if self.queue_type == "quorum" and self.delivery_limit is not None:
            dlx = queue_argument(conn, self.queue, "x-dead-letter-exchange")
            if dlx.known and dlx.value is None:
                log.warning(
                    "source %r: quorum queue %r has a delivery limit (%d) and no "
                    "x-dead-letter-exchange: RabbitMQ counts every give-back as a delivery "
                    "(a nack, a lost connection, a crash), and drops a message given back "
                    "past the limit. ackflow dead-letters what it holds at its last delivery "
                    "on a stop, but cannot after a crash: give the queue a dead-letter "
                    "exchange", self.name, self.queue, self.delivery_limit)

    @property
    def broker_counts(self) -> bool:
        """True when the broker's own ``x-delivery-count`` may be read (quorum queues)."""
        return self.queue_type == "quorum"

    def _check_dead_letter_route(self, conn: Any) -> None:
        """A dead letter must reach a queue, proven at start, or the run stops with one
        line. ``reject_to_dlx``: the queue must have an ``x-dead-letter-exchange`` (learned
        from the broker's refusals: AMQP cannot read arguments), and that exchange must
        exist and route the dead-letter routing key (``route_refusal``);
        ``dead_letter_exchange``: the same for ackflow's own copies."""
        from ackflow.sources.amqp_probe import queue_argument, route_refusal

        if self.dead_letter_exchange:
            exchange = self.dead_letter_exchange
            key = self.dead_letter_routing_key or self.queue
            what = "dead_letter_exchange"
        elif self.reject_to_dlx and not self.dlx_by_policy:
            learned = queue_argument(conn, self.queue, "x-dead-letter-exchange")
            if not learned.known:
                raise ConfigError(
                    f"source {self.name!r}: reject_to_dlx=True but the dead-letter exchange of "
                    f"queue {self.queue!r} could not be verified ({redact(learned.why)[:200]}); "
                    "use dead_letter_exchange='...' or flow.on_error(sink), or, if a policy "
                    "sets it, dlx_by_policy=True")
            if learned.value is None:
                raise ConfigError(
                    f"source {self.name!r}: reject_to_dlx=True but queue {self.queue!r} has no "
                    "x-dead-letter-exchange argument: rejected poison messages would be "
                    "dropped. Give the queue one, use dead_letter_exchange='...' or "
                    "flow.on_error(sink), or, if a policy sets it (invisible to AMQP), pass "
                    "dlx_by_policy=True")
            exchange = str(learned.value)
            rk = queue_argument(conn, self.queue, "x-dead-letter-routing-key")
            key = str(rk.value) if rk.known and rk.value is not None else self.queue
            what = f"queue {self.queue!r}'s x-dead-letter-exchange"
        else:
            return
        why = route_refusal(conn, exchange, key)
        if why is not None:
            raise ConfigError(f"source {self.name!r}: dead letters would be lost: {what} "
                              f"{exchange!r}: {why}")

    def _on_message(self, ch: Any, method: Any, props: Any, body: bytes) -> None:
        raw = props.headers if isinstance(props.headers, dict) else {}
        headers = {_text(k): _text(v) for k, v in raw.items()}
        key = message_key(props.message_id, self._next_unnamed)
        # A quorum queue writes x-delivery-count on each redelivery; a first delivery (and
        # any message of another queue type) carries the producer's header, if any, which
        # must not count (a header of 0 kept a poison message alive forever)
        before = (header_count(raw.get("x-delivery-count"))
                  if self.broker_counts and method.redelivered else None)
        seen_key = retry_key(props.message_id, body)
        backs = self._backs.pop(seen_key, 0)  # given back by this process: not spent
        if before is not None:  # quorum queue: deliveries before this one; the broker
            count = before + 1  # spends one per give-back too, and drops at its limit
        else:  # counted here, by message id or body digest
            count = max(self._seen.get(seen_key, 0) + 1 - backs, 1)
            if method.redelivered and not backs:
                count = max(count, 2)
            self._seen[seen_key] = count
            self._seen.move_to_end(seen_key)
            if len(self._seen) > SEEN_MAX:
                self._seen.popitem(last=False)
        handle = (self._gen, method.delivery_tag)
        self._retry_keys[handle] = seen_key
        if len(self._retry_keys) > RETRY_KEYS_MAX:
            self._retry_keys.popitem(last=False)
        d = Delivery(0, key, body, headers, count, handle=handle)
        self._outstanding[method.delivery_tag] = d
        self._buffer.append(d)

    def _next_unnamed(self) -> str:
        return f"{self._unnamed_prefix}{next(self._unnamed)}"

    def _lose_connection(self, why: BaseException) -> None:
        """The channel is gone: everything on it is the broker's again."""
        log.warning("source %r: lost the connection to %s (%s: %s); reconnecting",
                    self.name, self.where, type(why).__name__, redact(str(why)))
        if self._held_acks:
            # written and settled, but the broker never heard the ack: it delivers them
            # again, and keyed sinks write their rows in place
            log.warning("source %r: %d held acks were not sent before the channel died; "
                        "those messages come again", self.name, len(self._held_acks))
            self.stats["unsent_acks"] += len(self._held_acks)
            self._unsent.extend(self._outstanding[t] for t in sorted(self._held_acks)
                                if t in self._outstanding)
            self._held_acks.clear()
        buffered = {id(d) for d in self._buffer}
        handed = [d for d in self._outstanding.values() if id(d) not in buffered]
        self._lost.extend(d for d in handed if not d.settled)
        self.stats["lost"] += len(handed)
        self._outstanding.clear()
        self._buffer.clear()
        self._delayed.clear()
        conn, self._conn, self._ch = self._conn, None, None
        self._gen += 1  # no handle of the dead channel matches any more
        try:
            if conn is not None and conn.is_open:
                conn.close()
        except Exception:  # noqa: BLE001 - it is dead already
            pass
        self._next_connect = time.monotonic() + self._backoff
        self._backoff = min(self.reconnect_max_s, self._backoff * 2)

    def _ensure(self) -> bool:
        if self._ch is not None:
            return True
        if time.monotonic() < self._next_connect:
            return False
        try:
            faults.point("source.reconnect")
            self._connect()
            return True
        except Exception as e:  # noqa: BLE001 - retried with backoff
            self._gone_check(isinstance(e, QueueMissing), "after a reconnection")
            log.warning("source %r: cannot reconnect to %s yet: %s", self.name, self.where,
                        redact(str(e)))
            self._next_connect = time.monotonic() + self._backoff
            self._backoff = min(self.reconnect_max_s, self._backoff * 2)
            return False

    def _gone_check(self, missing: bool, when: str) -> None:
        """Count how long the queue has been missing; past ``gone_timeout_s`` stop the run
        with one line (:class:`SourceGone`)."""
        if not missing:
            self._missing_since = None
            return
        now = time.monotonic()
        self._missing_since = self._missing_since or now
        if now - self._missing_since >= self.gone_timeout_s:
            raise SourceGone(f"source {self.name!r}: queue {self.queue!r} does not exist on "
                             f"{self.where} any more ({when}; deleted?), for "
                             f"{now - self._missing_since:.0f} s; stopping")

    def _on_cancelled(self, frame: Any) -> None:
        """The broker cancelled a consumer (``basic.cancel``: the queue was deleted, or
        the consumer cancelled on the broker's side). pika calls this while it processes
        events, on the owner's thread; :meth:`_reconsume` acts on it."""
        tag = frame.method.consumer_tag
        if tag not in self._consumer_tags:
            return
        self._consumer_tags.remove(tag)
        self._cancelled.add(tag)
        if self._cancelled_since is None:
            self._cancelled_since = time.monotonic()
            self._next_consume = 0.0
            self.stats["cancelled_by_broker"] += 1
            log.warning("source %r: the broker cancelled the consumer of queue %r on %s "
                        "(basic.cancel: the queue was deleted, or its consumer cancelled); "
                        "consuming again when the queue is there (waiting up to %.0f s)",
                        self.name, self.queue, self.where, self.gone_timeout_s)

    def _reconsume(self) -> None:
        """After a ``basic.cancel``: consume again on the same channel once the queue
        exists (the deliveries in flight keep their tags on it), checked with a passive
        declaration on a channel of its own (a 404 closes the channel it is made on)."""
        from pika.exceptions import ChannelClosedByBroker

        if not self._cancelled or self._ch is None or time.monotonic() < self._next_consume:
            return
        if self._stopped_consuming:
            self._cancelled.clear()
            self._cancelled_since = None
            return
        missing = False
        try:
            probe = self._conn.channel()
            try:
                probe.queue_declare(self.queue, passive=True)
            finally:
                if probe.is_open:
                    probe.close()
        except ChannelClosedByBroker as e:
            missing = e.reply_code == 404
            if not missing:
                log.warning("source %r: cannot check queue %r: %s", self.name, self.queue,
                            redact(str(e)))
        except Exception as e:  # noqa: BLE001 - the connection itself: handled as a loss
            self._lose_connection(e)
            return
        if not missing:
            tags: list[str] = []
            if not self._broker(self._consume, len(self._cancelled), tags):
                return
            waited = time.monotonic() - (self._cancelled_since or time.monotonic())
            self._consumer_tags.extend(tags)
            self._cancelled.clear()
            self._cancelled_since = self._missing_since = None
            self.stats["reconsumed"] += 1
            self._gone_backoff = 0.5
            log.warning("source %r: consuming queue %r again after %.1f s", self.name,
                        self.queue, waited)
            return
        self._next_consume = time.monotonic() + self._gone_backoff
        self._gone_backoff = min(self.reconnect_max_s, self._gone_backoff * 2)
        self._gone_check(True, "the broker cancelled its consumer")

    def _consume(self, n: int, tags: list[str]) -> None:
        for _ in range(n):
            tags.append(self._ch.basic_consume(self.queue, self._on_message, auto_ack=False))

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

    def pull(self, max_messages: int, timeout: float) -> list[Delivery]:
        deadline = time.monotonic() + timeout
        self._service()
        self._reconsume()
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
        return out

    def status(self) -> dict[str, object]:
        return {"kind": "RabbitMQ queue", "url": self.where, "queue": self.queue,
                "retries_waiting": len(self._delayed), "buffered": len(self._buffer),
                "unsettled_on_channel": len(self._outstanding),
                "dead_letters_refused": self.stats["dead_letters_refused"],
                "connected": self.connected,
                "cancelled_by_broker": self.stats["cancelled_by_broker"]}

    @property
    def connected(self) -> bool:
        """A channel, and no consumer the broker cancelled waiting to consume again."""
        return self._ch is not None and not self._cancelled

    @property
    def retries_waiting(self) -> int:
        """Failed deliveries whose nack waits for its backoff (held on the channel)."""
        return len(self._delayed)

    def take_lost(self) -> list[Delivery]:
        lost, self._lost = self._lost, []
        return lost

    def take_unsent_acks(self) -> list[Delivery]:
        unsent, self._unsent = self._unsent, []
        return unsent

    def _current(self, deliveries: Sequence[Delivery]) -> tuple[list[int], list[Delivery]]:
        """Split into tags of the current channel and stale deliveries."""
        tags, stale = [], []
        for d in deliveries:
            if self._live(d):
                tags.append(_handle(d)[1])
            else:
                stale.append(d)
        if stale:
            self.stats["stale"] += len(stale)
            log.warning("source %r: %d settlements for deliveries of a closed channel are "
                        "dropped; the broker delivers those messages again", self.name,
                        len(stale))
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
            for tag in list(itertools.islice(self._outstanding, head)):
                del self._outstanding[tag]
                held.discard(tag)
                sent.add(tag)
            self.stats["multiple_acks"] += 1
        if force:
            for tag in sorted(held):
                if not self._call("rabbitmq.ack", "basic_ack", delivery_tag=tag):
                    return None
                self._outstanding.pop(tag, None)
                held.discard(tag)
                sent.add(tag)
                self.stats["acks"] += 1
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
        self._forget(deliveries)
        tags, stale = self._current(deliveries)
        if tags:
            done = self._settle_tags(tags, "ack")
            if len(done) < len(tags):
                # the connection died mid-way: what was not acked comes back from the broker
                live = {id(d) for d in stale}
                stale += [d for d in deliveries if id(d) not in live
                          and _handle(d)[1] not in done]
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
        gen, tag = _handle(d)
        return gen == self._gen and self._ch is not None and tag in self._outstanding

    def _schedule_nacks(self, failures: Sequence[tuple[Delivery, Failure]], backoff: bool) -> None:
        now = time.monotonic()
        for d, _ in failures:
            gen, tag = _handle(d)
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
            import pika

            refused: set[int] = set()
            for d, f in dead:
                headers = {**d.headers, "x-ackflow-step": f.step, "x-ackflow-error": f.error[:1000],
                           "x-ackflow-deliveries": d.delivery_count, "x-ackflow-queue": self.queue}
                props = pika.BasicProperties(delivery_mode=2, headers=headers,
                                             message_id=producer_id(d.key))
                rk = self.dead_letter_routing_key or self.queue
                try:
                    if self._ch is None:
                        raise pika.exceptions.ChannelClosed(0, "channel is gone")
                    faults.point("rabbitmq.dead_letter")
                    self._ch.basic_publish(self.dead_letter_exchange, rk, d.body, props,
                                           mandatory=True)
                except pika.exceptions.UnroutableError:
                    log.error("source %r: dead letter of %s is unroutable on exchange %r; "
                              "nacking it instead", self.name, d.key, self.dead_letter_exchange)
                    refused.add(id(d))
                    self.stats["dead_letters_refused"] += 1
                except pika.exceptions.NackError:
                    # the broker refused this one message (a full dead-letter queue with
                    # x-overflow=reject-publish): its failure, not the connection's
                    log.error("source %r: the broker refused the dead letter of %s on exchange "
                              "%r (basic.nack: a full dead-letter queue?); nacking it, it is "
                              "retried after the backoff", self.name, d.key,
                              self.dead_letter_exchange)
                    refused.add(id(d))
                    self.stats["dead_letters_refused"] += 1
                except (pika.exceptions.AMQPError, OSError, faults.InjectedFault) as e:
                    if self._ch is not None:
                        self._lose_connection(e)
                    return refused, lost | {id(x) for x, _ in dead}
            ok = [d for d, _ in dead if id(d) not in refused]
            lost |= {id(d) for d in self._ack_now(ok)}
            self._schedule_nacks([(d, f) for d, f in dead if id(d) in refused], backoff=True)
            self.stats["dead_letters"] += len(ok)
            return refused, lost
        tags, _ = self._current([d for d, _ in dead])
        done = self._settle_tags(tags, "reject")
        for d, f in dead:
            if _handle(d)[1] not in done:
                lost.add(id(d))
                continue
            log.warning("source %r: message %s rejected to the queue's dead-letter exchange "
                        "after %d deliveries: %s", self.name, d.key, d.delivery_count, f)
        return set(), lost

    def nack(self, failures: Sequence[tuple[Delivery, Failure]]) -> None:
        self._schedule_nacks(failures, backoff=True)

    def release(self, deliveries: Sequence[Delivery]) -> None:
        """``basic.nack`` with requeue. On a quorum queue (RabbitMQ 3.10) every give-back
        counts as a delivery (a nack, a reject, a closed channel or a cancelled consumer
        alike, measured): see :meth:`unreleasable`. On a classic queue ackflow's own count
        leaves a give-back out: the message's next delivery counts as the one it gave
        back (a quorum queue's count is the broker's, which spends one)."""
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
        if self._stopped_consuming or not self._is_owner():
            return []
        self._stopped_consuming = True
        if self._ch is not None:  # what arrived already reaches the buffer first
            self._broker(self._conn.process_data_events, time_limit=0)
        for tag in self._consumer_tags:
            if self._ch is None or not self._broker(self._ch.basic_cancel, tag):
                break
        self._consumer_tags = []
        self._cancelled.clear()  # nothing to consume again: the run is ending
        self._cancelled_since = None
        left = [d for d in self._buffer if self._live(d)]
        self._buffer.clear()
        return left

    def unreleasable(self, deliveries: Sequence[Delivery]) -> list[Delivery]:
        """On a quorum queue with a delivery limit, the deliveries past it: a give-back
        would make the broker drop them (or dead-letter them without provenance)."""
        if not self.broker_counts or self.delivery_limit is None:
            return []
        return [d for d in deliveries if self._live(d) and self.exhausted(d)
                and d.delivery_count > self.delivery_limit]

    def keepalive(self, deliveries: Sequence[Delivery]) -> None:
        if self._ch is not None:
            self._broker(self._conn.process_data_events, time_limit=0)
        self._service()
        self._reconsume()

    def close(self) -> None:
        self._service()
        if self._held_acks and self._ch is not None:
            self._send_acks(force=True)
        conn, self._conn, self._ch = self._conn, None, None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # noqa: BLE001 - unsettled messages return to the queue
                pass


def _text(v: Any) -> str:
    """A header value as text, whatever its AMQP type (bytes, nested tables, lists,
    decimals, timestamps): total, never raises."""
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if isinstance(v, str):
        return v
    try:
        return str(v)
    except Exception:  # noqa: BLE001 - a value whose __str__ fails is still a value
        return f"<unprintable {type(v).__name__}>"


def _handle(d: Delivery) -> tuple[int, int]:
    """A delivery's channel generation and delivery tag (the handle this source gave it)."""
    return cast(tuple[int, int], d.handle)
