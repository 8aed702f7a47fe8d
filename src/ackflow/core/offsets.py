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

It holds only the window between the committed offset and the highest pulled, and
a declared gap as one range whatever its length.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable

_PENDING, _DONE = 0, 1


class OffsetTracker:
    """Pulled / settled offsets of one log, and the committable offset.

    Pulled offsets are held one by one (there are at most ``max_inflight`` in flight
    and the settled ones above the committed offset); declared gaps are held as ranges,
    so a gap of 10⁹ offsets costs what a gap of one does.

    >>> t = OffsetTracker(start=10)
    >>> for o in (10, 11, 12):
    ...     _ = t.pulled(o)
    >>> t.settled(11); t.committed       # 10 still in flight: nothing committed past it
    10
    >>> t.settled(10); t.committed       # 10 and 11 done; 12 in flight
    12
    >>> t.gap(13, 15); _ = t.pulled(15); t.settled(12); t.committed   # 13, 14 never come
    15
    >>> t.gap(16, 10**12); _ = t.pulled(10**12); t.settled(15); t.committed
    1000000000000
    """

    def __init__(self, start: int = 0) -> None:
        if start < 0:
            raise ValueError("offsets start at 0")
        self._base = start
        self._high = start - 1
        self._state: dict[int, int] = {}
        # declared gaps at or above the committed offset: sorted, disjoint, not
        # touching, half-open [start, end). An offset in a gap that was also pulled is
        # governed by its pulled state (a gap never settles a message in flight).
        self._gap_starts: list[int] = []
        self._gap_ends: list[int] = []

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
        """How many offsets the tracker holds (the window above the committed offset):
        pulled ones and those of declared gaps. Its memory is the number of pulled
        offsets plus the number of gap ranges, whatever their length."""
        base = self._base  # the first range may start below it (settled since)
        in_gaps = sum(e - max(s, base) for s, e in zip(self._gap_starts, self._gap_ends, strict=True))
        both = sum(1 for o in self._state if self._in_gap(o))
        return len(self._state) + in_gaps - both

    def _in_gap(self, offset: int) -> bool:
        i = bisect_right(self._gap_starts, offset) - 1
        return i >= 0 and offset < self._gap_ends[i]

    def pulled(self, offset: int) -> bool:
        """Record a delivery of ``offset``. Returns False for an offset below the
        committed one (already settled: the caller should skip it)."""
        if offset < self._base:
            return False
        if offset not in self._state and not (self._gap_starts and self._in_gap(offset)):
            self._state[offset] = _PENDING  # a settled or gap offset stays settled
        self._high = max(self._high, offset)
        return True

    def pulled_range(self, start: int, end: int) -> None:
        """:meth:`pulled` for each offset from ``start`` to ``end`` (exclusive), a
        source's read of fresh lines: one dict update when they lie above every offset
        seen and no gap is declared.

        >>> t = OffsetTracker(); t.pulled_range(0, 3); t.settled_many([0, 1]); t.committed
        2
        """
        if start >= end:
            return
        if start > self._high and not self._gap_starts and start >= self._base:
            self._state.update(dict.fromkeys(range(start, end), _PENDING))
            self._high = end - 1
            return
        for offset in range(start, end):
            self.pulled(offset)

    def settled(self, offset: int) -> None:
        """``offset`` was acked or durably dead-lettered."""
        if offset < self._base:
            return
        if offset not in self._state:
            if self._gap_starts and self._in_gap(offset):
                return  # declared a gap: already settled
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
                if self._gap_starts and self._in_gap(offset):
                    continue
                raise KeyError(f"offset {offset} was never pulled")
            state[offset] = _DONE
        self._advance()

    def failed(self, offset: int) -> None:
        """``offset`` failed and will be delivered again: it stays unsettled."""
        if offset >= self._base and offset not in self._state and not self._in_gap(offset):
            raise KeyError(f"offset {offset} was never pulled")

    def gap(self, start: int, end: int) -> None:
        """Offsets ``start`` (inclusive) to ``end`` (exclusive) will never be delivered.
        Held as one range: time and memory do not depend on ``end - start``."""
        start = max(start, self._base)
        if start < end:
            starts, ends = self._gap_starts, self._gap_ends
            # the ranges that overlap or touch [start, end) are merged into one
            lo = bisect_left(ends, start)  # first range with end >= start
            hi = bisect_right(starts, end)  # ranges from hi on start past end
            if lo < hi:
                start = min(start, starts[lo])
                end = max(end, ends[hi - 1])
            starts[lo:hi] = [start]
            ends[lo:hi] = [end]
        self._high = max(self._high, end - 1)
        self._advance()

    def pending(self) -> Iterable[int]:
        """Offsets pulled and not settled, in order."""
        return sorted(o for o, s in self._state.items() if s == _PENDING)

    def _advance(self) -> None:
        state, base = self._state, self._base
        starts, ends = self._gap_starts, self._gap_ends
        while True:
            s = state.get(base)
            if s == _DONE:
                del state[base]
                base += 1
                continue
            while starts and ends[0] <= base:  # passed over by pulled offsets
                del starts[0], ends[0]
            if s == _PENDING or not starts or starts[0] > base:
                break
            # base lies in the first gap (ranges below base were dropped): skip to
            # its end, or to the first offset in flight inside it
            end = ends[0]
            inside = [o for o in state if base <= o < end]
            stop = min((o for o in inside if state[o] == _PENDING), default=end)
            for o in inside:
                if o < stop:
                    del state[o]
            base = stop
            if stop == end:
                del starts[0], ends[0]
            else:
                starts[0] = stop
                break
        self._base = base
