"""Read and replay RabbitMQ dead letters: ``ackflow dlq peek|replay``.

A RabbitMQ source dead-letters a message it gave up on either through
``dead_letter_exchange=`` (a copy with ackflow's provenance headers ``x-ackflow-step``,
``-error``, ``-deliveries``, ``-queue``) or with ``reject_to_dlx=True`` into the queue's
own dead-letter exchange (the broker's ``x-death`` headers). Either way the dead
letters wait in an ordinary queue. This module reads that queue and sends its messages
back for another try.

**Peek leaves the queue as it was.** Every way AMQP has of looking at a message and
giving it back (``basic.get`` then ``basic.nack(requeue=True)``, or closing the channel
before the ack) marks the message ``redelivered``, and on a quorum queue spends one of
its deliveries (the broker's ``x-delivery-count`` grows, and a queue with
``x-delivery-limit`` drops or dead-letters it at the limit): measured on the broker
in ``tests/test_dlq.py``. So :func:`peek` never gives a message back: it *rotates* the
queue. It takes each message that was in the queue when it started, publishes an exact
copy (body, properties, headers; only the broker's own ``x-delivery-count`` is left
out) to the tail of the same queue with publisher confirms, and acks the original only
after the broker confirmed the copy. After one full turn the queue holds the same
messages in the same order, none of them ``redelivered``, none with a delivery spent.
The cost: peek reads the whole queue once (400 to 800 messages a second on a small
machine), whatever ``count`` shows; a crash mid-peek leaves at most ``window`` messages
twice. Per-message TTLs (``expiration``) start again, and a message whose
``user_id`` is not the peeking user's is refused by the broker (peek stops and says so).

**Replay** takes dead letters from the head of the queue, strips what describes their
past lives (ackflow's ``x-ackflow-*`` headers; the broker's ``x-death``,
``x-first-death-*``, ``x-last-death-*`` and ``x-delivery-count``), keeps everything
else (the ``message_id`` above all: ackflow's identity of the message, so a sink keyed
by it writes the replayed message's rows in place), and publishes it to the target
queue or exchange with publisher confirms and ``mandatory`` set. The dead letter is
acked only after the broker confirmed its copy: a crash (or a lost connection) in
between leaves the dead letter in its queue and its copy at the target, so a crash can
duplicate at most the one message in hand (or the ``window`` in hand), never lose one;
its ``message_id`` makes the duplicate the same identity for ackflow. A copy the broker
refuses (unroutable, or a ``basic.nack``) stops the replay and the dead letter stays in
its queue.

Neither touches messages that arrive while it runs (peek stops at its marker, replay
after the number of messages the queue held when it started); a message that arrives
during a peek ends up ahead of the older ones, which are behind the marker by then.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ackflow import faults
from ackflow.core.errors import ConfigError
from ackflow.core.secrets import redact
from ackflow.sources.amqp_probe import PROBE_HEADER as PROBE

#: ackflow's provenance headers (:data:`ackflow.sources.rabbitmq_keys.PROVENANCE`)
ACKFLOW_PREFIX = "x-ackflow-"
#: headers the broker writes about a message's past (dead-lettering and deliveries)
BROKER_HEADERS = ("x-death", "x-delivery-count")
BROKER_PREFIXES = ("x-first-death-", "x-last-death-")

#: the header of :func:`peek`'s end-of-turn marker
PEEK_END = "x-ackflow-peek-end"

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class DeadLetter:
    """One dead letter as :func:`peek` saw it.

    ``step``, ``error``, ``deliveries`` and ``source_queue`` come from ackflow's
    ``x-ackflow-*`` headers; for a message the broker dead-lettered
    (``reject_to_dlx=True``, no ackflow headers) ``source_queue`` and ``reason`` come
    from its first ``x-death`` entry and ``deliveries`` is None.
    """

    message_id: str | None
    body: bytes
    headers: dict[str, Any] = field(default_factory=dict)
    step: str | None = None
    error: str | None = None
    deliveries: int | None = None
    source_queue: str | None = None
    reason: str | None = None

    def preview(self, limit: int = 200) -> str:
        """The body as text (undecodable bytes as ``\\ufffd``), cut to ``limit`` chars."""
        text = self.body.decode("utf-8", errors="replace")
        return text if len(text) <= limit else text[:limit] + f"... ({len(self.body):,} bytes)"

    def as_json(self) -> dict[str, Any]:
        return {
            "message_id": self.message_id,
            "step": self.step,
            "error": self.error,
            "deliveries": self.deliveries,
            "source_queue": self.source_queue,
            "reason": self.reason,
            "body": self.preview(10_000),
            "headers": {k: _plain(v) for k, v in self.headers.items()},
        }


@dataclass
class Replayed:
    """What :func:`replay` did: ``replayed`` messages confirmed at the target (and their
    dead letters acked), the target it resolved, and ``left`` messages still queued."""

    replayed: int = 0
    target: str = ""
    left: int = 0
    message_ids: list[str | None] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {"replayed": self.replayed, "target": self.target, "left": self.left}


def dead_letter(props: Any, body: bytes) -> DeadLetter:
    """A :class:`DeadLetter` from a message's pika properties and body."""
    headers = dict(props.headers or {})
    text = {k: _text(v) for k, v in headers.items()}
    deliveries = None
    if "x-ackflow-deliveries" in headers:
        try:
            deliveries = int(text["x-ackflow-deliveries"])
        except ValueError:
            deliveries = None
    source_queue = text.get("x-ackflow-queue")
    reason = None
    deaths = headers.get("x-death")
    if isinstance(deaths, list) and deaths and isinstance(deaths[0], dict):
        source_queue = source_queue or _text(deaths[0].get("queue"))
        reason = _text(deaths[0].get("reason"))
    return DeadLetter(
        message_id=props.message_id,
        body=body,
        headers=headers,
        step=text.get("x-ackflow-step"),
        error=text.get("x-ackflow-error"),
        deliveries=deliveries,
        source_queue=source_queue,
        reason=reason,
    )


def stripped(headers: dict[str, Any] | None) -> dict[str, Any]:
    """``headers`` without ackflow's provenance and the broker's dead-letter and delivery
    headers (what :func:`replay` sends on).

    >>> stripped({"x-ackflow-step": "parse", "x-death": [], "x-first-death-queue": "q",
    ...           "x-delivery-count": 3, "tenant": "a"})
    {'tenant': 'a'}
    """
    return {
        k: v
        for k, v in (headers or {}).items()
        if not k.startswith(ACKFLOW_PREFIX) and k not in BROKER_HEADERS and not k.startswith(BROKER_PREFIXES)
    }


#: copies :func:`peek` has in flight at once (a crash mid-peek leaves at most this many
#: messages twice in the queue)
PEEK_WINDOW = 500


def peek(
    url: str, queue: str, count: int = 10, *, window: int = PEEK_WINDOW, progress: Progress | None = None
) -> list[DeadLetter]:
    """The first ``count`` messages of ``queue``, leaving the queue as it was (see the
    module's docstring: the whole queue is rotated once, each copy confirmed before its
    original is acked; up to ``window`` copies are confirmed at a time).

    The turn ends at a marker message (header ``x-ackflow-peek-end``) published to the
    tail first and dropped when it comes round, so messages that expire meanwhile (such
    as the route probes a RabbitMQ source publishes with ``expiration`` 0) or arrive
    meanwhile do not shift the order. A marker left by a peek that crashed is dropped by
    the next peek or replay.
    """
    import uuid

    import pika

    if window < 1:
        raise ConfigError("peek: window must be at least 1")
    conn = _connect(url)
    try:
        total = _depth(conn, queue)
        ch = conn.channel()
        ch.confirm_delivery()
        seen: list[DeadLetter] = []
        if total == 0:
            return seen
        mark = uuid.uuid4().hex
        ch.basic_publish(
            "", queue, b"", pika.BasicProperties(delivery_mode=2, headers={PEEK_END: mark}), mandatory=True
        )
        n, turned = 0, False
        while not turned:
            batch: list[tuple[int, str, bytes, Any]] = []
            while len(batch) < window:
                method, props, body = ch.basic_get(queue, auto_ack=False)
                if method is None:
                    turned = True  # someone else took the rest (and the marker)
                    break
                headers = props.headers or {}
                if PEEK_END in headers or PROBE in headers:
                    ch.basic_ack(method.delivery_tag)  # a marker (ours ends the turn), a probe
                    turned = _text(headers.get(PEEK_END)) == mark
                    if turned:
                        break
                    continue
                if len(seen) < count:
                    seen.append(dead_letter(props, body))
                kept = {k: v for k, v in headers.items() if k != "x-delivery-count"}
                batch.append((method.delivery_tag, queue, body, _props(props, kept or None)))
            if not batch:
                continue
            failed = _send(url, ch, "", batch)
            if failed:
                raise ConfigError(
                    f"peek: the broker did not take the copy of message "
                    f"{n + min(failed) + 1} of queue {queue!r} "
                    f"({next(iter(failed.values()))}); the messages not copied "
                    "are given back to the queue (marked redelivered)"
                )
            faults.point("dlq.peek_copied")
            for tag, *_ in batch:
                ch.basic_ack(tag)
            n += len(batch)
            if progress is not None:
                progress(n, total)
        return seen
    finally:
        _close(conn)


def replay(
    url: str,
    queue: str,
    to: str,
    *,
    count: int | None = None,
    routing_key: str | None = None,
    window: int = 1,
    progress: Progress | None = None,
) -> Replayed:
    """Move up to ``count`` dead letters (default: all that ``queue`` held at the start)
    to ``to``, each with its past stripped (:func:`stripped`) and its ``message_id``
    kept; each dead letter is acked only after the broker confirmed its copy.

    ``to`` is a queue (published through the default exchange) or an exchange
    (published with ``routing_key``, or else the queue ackflow dead-lettered the
    message from: its ``x-ackflow-queue`` or first ``x-death`` header). Write
    ``queue:NAME`` or ``exchange:NAME`` when a queue and an exchange share the name.

    ``window`` copies are confirmed at a time (default 1: a crash duplicates at most
    one message; a larger window is faster, and a crash then duplicates at most that
    many, each with its own ``message_id``).
    """
    if count is not None and count < 1:
        raise ConfigError("replay: count must be at least 1")
    if window < 1:
        raise ConfigError("replay: window must be at least 1")
    conn = _connect(url)
    done = Replayed()
    try:
        exchange, fixed_key, done.target = _target(conn, to, routing_key)
        total = _depth(conn, queue)
        todo = total if count is None else min(count, total)
        ch = conn.channel()
        ch.confirm_delivery()
        empty = False
        while done.replayed < todo and not empty:
            batch: list[tuple[int, str, bytes, Any]] = []
            ids: list[str | None] = []
            while len(batch) < min(window, todo - done.replayed):
                method, props, body = ch.basic_get(queue, auto_ack=False)
                if method is None:
                    empty = True
                    break
                if PEEK_END in (props.headers or {}) or PROBE in (props.headers or {}):
                    ch.basic_ack(method.delivery_tag)  # a stale peek marker, a route probe:
                    continue  # no message of anyone's
                key = fixed_key
                if key is None:  # to an exchange, no routing key given: where it came from
                    key = dead_letter(props, body).source_queue
                    if key is None:
                        _give_back(ch, batch, method.delivery_tag)
                        raise ConfigError(
                            f"replay: message {props.message_id or '(no message_id)'} carries "
                            "no x-ackflow-queue or x-death header to route it by: give "
                            f"--routing-key ({done.replayed} replayed before it)"
                        )
                batch.append((method.delivery_tag, key, body, _props(props, stripped(props.headers) or None)))
                ids.append(props.message_id)
            if not batch:
                continue
            failed = _send(url, ch, exchange, batch)
            faults.point("dlq.replay_published")
            for i, (tag, *_) in enumerate(batch):
                if i in failed:
                    ch.basic_nack(tag, requeue=True)
                else:
                    ch.basic_ack(tag)
                    done.replayed += 1
                    done.message_ids.append(ids[i])
            if failed:
                i = min(failed)
                raise ConfigError(
                    f"replay: message {ids[i] or '(no message_id)'} was not taken at "
                    f"{done.target} (routing key {batch[i][1]!r}): {failed[i]}; it stays in "
                    f"{queue!r} ({done.replayed} replayed)"
                )
            if progress is not None:
                progress(done.replayed, todo)
        done.left = _depth(conn, queue)
        return done
    finally:
        _close(conn)


def _send(url: str, ch: Any, exchange: str, batch: list[tuple[int, str, bytes, Any]]) -> dict[int, str]:
    """Publish ``batch`` ((tag, routing key, body, properties)) with publisher confirms
    and ``mandatory``; index -> why, for each copy the broker did not confirm. One copy
    goes on ``ch`` (a confirming channel), more on a connection of their own with
    asynchronous confirms (one round of the broker's fsync for all of them)."""
    import pika

    if len(batch) == 1:
        _, key, body, props = batch[0]
        try:
            ch.basic_publish(exchange, key, body, props, mandatory=True)
        except pika.exceptions.UnroutableError:
            return {0: "unroutable: nothing is bound for it"}
        except pika.exceptions.NackError:
            return {0: "the broker refused it (basic.nack)"}
        return {}
    from ackflow.sinks.rabbitmq import publish_confirmed

    return publish_confirmed(url, exchange, [(k, b, p) for _, k, b, p in batch], window=len(batch))


def _give_back(ch: Any, batch: list[tuple[int, str, bytes, Any]], tag: int) -> None:
    for t, *_ in batch:
        ch.basic_nack(t, requeue=True)
    ch.basic_nack(tag, requeue=True)


def _connect(url: str) -> Any:
    import pika

    try:
        return pika.BlockingConnection(pika.URLParameters(url))
    except Exception as e:  # noqa: BLE001 - one line that says what to fix
        raise ConfigError(f"cannot connect to {redact(url)}: {type(e).__name__}: {redact(str(e))}") from None


def _close(conn: Any) -> None:
    try:
        conn.close()
    except Exception:  # noqa: BLE001 - already closed by the broker
        pass


def _depth(conn: Any, queue: str) -> int:
    """The queue's ready messages (a passive declare on a channel of its own, since a
    missing queue closes the channel)."""
    import pika

    ch = conn.channel()
    try:
        ok = ch.queue_declare(queue, passive=True)
    except pika.exceptions.ChannelClosedByBroker:
        raise ConfigError(f"queue {queue!r} does not exist") from None
    ch.close()
    return int(ok.method.message_count)


def _exists(conn: Any, kind: str, name: str) -> bool:
    import pika

    ch = conn.channel()
    try:
        if kind == "queue":
            ch.queue_declare(name, passive=True)
        else:
            ch.exchange_declare(name, passive=True)
    except pika.exceptions.ChannelClosedByBroker:
        return False
    ch.close()
    return True


def _target(conn: Any, to: str, routing_key: str | None) -> tuple[str, str | None, str]:
    """(exchange, routing key or None for "per message", description) for ``to``."""
    kind, sep, name = to.partition(":")
    if not (sep and kind in ("queue", "exchange")):
        kind, name = "", to
    if not name:
        raise ConfigError("replay: --to needs a queue or exchange name")
    queue = kind in ("", "queue") and _exists(conn, "queue", name)
    exchange = kind in ("", "exchange") and _exists(conn, "exchange", name)
    if queue and exchange:
        raise ConfigError(
            f"replay: {name!r} is both a queue and an exchange: write "
            f"--to queue:{name} or --to exchange:{name}"
        )
    if queue:
        if routing_key is not None:
            raise ConfigError("replay: --routing-key is for an exchange; --to names a queue")
        return "", name, f"queue {name!r}"
    if exchange:
        return name, routing_key, f"exchange {name!r}"
    raise ConfigError(f"replay: there is no {kind or 'queue or exchange'} named {name!r}")


def _props(props: Any, headers: dict[str, Any] | None) -> Any:
    """A copy of ``props`` with ``headers`` instead of its own."""
    import pika

    keep = (
        "content_type",
        "content_encoding",
        "delivery_mode",
        "priority",
        "correlation_id",
        "reply_to",
        "expiration",
        "message_id",
        "timestamp",
        "type",
        "user_id",
        "app_id",
        "cluster_id",
    )
    return pika.BasicProperties(headers=headers, **{k: getattr(props, k) for k in keep})


def _text(v: Any) -> str:
    if isinstance(v, bytes):
        return v.decode("utf-8", errors="replace")
    return str(v)


def _plain(v: Any) -> Any:
    """A header value as JSON can carry it."""
    if isinstance(v, bytes):
        return v.decode("utf-8", errors="replace")
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_plain(x) for x in v]
    if isinstance(v, int | float | str | bool) or v is None:
        return v
    return str(v)


def print_progress(what: str) -> Progress:
    """A progress callback printing ``what n/total`` to stderr every 1,000 messages."""

    def show(n: int, total: int) -> None:
        if n % 1000 == 0 or n == total:
            print(f"{what} {n:,}/{total:,}", file=sys.stderr, flush=True)

    return show
