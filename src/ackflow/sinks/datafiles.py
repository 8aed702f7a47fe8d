"""A table's data files: Hive-style partition paths, and the statistics of a file."""

from __future__ import annotations

import json
import os
from typing import Any


def hive_escape(value: str | None) -> str:
    """A partition value as a folder name: every byte outside ``[A-Za-z0-9._-]`` as
    ``%XX`` (so no value can leave its folder)."""
    if value is None:
        return "__HIVE_DEFAULT_PARTITION__"
    return "".join(
        c if c.isascii() and (c.isalnum() or c in "._-") else "".join(f"%{b:02X}" for b in c.encode())
        for c in value
    )


def partition_value(path: str, column: str) -> str | None:
    from urllib.parse import unquote

    for part in path.split(os.sep):
        name, sep, value = part.partition("=")
        if sep and name == column:
            return None if value == "__HIVE_DEFAULT_PARTITION__" else unquote(value)
    return None


def split_partitions(data: Any, columns: list[str]) -> list[tuple[dict[str, str | None], Any]]:
    """Rows grouped by their partition values (as Delta writes them: strings)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    text = [
        pc.cast(data.column(c), pa.string()).to_pylist()
        if not pa.types.is_boolean(data.column(c).type)
        else [None if v is None else str(v).lower() for v in data.column(c).to_pylist()]
        for c in columns
    ]
    groups: dict[tuple[str | None, ...], list[int]] = {}
    for i, values in enumerate(zip(*text, strict=True)):
        groups.setdefault(values, []).append(i)
    return [
        (dict(zip(columns, values, strict=True)), data.take(pa.array(idx))) for values, idx in groups.items()
    ]


#: the longest name of one folder most file systems take (ext4, xfs, btrfs: NAME_MAX)
NAME_MAX = 255


def too_long(data: Any, columns: list[str]) -> dict[int, str]:
    """The rows whose partition value would make a folder name (``column=escaped``)
    longer than :data:`NAME_MAX` bytes, with why: writing them would raise
    ENAMETOOLONG for the whole partition, so they fail alone instead."""
    import pyarrow as pa
    import pyarrow.compute as pc

    out: dict[int, str] = {}
    for c in columns:
        col = data.column(c)
        if pa.types.is_boolean(col.type):
            continue
        text = pc.cast(col, pa.string()).to_pylist()
        long = {v: n for v in set(text) if v is not None and (n := len(f"{c}={hive_escape(v)}")) > NAME_MAX}
        for i, v in enumerate(text):
            if v in long:
                out.setdefault(
                    i,
                    f"partition column {c!r}: its value makes a folder name of {long[v]} bytes "
                    f"(escaped), more than the {NAME_MAX} a file system takes; shorten it in the flow",
                )
    return out


def file_stats(data: Any) -> str:
    """Delta-style statistics: row count, null counts, and min/max of numeric columns."""
    import math

    import pyarrow.compute as pc
    import pyarrow.types as t

    nulls, mins, maxs = {}, {}, {}
    for name in data.column_names:
        col = data.column(name)
        if t.is_nested(col.type):
            continue
        nulls[name] = col.null_count
        if (t.is_integer(col.type) or t.is_floating(col.type)) and col.null_count < len(col):
            mm = pc.min_max(col).as_py()
            if all(
                v is not None and not (isinstance(v, float) and not math.isfinite(v)) for v in mm.values()
            ):
                mins[name], maxs[name] = mm["min"], mm["max"]
    return json.dumps({"numRecords": data.num_rows, "minValues": mins, "maxValues": maxs, "nullCount": nulls})
