"""A window's fold in Arrow: the common case of :func:`~ackflow.state.partials.contribute`
without a Python step per row.

Taken when every row's outcome is certain to match the row-by-row fold: tumbling or
hopping windows, the built-in ``count``, ``sum``, ``min``, ``max`` and ``avg`` over
integer or float64 columns, keys that are text or integers, and an event time that is
a number (epoch seconds) or a microsecond timestamp. Anything else (a NaN or a -0.0, a time out of
range, an integer sum that could pass 2**63, a float key) returns None and the
row-by-row fold runs, which knows how to fail one row. The results are the same values
(a property test holds the two folds to each other): Arrow sums a group's values in row
order, as the row-by-row fold does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ackflow.sinks.base import ROW_KEY
from ackflow.state.partials import LIMIT_S, YEAR_1_S, outside_years
from ackflow.state.spec import WindowSpec
from ackflow.windows import Hopping, Tumbling

#: the aggregates this fold computes
FNS = frozenset({"count", "sum", "min", "max", "avg"})
#: text a JSON string keeps as it is (printable ASCII but the quote and the backslash)
PLAIN_TEXT = r"^[ !#-\[\]-~]*$"


def fold(
    spec: WindowSpec, rows: pa.Table, row_keys: Sequence[str], watermark: int | None, applied: set[str]
) -> tuple[Any, dict[int, str], list[int]] | None:
    """The partials, failed rows and late rows of ``rows``, as ``contribute`` returns
    them; None if this fold cannot be sure of the same result."""
    from ackflow.state.partials import Partials

    kind = spec.kind
    if not isinstance(kind, (Tumbling, Hopping)) or spec.time is None or not rows.num_rows:
        return None
    if any(a.fn not in FNS for a in spec.aggs):
        return None
    names = set(rows.column_names)
    if spec.time not in names or any(k not in names for k in spec.by):
        return None
    if any(not _key_type(rows.schema.field(k).type) for k in spec.by):
        return None
    inputs: list[pa.ChunkedArray | None] = []
    for a in spec.aggs:
        if a.column is None:
            inputs.append(None)
        elif a.column not in names:
            return None
        elif a.fn == "count":
            inputs.append(rows.column(a.column))
        else:
            col = _number(rows.column(a.column))
            if col is None:
                return None
            inputs.append(col)
    times = _micros(rows.column(spec.time))
    if times is None:
        return None
    t, null_time = times
    n = rows.num_rows
    skip = np.zeros(n, dtype=bool)
    if applied:
        keys_col = rows.column(ROW_KEY) if ROW_KEY in names else pa.array(row_keys, pa.string())
        skip = pc.is_in(keys_col, value_set=pa.array(list(applied), pa.string())).to_numpy(
            zero_copy_only=False
        )
    failed_idx = np.flatnonzero(null_time & ~skip)
    live = ~skip & ~null_time
    late_mask = live & (t < watermark) if watermark is not None else np.zeros(n, dtype=bool)
    take = live & ~late_mask
    idx = np.flatnonzero(take)
    out = Partials(watermark)
    out.applied = int(skip.sum())
    out.late = int(late_mask.sum())
    failed = {int(i): f"event time column {spec.time!r} is null" for i in failed_idx}
    late = np.flatnonzero(late_mask).tolist()
    if not len(idx):
        return out, failed, late
    tt = t[idx]
    # each contributing row once per window it falls in: (row, window start)
    if isinstance(kind, Tumbling):
        members, starts = idx, tt - np.mod(tt, kind.size_us)
    else:
        last = tt - np.mod(tt, kind.every_us)
        picks, begins = [], []
        for j in range(-(-kind.size_us // kind.every_us) + 1):
            s = last - j * kind.every_us
            inside = s > tt - kind.size_us
            picks.append(idx[inside])
            begins.append(s[inside])
        members, starts = np.concatenate(picks), np.concatenate(begins)
        order = np.argsort(members, kind="stable")  # a window's rows in row order: its sums too
        members, starts = members[order], starts[order]
    if len(starts) and outside_years(int(starts.min()), int(starts.max()) + kind.size_us):
        return None  # a window outside the years 1-9999: its rows fail alone, row by row
    for col in inputs:  # an integer sum in Arrow is int64: it must not wrap
        if col is not None and pa.types.is_integer(col.type) and _may_wrap(col, len(members)):
            return None
    where = pa.array(members, pa.int64())
    table = {f"k{j}": rows.column(k).take(where) for j, k in enumerate(spec.by)}
    table["__s"] = pa.array(starts, pa.int64())
    aggs: list[tuple[str, str, Any]] = [("__s", "count", pc.CountOptions("all"))]
    for j, (a, col) in enumerate(zip(spec.aggs, inputs, strict=True)):
        if col is None:
            continue
        table[f"v{j}"] = col.take(where)
        if a.fn == "count":
            aggs.append((f"v{j}", "count", pc.CountOptions("only_valid")))
        elif a.fn == "avg":
            aggs += [(f"v{j}", "sum", None), (f"v{j}", "count", pc.CountOptions("only_valid"))]
        else:
            aggs.append((f"v{j}", a.fn, None))
    if any(pa.types.is_floating(c.type) and _odd_floats(c) for c in table.values()):
        return None
    keys = [f"k{j}" for j in range(len(spec.by))]
    grouped = pa.table(table).group_by([*keys, "__s"], use_threads=False).aggregate(aggs)
    starts = grouped.column("__s")
    cols = {
        "gk": _texts([grouped.column(k) for k in keys], grouped.num_rows).cast(pa.string()),
        "start": starts,
        "end": pc.add(starts, pa.scalar(kind.size_us, pa.int64())),
        "nrows": grouped.column("__s_count"),
    }
    for k in keys:
        cols[k] = grouped.column(k)
    for j, a in enumerate(spec.aggs):
        if inputs[j] is None:  # count(): the rows
            cols[f"a{j}"] = grouped.column("__s_count")
        elif a.fn == "avg":  # (sum, count); the sum of no values is 0, as the row fold's
            total = grouped.column(f"v{j}_sum")
            cols[f"a{j}s"] = total.fill_null(pa.scalar(0, total.type))
            cols[f"a{j}c"] = grouped.column(f"v{j}_count")
        else:
            cols[f"a{j}"] = grouped.column(f"v{j}_{a.fn}")
    out.table = pa.table(cols)
    out.keys = [row_keys[i] for i in idx.tolist()] if len(idx) < n else list(row_keys)
    out.max_t = int(tt.max())
    return out, failed, late


def _key_type(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_integer(t)


def _number(col: pa.ChunkedArray) -> pa.ChunkedArray | None:
    """An aggregate's input as int64 or float64 (the types Python's numbers have), or None."""
    t = col.type
    if pa.types.is_floating(t):
        return col.cast(pa.float64())
    if pa.types.is_integer(t):
        if pa.types.is_uint64(t) and col.null_count < len(col):
            top = pc.max(col).as_py()
            if top is not None and top >= 2**63:
                return None
        return col.cast(pa.int64())
    return None


def _odd_floats(col: pa.ChunkedArray) -> bool:
    """A NaN (its min or max depends on where it stands) or a -0.0 (Arrow's sum starts at
    0.0, the row fold at the first value; min and max keep the first of 0.0 and -0.0)."""
    values = col.fill_null(1.0).to_numpy()
    return bool(np.isnan(values).any() or (np.signbit(values) & (values == 0)).any())


def _may_wrap(col: pa.ChunkedArray, n: int) -> bool:
    bounds = pc.min_max(col).as_py()
    if bounds["min"] is None:
        return False
    return max(abs(bounds["min"]), abs(bounds["max"])) * max(n, 1) >= 2**63


def _micros(col: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray] | None:
    """Event times in microseconds since the epoch (numpy int64) and which are null, as
    ``to_us`` reads them; None where a value needs its own reading (NaN, out of range,
    a unit or type it reads another way)."""
    t = col.type
    null = pc.is_null(col).to_numpy(zero_copy_only=False)
    if pa.types.is_timestamp(t):
        if t.unit != "us":
            return None
        us = col.cast(pa.int64())
        bounds = pc.min_max(us).as_py()
        if bounds["min"] is not None and (
            bounds["min"] < YEAR_1_S * 1_000_000 or bounds["max"] > LIMIT_S * 1_000_000
        ):
            return None
        return us.fill_null(0).to_numpy(), null
    if pa.types.is_integer(t) or pa.types.is_floating(t):
        floating = pa.types.is_floating(t)
        if floating and pc.any(pc.is_nan(col)).as_py():
            return None
        bounds = pc.min_max(col).as_py()
        if bounds["min"] is not None and (bounds["min"] < YEAR_1_S or bounds["max"] > LIMIT_S):
            return None
        if floating:  # round(value * 1_000_000), ties to even, as Python's round
            scaled = pc.round(pc.multiply(col.cast(pa.float64()), 1_000_000.0), round_mode="half_to_even")
            return scaled.fill_null(0).cast(pa.int64()).to_numpy(), null
        return pc.multiply(col.cast(pa.int64()), 1_000_000).fill_null(0).to_numpy(), null
    return None


def _texts(cols: list[pa.ChunkedArray], n: int) -> pa.ChunkedArray | pa.Array:
    """Each group's key text, as ``gk_text`` makes it: built in Arrow when every key is
    an integer or text JSON keeps as it is, else ``gk_text`` per group."""
    from ackflow.state.partials import gk_text

    parts = []
    for col in cols:
        if pa.types.is_integer(col.type):
            parts.append(pc.fill_null(col.cast(pa.string()), "null"))
            continue
        if pc.all(pc.match_substring_regex(col, PLAIN_TEXT)).as_py() is False:
            values = zip(*(c.to_pylist() for c in cols), strict=True)
            return pa.array([gk_text(v) for v in values], pa.string())
        quoted = pc.binary_join_element_wise('"', col, '"', "")
        parts.append(pc.fill_null(quoted, "null"))
    if not parts:
        return pa.array(["[]"] * n, pa.string())
    joined = pc.binary_join_element_wise(*parts, ",") if len(parts) > 1 else parts[0]
    return pc.binary_join_element_wise("[", joined, "]", "")
