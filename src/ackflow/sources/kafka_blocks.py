"""Blocks for the Kafka source (engine/blocks.py): a run of one partition's first
deliveries, handed to the engine as one :class:`Delivery` of many messages.

A block's ``handle`` is a :class:`KafkaBlock`: its partition, assignment, offsets and
the client's messages (their bodies, keys and headers, kept until the block settles);
``parts`` are the messages' identities (``topic/partition@offset``, as each alone would
have it) and bodies. The partition's tracker holds each offset in flight as before: the
commit passes a block only once the block is acked.

Only first deliveries join a block: a message handed out before this assignment (by an
earlier run, or before a rebalance) comes alone with its recorded count, so a poison
message does not split block after block. A block that fails is split (:func:`again`):
its messages come again one by one from the retry queue, each a first delivery (the
block's try is spent by none of them), and are retried or dead-lettered as single
messages. A block whose partition was revoked while it was in flight is let go with
the partition: its late ack commits nothing, and the new owner reads it again.
Blocks are not used with ``headers_field`` (headers are made per delivery).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ackflow.core.settlement import Delivery
from ackflow.sources.kafka_attempts import Partition
from ackflow.sources.kafka_messages import delivery_headers, message_key

if TYPE_CHECKING:
    from ackflow.sources.kafka import KafkaSource

#: messages of one block at most
BLOCK_MESSAGES = 4096
#: bytes of bodies a block holds at most (an Arrow binary array holds 2 GiB at most;
#: several blocks make one batch's column)
BLOCK_BYTES = 16 << 20


@dataclass(eq=False)
class KafkaBlock:
    """A block's receipt: its partition, the assignment it was read in, its offsets and
    the client's messages (same order)."""

    tp: Partition
    gen: int
    offsets: list[int]
    messages: list[Any]


def make(
    src: KafkaSource, tp: Partition, gen: int, offsets: list[int], messages: list[Any]
) -> list[Delivery]:
    """The deliveries for a partition's first deliveries ``messages`` (at ``offsets``,
    tracked already): blocks of at most the source's block size, a run of one alone."""
    import pyarrow as pa

    size = src.block_size.now
    out = []
    for offs, ms in _cuts(offsets, messages, size):
        if len(offs) == 1:
            out.append(src._single(tp, offs[0], ms[0], gen, 1))
            continue
        block = KafkaBlock(tp, gen, offs, ms)
        d = Delivery(
            0,
            f"#{message_key(tp, offs[0])}+{len(offs)}",  # a label: the engine keys by its parts
            b"",
            {},
            1,
            block,
            messages=len(offs),
            parts=([message_key(tp, o) for o in offs], pa.array([m.value() or b"" for m in ms], pa.binary())),
        )
        src._blocks[(tp, offs[0])] = block
        src._in_blocks += len(offs)
        out.append(d)
    return out


def _cuts(offsets: list[int], messages: list[Any], size: int) -> list[tuple[list[int], list[Any]]]:
    """``offsets`` and ``messages`` cut into runs of at most ``size`` messages and
    :data:`BLOCK_BYTES` of bodies (a larger message alone)."""
    out = []
    start, held = 0, 0
    for i, m in enumerate(messages):
        n = len(m.value() or b"")
        if i > start and (i - start >= size or held + n > BLOCK_BYTES):
            out.append((offsets[start:i], messages[start:i]))
            start, held = i, 0
        held += n
    if start < len(messages):
        out.append((offsets[start:], messages[start:]))
    return out


def live(src: KafkaSource, d: Delivery) -> KafkaBlock | None:
    """The block ``d`` stands for, while the source holds it (not settled, split, or let
    go with its partition); else None."""
    block = d.handle
    if isinstance(block, KafkaBlock) and src._blocks.get((block.tp, block.offsets[0])) is block:
        return block
    return None


def take(src: KafkaSource, block: KafkaBlock) -> None:
    """The source no longer holds ``block`` (acked, split, given back)."""
    del src._blocks[(block.tp, block.offsets[0])]
    src._in_blocks -= len(block.offsets)


def acked(src: KafkaSource, d: Delivery) -> int:
    """Settle block ``d`` if the source still holds it (the lock held); returns how many
    messages it carried (0: let go with its partition, it commits nothing here)."""
    block = live(src, d)
    if block is None:
        return 0
    take(src, block)
    part = src._parts.get(block.tp)
    if part is not None and part.tracker is not None:
        part.tracker.settled_many(block.offsets)
    return len(block.offsets)


def again(src: KafkaSource, blocks: Sequence[Delivery], count: int = 1) -> int:
    """The blocks' messages come again one by one from the retry queue, due now, each
    with delivery count ``count`` (the lock held); returns how many blocks the source
    held. A block let go with its partition, or of a partition being revoked, comes
    again from nowhere: the new owner reads it."""
    now = time.monotonic()
    held = 0
    for d in blocks:
        block = live(src, d)
        if block is None:
            continue
        take(src, block)
        held += 1
        tp, gen = block.tp, block.gen
        if not src._keeps(tp, gen):
            continue
        for off, m in zip(block.offsets, block.messages, strict=True):
            src._bodies[(tp, off)] = (gen, m.value() or b"", delivery_headers(tp, off, m))
            heapq.heappush(src._retry, (now, tp, off, count, gen))
    return held


def let_go(src: KafkaSource, tps: Sequence[Partition]) -> int:
    """Forget the blocks of revoked or lost partitions ``tps`` (the lock held); returns
    how many messages they carried."""
    gone = [b for key, b in src._blocks.items() if key[0] in tps]
    for b in gone:
        take(src, b)
    return sum(len(b.offsets) for b in gone)
