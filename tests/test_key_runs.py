"""The key manifest as runs (core/key_runs.py): a run stands for exactly its keys, the
record inserts all of a batch's runs or none, the slow path finds exactly the written
keys, and an older manifest (one row per key) is moved into runs at open."""

from __future__ import annotations

import itertools
import os
import sqlite3

import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import given, settings
from hypothesis import strategies as st

from ackflow.core import key_runs
from ackflow.core.durable import WriteTx
from ackflow.sinks import ParquetSink

# keys that make runs (a file's lines, offsets, children) and keys that do not
STEMS = st.sampled_from(["f:", "f#", "é:", "", "a0", "t/0@", "#"])
KEY = st.one_of(
    st.builds(
        lambda s, n, m: f"{s}{n}{m}", STEMS, st.integers(0, 30), st.sampled_from(["", "!", "!!", "!#0"])
    ),
    st.text(alphabet="ab:#!0123456789", max_size=5),
    st.text(max_size=4),
    st.sampled_from(["x05", "007", "0", "-1", "9" * 19, "1" + "0" * 18, "a\x00b", "a\x00", "\U0001f600 1"]),
)


def keys_of(runs):
    """The keys a list of runs stands for."""
    return [
        stem if n < 0 else f"{stem}{n}{'!' * marks}"
        for stem, marks, first, last in runs
        for n in range(first, last + 1)
    ]


def manifest():
    db = sqlite3.connect(":memory:", isolation_level=None)
    db.execute(key_runs.SCHEMA)
    return db


@settings(max_examples=300, deadline=None, derandomize=True)
@given(keys=st.lists(KEY, max_size=40))
def test_runs_stand_for_exactly_their_keys(keys):
    """Expanded, the runs are the keys: none lost, none added, none merged with another
    (``x05`` is not ``x5``, ``a0`` + 1 is not ``a01``); a repeated key answers None."""
    runs = key_runs.runs(keys)
    if len(set(keys)) < len(keys):
        assert runs is None
        return
    assert runs is not None
    expanded = keys_of(runs)
    assert sorted(expanded) == sorted(keys)
    for stem, marks, first, last in runs:
        assert first <= last
        assert not stem[-1:].isdigit() or (first == last == -1)  # only a whole key ends in a digit
        assert marks == 0 or first >= 0
    spans = sorted(runs)
    for (s1, m1, _, b1), (s2, m2, a2, _) in itertools.pairwise(spans):
        assert (s1, m1) != (s2, m2) or b1 < a2  # disjoint


def test_a_file_s_lines_are_one_run_and_a_gap_makes_two():
    lines = [f"f3a9:{i}" for i in range(1, 10_001)]
    assert key_runs.runs(lines) == [["f3a9:", 0, 1, 10_000]]
    assert key_runs.runs(pa.array(lines[:10] + lines[11:20])) == [["f3a9:", 0, 1, 10], ["f3a9:", 0, 12, 20]]
    # the embedded queue's messages without an id: row_key marks them ``#7!``
    assert key_runs.runs([f"#{i}!" for i in range(5, 0, -1)] + ["#6!!", "#7"]) == [
        ["#", 0, 7, 7],
        ["#", 1, 1, 5],
        ["#", 2, 6, 6],
    ]
    assert key_runs.runs(["a", None]) is None


@settings(max_examples=200, deadline=None, derandomize=True)
@given(before=st.lists(KEY, max_size=14), batch=st.lists(KEY, max_size=14))
def test_the_record_inserts_every_run_or_none_and_the_slow_path_finds_the_written(before, batch):
    """The fast path of the record: every key of a batch inserted when none is in the
    manifest; otherwise nothing inserted. Then :func:`written` finds exactly the batch's
    keys the manifest holds, and :func:`insert_new` adds the others: the manifest holds
    the union, whatever the keys are (numbered or not, NUL, repeats)."""
    db = manifest()
    before = list(dict.fromkeys(before))
    with WriteTx(db):
        key_runs.insert_new(db, before, 1.0, "b0")
    half = len(batch) // 2  # two parts, as two tasks' tokens
    parts = [key_runs.runs(batch[:half]), key_runs.runs(batch[half:])]
    with WriteTx(db):
        fresh = all(p is not None for p in parts) and key_runs.insert_if_all_new(
            db, [key_runs.text(p) for p in parts], sum(len(p) for p in parts), 2.0, "b1"
        )
    expect_fresh = (
        len(set(batch)) == len(batch) and not set(batch) & set(before) and not any("\x00" in k for k in batch)
    )
    assert fresh == expect_fresh
    stored = sorted(keys_of(db.execute("SELECT stem, marks, first, last FROM key_runs").fetchall()))
    if fresh:
        assert stored == sorted({*before, *batch})
        return
    assert stored == sorted(before)
    with WriteTx(db):
        seen = key_runs.written(db, batch)
        assert seen == set(batch) & set(before)
        key_runs.insert_new(db, [k for k in batch if k not in seen], 2.0, "b1")
    stored = sorted(keys_of(db.execute("SELECT stem, marks, first, last FROM key_runs").fetchall()))
    assert stored == sorted({*before, *batch})
    assert key_runs.written(db, [*before, *batch]) == {*before, *batch}


def test_a_batch_of_a_file_s_lines_costs_the_manifest_one_row():
    db = manifest()
    for b in range(3):
        runs = key_runs.runs([f"f:{i}" for i in range(b * 1000 + 1, b * 1000 + 1001)])
        with WriteTx(db):
            assert key_runs.insert_if_all_new(db, [key_runs.text(runs)], len(runs), 1.0, f"b{b}")
    assert db.execute("SELECT count(*) FROM key_runs").fetchone()[0] == 3
    # one line inside a run, one past its end, one of the next run's first
    assert key_runs.written(db, ["f:500", "f:3001", "f:1001", "f:0", "f:", "f:500!"]) == {"f:500", "f:1001"}
    runs = key_runs.runs(["f:2999", "f:3001"])  # one written before, one not: nothing inserted
    with WriteTx(db):
        assert not key_runs.insert_if_all_new(db, [key_runs.text(runs)], len(runs), 1.0, "b3")
    assert db.execute("SELECT count(*) FROM key_runs").fetchone()[0] == 3


def test_an_older_manifest_s_keys_are_moved_into_runs_and_still_drop_a_redelivery(tmp_path):
    """A dataset written by 0.6.15 keeps one row per key (``row_keys``); opened by this
    version, its keys move into runs once, and a message written then and delivered again
    now is not written twice."""
    out = tmp_path / "out"
    os.makedirs(out / "batch=old")
    pq.write_table(pa.table({"n": [0, 1]}), out / "batch=old" / "part-00000.parquet")
    db = sqlite3.connect(out / "_manifest.db")
    db.executescript(
        "CREATE TABLE batches (batch TEXT PRIMARY KEY, rows INTEGER NOT NULL, dropped INTEGER NOT NULL,"
        " committed_at REAL NOT NULL);"
        "CREATE TABLE row_keys (key TEXT PRIMARY KEY, at REAL NOT NULL DEFAULT 0) WITHOUT ROWID;"
        "INSERT INTO batches VALUES ('old', 2, 0, 0);"
        "INSERT INTO row_keys VALUES ('f:1', 5), ('msg-a', 5);"
    )
    db.commit()
    db.close()
    sink = ParquetSink(out)
    sink.open()
    try:
        rows = pa.table({"n": [1, 2, 3], "__af_key": ["msg-a", "f:2", "f:1"]})
        sink.commit("b1", [sink.write_partition("b1", 0, rows).token])
    finally:
        sink.close()
    assert sorted(pq.read_table(out).column("n").to_pylist()) == [0, 1, 2]  # msg-a, f:1 dropped
    db = sqlite3.connect(out / "_manifest.db")
    assert db.execute("SELECT name FROM sqlite_master WHERE name = 'row_keys'").fetchone() is None
    assert sorted(db.execute("SELECT stem, marks, first, last, at FROM key_runs WHERE batch IS NULL")) == [
        ("f:", 0, 1, 1, 5.0),
        ("msg-a", 0, -1, -1, 5.0),
    ]


def test_a_lakehouse_manifest_of_one_row_per_key_is_moved_into_runs(tmp_path):
    """The Delta and Iceberg sinks' manifest (0.6.15 and older: ``row_keys`` without a
    time) moves into runs at its first connection, and its keys still count as written."""
    from ackflow.sinks.lakehouse import KeyManifest

    path = str(tmp_path / "keys.db")
    db = sqlite3.connect(path)
    db.executescript(
        "CREATE TABLE row_keys (key TEXT PRIMARY KEY) WITHOUT ROWID;"
        "INSERT INTO row_keys VALUES ('#1!'), ('#2!'), ('[\"a\",1]');"
    )
    db.commit()
    db.close()
    db = KeyManifest(path).connect()
    try:
        assert KeyManifest.written(db, ["#1!", "#2!", "#3!", '["a",1]', '["a",2]']) == {
            "#1!",
            "#2!",
            '["a",1]',
        }
        assert db.execute("SELECT name FROM sqlite_master WHERE name = 'row_keys'").fetchone() is None
    finally:
        db.close()


def test_a_move_keeps_the_runs_a_newer_version_recorded_and_runs_once(tmp_path):
    """Found by review: an older writer beside a newer one (a downgrade, a rolling
    upgrade of two table writers) leaves ``row_keys`` beside runs. Moving a key a run
    holds already made a second, overlapping run, which hid the first: ``f:70`` looked
    unwritten and was written twice."""
    db = manifest()
    db.execute("CREATE TABLE row_keys (key TEXT PRIMARY KEY, at REAL NOT NULL DEFAULT 0) WITHOUT ROWID")
    with WriteTx(db):
        key_runs.insert(db, [["f:", 0, 1, 100]], 2.0, "new1")
        db.executemany("INSERT INTO row_keys VALUES (?, 1)", [("f:50",), ("f:200",), ("abc",)])
    key_runs.migrate(db, "t")
    key_runs.migrate(db, "t")  # nothing left to move: nothing happens
    assert sorted(db.execute("SELECT stem, marks, first, last FROM key_runs")) == [
        ("abc", 0, -1, -1),
        ("f:", 0, 1, 100),
        ("f:", 0, 200, 200),
    ]
    assert key_runs.written(db, ["f:70", "f:50", "f:150", "f:200"]) == {"f:70", "f:50", "f:200"}


# a model of the Parquet sink's effectively-once commit, against the real sink: batches
# of parts drawn from a pool of keys (runs of numbers, marks, keys that make no run),
# some commits failing between the record and the rename (the record is undone, the
# batch aborted), some followed by a restart (a new sink on the same path)
MARKS = st.sampled_from(["", "!"])
POOL = st.lists(
    st.one_of(
        st.builds(lambda s, n, m: f"{s}{n}{m}", STEMS, st.integers(0, 12), st.sampled_from(["", "!"])), KEY
    ),
    min_size=1,
    max_size=14,
    unique=True,
)
STEP = st.tuples(
    st.lists(st.integers(0, 13), min_size=1, max_size=3).map(tuple),  # a part: picks from the pool
    st.integers(1, 3),  # parts in the batch
    st.sampled_from(["commit", "commit", "commit", "rename fails", "restart"]),
)


@settings(max_examples=120, deadline=None, derandomize=True)
@given(pool=POOL, steps=st.lists(STEP, min_size=1, max_size=6))
def test_the_parquet_sink_writes_each_key_once_against_a_model(tmp_path_factory, pool, steps):
    """After every step the dataset holds exactly one row per key committed so far (the
    first write's), and the manifest's runs expand to exactly those keys."""
    from ackflow import faults

    out = str(tmp_path_factory.mktemp("model") / "out")
    sink = ParquetSink(out)
    sink.open()
    model: dict[str, int] = {}  # key -> the n of its row in the dataset
    again: list[int] = []  # rows of a key repeated inside one batch (both are written, as before)
    counter = 0
    try:
        for b, (picks, nparts, what) in enumerate(steps):
            tokens, staged = [], {}
            for p in range(nparts):
                keys = list(dict.fromkeys(pool[(i + p) % len(pool)] for i in picks))
                ns = list(range(counter, counter + len(keys)))
                counter += len(keys)
                tokens.append(sink.write_partition(f"b{b}", p, pa.table({"n": ns, "__af_key": keys})).token)
                for k, n in zip(keys, ns, strict=True):
                    staged.setdefault(k, []).append(n)
            if what == "rename fails":
                faults.arm("parquet.after_record", "raise")
                try:
                    sink.commit(f"b{b}", tokens)
                except faults.InjectedFault:
                    sink.abort(f"b{b}", tokens)
                finally:
                    faults.disarm()
                continue  # undone: as if never committed
            sink.commit(f"b{b}", tokens)
            for k, ns in staged.items():
                if k not in model:
                    model[k] = ns[0]
                    again.extend(ns[1:])
            if what == "restart":
                sink.close()
                sink = ParquetSink(out)
                sink.open()
            has = [n for n in os.listdir(out) if n.startswith("batch=")]
            got = sorted(pq.read_table(out).column("n").to_pylist()) if has else []
            assert got == sorted([*model.values(), *again])
            db = sqlite3.connect(os.path.join(out, "_manifest.db"))
            try:
                runs = db.execute("SELECT stem, marks, first, last FROM key_runs").fetchall()
            finally:
                db.close()
            assert sorted(keys_of(runs)) == sorted(model)
    finally:
        sink.close()
