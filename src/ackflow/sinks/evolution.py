"""How a table sink's columns grow with the flow's schema (``evolve=True``).

:func:`evolved` merges the flow's columns into a table's: a column the table lacks is
added (nullable), a field a struct lacks is added inside it (also a struct inside a
list or a map value), and a type widens where the table format allows it (``promote``:
the sink's rule; never narrowed). What cannot be merged (a string into a number, a
widening the format cannot make) keeps the table's type and is left to the sink's
refusal path (:class:`~ackflow.core.errors.ColumnsRefused`: value by value in the
table's type, or the rows holding a value fail alone). The result depends only on the
two schemas, so a prepare repeated after a crash, or after another process evolved the
table first, finds nothing left to do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Promote = Callable[[Any, Any], bool]


def _small_int(t: Any) -> bool:
    import pyarrow.types as pt

    return bool(pt.is_int8(t) or pt.is_int16(t) or pt.is_int32(t))


def promote_ints(have: Any, want: Any) -> bool:
    """int8/16/32 -> int64 and float32 -> float64 (Iceberg's promotions)."""
    import pyarrow.types as pt

    return bool(
        (_small_int(have) and pt.is_int64(want))
        or (pt.is_float32(have) and pt.is_float64(want))
        or (pt.is_int8(have) and (pt.is_int16(want) or pt.is_int32(want)))
        or (pt.is_int16(have) and pt.is_int32(want))
    )


def promote_parquet(have: Any, want: Any) -> bool:
    """:func:`promote_ints`, and int8/16/32 -> float64: the promotions Spark 4 reads in
    older Parquet files (measured: int8/16/32 files read as bigint or double, float as
    double; an INT64 file read as double fails with PARQUET_COLUMN_DATA_TYPE_MISMATCH)."""
    import pyarrow.types as pt

    return promote_ints(have, want) or bool(_small_int(have) and pt.is_float64(want))


def promote_none(have: Any, want: Any) -> bool:
    """No widening (Delta through delta-rs 1.6: no ``typeWidening`` table feature)."""
    return False


def _lists(t: Any) -> bool:
    import pyarrow.types as pt

    return bool(pt.is_list(t) or pt.is_large_list(t))


def merge_type(have: Any, want: Any, promote: Promote, path: str, changes: list[str]) -> Any | None:
    """The type a column of type ``have`` becomes to take values of type ``want``
    (``have`` itself when nothing changes), appending what changed to ``changes``; None
    when the two do not merge (the table's type is kept and the sink refuses)."""
    import pyarrow as pa
    import pyarrow.types as pt

    from ackflow.sinks.conform import can_take

    if have.equals(want) or pt.is_null(want):
        return have
    if pt.is_null(have):  # held no value yet (a field null in every row, an empty list)
        changes.append(f"{path}: null -> {want}")
        return want
    if pt.is_struct(have) and pt.is_struct(want):
        fields, names = [], set()
        for i in range(have.num_fields):
            f = have.field(i)
            names.add(f.name)
            j = want.get_field_index(f.name)
            if j < 0:
                fields.append(f)
                continue
            t = merge_type(f.type, want.field(j).type, promote, f"{path}.{f.name}", changes)
            if t is None:
                return None
            fields.append(f.with_type(t))
        for i in range(want.num_fields):
            f = want.field(i)
            if f.name not in names:
                fields.append(f.with_nullable(True))
                changes.append(f"new field {path}.{f.name} ({f.type})")
        return pa.struct(fields)
    if _lists(have) and _lists(want):
        t = merge_type(have.value_type, want.value_type, promote, f"{path}[]", changes)
        if t is None:
            return None
        field = have.value_field.with_type(t)
        return pa.large_list(field) if pt.is_large_list(have) else pa.list_(field)
    if pt.is_map(have) and pt.is_map(want):
        t = merge_type(have.item_type, want.item_type, promote, f"{path}{{}}", changes)
        if t is None or not can_take(want.key_type, have.key_type):
            return None
        return pa.map_(have.key_field, have.item_field.with_type(t), keys_sorted=have.keys_sorted)
    if promote(have, want):
        changes.append(f"{path}: {have} -> {want}")
        return want
    return have if can_take(want, have) else None


def evolved(
    table: Any, incoming: Any, promote: Promote, holds: Callable[[Any], bool] | None = None
) -> tuple[Any, list[str]]:
    """``table``'s schema grown to take ``incoming``'s columns, and what changed (empty:
    nothing to do). Columns that do not merge, and new columns ``holds(field)`` says the
    format cannot hold, are left as they are (the sink then refuses them)."""
    import pyarrow as pa

    changes: list[str] = []
    fields = []
    for f in table:
        j = incoming.get_field_index(f.name)
        if j < 0:
            fields.append(f)
            continue
        mine: list[str] = []
        t = merge_type(f.type, incoming.field(j).type, promote, f.name, mine)
        if t is None or (mine and holds is not None and not holds(f.with_type(t))):
            fields.append(f)
            continue
        changes.extend(mine)
        fields.append(f.with_type(t))
    for f in incoming:
        if f.name not in table.names and (holds is None or holds(f)):
            fields.append(f.with_nullable(True))
            changes.append(f"new column {f.name} ({f.type})")
    return pa.schema(fields, metadata=table.metadata), changes
