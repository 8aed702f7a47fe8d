"""The settlement state machine of one delivery (law 2: settle once).

A :class:`Delivery` starts ``PENDING`` and moves exactly once to ``ACKED``,
``NACKED``, ``DEAD_LETTERED`` or ``RELEASED``. A second move raises
:class:`~ackflow.core.errors.AlreadySettled` naming both outcomes.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Any

from ackflow.core.errors import AlreadySettled

#: What a merged flow's origin prefix looks like (see :attr:`Delivery.identity`).
_PREFIXED = re.compile(r"[0-9]+\|")


class Settlement(enum.Enum):
    PENDING = "pending"
    ACKED = "acked"
    NACKED = "nacked"  # failed; the source's retry policy redelivers it later
    DEAD_LETTERED = "dead_lettered"  # failed for good, durably kept with provenance
    RELEASED = "released"  # not processed (shutdown); given back without counting a failure


@dataclass(eq=False, slots=True)
class Delivery:
    """One message as pulled from a source, and how it was settled.

    ``key`` is the source's stable identity of the message (used in errors and
    reports); ``lineage_id`` is the number the engine gives it for this run and
    which every derived row carries through Spark.
    """

    lineage_id: int
    key: str
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)
    delivery_count: int = 1
    handle: object = None  # the source's own receipt handle (lease, delivery tag, offset)
    origin: int = 0  # which source of a merged flow it came from
    state: Settlement = Settlement.PENDING
    revised: bool = False
    pulled_at: float = 0.0  # time.monotonic() when the engine pulled it (pull-to-ack latency)
    #: source messages this delivery carries: 1, or a *block* of several (a run of a
    #: file's lines, see :meth:`ackflow.sources.base.Source.split`) whose rows each
    #: keep their own message's identity; a block that fails is split, never retried
    #: or dead-lettered as a whole
    messages: int = 1
    #: a block of separate messages (not a run of lines in ``body``): their identities
    #: and bodies, as ``(list[str], pyarrow.Array)``
    parts: Any = None

    @property
    def identity(self) -> str:
        """The message's identity within its flow: its key, prefixed with its origin in a
        merged flow (two sources may use the same keys). Row keys, group keys and dead
        letters derive from it, never from ``key`` alone. The first source's keys are
        kept as they are unless they look prefixed (``2|x``): those get ``0|``, so that
        no key of one source names a message of another.

        >>> Delivery(0, "x", b"").identity, Delivery(0, "x", b"", origin=2).identity
        ('x', '2|x')
        >>> Delivery(0, "2|x", b"").identity
        '0|2|x'
        """
        if self.origin:
            return f"{self.origin}|{self.key}"
        if self.key[:1].isdigit() and _PREFIXED.match(self.key):
            return "0|" + self.key
        return self.key

    @property
    def settled(self) -> bool:
        return self.state is not Settlement.PENDING

    def settle(self, outcome: Settlement) -> None:
        """Move to ``outcome``; raise :class:`AlreadySettled` if already settled."""
        if outcome is Settlement.PENDING:
            raise ValueError("cannot settle a delivery as pending")
        if self.state is not Settlement.PENDING:
            raise AlreadySettled(
                f"message {self.key!r} was already {self.state.value}; refusing to mark it {outcome.value}"
            )
        self.state = outcome

    @staticmethod
    def settle_all(deliveries: list[Delivery], outcome: Settlement) -> None:
        """:meth:`settle` each of ``deliveries`` (a batch's acks: no call per delivery
        unless one is settled already, which raises as :meth:`settle` does). A raise
        leaves the ones before it settled, as a loop of :meth:`settle` would."""
        if outcome is Settlement.PENDING:
            raise ValueError("cannot settle a delivery as pending")
        pending = Settlement.PENDING
        for d in deliveries:
            if d.state is not pending:
                d.settle(outcome)  # raises AlreadySettled, naming both outcomes
            d.state = outcome

    def revise(self, outcome: Settlement) -> None:
        """The source answered otherwise than the engine settled (which it does first,
        before talking to the broker, so that a second settle never reaches it): a stale
        receipt makes a settlement ``RELEASED`` (the broker delivers it again), a refused
        dead letter makes it ``NACKED``. The source's answer stands. Once, and only from a
        settled state.
        """
        if self.state is Settlement.PENDING or self.revised:
            raise AlreadySettled(f"message {self.key!r}: cannot revise {self.state.value} to {outcome.value}")
        if outcome is Settlement.PENDING:
            raise ValueError("cannot revise a settlement to pending")
        self.revised = True
        self.state = outcome
