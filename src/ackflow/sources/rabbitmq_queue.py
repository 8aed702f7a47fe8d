"""The queue as the broker sees it, for the RabbitMQ source: the connection and its
consumers, what is learned and checked at start (the queue's type and delivery limit,
where its dead letters go), and what happens when the queue goes away (``basic.cancel``,
deletion). Functions of the source (:class:`~ackflow.sources.rabbitmq.RabbitMQSource`),
run on its owner's thread."""

from __future__ import annotations

import heapq
import logging
import time
from typing import TYPE_CHECKING, Any

from ackflow import faults
from ackflow.core.errors import ConfigError, SourceGone
from ackflow.core.ledger import Failure
from ackflow.core.policy import dead_letter_retry_after
from ackflow.core.secrets import redact
from ackflow.core.settlement import Delivery
from ackflow.sources import rabbitmq_blocks as blocks
from ackflow.sources.rabbitmq_keys import consumer_prefetch, producer_id

if TYPE_CHECKING:
    from ackflow.sources.rabbitmq import RabbitMQSource

log = logging.getLogger("ackflow.sources.rabbitmq")


class QueueMissing(ConfigError):
    """The queue does not exist (at start: the run does not start; later: wait for it,
    up to ``gone_timeout_s``)."""


def connect(src: RabbitMQSource) -> None:
    import pika
    from pika.exceptions import ChannelClosedByBroker

    settings = {"connection_attempts": 1, "socket_timeout": 5, "blocked_connection_timeout": 60}
    conn: Any
    if src.consumer == "process":
        from ackflow.sources.rabbitmq_remote import RemoteConnection

        conn = RemoteConnection(src.url, settings)
    else:
        params = pika.URLParameters(src.url)
        for k, v in settings.items():
            setattr(params, k, v)
        conn = pika.BlockingConnection(params)
    try:
        ch = conn.channel()
        try:
            if src.declare:
                ch.queue_declare(src.queue, durable=True, arguments=src.arguments or None)
            else:
                ch.queue_declare(src.queue, passive=True)
        except ChannelClosedByBroker as e:
            if e.reply_code == 404:
                raise QueueMissing(
                    f"source {src.name!r}: queue {src.queue!r} does not "
                    f"exist on {src.where}; create it or pass "
                    "declare=True"
                ) from None
            raise ConfigError(
                f"source {src.name!r}: cannot use queue {src.queue!r}: {e.reply_text}"
            ) from None
        if src._gen == 0:
            learn_queue_type(src, conn)
        if src._gen == 0 and not src._error_sink:
            check_dead_letter_route(src, conn)
        if src.dead_letter_exchange:
            ch.confirm_delivery()
        # never past the window (or this source's share of a merged flow's): law 6
        consumers, prefetch = (
            (1, min(src.prefetch, src._window)) if src.prefetch else consumer_prefetch(src._window)
        )
        ch.basic_qos(prefetch_count=prefetch)  # per consumer (AMQP's global=False)
        ch.add_on_cancel_callback(lambda frame: on_cancelled(src, frame))
        tags = []
        for _ in range(0 if src._stopped_consuming else consumers):
            # one channel: one space of delivery tags
            tags.append(ch.basic_consume(src.queue, src._callback, auto_ack=False))
    except BaseException:
        conn.close()
        raise
    src._conn, src._ch = conn, ch
    src._consumer_tags = tags
    src._cancelled.clear()
    src._cancelled_since = src._missing_since = None
    src._gen += 1
    src._backoff = 0.5
    if src._gen > 1:
        log.warning("source %r: reconnected to %s", src.name, src.where)


def lose_connection(src: RabbitMQSource, why: BaseException) -> None:
    """The channel is gone: everything on it is the broker's again."""
    log.warning(
        "source %r: lost the connection to %s (%s: %s); reconnecting",
        src.name,
        src.where,
        type(why).__name__,
        redact(str(why)),
    )
    if src._held_acks:
        # written and settled, but the broker never heard the ack: it delivers them
        # again, and keyed sinks write their rows in place
        log.warning(
            "source %r: %d held acks were not sent before the channel died; those messages come again",
            src.name,
            len(src._held_acks),
        )
        src.stats["unsent_acks"] += len(src._held_acks)
        unsent, counts = blocks.answer(
            src, [src._outstanding[t] for t in sorted(src._held_acks) if t in src._outstanding]
        )
        src._unsent.extend(unsent)
        src._unsent_n.update(counts)
        src._held_acks.clear()
    buffered = {id(d) for d in (*src._buffer, *src._again)}  # never handed to the engine
    handed = [d for d in src._outstanding.values() if id(d) not in buffered]
    src._lost.extend(d for d in blocks.answer(src, handed)[0] if not d.settled)
    src.stats["lost"] += len(handed)
    src._outstanding.clear()
    src._buffer.clear()
    src._again.clear()
    src._block_of.clear()
    src._delayed.clear()
    give_up_held_dead(src, "went back with the channel")
    conn, src._conn, src._ch = src._conn, None, None
    src._gen += 1  # no handle of the dead channel matches any more
    try:
        if conn is not None and conn.is_open:
            conn.close()
    except Exception:  # noqa: BLE001 - it is dead already
        pass
    src._next_connect = time.monotonic() + src._backoff
    src._backoff = min(src.reconnect_max_s, src._backoff * 2)


def learn_queue_type(src: RabbitMQSource, conn: Any) -> None:
    """Quorum queues count deliveries themselves (``x-delivery-count`` on each
    redelivery); on any other queue that header is whatever the producer wrote, and
    ackflow counts. AMQP cannot read the type: it is learned from the broker's
    refusals (see ``amqp_probe``); if that fails, ackflow counts (never trusts)."""
    from ackflow.sources.amqp_probe import queue_argument

    given = src.arguments.get("x-queue-type") if src.declare else None
    if given is not None:
        src.queue_type = str(given)
        return
    if src.declare:  # declared with no type: classic
        src.queue_type = "classic"
        return
    learned = queue_argument(conn, src.queue, "x-queue-type")
    if not learned.known:
        log.warning(
            "source %r: could not learn the type of queue %r (%s); delivery "
            "counts are ackflow's own (a producer's x-delivery-count header is "
            "never read)",
            src.name,
            src.queue,
            redact(learned.why)[:200],
        )
        src.queue_type = "unknown"
        return
    src.queue_type = str(learned.value) if learned.value is not None else "classic"
    if src.queue_type == "quorum" and src.delivery_limit is None:
        limit = queue_argument(conn, src.queue, "x-delivery-limit", numeric=True)
        if limit.known and isinstance(limit.value, int):
            src.delivery_limit = limit.value
    if src.queue_type == "quorum" and src.delivery_limit is not None:
        dlx = queue_argument(conn, src.queue, "x-dead-letter-exchange")
        if dlx.known and dlx.value is None:
            log.warning(
                "source %r: quorum queue %r has a delivery limit (%d) and no "
                "x-dead-letter-exchange: RabbitMQ counts every give-back as a delivery "
                "(a nack, a lost connection, a crash), and drops a message given back "
                "past the limit. ackflow dead-letters what it holds at its last delivery "
                "on a stop, but cannot after a crash: give the queue a dead-letter "
                "exchange",
                src.name,
                src.queue,
                src.delivery_limit,
            )


def check_dead_letter_route(src: RabbitMQSource, conn: Any) -> None:
    """A dead letter must reach a queue, proven at start, or the run stops with one
    line. ``reject_to_dlx``: the queue must have an ``x-dead-letter-exchange`` (learned
    from the broker's refusals: AMQP cannot read arguments), and that exchange must
    exist and route the dead-letter routing key (``route_refusal``);
    ``dead_letter_exchange``: the same for ackflow's own copies."""
    from ackflow.sources.amqp_probe import queue_argument, route_refusal

    if src.dead_letter_exchange:
        exchange = src.dead_letter_exchange
        key = src.dead_letter_routing_key or src.queue
        what = "dead_letter_exchange"
    elif src.reject_to_dlx and not src.dlx_by_policy:
        learned = queue_argument(conn, src.queue, "x-dead-letter-exchange")
        if not learned.known:
            raise ConfigError(
                f"source {src.name!r}: reject_to_dlx=True but the dead-letter exchange of "
                f"queue {src.queue!r} could not be verified ({redact(learned.why)[:200]}); "
                "use dead_letter_exchange='...' or flow.on_error(sink), or, if a policy "
                "sets it, dlx_by_policy=True"
            )
        if learned.value is None:
            raise ConfigError(
                f"source {src.name!r}: reject_to_dlx=True but queue {src.queue!r} has no "
                "x-dead-letter-exchange argument: rejected poison messages would be "
                "dropped. Give the queue one, use dead_letter_exchange='...' or "
                "flow.on_error(sink), or, if a policy sets it (invisible to AMQP), pass "
                "dlx_by_policy=True"
            )
        exchange = str(learned.value)
        rk = queue_argument(conn, src.queue, "x-dead-letter-routing-key")
        key = str(rk.value) if rk.known and rk.value is not None else src.queue
        what = f"queue {src.queue!r}'s x-dead-letter-exchange"
    else:
        return
    why = route_refusal(conn, exchange, key)
    if why is not None:
        raise ConfigError(f"source {src.name!r}: dead letters would be lost: {what} {exchange!r}: {why}")


def gone_check(src: RabbitMQSource, missing: bool, when: str) -> None:
    """Count how long the queue has been missing; past ``gone_timeout_s`` stop the run
    with one line (:class:`SourceGone`)."""
    if not missing:
        src._missing_since = None
        return
    now = time.monotonic()
    src._missing_since = src._missing_since or now
    if now - src._missing_since >= src.gone_timeout_s:
        raise SourceGone(
            f"source {src.name!r}: queue {src.queue!r} does not exist on "
            f"{src.where} any more ({when}; deleted?), for "
            f"{now - src._missing_since:.0f} s; stopping"
        )


def on_cancelled(src: RabbitMQSource, frame: Any) -> None:
    """The broker cancelled a consumer (``basic.cancel``: the queue was deleted, or
    the consumer cancelled on the broker's side). pika calls this while it processes
    events, on the owner's thread; :meth:`_reconsume` acts on it."""
    tag = frame.method.consumer_tag
    if tag not in src._consumer_tags:
        return
    src._consumer_tags.remove(tag)
    src._cancelled.add(tag)
    if src._cancelled_since is None:
        src._cancelled_since = time.monotonic()
        src._next_consume = 0.0
        src.stats["cancelled_by_broker"] += 1
        log.warning(
            "source %r: the broker cancelled the consumer of queue %r on %s "
            "(basic.cancel: the queue was deleted, or its consumer cancelled); "
            "consuming again when the queue is there (waiting up to %.0f s)",
            src.name,
            src.queue,
            src.where,
            src.gone_timeout_s,
        )


def reconsume(src: RabbitMQSource) -> None:
    """After a ``basic.cancel``: consume again on the same channel once the queue
    exists (the deliveries in flight keep their tags on it), checked with a passive
    declaration on a channel of its own (a 404 closes the channel it is made on)."""
    from pika.exceptions import ChannelClosedByBroker

    if not src._cancelled or src._ch is None or time.monotonic() < src._next_consume:
        return
    if src._stopped_consuming:
        src._cancelled.clear()
        src._cancelled_since = None
        return
    missing = False
    try:
        probe = src._conn.channel()
        try:
            probe.queue_declare(src.queue, passive=True)
        finally:
            if probe.is_open:
                probe.close()
    except ChannelClosedByBroker as e:
        missing = e.reply_code == 404
        if not missing:
            log.warning("source %r: cannot check queue %r: %s", src.name, src.queue, redact(str(e)))
    except Exception as e:  # noqa: BLE001 - the connection itself: handled as a loss
        src._lose_connection(e)
        return
    if not missing:
        tags: list[str] = []
        if not src._broker(src._consume, len(src._cancelled), tags):
            return
        waited = time.monotonic() - (src._cancelled_since or time.monotonic())
        src._consumer_tags.extend(tags)
        src._cancelled.clear()
        src._cancelled_since = src._missing_since = None
        src.stats["reconsumed"] += 1
        src._gone_backoff = 0.5
        log.warning("source %r: consuming queue %r again after %.1f s", src.name, src.queue, waited)
        return
    src._next_consume = time.monotonic() + src._gone_backoff
    src._gone_backoff = min(src.reconnect_max_s, src._gone_backoff * 2)
    gone_check(src, True, "the broker cancelled its consumer")


def publish_dead_letters(src: RabbitMQSource, dead: list[tuple[Delivery, Failure]]) -> tuple[set[int], bool]:
    """Publish a copy of each dead delivery, with ackflow's provenance headers, to the
    source's ``dead_letter_exchange`` (confirmed, mandatory). Returns the ids of the
    deliveries the broker refused (unroutable, or ``basic.nack``: they are nacked and
    retried instead) and False if the connection died on the way (the loss is handled;
    the broker delivers them all again)."""
    import pika

    refused: set[int] = set()
    for d, f in dead:
        headers = {
            **d.headers,
            "x-ackflow-step": f.step,
            "x-ackflow-error": f.error[:1000],
            "x-ackflow-deliveries": d.delivery_count,
            "x-ackflow-queue": src.queue,
        }
        props = pika.BasicProperties(delivery_mode=2, headers=headers, message_id=producer_id(d.key))
        rk = src.dead_letter_routing_key or src.queue
        try:
            if src._ch is None:
                raise pika.exceptions.ChannelClosed(0, "channel is gone")
            faults.point("rabbitmq.dead_letter")
            src._ch.basic_publish(src.dead_letter_exchange, rk, d.body, props, mandatory=True)
        except pika.exceptions.UnroutableError:
            log.error(
                "source %r: dead letter of %s is unroutable on exchange %r; nacking it "
                "instead (at its last delivery: held, published again)",
                src.name,
                d.key,
                src.dead_letter_exchange,
            )
            refused.add(id(d))
            src.stats["dead_letters_refused"] += 1
        except pika.exceptions.NackError:
            # the broker refused this one message (a full dead-letter queue with
            # x-overflow=reject-publish): its failure, not the connection's
            log.error(
                "source %r: the broker refused the dead letter of %s on exchange "
                "%r (basic.nack: a full dead-letter queue?); nacking it, it is "
                "retried after the backoff (at its last delivery: held, published again)",
                src.name,
                d.key,
                src.dead_letter_exchange,
            )
            refused.add(id(d))
            src.stats["dead_letters_refused"] += 1
        except (pika.exceptions.AMQPError, OSError, faults.InjectedFault) as e:
            if src._ch is not None:
                src._lose_connection(e)
            return refused, False
    return refused, True


def hold_dead(src: RabbitMQSource, dead: list[tuple[Delivery, Failure]], tries: int) -> None:
    """Hold refused dead letters of messages at their last delivery (a nack would
    make the broker drop them) and publish them again after a backoff (0.5 s,
    doubling to 30 s)."""
    due = time.monotonic() + dead_letter_retry_after(tries)
    for d, f in dead:
        src._seq += 1
        heapq.heappush(src._dead_again, (due, src._seq, tries, d, f))
    if dead:
        log.warning(
            "source %r: %d messages at their last delivery whose dead letters %r refused "
            "are held on the channel and published again (a nack would make the broker "
            "drop them)",
            src.name,
            len(dead),
            src.dead_letter_exchange,
        )


def publish_held_dead(src: RabbitMQSource, until: float) -> None:
    """Publish the held dead letters due by ``until``; ack what the broker took."""
    due: list[tuple[int, Delivery, Failure]] = []
    while src._dead_again and src._dead_again[0][0] <= until:
        _, _, tries, d, f = heapq.heappop(src._dead_again)
        if src._live(d):
            due.append((tries, d, f))
    if not due:
        return
    items = [(d, f) for _, d, f in due]
    refused, alive = publish_dead_letters(src, items)
    if not alive:  # the connection died on the way: they went back with it
        give_up_held_dead(src, "went back with the channel", len(due))
        return
    ok = [(d, f) for d, f in items if id(d) not in refused]
    stale = {id(d) for d in src._ack_now([d for d, _ in ok])}
    src.stats["dead_letters"] += len(ok) - len(stale)
    src._late_dead.extend((d, f) for d, f in ok if id(d) not in stale)
    for tries, d, f in due:
        if id(d) in refused:
            hold_dead(src, [(d, f)], tries + 1)


def give_up_held_dead(src: RabbitMQSource, why: str, more: int = 0) -> None:
    if src._dead_again or more:
        log.error(
            "source %r: %d messages held for their dead letters (refused by %r) %s: at "
            "their last delivery, the broker drops them or moves them to the queue's "
            "own x-dead-letter-exchange",
            src.name,
            len(src._dead_again) + more,
            src.dead_letter_exchange,
            why,
        )
        src._dead_again.clear()
