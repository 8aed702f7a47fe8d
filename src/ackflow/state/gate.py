"""Which batches may move a window's watermark (:class:`Gate`), kept by the window sink."""

from __future__ import annotations


class Gate:
    """Which batches may move the watermark: a batch's largest event time counts once
    every batch that began before it has ended (committed or failed); until then it
    waits. Otherwise a younger batch that commits first moves the watermark past rows
    of an older one that then fails, or dies in a crash, and comes again: late for no
    fault of theirs. A crash forgets what waits: the watermark is then lower, never
    past a row still to come. The batch's own tasks judge lateness by the watermark it
    began with. Not thread-safe: the window sink calls it under the store's lock."""

    def __init__(self) -> None:
        self._seq = 0
        self.running: dict[str, tuple[int, int | None]] = {}  # batch -> (order, watermark)
        self._waiting: list[tuple[int, int]] = []  # (order, largest event time)

    def begin(self, batch: str, watermark: int | None) -> None:
        self._seq += 1
        self.running[batch] = (self._seq, watermark)

    def _split(self, batch: str, event_max: int | None) -> tuple[int | None, list[tuple[int, int]]]:
        seq = self.running.get(batch, (None, None))[0]
        waiting = list(self._waiting)
        if seq is not None and event_max is not None:
            waiting.append((seq, event_max))
        others = [s for b, (s, _) in self.running.items() if b != batch]
        oldest = min(others, default=None)
        ready = [t for s, t in waiting if oldest is None or s < oldest]
        keep = [(s, t) for s, t in waiting if not (oldest is None or s < oldest)]
        return max(ready, default=None), keep

    def ready(self, batch: str, event_max: int | None) -> int | None:
        """The event time the watermark may follow if ``batch`` ends now with ``event_max``."""
        return self._split(batch, event_max)[0]

    def end(self, batch: str, event_max: int | None) -> int | None:
        """``batch`` ended (``event_max``: None if it failed); what may count now."""
        out, self._waiting = self._split(batch, event_max)
        self.running.pop(batch, None)
        return out

    def rename(self, batch: str, to: str) -> None:
        """``batch``'s place (its order and watermark) goes on as ``to``."""
        if batch in self.running:
            self.running[to] = self.running.pop(batch)

    def bound(self, watermark: int | None) -> int | None:
        """The watermark windows may close by: held back by every running batch's."""
        for _, started in self.running.values():
            if watermark is None or started is None:
                return None
            watermark = min(watermark, started)
        return watermark
