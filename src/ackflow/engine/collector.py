"""The garbage collector while a flow runs (the driver's CPU a message)."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

#: The young generation's threshold while a flow runs (Python's default is 700): each
#: message makes a few objects the collector tracks (its delivery, headers, handle), and
#: with tens of thousands in flight a young collection every 700 allocations cost ~10 %
#: of the driver's CPU (measured without Spark, 400 000 messages: 2 957 collections took
#: 1.1 s of 11 s; at 10 000, 307 took 0.5 s. In the files benchmark the driver's CPU a
#: message fell by about an eighth: docs/performance.md).
GC_YOUNG = 20_000


_gc_runs: list[tuple[int, ...]] = []  # the settings before the first of the runs now going
_gc_lock = threading.Lock()


@contextlib.contextmanager
def fewer_collections() -> Iterator[None]:
    """For the run: young collections every :data:`GC_YOUNG` allocations (unless the
    application turned automatic collection off: a threshold of 0 stays). The last of
    the runs going at once in this process gives the settings back. Nothing is frozen
    (``gc.freeze`` would pin garbage alive at the start for the whole run, and undo an
    application's own freeze; measured, it saved nothing more)."""
    with _gc_lock:
        if not _gc_runs:
            before: tuple[int, ...] = gc.get_threshold()
            if before[0] > 0:
                gc.set_threshold(max(before[0], GC_YOUNG), *before[1:])
        else:
            before = _gc_runs[0]
        _gc_runs.append(before)
    try:
        yield
    finally:
        with _gc_lock:
            _gc_runs.pop()
            if not _gc_runs:
                gc.set_threshold(*before)
