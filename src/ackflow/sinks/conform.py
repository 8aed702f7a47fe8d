"""Arrow data cast to a table's columns, value by value where a whole column will not go.

Used by the table sinks (Delta Lake, Iceberg, Parquet) in their tasks: a row that
does not fit the table fails its own message, with the column and the value; the
other rows are written.
"""

from __future__ import annotations

from typing import Any


def can_take(src: Any, dst: Any) -> bool:
    """Whether a column of type ``src`` can be written into one of type ``dst`` (value by
    value: an integer that does not fit fails its row; a string never becomes a number)."""
    import pyarrow.types as t

    if src.equals(dst) or t.is_null(src):
        return True
    if t.is_struct(src) and t.is_struct(dst):
        names = {dst.field(i).name: dst.field(i).type for i in range(dst.num_fields)}
        return all(
            src.field(i).name in names and can_take(src.field(i).type, names[src.field(i).name])
            for i in range(src.num_fields)
        )
    lists = (t.is_list, t.is_large_list, t.is_list_view, t.is_large_list_view)
    if any(f(src) for f in lists) and any(f(dst) for f in lists):
        return can_take(src.value_type, dst.value_type)
    if t.is_map(src) and t.is_map(dst):
        return can_take(src.key_type, dst.key_type) and can_take(src.item_type, dst.item_type)
    a, b = _kind(src), _kind(dst)
    return a is not None and (a == b or (a, b) in {("int", "float"), ("int", "decimal")})


def _kind(x: Any) -> str | None:
    import pyarrow.types as t

    kinds = [
        ("bool", t.is_boolean),
        ("int", t.is_integer),
        ("float", t.is_floating),
        ("decimal", t.is_decimal),
        ("timestamp", t.is_timestamp),
        ("date", t.is_date),
        ("time", t.is_time),
        ("string", lambda y: t.is_string(y) or t.is_large_string(y) or t.is_string_view(y)),
        (
            "binary",
            lambda y: (
                t.is_binary(y) or t.is_large_binary(y) or t.is_binary_view(y) or t.is_fixed_size_binary(y)
            ),
        ),
    ]
    return next((name for name, check in kinds if check(x)), None)


def conform(data: Any, target: Any) -> tuple[Any, dict[int, str]]:
    """``data`` with ``target``'s columns and types, and the rows that cannot have them
    (row index -> why). Columns the flow lacks are null; a value that does not fit its
    column's type, or a null in a NOT NULL column, fails that row only."""
    import pyarrow as pa

    n = data.num_rows
    failed: dict[int, str] = {}
    arrays = []
    for field in target:
        if field.name not in data.column_names:
            arrays.append(pa.nulls(n, field.type))
            continue
        col = data.column(field.name)
        if pa.types.is_nested(col.type) and not col.type.equals(field.type):
            # a cast to a struct without some field drops its values silently: fail the
            # rows that hold one instead (the rows without lose nothing)
            for path, rows in outside_fields(col.combine_chunks(), field.type, field.name).items():
                for i in rows:
                    failed.setdefault(
                        i,
                        f"column {field.name!r}: the table has no field "
                        f"{path!r} (its type is {field.type}); the row's "
                        "value there would be lost",
                    )
        try:
            arrays.append(col.cast(field.type, safe=True))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OverflowError):
            values = []
            for i in range(n):
                one = col.slice(i, 1)
                try:
                    values.append(one.cast(field.type, safe=True).combine_chunks())
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OverflowError) as e:
                    failed.setdefault(
                        i, f"column {field.name!r}: cannot store {_value(one)} as {field.type}: {e}"
                    )
                    values.append(pa.nulls(1, field.type))
            arrays.append(pa.concat_arrays(values) if values else pa.nulls(0, field.type))
        if not field.nullable and arrays[-1].null_count:
            for i, v in enumerate(arrays[-1].is_null().to_pylist()):
                if v:
                    failed.setdefault(i, f"column {field.name!r} is NOT NULL and the row has no value")
    return pa.table(arrays, schema=target), failed


def outside_fields(array: Any, dst: Any, path: str) -> dict[str, list[int]]:
    """Nested fields of ``array`` that type ``dst`` lacks (a struct field, also inside
    lists and map values), each with the rows (indexes into ``array``) holding a
    non-null value there."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.types as t

    out: dict[str, list[int]] = {}
    src = array.type
    valid = np.asarray(array.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
    if t.is_struct(src) and t.is_struct(dst):
        for i in range(src.num_fields):
            name = src.field(i).name
            child = array.field(i)
            j = dst.get_field_index(name)
            if j < 0:
                held = valid & np.asarray(child.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
                if held.any():
                    out[f"{path}.{name}"] = np.flatnonzero(held).tolist()
                continue
            for p, rows in outside_fields(child, dst.field(j).type, f"{path}.{name}").items():
                kept = [r for r in rows if valid[r]]
                if kept:
                    out[p] = kept
        return out
    lists = (t.is_list, t.is_large_list)
    maps = t.is_map(src) and t.is_map(dst)
    if maps or (any(f(src) for f in lists) and any(f(dst) for f in lists)):
        # a map's entries as a list of its values (null entries hold none)
        flat = pa.ListArray.from_arrays(array.offsets, array.items) if maps else array
        values = flat.flatten()
        parents = pc.list_parent_indices(flat).to_numpy(zero_copy_only=False)
        inner = dst.item_type if maps else dst.value_type
        for p, rows in outside_fields(values, inner, f"{path}[]").items():
            out[p] = sorted({int(parents[r]) for r in rows})
    return out


def _value(one: Any) -> str:
    """One value of an Arrow array, shown short; never raises (a date Python cannot
    hold is shown as Arrow prints it)."""
    try:
        return _short(one[0].as_py())
    except Exception:  # noqa: BLE001 - outside bytes: showing them must not fail the row set
        try:
            return _short(str(one[0]))
        except Exception:  # noqa: BLE001
            return f"a {one.type} value"


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."
