"""ackflow's own columns on every row inside a Spark task, and the rules for names.

Each row carries its message's lineage id (``__af_id``, or the member ids after a
group_by), its key, and its status (live, filtered, or failed with the step and the
error). User fields may not take these names, nor any name Spark cannot address.
"""

from __future__ import annotations

import array
import itertools
import threading
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from ackflow.core.ledger import RECEIPT_SCHEMA
from ackflow.sinks.base import ROW_KEY

ID, BODY, STATUS, STEP, ERR = "__af_id", "__af_body", "__af_status", "__af_step", "__af_err"
SRC = "__af_src"  # the index of the message's source (merged flows)
RESERVED = "__af_"  # the prefix of ackflow's own columns; user fields may not use it
HDR = "__af_hdr"  # JSON {field: headers} to add to the first row, for sources that ask
IDS = "__af_ids"  # after a group_by: the ids of every member message of the row
KEY = ROW_KEY  # the row's deterministic key: its message's identity + its position
LIVE, FILTERED, FAILED = 0, 1, 2
LOCAL_TASK = threading.local()  # the in-process executor's task: its partition id


def local_partition() -> int:
    """The partition id of a task of the in-process executor (0 outside one)."""
    return int(getattr(LOCAL_TASK, "partition", 0))


def internal_schema(lineage: str = ID) -> pa.Schema:
    """The internal columns: lineage (one id, or a list after grouping), key and status."""
    id_type = pa.int64() if lineage == ID else pa.list_(pa.int64())
    return pa.schema(
        [
            (lineage, id_type),
            (KEY, pa.string()),
            (STATUS, pa.int32()),
            (STEP, pa.string()),
            (ERR, pa.string()),
        ]
    )


def row_key(identity: str) -> str:
    """The key of a message's first row: its identity, unless the identity ends like a
    suffix ackflow adds (``#n`` for a flat_map child, ``~n`` for a repeat) or like the
    mark itself (``!``): then with a ``!`` after it.

    So no message's key is the key of another message's child or repeat (message
    ``a#1`` and the second child of message ``a`` would otherwise both be ``a#1``, and
    a keyed sink would keep one row of the two): a row key is ``row_key(identity)``,
    then any number of ``#n`` and ``~n``, and read from the right it names one message
    and one position.

    >>> row_key("a"), row_key("a#1"), row_key("#7"), row_key("b~2"), row_key("c!")
    ('a', 'a#1!', '#7!', 'b~2!', 'c!!')
    """
    if identity.endswith("!"):
        return identity + "!"
    # ends in ``#`` or ``~`` and digits? (string methods: a third of a regex's time for
    # keys ending in digits, such as a file's line number)
    stem = identity.rstrip("0123456789")
    return identity + "!" if stem != identity and stem.endswith(("#", "~")) else identity


def child_key(key: str, index: int) -> str:
    """The key of the ``index``-th row a flat_map made of the row keyed ``key``."""
    return f"{key}#{index}"


TASK_RECEIPTS = RECEIPT_SCHEMA.append(pa.field("token", pa.binary()))


def fold(name: str) -> str:
    """A name as Spark's case-insensitive resolution sees it: Java's ``equalsIgnoreCase``
    matches two chars when the lower case of their upper cases agree (so the dotless i and
    ``i``, the long s and ``s``, the final and the plain sigma match). Names with one fold
    are one column to Spark."""
    out = []
    for c in name:
        u = c.upper()
        low = (u if len(u) == 1 else c).lower()
        out.append(low[0] if low else c)
    return "".join(out)


def reserved(name: str) -> bool:
    """Whether a name is (a case variant of) one of ackflow's own column names."""
    return fold(name).startswith(RESERVED)


def unaddressable(name: str) -> str | None:
    """Why Spark cannot address a column of this name (PySpark's own ``mapInArrow``
    looks every column up by name), or None."""
    if name == "" or name == "*":
        return "an empty name or '*' cannot be a Spark column"
    if "." in name or "`" in name:
        return "a name with '.' or '`' cannot be a Spark column (Spark reads it as a path)"
    return None


def wide(rows: Sequence[Any], columns: int) -> bool:
    """Whether rows are worth reading by their own fields rather than column by column:
    more than 8 columns, every row a plain ``dict`` (another mapping may read its items
    otherwise than it is looked up), and the columns more than twice the fields a row
    has (counted over the first 64 rows).

    >>> wide([{"a": 1}] * 3, 20), wide([{"a": 1}] * 3, 8), wide([dict.fromkeys("abcdefghij")], 12)
    (True, False, False)
    """
    if columns <= 8 or any(type(r) is not dict for r in rows):
        return False
    seen = sum(len(r) for r in itertools.islice(rows, 64))
    return columns * min(len(rows), 64) > 2 * seen


def rows_table(rows: list[dict[str, Any]], schema: pa.Schema) -> pa.Table:
    """``pa.Table.from_pylist(rows, schema=schema)``, the same table and the same errors,
    at a cost that follows the fields the rows have rather than the columns there are
    when the columns are many more than a row's fields (wide, sparse data: a column per
    optional field). ``from_pylist`` looks each column up in each row; here each row's
    own fields are placed once, and a column no row has is all nulls.

    >>> t = rows_table([{"a": 1}, {"b": "x", "z": 0}], pa.schema([("a", pa.int64()), ("b", pa.string())]))
    >>> t.to_pylist()
    [{'a': 1, 'b': None}, {'a': None, 'b': 'x'}]
    """
    n, width = len(rows), len(schema)
    place = {name: j for j, name in enumerate(schema.names)}
    if len(place) != width or not wide(rows, width):  # two columns of one name, or narrow
        return pa.Table.from_pylist(rows, schema=schema)  # (from_pylist is faster there)
    where: list[list[int] | None] = [None] * width  # per column: the rows that have it
    values: list[list[Any]] = [[] for _ in range(width)]  # and their values, in row order
    for i, r in enumerate(rows):
        for k, v in r.items():
            j = place.get(k)
            if j is not None:
                at = where[j]
                if at is None:
                    where[j] = [i]
                else:
                    at.append(i)
                values[j].append(v)
    nothing: list[Any] | None = None
    arrays: list[pa.Array] = []  # converted one by one in the columns' order, as from_pylist
    for j, f in enumerate(schema):  # does (the first column that cannot be raises)
        at = where[j]
        if at is None:  # a column no row has
            nothing = nothing or [None] * n
            arrays.append(pa.array(nothing, f.type))
        elif len(at) * 8 >= n:  # dense enough: the column's list, as from_pylist makes it
            full: list[Any] = [None] * n
            for i, v in zip(at, values[j], strict=True):
                full[i] = v
            arrays.append(pa.array(full, f.type))
        else:  # sparse: its values converted alone (the same conversion, without the
            arrays.append(_spread(pa.array(values[j], f.type), at, n))  # Nones), then spread
    return pa.Table.from_arrays(arrays, schema=schema)


def _spread(got: pa.Array, at: list[int], n: int) -> pa.Array:
    """An array of ``n`` with ``got[p]`` at row ``at[p]`` and null elsewhere (``at``
    increasing): Arrow's ``take`` over an index that is null where no value is."""
    index = array.array("i", bytes(4 * n))
    valid = bytearray((n + 7) // 8)
    for p, i in enumerate(at):
        index[i] = p
        valid[i >> 3] |= 1 << (i & 7)
    buffers = [pa.py_buffer(valid), pa.py_buffer(index)]
    return pc.take(got, pa.Array.from_buffers(pa.int32(), n, buffers, null_count=n - len(at)))
