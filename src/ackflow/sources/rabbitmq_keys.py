"""Identity and delivery counting for the RabbitMQ source: a message's key (from its
``message_id``, never from its body), the id a dead letter carries on, what delivery
counts are remembered by, headers read as counts and as text, and how a window is
split over consumers (AMQP's prefetch count is 16 bits)."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable
from typing import Any, cast

from ackflow.core.settlement import Delivery

#: Headers ackflow puts on a message it dead-letters (its provenance).
PROVENANCE = ("x-ackflow-step", "x-ackflow-error", "x-ackflow-deliveries", "x-ackflow-queue")


#: Prefix of the key of a message published without a ``message_id``: unique to that one
#: delivery, so a redelivery of it is a new identity (at-least-once for keyed sinks).
UNNAMED = "delivery:"


# AMQP's prefetch count is 16 bits: a window past it is split over several consumers
PREFETCH_MAX = 65535
#: message ids whose delivery count a classic queue's source remembers (and their
#: give-backs), the most recent ones; older ones are forgotten (a redelivery of one then
#: counts from the broker's ``redelivered`` flag: 2)
SEEN_MAX = 100_000
#: deliveries whose retry key is kept for a give-back (the most recent)
RETRY_KEYS_MAX = 200_000
MAX_CONSUMERS = 16


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


def header_text(v: Any) -> str:
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


def handle_of(d: Delivery) -> tuple[int, int]:
    """A delivery's channel generation and delivery tag (the handle this source gave it)."""
    return cast(tuple[int, int], d.handle)
