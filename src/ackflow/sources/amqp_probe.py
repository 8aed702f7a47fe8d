"""What AMQP 0-9-1 will not say about a queue, learned from what it refuses.

AMQP has no call that reads a queue's arguments, but RabbitMQ refuses a declaration
whose arguments differ from the queue's and names the first difference with the
queue's current value ("inequivalent arg 'x-message-ttl' ...: received none but current
is the value '1000' of type 'signedint'"). :func:`queue_argument` declares the queue
with a probe value for one argument, adds each argument the refusal reveals, and
declares again, until the refusal names the probed argument. The probe value is one no
queue has (a random name), so a declaration never goes through and nothing is changed;
each probe uses a channel of its own (a refusal closes it).
"""

from __future__ import annotations

import logging
import re
import uuid
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("ackflow.sources.rabbitmq")

#: Refusals followed before giving up (a queue has a handful of arguments).
MAX_STEPS = 24

_REFUSAL = re.compile(
    r"inequivalent arg '(?P<key>[^']+)' for queue .*?: received (?P<got>.*) "
    r"but current is (?P<cur>.*)\Z",
    re.S,
)
_TYPED = re.compile(r"the value '(?P<v>.*)' of type '(?P<t>[a-z]+)'\Z", re.S)
_INTS = {
    "signedint",
    "long",
    "short",
    "byte",
    "unsignedbyte",
    "unsignedshort",
    "unsignedint",
    "signedlong",
    "longlong",
}


@dataclass(frozen=True)
class Learned:
    """The probed argument's current value (None: the queue has none), or ``known``
    False when the broker's answers could not be read (then ``why`` says what came)."""

    known: bool
    value: Any = None
    durable: bool = True
    why: str = ""


def _current(text: str) -> tuple[bool, Any]:
    """The queue's side of a refusal: (readable, value or None)."""
    text = text.strip()
    if text == "none":
        return True, None
    m = _TYPED.match(text)
    if m is not None:
        v, t = m.group("v"), m.group("t")
        if t in _INTS:
            try:
                return True, int(v)
            except ValueError:
                return False, None
        if t == "longstr":
            return True, v
        if t == "bool":
            return True, v == "true"
        return False, None  # a table, a float, a timestamp: not sent back faithfully
    if len(text) >= 2 and text[0] == text[-1] == "'":
        return True, text[1:-1]
    return False, None


def queue_argument(conn: Any, queue: str, key: str, *, numeric: bool = False) -> Learned:
    """The current value of argument ``key`` of the existing ``queue`` (see the module's
    docstring). Never declares anything new and never changes the queue. ``numeric``:
    the argument takes a number (the broker checks the type before equivalence)."""
    from pika.exceptions import ChannelClosedByBroker

    args: dict[str, Any] = {}
    durable = True
    probe: Any = (
        "ackflow-probe-" + uuid.uuid4().hex
        if not numeric
        else 1_000_000_000 + uuid.uuid4().int % 1_000_000_000
    )
    last = ""
    for _ in range(MAX_STEPS):
        ch = conn.channel()
        try:
            ch.queue_declare(queue, durable=durable, arguments={**args, key: probe})
        except ChannelClosedByBroker as e:
            last = str(e.reply_text)
            m = _REFUSAL.search(last)
            if e.reply_code != 406 or m is None:
                return Learned(False, why=last)
            name = m.group("key")
            if name == "durable":
                durable = not durable
                continue
            if name in ("auto_delete", "exclusive"):  # not sent back: cannot match it
                return Learned(False, why=last)
            ok, value = _current(m.group("cur"))
            if not ok:
                return Learned(False, why=last)
            if name == key:
                if numeric and isinstance(value, str):  # "received '7' but current is '1'"
                    if not value.lstrip("-").isdigit():
                        return Learned(False, why=last)
                    value = int(value)
                return Learned(True, value, durable)
            if value is None or name in args:  # it would not have named this one
                return Learned(False, why=last)
            args[name] = value
            continue
        else:  # cannot happen: no queue has the probe value
            return Learned(False, why="the probe declaration went through")
        finally:
            if ch.is_open:
                ch.close()
    return Learned(False, why=last or "too many refusals")


#: The header of the probe :func:`route_refusal` publishes (expiration 0: it is dropped
#: unless a consumer of the dead-letter queue is waiting, which then sees this header).
PROBE_HEADER = "x-ackflow-probe"


def route_refusal(conn: Any, exchange: str, routing_key: str) -> str | None:
    """Why a dead letter published to ``exchange`` with ``routing_key`` would reach no
    queue, or None once proven that it reaches one: the exchange must exist (a passive
    declaration) and route the key (a ``mandatory`` probe, published with confirms and
    ``expiration`` 0 so that it does not stay in the dead-letter queue)."""
    import pika
    from pika.exceptions import ChannelClosedByBroker, NackError, UnroutableError

    ch = conn.channel()
    try:
        if exchange:  # "" is the default exchange: it always exists
            try:
                ch.exchange_declare(exchange, passive=True)
            except ChannelClosedByBroker as e:
                if e.reply_code == 404:
                    return f"exchange {exchange!r} does not exist"
                return f"cannot use exchange {exchange!r}: {e.reply_text}"
        ch.confirm_delivery()
        try:
            ch.basic_publish(
                exchange,
                routing_key,
                b"",
                pika.BasicProperties(expiration="0", headers={PROBE_HEADER: "route check at start"}),
                mandatory=True,
            )
        except UnroutableError:
            return (
                f"exchange {exchange!r} routes routing key {routing_key!r} to no queue (bind a queue to it)"
            )
        except NackError:  # routed, to a queue that refuses for now (full): not lost
            log.warning(
                "dead-letter exchange %r: a queue it routes %r to refuses messages "
                "now (basic.nack, e.g. full with x-overflow=reject-publish); dead "
                "letters it refuses are retried later",
                exchange,
                routing_key,
            )
        except ChannelClosedByBroker as e:
            return f"cannot publish to exchange {exchange!r}: {e.reply_text}"
        return None
    finally:
        if ch.is_open:
            ch.close()
