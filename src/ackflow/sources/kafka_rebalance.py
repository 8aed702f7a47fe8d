"""A Kafka group's rebalances, as the source lives them (the consumer thread, in the
client's callbacks).

Revoked partitions: nothing more of theirs is handed out; their messages waiting for a
retry are let go at once (not in flight); the thread waits up to ``revoke_timeout_s``
for those in flight (single messages and blocks) to settle, commits each partition's
contiguous settled prefix, and lets the partitions go. What is still in flight then is
given up knowingly: it stays uncommitted, the new owner reads it again, and a late
settlement here commits nothing (a keyed sink absorbs the second write).

Lost partitions (the session expired): nothing may be committed for them any more.
"""

from __future__ import annotations

import heapq
import logging
import time
from typing import TYPE_CHECKING

from ackflow import faults
from ackflow.sources import kafka_blocks as kb
from ackflow.sources.kafka_attempts import Partition

if TYPE_CHECKING:
    from ackflow.sources.kafka import KafkaSource

log = logging.getLogger("ackflow.sources.kafka")


def revoke(src: KafkaSource, tps: list[Partition]) -> None:
    """Stop handing out the revoked partitions ``tps``, let their messages in flight
    settle (bounded), commit their settled prefixes, then let them go."""
    deadline = time.monotonic() + src.revoke_timeout_s
    with src._lock:
        for tp in tps:
            part = src._parts.get(tp)
            if part is not None:
                part.revoking = True
                part.inbox.clear()  # fetched, never handed out: read again by the owner
        waiting = [r for r in src._retry if r[1] in tps]  # not in flight: let go now
        for _, tp, off, _, _ in waiting:
            src._bodies.pop((tp, off), None)
        src._retry = [r for r in src._retry if r[1] not in tps]
        heapq.heapify(src._retry)
        while (
            not src._stop.is_set()
            and any(key[0] in tps for key in (*src._bodies, *src._blocks))
            and time.monotonic() < deadline
        ):
            src._lock.wait(0.05)
    faults.point("kafka.revoke_settled")
    try:
        src._commit(only=tps)
    except Exception as e:  # noqa: BLE001 - uncommitted: the new owner reads it again
        log.warning("source %r: commit at revoke failed: %s", src.name, e)
    let_go(src, tps, "revoked")


def lost(src: KafkaSource, tps: list[Partition]) -> None:
    """The partitions ``tps`` were taken away: nothing more of theirs is handed out or
    retried here."""
    with src._lock:
        for tp in tps:
            part = src._parts.get(tp)
            if part is not None:
                part.revoking = True
                part.inbox.clear()
        src._retry = [r for r in src._retry if r[1] not in tps]
        heapq.heapify(src._retry)
    let_go(src, tps, "lost")


def let_go(src: KafkaSource, tps: list[Partition], why: str) -> None:
    """Forget the partitions ``tps`` and what of theirs is still in flight (settled
    late, it commits nothing: the new owner reads it again)."""
    with src._lock:
        left = [key for key in src._bodies if key[0] in tps]
        for key in left:
            del src._bodies[key]
        n = len(left) + kb.let_go(src, tps)
        for tp in tps:
            src._parts.pop(tp, None)
        src.given_up += n
        src.rebalances += 1
        src._lock.notify_all()
    if n:
        log.warning(
            "source %r: partitions %s %s with %d messages still in flight; they "
            "stay uncommitted and their new owner reads them again",
            src.name,
            tps,
            why,
            n,
        )
