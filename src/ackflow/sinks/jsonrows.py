"""Rows as JSON, written the same way by every sink that writes JSON (the embedded
queue, RabbitMQ, PostgreSQL's ``jsonb`` columns).

Every Spark SQL type a flow can produce has one JSON form, chosen so that nothing is
lost or invented and ackflow's own strict decoder reads it back:

=====================  ==========================================================
Spark type             JSON
=====================  ==========================================================
timestamp              ISO 8601 with its offset: ``"2024-01-02T03:04:05+00:00"``
timestamp_ntz          ISO 8601 without an offset: ``"2024-01-02T03:04:05"``
date, time             ISO 8601: ``"2024-01-02"``, ``"03:04:05"``
decimal                a string holding the exact value: ``"12.34"`` (a JSON number
                       would be read back as a binary float by most consumers)
binary                 base64 (as Spark's ``to_json``): ``"aGVsbG8="``
day-time interval      ISO 8601 duration: ``"P1DT3.5S"``
map                    an object; keys become strings (``{"1": "a"}``)
struct                 an object
array                  an array
float/double NaN, ±∞   refused: the row fails alone, naming the field (JSON has no
                       such numbers; ackflow's decoder refuses them)
=====================  ==========================================================

>>> import pyarrow as pa, datetime as dt, decimal
>>> t = pa.table({"t": pa.array([dt.datetime(2024, 1, 2, 3, 4, 5)], pa.timestamp("us", "UTC")),
...               "d": pa.array([decimal.Decimal("12.34")], pa.decimal128(10, 2)),
...               "m": pa.array([[("k", 1)]], pa.map_(pa.string(), pa.int64())),
...               "x": pa.array([float("nan")])})
>>> json_records(t.drop_columns(["x"]))
[b'{"t": "2024-01-02T03:04:05+00:00", "d": "12.34", "m": {"k": 1}}']
>>> json_records(t)[0][:61]
"field 'x': a NaN or infinite number cannot be written as JSON"
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import math
from collections.abc import Callable
from decimal import Decimal
from typing import Any

__all__ = ["json_ready", "json_records", "needs_conversion"]


def needs_conversion(t: Any) -> bool:
    """True if values of Arrow type ``t`` are not plain JSON as ``to_pylist`` gives them."""
    import pyarrow as pa

    if pa.types.is_struct(t):
        return any(needs_conversion(t.field(i).type) for i in range(t.num_fields))
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return needs_conversion(t.value_type)
    return not (
        pa.types.is_integer(t)
        or pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_boolean(t)
        or pa.types.is_floating(t)
        or pa.types.is_null(t)
    )


def _converter(t: Any) -> Callable[[Any], Any]:
    """A function from a value of Arrow type ``t`` (as ``to_pylist`` gives it, never None)
    to its JSON form."""
    import pyarrow as pa

    if not needs_conversion(t):
        return lambda v: v
    if pa.types.is_timestamp(t) or pa.types.is_date(t) or pa.types.is_time(t):
        return lambda v: v.isoformat()
    if pa.types.is_decimal(t):
        return lambda v: str(v) if not isinstance(v, Decimal) else format(v, "f")
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return lambda v: base64.b64encode(v).decode("ascii")
    if pa.types.is_duration(t):
        return _duration
    if pa.types.is_map(t):
        key, item = _converter(t.key_type), _converter(t.item_type)
        return lambda v: {_map_key(key(k)): (None if x is None else item(x)) for k, x in v}
    if pa.types.is_struct(t):
        fields = [(t.field(i).name, _converter(t.field(i).type)) for i in range(t.num_fields)]
        return lambda v: {n: (None if v.get(n) is None else c(v[n])) for n, c in fields}
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        each = _converter(t.value_type)
        return lambda v: [None if x is None else each(x) for x in v]
    return str  # an Arrow type Spark does not produce: its text, never dropped


def _map_key(k: Any) -> str:
    return k if isinstance(k, str) else json.dumps(k)


def _duration(v: dt.timedelta) -> str:
    sign = "-" if v < dt.timedelta(0) else ""
    v = abs(v)
    seconds = f"{v.seconds}.{v.microseconds:06d}".rstrip("0").rstrip(".")  # exact, no float
    return f"{sign}P{v.days}DT{seconds}S"


def json_ready(value: Any, t: Any) -> Any:
    """``value`` (of Arrow type ``t``, as ``to_pylist`` gives it) in its JSON form."""
    return None if value is None else _converter(t)(value)


def _bad_number(value: Any, path: str) -> str | None:
    """The path of the first NaN or infinity inside ``value``, if any."""
    if isinstance(value, float):
        return path if not math.isfinite(value) else None
    if isinstance(value, dict):
        for k, v in value.items():
            found = _bad_number(v, f"{path}.{k}")
            if found:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = _bad_number(v, f"{path}[{i}]")
            if found:
                return found
    return None


def json_records(table: Any) -> list[bytes | str]:
    """Each row of ``table`` (a ``pyarrow.Table``) as UTF-8 JSON bytes, or, for a row
    that cannot be JSON (a NaN or infinity in it), the reason as a string: that row
    fails alone."""
    columns = []
    for col in table.columns:
        values = col.to_pylist()
        if needs_conversion(col.type):
            convert = _converter(col.type)
            values = [None if v is None else convert(v) for v in values]
        columns.append(values)
    names = table.column_names
    out: list[bytes | str] = []
    for row in zip(*columns, strict=True) if columns else ([()] * table.num_rows):
        record = dict(zip(names, row, strict=True))
        try:
            out.append(json.dumps(record, allow_nan=False).encode())
        except ValueError:
            path = next((p for n, v in record.items() if (p := _bad_number(v, n))), "?")
            out.append(
                f"field {path!r}: a NaN or infinite number cannot be written as JSON "
                "(JSON has neither); map it to null or a string first"
            )
    return out
