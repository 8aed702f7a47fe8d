"""What a Kafka message becomes: a delivery's headers, and, given up, a record of the
dead-letter topic."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from ackflow import faults
from ackflow.core.ledger import Failure
from ackflow.core.settlement import Delivery

if TYPE_CHECKING:
    from ackflow.sources.kafka import KafkaSource

log = logging.getLogger("ackflow.sources.kafka")

Partition = tuple[str, int]

#: the headers ackflow gives a delivery (a message's own header of one of these names is
#: left out)
OWN_HEADERS = frozenset({"topic", "partition", "offset", "timestamp", "key"})


def message_key(tp: Partition, off: int) -> str:
    """A message's identity: ``topic/partition@offset`` (a topic's name has no ``|``, so
    it is also its :attr:`Delivery.identity`)."""
    return f"{tp[0]}/{tp[1]}@{off}"


def delivery_headers(tp: Partition, off: int, m: Any) -> dict[str, str]:
    """The delivery's headers: its place, timestamp and key, then the message's own
    headers that are UTF-8 text (one named like ackflow's is left out: it never stands
    in for them)."""
    headers = {
        "topic": tp[0],
        "partition": str(tp[1]),
        "offset": str(off),
        "timestamp": str(m.timestamp()[1]),
    }
    key = m.key()
    if key is not None:
        try:
            headers["key"] = key.decode()
        except UnicodeDecodeError:
            pass
    for k, v in m.headers() or []:
        if isinstance(v, bytes) and k not in OWN_HEADERS and k not in headers:
            try:
                headers[k] = v.decode()
            except UnicodeDecodeError:
                pass
    return headers


def produce_dead_letters(producer: Any, topic: str, dead: Sequence[tuple[Delivery, Failure]]) -> set[str]:
    """Produce each given-up message to ``topic`` (body unchanged, key its identity,
    its provenance in ``ackflow-*`` headers) and wait for the delivery reports; returns
    the keys of those that were not delivered."""
    failed: set[str] = set()
    delivered: set[str] = set()

    def report(key: str) -> Any:
        def done(err: Any, msg: Any) -> None:
            (failed if err is not None else delivered).add(key)

        return done

    for d, f in dead:
        tp, off, _ = cast(tuple[Partition, int, int], d.handle)
        headers = [
            (k, str(v).encode())
            for k, v in (
                ("ackflow-message", d.key),
                ("ackflow-topic", tp[0]),
                ("ackflow-partition", tp[1]),
                ("ackflow-offset", off),
                ("ackflow-step", f.step),
                ("ackflow-error", f.error[:2000]),
                ("ackflow-deliveries", d.delivery_count),
            )
        ]
        try:
            producer.produce(
                topic, value=d.body, headers=headers, key=d.key.encode(), on_delivery=report(d.key)
            )
        except Exception:  # noqa: BLE001 - retried, never lost
            failed.add(d.key)
    producer.flush(30)
    return {d.key for d, _ in dead if d.key not in delivered} | failed


def dead_letter(src: KafkaSource, dead: Sequence[tuple[Delivery, Failure]]) -> set[str]:
    """Produce ``dead`` to the source's dead-letter topic, then settle those delivered;
    returns the keys of those that were not (they are retried, never lost)."""
    if not dead:
        return set()
    stuck = produce_dead_letters(src._producer, str(src.dead_letter_topic), dead)
    faults.point("kafka.dead_lettered")
    src.ack([d for d, _ in dead if d.key not in stuck])
    if stuck:
        log.warning(
            "source %r: %d dead letters were not delivered to %r; they are retried",
            src.name,
            len(stuck),
            src.dead_letter_topic,
        )
    return stuck
