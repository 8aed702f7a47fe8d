"""Applied row keys kept as runs (state/runs.py): a key splits one way, in Python and in
Arrow alike; a batch's runs hold exactly its keys; a task finds exactly the applied ones;
a run that meets a stored one is refused; keys an older version kept whole move over."""

from __future__ import annotations

import sqlite3

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ackflow.state import runs
from ackflow.state.store import StateError, WindowStore, read_view

KEYS = st.one_of(
    st.text(max_size=8),
    st.builds(
        lambda stem, n: f"{stem}{n}",
        st.sampled_from(["f@a:", "t/0@", "s@", "x", "", "9", "日本", "a\n", "n\x00"]),
        st.integers(0, 40),
    ),
    st.sampled_from(["x:007", "1" * 19, "k" + "2" * 18, "00", "0"]),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(KEYS, max_size=40))
def test_a_key_splits_one_way_and_runs_hold_exactly_the_keys(keys):
    stems, ns = runs.split_many(keys)
    assert [runs.split(k) for k in keys] == [
        None if s is None else (s, n) for s, n in zip(stems.to_pylist(), ns.tolist(), strict=True)
    ]
    # a slice of an Arrow array (the keys' bytes begin past others', maybe a NUL's)
    sliced = runs.split_many(pa.array(["a\x0012", *keys], pa.string()).slice(1))
    assert (sliced[0].to_pylist(), sliced[1].tolist()) == (stems.to_pylist(), ns.tolist())
    made, whole, twice = runs.make_runs(keys)
    if twice is not None:
        assert keys.count(twice) > 1
        return
    assert len(set(keys)) == len(keys)
    held = [f"{s}{n}" for s, lo, hi in made for n in range(lo, hi + 1)]
    assert sorted(held + whole) == sorted(keys)
    assert all(runs.split(k) is None for k in whole)


def test_a_null_key_is_kept_whole():  # (found by review: the split raised on a null)
    stems, ns = runs.split_many(pa.array(["a1", None, "b22"], pa.string()))
    assert (stems.to_pylist(), ns.tolist()) == (["a", None, "b"], [1, 0, 22])


@settings(max_examples=60, deadline=None)
@given(st.lists(KEYS, unique=True, max_size=30), st.lists(KEYS, max_size=30))
def test_a_task_finds_exactly_the_applied_keys(tmp_path_factory, applied, asked):
    store = WindowStore(str(tmp_path_factory.mktemp("runs") / "windows.db"))
    try:
        with store.lock:
            store.db.execute("BEGIN IMMEDIATE")
            store._applied("w", applied, 1.0, lite=True)
            store.db.execute("COMMIT")
        assert read_view(store.path, "w", asked)[1] == set(asked) & set(applied)
    finally:
        store.close()


def test_a_run_meeting_a_stored_one_is_refused_and_names_the_key(tmp_path):
    store = WindowStore(str(tmp_path / "windows.db"))
    with store.lock:
        store.db.execute("BEGIN IMMEDIATE")
        store._applied("w", [f"f@a:{i}" for i in range(10, 20)], 1.0, lite=True)
        store.db.execute("COMMIT")
    for keys, named in (([f"f@a:{i}" for i in range(5, 11)], "f@a:10"), (["f@a:19", "f@a:20"], "f@a:19")):
        with store.lock, pytest.raises(StateError, match=f"row key '{named}' is applied already"):
            store.db.execute("BEGIN IMMEDIATE")
            try:
                store._applied("w", keys, 2.0, lite=True)
            finally:
                store.db.execute("ROLLBACK")
    with store.lock, pytest.raises(StateError, match="'g:3' is in the batch twice"):
        store._applied("w", ["g:3", "g:4", "g:3"], 2.0, lite=True)
    store.db.execute("BEGIN IMMEDIATE")
    store._applied("w", [f"f@a:{i}" for i in range(20, 30)], 2.0, lite=True)  # adjoining: fine
    store.db.execute("COMMIT")
    stored = store.db.execute("SELECT stem, lo, hi FROM applied_runs ORDER BY lo").fetchall()
    assert stored == [("f@a:", 10, 19), ("f@a:", 20, 29)]  # a row per batch, not per key
    store.close()


def test_keys_an_older_version_kept_whole_move_into_runs(tmp_path):
    path = str(tmp_path / "windows.db")
    WindowStore(path).close()
    db = sqlite3.connect(path)
    db.execute("DELETE FROM upgrades")  # (a store an older version made)
    db.executemany(
        "INSERT INTO applied (op, key, at) VALUES (?, ?, ?)",
        [("w", f"f@a:{i}", 5.0) for i in range(100)] + [("w", "uuid-x", 5.0)],
    )
    db.commit()
    db.close()
    store = WindowStore(path)  # (opened by this version)
    try:
        assert read_view(path, "w", ["f@a:7", "f@a:100", "uuid-x"])[1] == {"f@a:7", "uuid-x"}
        assert store.db.execute("SELECT count(*) FROM applied").fetchone()[0] == 1
        assert store.db.execute("SELECT op, stem, lo, hi, at FROM applied_runs").fetchall() == [
            ("w", "f@a:", 0, 99, 5.0)
        ]
    finally:
        store.close()
    db = sqlite3.connect(path)  # once per store: a key kept whole later is not moved again
    db.execute("INSERT INTO applied (op, key, at) VALUES ('w', 'f@b:1', 6.0)")
    db.commit()
    WindowStore(path).close()
    assert db.execute("SELECT count(*) FROM applied").fetchone()[0] == 2
    db.close()


def test_two_processes_opening_one_older_postgresql_store_move_its_keys_once(postgres, monkeypatch):
    """Two drivers (two window operators of one schema) open a PostgreSQL store an older
    version wrote, at once: the second waits for the first's move and does not move the
    keys again (it failed at start on a duplicate run before)."""
    import threading
    import uuid

    import psycopg

    from ackflow import windows as w
    from ackflow.state import pg

    state = w.PostgresState(postgres.dsn, schema=f"up_{uuid.uuid4().hex[:8]}")
    conn = pg.connect_store(state)
    conn.execute(
        "INSERT INTO applied (op, key, at) SELECT 'w', 'f@a:' || i, 5.0 FROM generate_series(0, 99) i"
    )
    conn.close()
    moving, release = threading.Event(), threading.Event()
    real = runs.migrate

    def slow(db, lite):  # the first mover holds its transaction open until released
        moved = real(db, lite)
        if not moving.is_set():
            moving.set()
            assert release.wait(30)
        return moved

    monkeypatch.setattr(runs, "migrate", slow)
    errors: list[BaseException] = []

    # both connected (their tables' DDL done) before either opens its store: the DDL
    # would otherwise wait for the first's move by chance and hide the race
    conns = [pg.connect_store(state), pg.connect_store(state)]

    def open_one(conn) -> None:
        try:
            WindowStore("pg", conn=conn).close()
        except BaseException as e:  # noqa: BLE001 (the test reports it below)
            errors.append(e)

    first = threading.Thread(target=open_one, args=(conns[0],))
    first.start()
    assert moving.wait(30)
    second = threading.Thread(target=open_one, args=(conns[1],))
    second.start()
    with psycopg.connect(postgres.dsn, autocommit=True) as watch:  # the second is waiting
        for _ in range(300):
            waiting = watch.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                " AND datname = current_database()"
            ).fetchone()[0]
            if waiting:
                break
            threading.Event().wait(0.05)
        assert waiting == 1
    release.set()
    first.join(30)
    second.join(30)
    assert errors == []
    check = pg.connect_store(state, create=False)
    assert check.execute("SELECT op, stem, lo, hi, at FROM applied_runs").fetchall() == [
        ("w", "f@a:", 0, 99, 5.0)
    ]
    assert check.execute("SELECT count(*) FROM applied").fetchone()[0] == 0
    check.close()


def test_a_task_finds_exactly_the_applied_keys_in_postgresql(postgres):
    """The task's view over the network: keys in runs and keys kept whole (no digits at
    the end, a NUL, a leading zero) found, others not."""
    import uuid

    from ackflow import windows as w
    from ackflow.state import pg

    state = w.PostgresState(postgres.dsn, schema=f"view_{uuid.uuid4().hex[:8]}")
    store = WindowStore("pg", conn=pg.connect_store(state))
    try:
        applied = ["f@a:1", "f@a:2", "f@a:7", "uuid-x", "x:007", "日本"]
        spans, whole, _ = runs.make_runs(applied)
        store.db.execute("BEGIN")
        runs.put(store.db, "w", spans, 1.0, lite=False)
        store.db.executemany(
            "INSERT INTO applied (op, key, at) VALUES (?, ?, 1.0)", [("w", k) for k in whole]
        )
        store.db.executemany("INSERT INTO applied (op, key, at) VALUES (?, ?, 1.0)", [("other", "uuid-y")])
        store.db.execute("COMMIT")
        asked = [*applied, "f@a:3", "f@a:70", "uuid-y", "x:07", "日", "f@b:1"]
        assert pg.read_view(state, "w", asked, None) == (None, set(applied))
    finally:
        store.close()


@pytest.mark.parametrize(
    ("dsn", "schema", "says"),
    [
        ("", "s", "give a DSN"),
        ("postgresql://u@127.0.0.1/db", "", "schema must be a name"),
        ("postgresql://u@127.0.0.1/db", "s" * 64, "longer than PostgreSQL's 63 bytes"),
        ("postgresql://u@127.0.0.1/db", "é" * 32, "longer than PostgreSQL's 63 bytes"),
    ],
)
def test_a_postgresql_state_with_a_bad_dsn_or_schema_fails_at_start(dsn, schema, says):
    """A schema PostgreSQL would cut at 63 bytes would make the DDL lock's key (the name
    as given) differ from the schema's own: refused at start, saying what to fix."""
    from ackflow import windows as w
    from ackflow.core.errors import ConfigError

    with pytest.raises(ConfigError, match=says):
        w.PostgresState(dsn, schema=schema)
    w.PostgresState("postgresql://u@127.0.0.1/db", schema="s" * 63)  # (63 bytes are fine)
