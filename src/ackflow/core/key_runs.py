"""Row keys kept as runs: a key manifest holds ``(stem, marks, first, last)`` rows, not one
row per key, so that a batch of a file's lines (``<file>:1`` ... ``<file>:10000``), a
queue's row ids (``#1!`` ...), a Kafka partition's offsets or a flat_map's children cost
the driver one insert, not ten thousand.

A key is ``stem + str(n) + "!" * marks``: ``marks`` the ``!`` it ends with (the mark
``row_key`` adds), ``n`` the digits before them read as an integer when they are written
the way ``str`` writes an integer (no leading zero, at most 18 digits), and ``stem`` the
rest (never ending in a digit; the split of :mod:`ackflow.state.runs`). Any other key
(``abc``, ``x05``, an empty key, a stem holding NUL) is the run ``(key, 0, -1, -1)``.
The mapping is one to one: a numbered key's stem never ends in a digit and its ``n`` is
at least 0, so it never meets another key's run.

The runs of a manifest never overlap (each insert checks), so a key ``(s, m, n)`` was
written iff the run of ``(s, m)`` with the greatest ``first <= n`` has ``last >= n``: one
search of the primary key ``(stem, marks, first)``.

The runs are computed where the rows are (a writer's task), with Arrow's kernels: about
0.1 us a key, measured at 10 000 keys of one file."""

import itertools
import json
import sqlite3
from typing import Any

# the manifest's table of runs
SCHEMA = (
    "CREATE TABLE IF NOT EXISTS key_runs (stem TEXT NOT NULL, marks INTEGER NOT NULL,"
    " first INTEGER NOT NULL, last INTEGER NOT NULL, at REAL NOT NULL, batch TEXT,"
    " PRIMARY KEY (stem, marks, first)) WITHOUT ROWID"
)

# the runs of a JSON text (``[[stem, marks, first, last], ...]``) as a table ``runs``
# (json_extract, not ``->>``: that needs SQLite 3.38, and Debian 11 or Ubuntu 22.04 have
# older ones)
_RUNS_OF_TEXT = (
    "WITH runs (stem, marks, first, last) AS (SELECT json_extract(value, '$[0]'), "
    "json_extract(value, '$[1]'), json_extract(value, '$[2]'), json_extract(value, '$[3]') "
    "FROM json_each(?))"
)


def _last_run(row: str, upto: str) -> str:
    """SQL: the ``last`` of the run of ``row``'s stem and marks with the greatest
    ``first <= row.upto`` (runs never overlap: the only one that can hold ``row.upto``),
    or -2 when there is none."""
    return (
        f"coalesce((SELECT r.last FROM key_runs AS r WHERE r.stem = {row}.stem AND r.marks = {row}.marks "
        f"AND r.first <= {row}.{upto} ORDER BY r.first DESC LIMIT 1), -2)"
    )


_INSERT = "INSERT INTO key_runs (stem, marks, first, last, at, batch) VALUES (?, ?, ?, ?, ?, ?)"


def parts(keys: Any) -> list[tuple[str, int, int]]:
    """Each key's ``(stem, marks, n)``, in the keys' order (``keys``: a list of str)."""
    stems, marks, n = _parts(keys)
    return list(zip(stems.to_pylist(), marks.to_pylist(), n.to_pylist(), strict=True))


def _parts(keys: Any) -> tuple[Any, Any, Any]:
    """Each key's stem, marks and ``n``, as three Arrow arrays in the keys' order (``keys``:
    a pyarrow string array or a list of str, no nulls). The key without its marks is
    split as the window state's applied keys are (:func:`ackflow.state.runs.split_many`:
    trailing digits without a leading zero, at most 18); a key that does not split is
    its own stem, with no marks and ``n`` -1."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from ackflow.state.runs import split_many

    arr = _array(keys)
    base = pc.utf8_rtrim(arr, characters="!")
    marks = pc.subtract(pc.utf8_length(arr), pc.utf8_length(base))
    stems, n = split_many(base)  # (a null stem: the key does not split)
    numbered = pc.is_valid(stems)
    mask = numbered.to_numpy(zero_copy_only=False)
    marks = pc.if_else(numbered, marks, pa.scalar(0, marks.type))
    return pc.if_else(numbered, stems, arr), marks, pa.array(np.where(mask, n, -1))


def _array(keys: Any) -> Any:
    """Keys as one Arrow string array (a table's column comes chunked: ``pa.array`` would
    read it value by value, ten times the cost of the runs themselves)."""
    import pyarrow as pa

    if isinstance(keys, pa.ChunkedArray):
        keys = keys.combine_chunks() if keys.num_chunks != 1 else keys.chunk(0)
    if isinstance(keys, pa.Array):
        return keys if keys.type == pa.string() else keys.cast(pa.string())
    return pa.array(keys, pa.string())


def runs(keys: Any) -> list[list[Any]] | None:
    """The keys as disjoint runs ``[stem, marks, first, last]`` (sorted), or None when a
    key is null or repeats (the caller's slow path handles those)."""
    import numpy as np
    import pyarrow.compute as pc

    arr = _array(keys)
    if len(arr) == 0:
        return []
    if arr.null_count:
        return None
    stems, marks, ns = _parts(arr)
    enc = pc.dictionary_encode(stems)
    names = enc.dictionary.to_pylist()
    m = marks.to_numpy(zero_copy_only=False).astype(np.int64)
    width = int(m.max()) + 1  # a group is a stem and its marks: stem * width + marks
    group = enc.indices.to_numpy(zero_copy_only=False).astype(np.int64) * width + m
    n = ns.to_numpy(zero_copy_only=False)
    order = np.lexsort((n, group))
    group, n = group[order], n[order]
    same = group[1:] == group[:-1]
    step = np.diff(n)
    if bool((same & (step == 0)).any()):
        return None  # a key repeats
    breaks = np.flatnonzero(~(same & (step == 1)))
    starts = np.concatenate(([0], breaks + 1))
    ends = np.concatenate((breaks, [len(n) - 1]))
    spans = zip(starts.tolist(), ends.tolist(), strict=True)
    return [[names[group[a] // width], int(group[a] % width), int(n[a]), int(n[b])] for a, b in spans]


def runs_or_none(keys: Any) -> list[list[Any]] | None:
    """:func:`runs`, or None also when Arrow cannot take the keys: a writer's task then
    leaves the driver to find the written keys one by one, never failing its part."""
    try:
        return runs(keys)
    except Exception:  # noqa: BLE001 - never the part's failure: the slow path takes it
        return None


def unique_runs(keys: list[str]) -> list[list[Any]]:
    """The runs of ``keys`` (str, repeats allowed: each is taken once)."""
    found = runs(list(dict.fromkeys(keys)))
    assert found is not None  # unique and not null
    return found


def insert_if_all_new(db: sqlite3.Connection, texts: list[str], count: int, at: float, batch: str) -> bool:
    """Insert every run of ``texts`` (JSON arrays of ``count`` runs in all, each made by
    :func:`runs`, so disjoint within a text) into ``key_runs`` if none of their keys is
    there yet: True. Otherwise nothing is inserted: False (the caller then finds which keys
    are there). One statement per text, inside a savepoint of the caller's transaction; a
    later text sees an earlier one's runs, so two parts holding one key answer False."""
    if any("\\u0000" in text for text in texts):
        return False  # SQLite's JSON functions cut a text at NUL: the slow way
    db.execute("SAVEPOINT all_new")
    before = db.total_changes
    for text in texts:
        db.execute(
            f"{_RUNS_OF_TEXT} INSERT INTO key_runs (stem, marks, first, last, at, batch) "
            f"SELECT stem, marks, first, last, ?, ? FROM runs AS i WHERE {_last_run('i', 'last')} < i.first",
            (text, at, batch),
        )
    fresh = db.total_changes - before == count
    if not fresh:
        db.execute("ROLLBACK TO all_new")
    db.execute("RELEASE all_new")
    return fresh


def written(db: sqlite3.Connection, keys: list[str]) -> set[str]:
    """Which of ``keys`` the manifest holds (the slow path: one search per key)."""
    if not keys:
        return set()
    unique = list(dict.fromkeys(keys))
    db.execute(
        "CREATE TEMP TABLE IF NOT EXISTS incoming_runs (key TEXT, stem TEXT, marks INTEGER, n INTEGER)"
    )
    db.execute("DELETE FROM incoming_runs")
    rows = ((k, *p) for k, p in zip(unique, parts(unique), strict=True))
    db.executemany("INSERT INTO incoming_runs VALUES (?, ?, ?, ?)", rows)
    found = db.execute(f"SELECT i.key FROM incoming_runs AS i WHERE {_last_run('i', 'n')} >= i.n")
    seen = {r[0] for r in found}
    db.execute("DELETE FROM incoming_runs")
    return seen


def insert_new(db: sqlite3.Connection, keys: list[str], at: float, batch: str | None) -> None:
    """Insert ``keys``, none of which the manifest holds (:func:`written` said so)."""
    insert(db, unique_runs(keys), at, batch)


def text(found: list[list[Any]]) -> str:
    """Runs as the JSON text :func:`insert_if_all_new` takes."""
    return json.dumps(found, ensure_ascii=False)


def migrate(db: sqlite3.Connection, name: str) -> None:
    """A manifest of ackflow 0.6.15 or older keeps one row per key (``row_keys``): move
    its keys into ``key_runs`` (those no run holds yet: an older version may have written
    beside this one), one run each with its own time, in one write transaction, and drop
    the old table. At the sink's open (Parquet) or connection (Delta, Iceberg)."""
    import logging

    from ackflow.core.durable import WriteTx

    old = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'row_keys'"
    if db.execute(old).fetchone() is None:
        return
    moved = 0
    with WriteTx(db):
        if db.execute(old).fetchone() is None:
            return  # another connection moved them meanwhile
        log = logging.getLogger("ackflow.sinks")
        log.info("sink %r: moving the row keys of an older manifest into runs (once)", name)
        timed = "at" in {r[1] for r in db.execute("PRAGMA table_info(row_keys)")}
        cursor = db.execute("SELECT key, at FROM row_keys" if timed else "SELECT key, 0 FROM row_keys")
        while chunk := cursor.fetchmany(100_000):
            # only keys no run holds yet (an older version wrote beside a newer one)
            seen = written(db, [k for k, _ in chunk])
            fresh = [(k, at) for k, at in chunk if k not in seen]
            db.executemany(
                _INSERT,
                (
                    (s, m, n, n, at, None)
                    for (s, m, n), (_, at) in zip(parts([k for k, _ in fresh]), fresh, strict=True)
                ),
            )
            moved += len(chunk)
        db.execute("DROP TABLE row_keys")
    log.info("sink %r: moved %d row keys of an older manifest into runs", name, moved)


def disjoint(found: list[list[Any]]) -> bool:
    """Whether runs (of several parts) share no key."""
    spans = sorted(found)
    return all(a[:2] != b[:2] or a[3] < b[2] for a, b in itertools.pairwise(spans))


def any_written(db: sqlite3.Connection, found: list[list[Any]]) -> bool:
    """Whether the manifest holds a key of ``found`` (runs). A stem holding NUL, which
    SQLite's JSON functions would cut, answers True: the caller's exact way decides."""
    body = text(found)
    if "\\u0000" in body:
        return True
    hit = db.execute(
        f"{_RUNS_OF_TEXT} SELECT 1 FROM runs AS i WHERE {_last_run('i', 'last')} >= i.first LIMIT 1", (body,)
    ).fetchone()
    return hit is not None


def insert(db: sqlite3.Connection, found: list[list[Any]], at: float, batch: str | None) -> None:
    """Insert runs the manifest does not hold (:func:`any_written` said so)."""
    db.executemany(_INSERT, ((s, m, a, b, at, batch) for s, m, a, b in found))
