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

import re
import uuid
from dataclasses import dataclass
from typing import Any

#: Refusals followed before giving up (a queue has a handful of arguments).
MAX_STEPS = 24

_REFUSAL = re.compile(r"inequivalent arg '(?P<key>[^']+)' for queue .*?: received (?P<got>.*) "
                      r"but current is (?P<cur>.*)\Z", re.S)
_TYPED = re.compile(r"the value '(?P<v>.*)' of type '(?P<t>[a-z]+)'\Z", re.S)
_INTS = {"signedint", "long", "short", "byte", "unsignedbyte", "unsignedshort",
         "unsignedint", "signedlong", "longlong"}


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


def queue_argument(conn: Any, queue: str, key: str) -> Learned:
    """The current value of argument ``key`` of the existing ``queue`` (see the module's
    docstring). Never declares anything new and never changes the queue."""
    from pika.exceptions import ChannelClosedByBroker

    args: dict[str, Any] = {}
    durable = True
    probe = "ackflow-probe-" + uuid.uuid4().hex
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
