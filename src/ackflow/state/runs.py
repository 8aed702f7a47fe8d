"""Applied row keys kept as runs: ``stem + str(n)`` for every n from ``lo`` to ``hi``.

Most row keys end in a number that counts up within their source: a file's line
(``<file>@<id>:<line>``), a Kafka offset (``topic/partition@offset``), a stream's
offset. A batch's keys then make a few runs per stem, and the store keeps a row per run
(table ``applied_runs``) instead of a row per key: a batch of 25 000 lines is one or
two rows to write, to check and to forget, and the state stays small whatever the rate.

A key splits one way only: its stem is the key without its trailing ASCII digits, and
those digits (1 to 18 of them, without a leading zero) are ``n``; so a key and its
(stem, n) name each other. Any other key (no digits at the end, a leading zero, a NUL)
is kept whole in the ``applied`` table as before. Stored runs of one stem never overlap:
a batch whose run meets a stored one is refused (:class:`StateError`), as a key applied
twice always was.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

DIGITS = "0123456789"
#: a run overlapping a stored one, in one statement over a JSON array of [stem, lo, hi]
_CLASH_LITE = (
    "SELECT a.stem, max(a.lo, json_extract(j.value, '$[1]')) FROM json_each(?) j "
    "JOIN applied_runs a ON a.op = ? AND a.stem = json_extract(j.value, '$[0]') "
    "AND a.lo <= json_extract(j.value, '$[2]') AND a.hi >= json_extract(j.value, '$[1]') LIMIT 1"
)
_CLASH_PG = (
    "SELECT a.stem, greatest(a.lo, n.lo) FROM unnest(%s::text[], %s::bigint[], %s::bigint[]) "
    "AS n(stem, lo, hi) JOIN applied_runs a ON a.op = %s AND a.stem = n.stem "
    "AND a.lo <= n.hi AND a.hi >= n.lo LIMIT 1"
)
_PUT_LITE = (
    "INSERT INTO applied_runs (op, stem, lo, hi, at) SELECT ?, json_extract(value, '$[0]'), "
    "json_extract(value, '$[1]'), json_extract(value, '$[2]'), ? FROM json_each(?)"
)
_FIND_LITE = (
    "SELECT a.stem, a.lo, a.hi FROM json_each(?) j JOIN applied_runs a ON a.op = ? "
    "AND a.stem = json_extract(j.value, '$[0]') AND a.lo <= json_extract(j.value, '$[2]') "
    "AND a.hi >= json_extract(j.value, '$[1]')"
)
_FIND_PG = (
    "SELECT a.stem, a.lo, a.hi FROM unnest(%s::text[], %s::bigint[], %s::bigint[]) AS n(stem, lo, hi) "
    "JOIN applied_runs a ON a.op = %s AND a.stem = n.stem AND a.lo <= n.hi AND a.hi >= n.lo"
)


def split(key: str) -> tuple[str, int] | None:
    """``(stem, n)`` with ``key == stem + str(n)``, or None: the key is kept whole.

    >>> split("data.jsonl@a1b2:1207"), split("orders/3@0"), split("x:007"), split("abc")
    (('data.jsonl@a1b2:', 1207), ('orders/3@', 0), None, None)
    """
    stem = key.rstrip(DIGITS)
    digits = key[len(stem) :]
    if not digits or len(digits) > 18 or (digits[0] == "0" and len(digits) > 1) or "\x00" in stem:
        return None
    return stem, int(digits)


def split_many(keys: Sequence[str] | pa.Array | pa.ChunkedArray) -> tuple[pa.Array, np.ndarray]:
    """:func:`split` over many keys at once: each key's stem (null: kept whole) and its
    n (0 where kept whole). The stem is the key with its trailing digits trimmed (in
    Arrow); the digits are read from the keys' bytes (in numpy: a regular expression
    over every key cost eight times as much)."""
    arr = keys if isinstance(keys, (pa.Array, pa.ChunkedArray)) else pa.array(keys, pa.string())
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if not pa.types.is_string(arr.type):
        arr = arr.cast(pa.string())
    stem = pc.utf8_rtrim(arr, characters=DIGITS)
    lengths = [pc.binary_length(a).fill_null(0).to_numpy(zero_copy_only=False) for a in (arr, stem)]
    nd = lengths[0] - lengths[1]  # (a null: no digits, kept whole)
    offsets = np.frombuffer(arr.buffers()[1], dtype=np.int32)[arr.offset : arr.offset + len(arr) + 1]
    data = arr.buffers()[2]
    raw = np.frombuffer(data, dtype=np.uint8) if data is not None and data.size else np.zeros(1, np.uint8)
    first = offsets[1:].astype(np.int64) - nd  # where each key's digits begin
    ok = (nd >= 1) & (nd <= 18)
    lead = np.where(ok, raw[np.clip(first, 0, len(raw) - 1)], 0)
    ok &= ~((lead == ord("0")) & (nd > 1))  # (a leading zero: kept whole)
    if arr.null_count:
        ok &= arr.is_valid().to_numpy(zero_copy_only=False)
    if (raw == 0).any():  # (a NUL somewhere: the keys whose stem holds one are kept whole)
        ok &= ~pc.fill_null(pc.match_substring(stem, "\x00"), True).to_numpy(zero_copy_only=False)
    n = np.zeros(len(arr), dtype=np.int64)
    for j in range(18):
        take = ok & (nd > j)
        if not take.any():
            break
        digit = raw[np.where(take, first + j, 0)].astype(np.int64) - ord("0")
        n = np.where(take, n * 10 + digit, n)
    stems = pc.if_else(pa.array(ok), stem, pa.scalar(None, pa.string()))
    return stems, np.where(ok, n, 0)


def make_runs(keys: Sequence[str]) -> tuple[list[tuple[str, int, int]], list[str], str | None]:
    """A batch's keys as runs, the keys kept whole, and a key given twice (or None)."""
    stems, ns = split_many(keys)
    whole_at = np.flatnonzero(pc.is_null(stems).to_numpy(zero_copy_only=False))
    whole = [keys[i] for i in whole_at.tolist()]
    twice = None
    if len(set(whole)) < len(whole):
        seen: set[str] = set()
        for k in whole:
            if k in seen:
                twice = k
                break
            seen.add(k)
    table = pa.table({"s": stems, "n": ns}).filter(pc.is_valid(stems))
    if not table.num_rows:
        return [], whole, twice
    table = table.sort_by([("s", "ascending"), ("n", "ascending")])
    s_col = table.column("s").combine_chunks()
    n_col = table.column("n").to_numpy()
    new_stem = np.ones(len(n_col), dtype=bool)
    new_stem[1:] = pc.not_equal(s_col[1:], s_col[:-1]).to_numpy(zero_copy_only=False)
    step = np.diff(n_col, prepend=n_col[0] - 1)
    same = ~new_stem & (step == 0)
    if twice is None and same.any():
        i = int(np.flatnonzero(same)[0])
        twice = f"{s_col[i].as_py()}{n_col[i]}"
    first = new_stem | (step != 1)
    firsts = np.flatnonzero(first)
    lasts = np.append(firsts[1:] - 1, len(n_col) - 1)
    run_stems = s_col.take(pa.array(firsts)).to_pylist()
    out = list(zip(run_stems, n_col[firsts].tolist(), n_col[lasts].tolist(), strict=True))
    return out, whole, twice


def clash(db: Any, op: str, runs: Sequence[tuple[str, int, int]], lite: bool) -> str | None:
    """A key of ``runs`` that a stored run of ``op`` holds already, or None."""
    if not runs:
        return None
    if lite:
        row = db.execute(_CLASH_LITE, (json.dumps(runs, ensure_ascii=False), op)).fetchone()
    else:
        row = db.execute(_CLASH_PG, (*_columns(runs), op)).fetchone()
    return None if row is None else f"{row[0]}{row[1]}"


def put(db: Any, op: str, runs: Sequence[tuple[str, int, int]], now: float, lite: bool) -> None:
    if not runs:
        return
    if lite:
        db.execute(_PUT_LITE, (op, now, json.dumps(runs, ensure_ascii=False)))
    else:
        db.executemany(
            "INSERT INTO applied_runs (op, stem, lo, hi, at) VALUES (?, ?, ?, ?, ?)",
            [(op, s, lo, hi, now) for s, lo, hi in runs],
        )


def applied_of(db: Any, op: str, keys: Sequence[str], lite: bool) -> tuple[set[str], list[str]]:
    """Which of ``keys`` stored runs of ``op`` hold, and the keys kept whole (for the
    caller to look up in ``applied``)."""
    stems, ns = split_many(keys)
    valid = pc.is_valid(stems)
    whole = [keys[i] for i in np.flatnonzero(~valid.to_numpy(zero_copy_only=False)).tolist()]
    table = pa.table({"s": stems, "n": ns}).filter(valid)
    if not table.num_rows:
        return set(), whole
    spans = table.group_by("s", use_threads=False).aggregate([("n", "min"), ("n", "max")])
    asked = list(
        zip(
            spans.column("s").to_pylist(),
            spans.column("n_min").to_pylist(),
            spans.column("n_max").to_pylist(),
            strict=True,
        )
    )
    if lite:
        found = db.execute(_FIND_LITE, (json.dumps(asked, ensure_ascii=False), op)).fetchall()
    else:
        found = db.execute(_FIND_PG, (*_columns(asked), op)).fetchall()
    if not found:
        return set(), whole
    held: dict[str, list[tuple[int, int]]] = {}
    for stem, lo, hi in found:
        held.setdefault(stem, []).append((int(lo), int(hi)))
    for spans_of in held.values():
        spans_of.sort()
    out = set()
    for k, stem, n in zip(keys, stems.to_pylist(), ns.tolist(), strict=True):
        have = held.get(stem) if stem is not None else None
        if have:
            i = bisect.bisect_right(have, (n, 2**63)) - 1
            if i >= 0 and have[i][0] <= n <= have[i][1]:
                out.add(k)
    return out, whole


def _columns(runs: Sequence[tuple[str, int, int]]) -> tuple[list[str], list[int], list[int]]:
    return [r[0] for r in runs], [r[1] for r in runs], [r[2] for r in runs]


def migrate(db: Any, lite: bool) -> int:
    """Move the keys an older version kept whole in ``applied`` that split into runs
    (once, when a store is opened): a redelivery after an upgrade is still found.
    Returns how many moved."""
    moved = 0
    if db.execute("SELECT 1 FROM applied LIMIT 1").fetchone() is None:
        return 0
    groups: dict[tuple[str, float], list[str]] = {}
    for op, key, at in db.execute("SELECT op, key, at FROM applied").fetchall():
        groups.setdefault((op, at), []).append(key)
    for (op, at), keys in groups.items():
        runs, whole, _ = make_runs(keys)
        if not runs:
            continue
        put(db, op, runs, at, lite)
        kept = set(whole)
        gone = [(op, k) for k in keys if k not in kept]
        db.executemany("DELETE FROM applied WHERE op = ? AND key = ?", gone)
        moved += len(gone)
    return moved
