"""Columns inferred from rows: every key seen, one type per key (in Spark tasks)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from ackflow.core.schema import empty, prune_nulls
from ackflow.spark.columns import reserved, wide

#: infer_schema() gathers each key's values from the rows' own fields (without the Nones
#: of the rows that lack it) instead of looking every key up in every row. A type Arrow
#: infers from them is the one it infers with the Nones; where Arrow raises, the key is
#: read again with its Nones (Arrow checks a mix of kinds every 100 values, Nones
#: counted, so which value it reaches before it raises depends on them). Tests compare.
BY_ROW_FIELDS = True


def infer_schema(rows: Sequence[dict[str, Any]], step: str) -> pa.Schema:
    """Columns and types from rows: every key seen, types unified across rows.

    Rows are outside data, so nothing in them may stop the run: a reserved ``__af_``
    field makes no column (the rows holding it fail, in :func:`~ackflow.spark.rows.conform`), and a key
    whose values have mixed types takes the type of most of them (ties: the first
    seen); the rows that do not fit fail alone, naming the step and the column. A key
    whose every value is null (or an empty list or object) makes a column of the null
    type: later steps see the field (as None) whatever the batch, and its first value
    evolves the column to that value's type; inside a struct such a field makes no
    field yet (:func:`~ackflow.core.schema.prune_nulls`). Sinks never see a null-typed
    column (:func:`held_columns`)."""
    keys: dict[Any, None] = {}  # in the order first seen
    for r in rows:
        keys.update(dict.fromkeys(r))
    columns: dict[Any, list[Any]] | None = None  # key -> its values, on wide rows
    if BY_ROW_FIELDS and wide(rows, len(keys)):
        columns = {k: [] for k in keys}
        for r in rows:
            for k, v in r.items():
                columns[k].append(v)
    fields = []
    for k in keys:
        if not isinstance(k, str) or reserved(k):
            continue
        t = None
        if columns is not None:
            try:
                t = pa.array([_hollow(v) for v in columns[k]]).type
            except Exception:  # noqa: BLE001 - read again with the Nones, below
                pass
        if t is None:
            values = [_hollow(r.get(k)) for r in rows]
            try:
                t = pa.array(values).type
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError):
                t = _majority_type(values)
                if t is None:
                    continue
        pruned = prune_nulls(t)
        fields.append(pa.field(k, pa.null() if pruned is None else pruned))
    return pa.schema(fields)


def held_columns(schema: pa.Schema, cols: Sequence[str], keys: Sequence[str]) -> list[str]:
    """``cols`` without those of the null type (a field that has held no value yet):
    a sink would have to guess their type, and a table column made as text could never
    take the numbers that come later. A row holds null there, so leaving the column out
    loses nothing; the sink's key columns are always kept (a null key fails its row)."""
    names = set(schema.names)  # (asked per column: a list made each time was quadratic)
    return [c for c in cols if c in keys or c not in names or not pa.types.is_null(schema.field(c).type)]


def _hollow(value: Any) -> Any:
    """``value`` with each empty part (``[]``, ``{}``, or only such) made null: they hold
    nothing, so they give no type (a ``[{}]`` beside ``[true]`` is no conflict)."""
    if empty(value):
        return None
    if isinstance(value, dict):
        return {k: _hollow(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_hollow(v) for v in value]
    return value


def _majority_type(values: list[Any]) -> pa.DataType | None:
    """The Arrow type of the largest group of values of one Python type that Arrow can
    take (numbers of both kinds count as one group); in a group Arrow refuses as a
    whole, the type most of its values take one by one. None if Arrow can hold none of
    them: such a value fails its own message, and never makes a column (one ``2**64``
    must not make a string column that refuses every later integer)."""
    from collections import Counter

    groups: dict[str, list[Any]] = {}
    for v in values:
        if v is None:
            continue
        kind = "number" if isinstance(v, int | float) and not isinstance(v, bool) else type(v).__name__
        groups.setdefault(kind, []).append(v)
    for _, group in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        try:
            return pa.array(group).type
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError):
            pass
        types: Counter[pa.DataType] = Counter()
        for v in group:
            try:
                types[pa.array([v]).type] += 1
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError):
                continue
        if types:
            return types.most_common(1)[0][0]
    return None
