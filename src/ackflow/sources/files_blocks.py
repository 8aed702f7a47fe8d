"""The Files source's blocks: runs of lines read, handed out and settled as one delivery.

In a flow that allows them (:mod:`ackflow.engine.blocks`) the source reads a run of up to
:data:`BLOCK_LINES` lines with one ``read`` and hands it out as one block: numpy finds
the line ends, no object is made per line, and the block settles its whole range of
lines at once. Each line keeps its identity (``<file>@<id>:<line>``): the executors make
one input row per line (:mod:`ackflow.spark.blocks`). A block that fails is split
(:func:`split`): its lines come back one by one through the retry queue, each at its
first delivery, and are isolated, retried and dead-lettered as lines always are.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import numpy as np

from ackflow.core.settlement import Delivery

if TYPE_CHECKING:
    from ackflow.sources.files import FilesSource, _File

BLOCK_LINES = 4096  # lines of one block at most
READ_BYTES = 1 << 20  # bytes read at once for a block, at most
_BLANK = np.zeros(256, bool)
_BLANK[list(b" \t\n\r\x0b\x0c")] = True  # a line of these only is no message


def read_blocks(src: FilesSource, f: _File, take: int, out: list[Delivery]) -> int:
    """Read up to ``take`` lines of ``f`` as blocks into ``out`` (a run with fewer than
    two messages is read line by line, as without blocks); the lines read."""
    handle = f.handle
    assert handle is not None
    read = 0
    while read < take and not f.eof:
        want = min(take - read, src.block_size.now)
        if want < 2:  # blocks split often here: the line way for now
            read += src._read(f, take - read, out)
            break
        size = min(READ_BYTES, want * 160 + 65_536)
        buf = handle.read(size)
        if not buf:
            f.eof = True
            break
        ends = np.flatnonzero(np.frombuffer(buf, np.uint8) == 10)
        whole = len(buf) < size  # a short read of a file: its end
        if len(ends) >= want:
            end = int(ends[want - 1]) + 1
        elif whole:
            end = len(buf)
        elif len(ends):
            end = int(ends[-1]) + 1
        else:
            end = 0  # one line longer than the read: the line way
        if end < len(buf):
            handle.seek(end - len(buf), 1)
        if not end:
            read += src._read(f, 1, out)
            continue
        chunk = buf[:end] if end < len(buf) else buf
        starts = np.concatenate(([0], ends[ends < end - 1] + 1))
        lines = len(starts)
        stops = np.append(starts[1:], end)
        maybe = _BLANK[np.frombuffer(chunk, np.uint8)[starts]]  # starts with white space
        spans = zip(starts[maybe].tolist(), stops[maybe].tolist(), strict=True)
        blank = sum(1 for s, e in spans if chunk[s:e].isspace())
        if lines - blank < 2:  # no block: these lines the line way
            handle.seek(-end, 1)
            read += src._read(f, lines, out)
            continue
        first = f.next_line
        span = f"{first + 1}-{first + lines}"
        # (not told to the tracker: a range it never saw holds its commit back, as a
        # line in flight does; acked, the range is declared settled at once)
        f.next_line = first + lines
        f.blocks[first] = (first + lines, chunk)
        f.block_lines += lines
        out.append(
            Delivery(
                0,
                f.key_prefix + span,
                chunk,
                {"file": f.name, "file_id": f.id, "lines": span},
                1,
                handle=(f.id, first, first + lines),
                messages=lines - blank,
            )
        )
        read += lines
        if whole and end == len(buf):
            f.eof = True
    if f.eof and f.id in src._files and src._finished(f):  # (the line way may have)
        src._finish([f])
    return read


def span_of(block: Delivery) -> tuple[str, int, int]:
    """A block's file id, first line and end (exclusive), from 0 (set in read_blocks)."""
    return cast(tuple[str, int, int], block.handle)


def settle_blocks(f: _File, blocks: Sequence[Delivery]) -> None:
    """Acked or split: the blocks leave ``f``'s window (what the tracker is told is the
    caller's: a whole range on an ack, the blank lines on a split)."""
    for d in blocks:
        _, first, end = span_of(d)
        if f.blocks.pop(first, None) is not None:
            f.block_lines -= end - first


def acked(src: FilesSource, blocks: Sequence[Delivery]) -> set[str]:
    """Acked blocks: each whole range settled at once; the ids of the files touched."""
    src.block_size.acked(sum(d.messages for d in blocks))
    touched = set()
    for d in blocks:
        fid, first, end = span_of(d)
        f = src._files.get(fid)
        if f is None:
            continue
        settle_blocks(f, [d])
        f.tracker.gap(first, end)  # settled as one range: no work per line
        touched.add(fid)
    return touched


def split(src: FilesSource, blocks: Sequence[Delivery]) -> None:
    """The blocks' lines come again one by one (first deliveries, due now)."""
    now = time.monotonic()
    touched = set()
    src.block_size.split(len(blocks))
    for d in blocks:
        fid, first, end = span_of(d)
        f = src._files.get(fid)
        held = f.blocks.get(first) if f is not None else None
        if f is None or held is None:
            continue
        settle_blocks(f, [d])
        f.tracker.pulled_range(first, end)  # from now on, line by line
        blanks = []
        for i, raw in enumerate(held[1].split(b"\n")[: end - first]):
            line = first + i
            if not raw or raw.isspace():
                blanks.append(line)
                continue
            f.bodies[line] = raw.rstrip(b"\r\n")
            src._seq += 1
            heapq.heappush(src._retry, (now, src._seq, fid, line, 1))
        f.tracker.settled_many(blanks)
        touched.add(fid)
    src._save(touched)
