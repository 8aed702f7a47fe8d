"""The embedded queue as a source (the default source of ackflow)."""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, SupportsInt, cast

from ackflow.core.errors import ConfigError
from ackflow.core.ledger import Failure
from ackflow.core.policy import RetryPolicy
from ackflow.core.settlement import Delivery, Settlement
from ackflow.embedded import EmbeddedQueue, message_key, stored_headers
from ackflow.sources.base import BlockSize, Source

BLOCK_MESSAGES = 4096  # messages of one block at most


def one(r: tuple[Any, ...]) -> Delivery:
    """The delivery of one leased row ``(row_id, msg_id, body, headers_json, deliveries,
    published_at)``."""
    return Delivery(0, message_key(r[0], r[1]), bytes(r[2]), stored_headers(r[3]), r[4], (r[0], r[4]))


def embedded_block(rows: list[tuple[Any, ...]]) -> Delivery:
    """One delivery for the leased ``rows`` (engine/blocks.py): each message's identity
    (as its own :class:`Delivery` would have it) and body; the rows are the handle (their
    leases, and the deliveries of a split)."""
    import pyarrow as pa

    identities = [Delivery(0, message_key(r[0], r[1]), b"").identity for r in rows]
    return Delivery(
        0,
        f"#{rows[0][0]}..{rows[-1][0]}",  # no message's key: a row id key has no dots
        b"",
        {},
        1,
        rows,
        messages=len(rows),
        parts=(identities, pa.array([bytes(r[2]) for r in rows], pa.binary())),
    )


class EmbeddedQueueSource(Source):
    """Consume one queue of an :class:`~ackflow.embedded.EmbeddedQueue` file.

    Failed messages are retried after an exponential backoff and dead-lettered
    (with step, error and delivery count) once ``policy.max_deliveries`` is reached.
    Leases last ``visibility_timeout`` seconds and are extended while in flight.
    On open, the leases of a consumer that died are given back (and counted).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        queue: str = "default",
        *,
        format: str = "json",
        policy: RetryPolicy | None = None,
        visibility_timeout: float = 300.0,
        name: str | None = None,
    ) -> None:
        super().__init__(format=format, name=name or f"embedded:{queue}")
        if visibility_timeout <= 0:
            raise ConfigError("visibility_timeout must be positive")
        self.path = os.fspath(path)
        self.queue = queue
        self.policy = policy or RetryPolicy()
        self.visibility_timeout = visibility_timeout
        self._q: EmbeddedQueue | None = None
        self._dead_ids: dict[tuple[int, int], int] = {}
        self._blocks = False  # a lease of several messages is one delivery (engine/blocks.py)
        self._again: deque[Delivery] = deque()  # a split block's messages, still leased
        self.block_size = BlockSize(BLOCK_MESSAGES)
        self._unacked: dict[int, int] = {}  # the last ack's stale blocks: messages not acked

    def configure(self, *, max_inflight: int, error_sink: bool, keepalive_s: float = 30.0) -> None:
        # A lease must outlive two keepalive rounds, or a message still being processed
        # is leased to... this very consumer again and processed twice at once.
        if self.visibility_timeout <= 2 * keepalive_s:
            raise ConfigError(
                f"source {self.name!r}: visibility_timeout ({self.visibility_timeout:g} s) must "
                f"be more than twice the lease keepalive ({keepalive_s:g} s): raise "
                "visibility_timeout or lower keepalive_s"
            )

    @property
    def q(self) -> EmbeddedQueue:
        if self._q is None:
            raise RuntimeError(f"source {self.name} is not open")
        return self._q

    def open(self) -> int:
        if not os.path.exists(self.path):
            raise ConfigError(
                f"embedded queue file {self.path!r} does not exist; publish to it first "
                "(ackflow.embedded.EmbeddedQueue(path).publish(...))"
            )
        self._q = EmbeddedQueue(self.path)
        return self._q.claim_consumer(self.queue)

    def use_blocks(self, on: bool) -> bool:
        self._blocks = on and self.headers_field is None  # (headers are made per delivery)
        return self._blocks

    def pull(self, max_messages: int, timeout: float) -> list[Delivery]:
        if self._again:  # a split block's messages first: they hold their leases
            again = self._again
            return [again.popleft() for _ in range(min(max_messages, len(again)))]
        deadline = time.monotonic() + timeout
        while True:
            rows = self.q.lease_rows(self.queue, max_messages, visibility_timeout=self.visibility_timeout)
            if rows or time.monotonic() >= deadline:
                # (row_id, msg_id, body, headers_json, deliveries, published_at)
                size = self.block_size.now
                if self._blocks and size > 1 and len(rows) > 1:
                    # a message delivered before (a retry, a redelivery) comes alone: a
                    # poison one would split block after block
                    first = [r for r in rows if r[4] == 1]
                    cuts = [first[i : i + size] for i in range(0, len(first), size)]
                    out = [embedded_block(c) if len(c) > 1 else one(c[0]) for c in cuts]
                    return out + [one(r) for r in rows if r[4] != 1]
                return [one(r) for r in rows]
            time.sleep(min(0.02, max(deadline - time.monotonic(), 0)))

    def split(self, blocks: Sequence[Delivery]) -> None:
        """A block's messages come again one by one, on the leases they hold."""
        self.block_size.split(len(blocks))
        for b in blocks:
            self._again.extend(one(r) for r in b.handle)  # type: ignore[attr-defined]

    def stop_consuming(self) -> list[Delivery]:
        again, self._again = list(self._again), deque()
        return again

    @staticmethod
    def _lease(d: Delivery) -> tuple[int, int]:
        """The delivery's lease in the queue file (row id, lease), as :meth:`pull` set it."""
        return cast(tuple[int, int], d.handle)

    @classmethod
    def _handles(cls, deliveries: Sequence[Delivery]) -> list[tuple[int, int]]:
        """The leases of ``deliveries``: a block's are its rows' (row id, lease)."""
        out = []
        for d in deliveries:
            if d.parts is not None:
                out += [(r[0], r[4]) for r in d.handle]  # type: ignore[attr-defined]
            else:
                out.append(cls._lease(d))
        return out

    def ack(self, deliveries: Sequence[Delivery]) -> list[Delivery]:
        """Ack; return the deliveries whose lease was lost meanwhile (not acked: the
        message was leased again and counts as redelivered)."""
        if not deliveries:
            return []
        stale = set(self.q.ack_held(self.queue, self._handles(deliveries)))
        if self._blocks:
            self.block_size.acked(sum(d.messages for d in deliveries))
        if not stale:
            return []
        # a block is stale when any of its leases was lost (a stalled engine); its other
        # messages were acked: unacked() says how many come again
        out = []
        self._unacked = {}
        for d in deliveries:
            lost = sum(1 for h in self._handles([d]) if h in stale)
            if lost:
                out.append(d)
                self._unacked[id(d)] = lost
        return out

    def unacked(self, delivery: Delivery) -> int:
        return self._unacked.get(id(delivery), delivery.messages)

    def fail(self, failures: Sequence[tuple[Delivery, Failure]]) -> list[Settlement]:
        outcomes, retry, dead = self.by_policy(failures)
        self.nack(retry)
        # only the last call's dead-letter ids are kept (bounded), for dead_letter_ref()
        self._dead_ids = (
            self.q.dead_letter_ids(self.queue, [(*self._lease(d), f.step, f.error) for d, f in dead])
            if dead
            else {}
        )
        # a lease that expired meanwhile moved nothing: the message is the queue's again
        # (it comes back), so it is no dead letter of this run
        return [
            Settlement.RELEASED
            if state is Settlement.DEAD_LETTERED and self._lease(d) not in self._dead_ids
            else state
            for (d, _), state in zip(failures, outcomes, strict=True)
        ]

    # -- the status page -------------------------------------------------------------------

    replays_dead_letters = True

    def status(self) -> dict[str, object]:
        return {"kind": "embedded queue", "file": self.path, "queue": self.queue}

    def probe(self) -> dict[str, object] | None:
        """The queue's backlog, from a read-only handle of its own (any thread)."""
        q = EmbeddedQueue(self.path, readonly=True)
        try:
            s = q.stats(self.queue)
        finally:
            q.close()
        return {
            "lag": s["ready"],
            "retries_waiting": s["delayed"],
            "leased": s["leased"],
            "dead_letters_kept": s["dead_lettered"],
        }

    def dead_letter_ref(self, delivery: Delivery) -> object | None:
        return self._dead_ids.get(self._lease(delivery))

    def replay_dead_letters(self, refs: Sequence[object]) -> tuple[int, dict[object, str]]:
        """Move dead letters (their ids in the queue file) back to the queue, through a
        handle of its own (any thread; the queue file serialises writers). One whose
        ``msg_id`` is queued stays a dead letter (see :meth:`EmbeddedQueue.replay_each`)."""
        q = EmbeddedQueue(self.path)
        try:
            # refs: the dead-letter ids dead_letter_ref gave
            done = q.replay_each(self.queue, [int(cast(SupportsInt, r)) for r in refs])
        finally:
            q.close()
        return len(done.moved), {ref: why for ref, why in done.kept.items()}

    def nack(self, failures: Sequence[tuple[Delivery, Failure]]) -> None:
        if failures:
            self.q.retry(
                [(*self._lease(d), self.policy.delay_after(d.delivery_count), str(f)) for d, f in failures]
            )

    def release(self, deliveries: Sequence[Delivery]) -> None:
        if deliveries:
            self.q.release(self._handles(deliveries))

    def keepalive(self, deliveries: Sequence[Delivery]) -> None:
        deliveries = [*deliveries, *self._again]  # (a split block's, not pulled yet)
        if deliveries:
            self.q.extend(self._handles(deliveries), visibility_timeout=self.visibility_timeout)

    def close(self) -> None:
        if self._again and self._q is not None:  # never pulled again: back to the queue
            self.q.release(self._handles(self._again))
            self._again.clear()
        if self._q is not None:
            self._q.close()
            self._q = None
