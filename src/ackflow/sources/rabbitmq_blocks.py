"""Blocks for the RabbitMQ source (engine/blocks.py): the first deliveries of one pull,
handed to the engine as one :class:`Delivery` of many messages.

A block's ``handle`` is its deliveries (each with its own channel generation and
delivery tag, unsettled on the channel as before); ``parts`` are their identities and
bodies. The engine admits, settles and acks the block as one; the source acks, releases
and gives back its deliveries' own tags, and answers for the block wherever the engine
knows only the block (a lost connection, an ack that never reached the broker).

Only first deliveries join a block (``delivery_count == 1``): a message delivered before
comes alone, so a poison message does not split block after block. A block that fails is
split (:func:`split`): its deliveries, still unsettled on the channel, come again one by
one from ``_again``, each with its own delivery count, and are retried or dead-lettered
as single messages. Blocks are not used when a release could cost a message its last
delivery (a quorum queue's ``x-delivery-limit`` below 1) or with ``headers_field``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, cast

from ackflow.core.settlement import Delivery

if TYPE_CHECKING:
    from ackflow.sources.rabbitmq import RabbitMQSource

#: messages of one block at most
BLOCK_MESSAGES = 4096


def inner(d: Delivery) -> list[Delivery]:
    """The channel's deliveries a delivery stands for: a block's, or itself."""
    return cast(list[Delivery], d.handle) if d.parts is not None else [d]


def expand(deliveries: Iterable[Delivery]) -> list[Delivery]:
    return [x for d in deliveries for x in inner(d)]


def make(src: RabbitMQSource, got: list[Delivery]) -> list[Delivery]:
    """Group the first deliveries of ``got`` into blocks of at most the source's block
    size; the others stay single. None where a give-back could cost a first delivery its
    last (an ``x-delivery-limit`` below 1, perhaps learned from the queue at the start,
    after the engine asked for blocks)."""
    import pyarrow as pa

    size = src.block_size.now
    first = [d for d in got if d.delivery_count == 1]
    limit = src.delivery_limit
    if size <= 1 or len(first) < 2 or (limit is not None and limit < 1):
        return got
    out = [d for d in got if d.delivery_count != 1]
    for i in range(0, len(first), size):
        run = first[i : i + size]
        if len(run) == 1:
            out.append(run[0])
            continue
        gen, first_tag = cast(tuple[int, int], run[0].handle)
        block = Delivery(
            0,
            f"#{gen}:{first_tag}+{len(run)}",  # a label: the engine keys by its parts
            b"",
            {},
            1,
            run,
            messages=len(run),
            parts=([d.identity for d in run], pa.array([d.body for d in run], pa.binary())),
        )
        of = src._block_of
        for d in run:
            of[cast(tuple[int, int], d.handle)] = block
        out.append(block)
    return out


def answer(src: RabbitMQSource, found: Sequence[Delivery]) -> tuple[list[Delivery], dict[int, int]]:
    """The deliveries the engine knows for the channel deliveries ``found`` (a stale ack,
    an unsent one, a lost one): each single itself, each block once; and how many of each
    block's messages were found (by ``id`` of the block: see ``unacked``)."""
    of = src._block_of
    return _by_block(found, lambda d: of.get(cast(tuple[int, int], d.handle)))


def regroup(
    deliveries: Sequence[Delivery], found: Sequence[Delivery]
) -> tuple[list[Delivery], dict[int, int]]:
    """As :func:`answer`, for channel deliveries ``found`` of ``deliveries`` (the blocks
    and singles given to a call; the source's own map may be gone: a lost connection
    clears it)."""
    owner = {id(x): d for d in deliveries if d.parts is not None for x in inner(d)}
    return _by_block(found, lambda x: owner.get(id(x)))


def _by_block(
    found: Sequence[Delivery], block_of: Callable[[Delivery], Delivery | None]
) -> tuple[list[Delivery], dict[int, int]]:
    """``found`` with each delivery of a block (``block_of``) replaced by its block, once,
    and how many of each block's deliveries were found."""
    out: list[Delivery] = []
    counts: dict[int, int] = {}
    for d in found:
        block = block_of(d)
        if block is None:
            out.append(d)
            continue
        if id(block) not in counts:
            out.append(block)
            counts[id(block)] = 0
        counts[id(block)] += 1
    return out, counts


def remember(src: RabbitMQSource, counts: dict[int, int]) -> None:
    """Keep how many of each stale block's messages were not acked (``unacked``, by the
    block's ``id``): merged, not replaced (the engine may ack in two calls before it
    asks), and set again for every block each answer names, so an ``id`` a freed block
    left is never read for another."""
    if len(src._unacked) > 10_000:
        src._unacked.clear()
    src._unacked.update(counts)


def split(src: RabbitMQSource, blocks: Sequence[Delivery]) -> None:
    """Failed blocks: their deliveries come again one by one (still unsettled on the
    channel: the broker spent no delivery on them)."""
    src.block_size.split(len(blocks))
    for b in blocks:
        for d in inner(b):
            src._block_of.pop(cast(tuple[int, int], d.handle), None)
            if src._live(d):
                src._again.append(d)


def forget(src: RabbitMQSource, tags: Iterable[int]) -> None:
    """Tags the channel settled (or lost): they belong to no block any more."""
    if src._block_of:
        gen, of = src._gen, src._block_of
        for tag in tags:
            of.pop((gen, tag), None)
