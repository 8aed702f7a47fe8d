"""Contiguous offset commits over replayable logs (law: never commit past a gap).

A replayable source (a stream partition, a file) remembers its progress as one
number per log: the *committed offset*, the first offset that is not settled yet.
Everything below it was acked or durably dead-lettered; everything from it on is
processed again after a restart. :class:`OffsetTracker` computes that number from
what was pulled and settled, in any order:

* a message still in flight holds the commit back (it is not a gap);
* an offset between the committed one and the highest pulled that was never
  pulled holds it back too, unless it is declared a :meth:`~OffsetTracker.gap`
  (an offset the source knows will never come);
* a failed message stays unsettled until it is settled on a later delivery.

It holds only the window between the committed offset and the highest pulled.
"""

from __future__ import annotations

from collections.abc import Iterable

_PENDING, _DONE = 0, 1


class OffsetTracker:
    """Pulled / settled offsets of one log, and the committable offset.

    >>> t = OffsetTracker(start=10)
    >>> for o in (10, 11, 12):
    ...     _ = t.pulled(o)
    >>> t.settled(11); t.committed       # 10 still in flight: nothing committed past it
    10
    >>> t.settled(10); t.committed       # 10 and 11 done; 12 in flight
    12
    >>> t.gap(13, 15); _ = t.pulled(15); t.settled(12); t.committed   # 13, 14 never come
    15
    """

    def __init__(self, start: int = 0) -> None:
        if start < 0:
            raise ValueError("offsets start at 0")
        self._base = start
        self._high = start - 1
        self._state: dict[int, int] = {}

    @property
    def committed(self) -> int:
        """The first offset not settled: every offset below it is settled (or a gap)."""
        return self._base

    @property
    def highest_pulled(self) -> int:
        return self._high

    @property
    def in_flight(self) -> int:
        """Offsets pulled and not settled yet."""
        return sum(1 for s in self._state.values() if s == _PENDING)

    def __len__(self) -> int:
        """How many offsets the tracker holds (the window above the committed offset)."""
        return len(self._state)

    def pulled(self, offset: int) -> bool:
        """Record a delivery of ``offset``. Returns False for an offset below the
        committed one (already settled: the caller should skip it)."""
        if offset < self._base:
            return False
        if self._state.get(offset) != _DONE:
            self._state[offset] = _PENDING
        self._high = max(self._high, offset)
        return True

    def settled(self, offset: int) -> None:
        """``offset`` was acked or durably dead-lettered."""
        if offset < self._base:
            return
        if offset not in self._state:
            raise KeyError(f"offset {offset} was never pulled")
        self._state[offset] = _DONE
        self._advance()

    def settled_many(self, offsets: Iterable[int]) -> None:
        """:meth:`settled` for each of ``offsets``, the commit advanced once."""
        state, base = self._state, self._base
        for offset in offsets:
            if offset < base:
                continue
            if offset not in state:
                raise KeyError(f"offset {offset} was never pulled")
            state[offset] = _DONE
        self._advance()

    def failed(self, offset: int) -> None:
        """``offset`` failed and will be delivered again: it stays unsettled."""
        if offset >= self._base and offset not in self._state:
            raise KeyError(f"offset {offset} was never pulled")

    def gap(self, start: int, end: int) -> None:
        """Offsets ``start`` (inclusive) to ``end`` (exclusive) will never be delivered."""
        for o in range(max(start, self._base), end):
            if self._state.get(o) is None:
                self._state[o] = _DONE
        self._high = max(self._high, end - 1)
        self._advance()

    def pending(self) -> Iterable[int]:
        """Offsets pulled and not settled, in order."""
        return sorted(o for o, s in self._state.items() if s == _PENDING)

    def _advance(self) -> None:
        state, base = self._state, self._base
        while state.get(base) == _DONE:
            del state[base]
            base += 1
        self._base = base
