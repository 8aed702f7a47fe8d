"""A block's lines as input rows (see :mod:`ackflow.engine.blocks`), made in Arrow.

A block of lines (the Files source) is one delivery whose body is the raw bytes of lines
``first`` to ``last`` of one file (numbered from 1, each ending in ``\\n`` but perhaps the
file's last) and whose key is ``<stem><first>-<last>``; line ``n`` alone would have been
the message ``<stem><n>`` with the body ``line.rstrip(b"\\r\\n")``, and a line of ASCII
white space only is no message. :func:`block_rows` makes exactly those rows, one per
message, in C (Arrow's kernels, numpy): the driver does no work per line.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ackflow.core.settlement import Delivery
from ackflow.spark.columns import row_key

#: bodies of blocks made into one array at most (a binary array holds 2 GiB)
BODIES_IN_ONE = 1 << 30
#: a line with only these bytes is no message (``bytes.isspace``; empty too)
BLANK = r"^[ \t\n\r\x0b\x0c]*$"


def stem_and_first(key: str) -> tuple[str, int]:
    """A block key's stem and first line: ``("f@id:", 3)`` for ``"f@id:3-9"``.

    >>> stem_and_first("a:b@x1:3-9")
    ('a:b@x1:', 3)
    """
    cut = key.rindex(":") + 1
    return key[:cut], int(key[cut:].split("-", 1)[0])


def block_rows(blocks: Sequence[Delivery], schema: pa.Schema, names: Sequence[str]) -> pa.Table:
    """The input rows of ``blocks``: ``names`` are the lineage, key, body, origin and
    headers columns of ``schema`` (the headers null: a source with a headers field pulls
    no blocks)."""
    lineage, key_col, body_col, origin_col, headers_col = names
    lists = pc.split_pattern(pa.array([d.body for d in blocks], pa.binary()), b"\n")
    lines = pc.list_flatten(lists)
    parents = pc.list_parent_indices(lists)
    parent = parents.to_numpy(zero_copy_only=False)
    offsets = lists.offsets.to_numpy()
    stems, firsts = [], []
    for d in blocks:
        stem, first = stem_and_first(d.key)
        # the message's identity, as Delivery.identity makes it (origin prefix)
        stems.append(Delivery(0, stem, b"", origin=d.origin).identity)
        firsts.append(first)
    numbers = np.asarray(firsts, np.int64)[parent] + (np.arange(len(parent)) - offsets[:-1][parent])
    if any(b"\r" in d.body for d in blocks):
        lines = pc.replace_substring_regex(lines, pattern="\r+$", replacement="")
    keep = pc.invert(pc.match_substring_regex(lines, pattern=BLANK))
    keys = pc.binary_join_element_wise(
        pa.array(stems, pa.string()).take(parents), pa.array(numbers).cast(pa.string()), ""
    )
    table = pa.table(
        {
            lineage: pa.array([d.lineage_id for d in blocks], pa.int64()).take(parents),
            key_col: keys,
            body_col: lines,
            origin_col: pa.array([d.origin for d in blocks], pa.int32()).take(parents),
            headers_col: pa.nulls(len(parent), pa.string()),
        },
        schema=schema,
    )
    return table.filter(keep)


def parts_rows(blocks: Sequence[Delivery], schema: pa.Schema, names: Sequence[str]) -> pa.Table:
    """The input rows of blocks of separate messages (``Delivery.parts``: identities and
    bodies, made by their source), one per message, keyed as each alone would be."""
    lineage, key_col, body_col, origin_col, headers_col = names
    counts = [d.messages for d in blocks]
    n = sum(counts)
    return pa.table(
        {
            lineage: pa.array(np.repeat(np.asarray([d.lineage_id for d in blocks], np.int64), counts)),
            key_col: pa.array([row_key(i) for d in blocks for i in d.parts[0]], pa.string()),
            body_col: _bodies([c for d in blocks for c in _chunks(d.parts[1])]),
            origin_col: pa.array(np.repeat(np.asarray([d.origin for d in blocks], np.int32), counts)),
            headers_col: pa.nulls(n, pa.string()),
        },
        schema=schema,
    )


def _bodies(chunks: list[pa.Array]) -> pa.Array | pa.ChunkedArray:
    """The blocks' bodies as one array; chunked, not copied into one, where together
    they pass what one binary array holds (2 GiB). (Each chunk becomes a batch of its
    own, and a Spark partition: one array for the usual case.)"""
    if sum(c.nbytes for c in chunks) < BODIES_IN_ONE:
        return pa.concat_arrays(chunks)
    return pa.chunked_array(chunks, pa.binary())


def _chunks(bodies: pa.Array | pa.ChunkedArray) -> list[pa.Array]:
    """A block's bodies as arrays (``pa.array`` makes a chunked one past 2 GiB)."""
    return bodies.chunks if isinstance(bodies, pa.ChunkedArray) else [bodies]
