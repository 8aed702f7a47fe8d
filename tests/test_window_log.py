"""The open windows' change log (state/winlog.py): a batch's changes as one row, folded
into the windows table now and then. What a reader, a crash, a fold cut short and a
refused result see of it. Without Spark."""

from __future__ import annotations

import pickle
import sqlite3

import pyarrow as pa
import pytest

from ackflow import faults
from ackflow.flow import Flow
from ackflow.state import winlog
from ackflow.state.partials import contribute
from ackflow.state.show import describe
from ackflow.state.spec import window_flow
from ackflow.state.store import SCHEMA, WindowStore
from ackflow.state.winlog import folded
from ackflow.testing import ListSource
from ackflow.windows import count, hopping, sum_, tumbling

S = 1_000_000


def spec(kind=None, **kw):
    kind = kind or tumbling("10s")
    return window_flow(
        Flow(ListSource([])), kind, aggs=[count(), sum_("v")], by="k", time="t", name="w", **kw
    ).spec


def apply(store, sp, *recs, keys, arrow=True):
    table = pa.Table.from_pylist([{"t": t, "k": k, "v": v} for t, k, v in recs])
    part, failed, late = contribute(sp, table, keys, None, set(), arrow=arrow)
    assert not failed and not late
    store.apply(sp, [pickle.loads(pickle.dumps(part))])  # (as a task's token travels)


def crash(store):
    """The process dies: its connections go, nothing is folded."""
    store.db.close()
    store.scratch.close()


def table_rows(path):
    db = sqlite3.connect(path)
    try:
        return sorted(db.execute('SELECT gk, start, "end", nrows, state, error FROM windows').fetchall())
    finally:
        db.close()


def due_of(store, sp):
    return sorted((d.gk, d.start, d.accs) for d in store.due(sp, bound=10_000 * S))


@pytest.fixture
def path(tmp_path):
    return str(tmp_path / "windows.db")


def test_the_log_is_the_state_until_folded_and_a_crash_keeps_it(path):
    sp = spec()
    store = WindowStore(path)
    apply(store, sp, (1.0, "a", 1), (2.0, "b", 2), keys=["r1", "r2"])
    apply(store, sp, (3.0, "a", 3), (12.0, "a", 4), keys=["r3", "r4"])
    (first,) = [d for d in store.due(sp, bound=10 * S) if d.gk == '["b"]']  # (a's is due too)
    store.done(sp, [first])  # b's window written out: a row of deletions
    assert table_rows(path) == []  # nothing in the table yet: three rows in the log
    want = [('["a"]', 0, [2, 4]), ('["a"]', 10 * S, [1, 4])]
    assert due_of(store, sp) == want
    (shown,) = describe(path)  # ackflow state show replays the log, read-only
    assert shown["open_windows"] == 2 and [w["rows"] for w in shown["open"]] == [2, 1]
    assert table_rows(path) == []
    crash(store)
    again = WindowStore(path)  # the next run: the table and the log replayed
    assert again.stats("w")["open_windows"] == 2
    assert due_of(again, sp) == want
    apply(again, sp, (13.0, "a", 5), keys=["r5"])
    assert due_of(again, sp) == [('["a"]', 0, [2, 4]), ('["a"]', 10 * S, [2, 9])]
    again.close()  # folded: the table alone is the state
    got = {(gk, start): (n, pickle.loads(state)[1]) for gk, start, _, n, state, _ in table_rows(path)}
    assert got == {('["a"]', 0): (2, [2, 4]), ('["a"]', 10 * S): (2, [2, 9])}
    db = sqlite3.connect(path)
    assert db.execute("SELECT count(*) FROM window_log").fetchone()[0] == 0
    assert folded(db, "w") is None
    db.close()


def test_a_fold_cut_short_is_rolled_back_whole(path, monkeypatch):
    monkeypatch.setattr(winlog, "COMPACT_EVERY", 2)
    sp = spec(hopping("10s", every="5s"))
    store = WindowStore(path)
    apply(store, sp, (1.0, "a", 1), (6.0, "b", 2), keys=["r1", "r2"])
    assert not store.settle(sp)  # one row: not yet
    apply(store, sp, (7.0, "a", 3), keys=["r3"])
    before = due_of(store, sp)
    faults.arm("state.compact", "raise")
    with pytest.raises(faults.InjectedFault):
        store.settle(sp)
    assert table_rows(path) == []  # the fold's writes undone with it
    db = sqlite3.connect(path)
    assert db.execute("SELECT count(*) FROM window_log").fetchone()[0] == 2
    assert sorted((w[0], w[1], w[3]) for w in folded(db, "w")) == [
        ('["a"]', -5 * S, 1),
        ('["a"]', 0, 2),
        ('["a"]', 5 * S, 1),
        ('["b"]', 0, 1),
        ('["b"]', 5 * S, 1),
    ]
    # it forgot what it held: the store is read again, the log replayed into the table
    assert due_of(store, sp) == before
    assert db.execute("SELECT count(*) FROM window_log").fetchone()[0] == 0
    assert len(table_rows(path)) == 5
    apply(store, sp, (8.0, "b", 4), keys=["r4"])
    apply(store, sp, (9.0, "a", 5), keys=["r5"])
    assert store.settle(sp)  # two rows since: folded from memory again
    assert db.execute("SELECT count(*) FROM window_log").fetchone()[0] == 0
    crash(store)
    again = WindowStore(path)
    assert due_of(again, sp) == sorted(
        [
            ('["a"]', -5 * S, [1, 1]),
            ('["a"]', 0, [3, 9]),
            ('["a"]', 5 * S, [2, 8]),
            ('["b"]', 0, [2, 6]),
            ('["b"]', 5 * S, [2, 6]),
        ]
    )
    again.close()
    db.close()


def test_folding_from_memory_and_by_replay_write_the_same_table(tmp_path, monkeypatch):
    """One handle folds from what it holds every two rows (the windows changed since);
    the other crashes before every fold and the next handle replays the log; the first
    also closes and opens again once (the windows it then holds are in the table, and
    are deleted from it when written). Both tables end equal."""
    monkeypatch.setattr(winlog, "COMPACT_EVERY", 2)
    sp = spec()
    a_path, b_path = str(tmp_path / "a.db"), str(tmp_path / "b.db")
    a, b = WindowStore(a_path), WindowStore(b_path)
    t = 0.0
    for batch in range(12):
        recs = [(t + i, k, batch + i) for i in range(4) for k in ("x", "y", "z")]
        keys = [f"r{batch}-{i}" for i in range(len(recs))]
        t += 4.0
        for store in (a, b):
            apply(store, sp, *recs, keys=keys)
            store.done(sp, store.due(sp, bound=int((t - 10) * S)))
        a.settle(sp)
        if batch == 5:  # a closes (folded) and opens again: what it holds is read from the table
            a.close()
            a = WindowStore(a_path)
        if batch % 3 == 2:
            crash(b)
            b = WindowStore(b_path)
        assert due_of(a, sp) == due_of(b, sp)
    a.close()
    b.close()
    assert table_rows(a_path) == table_rows(b_path) != []


def test_a_refused_window_only_in_the_log_is_kept_and_tried_again_next_start(path):
    sp = spec()
    store = WindowStore(path)
    apply(store, sp, (1.0, "a", 1), (2.0, "b", 2), keys=["r1", "r2"])
    refused, other = sorted(store.due(sp, bound=10 * S), key=lambda d: d.gk)
    store.fail(sp, refused, "out: refused")  # folded first: the table has its row
    assert [(r[0], r[5]) for r in table_rows(path)] == [('["a"]', "out: refused"), ('["b"]', None)]
    assert [d.gk for d in store.due(sp, bound=10 * S)] == ['["b"]']
    assert store.stats("w")["refused_windows"] == 1
    store.done(sp, [other])
    (shown,) = describe(path)
    assert [w.get("refused") for w in shown["open"]] == ["out: refused"]
    apply(store, sp, (12.0, "c", 3), keys=["r3"])
    assert [d.gk for d in store.due(sp, bound=20 * S)] == ['["c"]']  # (a's refused: c's the earliest)
    assert store.retry_failed(sp) == 1  # in the same handle: a's window is due again, the earliest
    assert [d.gk for d in store.due(sp, bound=15 * S)] == ['["a"]']
    store.fail(sp, refused, "out: refused")
    crash(store)
    again = WindowStore(path)
    assert [d.gk for d in again.due(sp, bound=20 * S)] == ['["c"]']  # refused until a start retries
    assert again.retry_failed(sp) == 1
    assert due_of(again, sp) == [('["a"]', 0, [1, 1]), ('["c"]', 10 * S, [1, 3])]
    again.close()


def test_state_show_reads_a_store_from_before_the_log(path):
    db = sqlite3.connect(path)
    db.executescript(SCHEMA)
    db.execute("DROP TABLE window_log")
    db.execute(
        "INSERT INTO marks (op, watermark, max_event, late, written, applied_rows) "
        "VALUES ('w', 0, 0, 0, 0, 1)"
    )
    db.execute(
        'INSERT INTO windows (op, gk, start, "end", nrows, state) VALUES (?, ?, 0, 10, 1, ?)',
        ("w", '["a"]', pickle.dumps((("a",), [1, 1]))),
    )
    db.commit()
    db.close()
    (shown,) = describe(path)
    assert shown["open_windows"] == 1 and shown["open"][0]["keys"] == ["a"]
    store = WindowStore(path)  # opening it adds the log's table
    sp = spec()
    assert due_of(store, sp) == [('["a"]', 0, [1, 1])]
    store.close()


def test_a_fold_by_another_handle_makes_this_one_read_the_windows_again(path):
    """A second handle (another run on the same state, ``state show`` does not write)
    folds the log: what the first knew of the table is stale, and a fold counts a write,
    so the first reads them again; the window it then writes out is deleted from the
    table, not brought back at the next start."""
    sp = spec()
    a = WindowStore(path)
    apply(a, sp, (1.0, "x", 1), keys=["r1"])  # only in the log
    b = WindowStore(path)
    assert b.stats("w")["open_windows"] == 1  # (b does not hold them: it folds, then counts)
    b.close()
    assert [r[0] for r in table_rows(path)] == ['["x"]']
    (w,) = a.due(sp, bound=10 * S)
    a.done(sp, [w])
    a.close()
    assert table_rows(path) == []
    again = WindowStore(path)
    assert due_of(again, sp) == []
    again.close()


def test_a_fold_whose_commit_failed_is_folded_again_by_replay(path, monkeypatch):
    """The fold's COMMIT fails (PostgreSQL away, a disk error): the log stays, and the
    handle forgets what it held, so the next fold replays the whole log instead of
    writing only the windows changed since (which would drop the others)."""
    monkeypatch.setattr(winlog, "COMPACT_EVERY", 2)

    class Flaky(sqlite3.Connection):
        fail_commit = False

        def execute(self, query, *args):
            if Flaky.fail_commit and query == "COMMIT":
                Flaky.fail_commit = False
                super().execute("ROLLBACK")
                raise sqlite3.OperationalError("disk I/O error")
            return super().execute(query, *args)

    sp = spec()
    store = WindowStore(path)
    store.db.close()
    store.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False, factory=Flaky)
    apply(store, sp, (1.0, "x", 1), keys=["r1"])
    apply(store, sp, (2.0, "y", 1), keys=["r2"])
    Flaky.fail_commit = True
    with pytest.raises(sqlite3.OperationalError):
        store.settle(sp)
    apply(store, sp, (13.0, "z", 1), keys=["r3"])
    apply(store, sp, (14.0, "z", 1), keys=["r4"])
    assert store.settle(sp)
    assert [(r[0], r[1], r[3]) for r in table_rows(path)] == [
        ('["x"]', 0, 1),
        ('["y"]', 0, 1),
        ('["z"]', 10 * S, 2),
    ]
    crash(store)
    again = WindowStore(path)
    assert due_of(again, sp) == [('["x"]', 0, [1, 1]), ('["y"]', 0, [1, 1]), ('["z"]', 10 * S, [2, 2])]
    again.close()


def test_a_refusal_the_store_cannot_keep_drops_what_the_output_staged(tmp_path, monkeypatch):
    """The output refuses a result; keeping the refusal in the store fails (a fold's
    COMMIT, PostgreSQL away): the output's staged batch is aborted, never left half
    done, and the window is still due at the next try."""
    from ackflow.sinks.base import PartitionResult, Sink
    from ackflow.state.window_sink import WindowSink

    class Refusing(Sink):
        def __init__(self):
            super().__init__("out")
            self.calls = []

        def write_partition(self, batch_id, partition, rows):
            return PartitionResult(failed={0: "no"}, token=b"staged")

        def commit(self, batch_id, tokens):
            self.calls.append(("commit", list(tokens)))

        def abort(self, batch_id, tokens):
            self.calls.append(("abort", list(tokens)))

    sp = spec()
    out = Refusing()
    sink = WindowSink(sp, out)
    sink.bind_state(str(tmp_path / "windows.db"))
    sink.open()
    sink._stopped.set()  # (its timer would emit too)
    sink._ticker.join()
    try:
        apply(sink._store, sp, (1.0, "a", 1), keys=["r1"])
        sink._store.close_open(sp)

        def away(*_args):
            raise sqlite3.OperationalError("the store went away")

        monkeypatch.setattr(sink._store, "fail", away)
        with pytest.raises(sqlite3.OperationalError):
            sink.emit()
        assert out.calls == [("abort", [b"staged"])]
        assert [d.gk for d in sink._store.due(sp, sink.bound())] == ['["a"]']
    finally:
        monkeypatch.undo()
        sink.close()


def test_a_refusal_kept_by_another_handle_holds_the_window_back_in_this_one(path, monkeypatch):
    """Keeping a refusal (and clearing them at a start) counts a write: a handle that
    holds the windows reads them again, and neither offers the refused window nor counts
    it as not refused."""
    monkeypatch.setattr(winlog, "COMPACT_EVERY", 1)
    sp = spec()
    b = WindowStore(path)
    apply(b, sp, (1.0, "x", 1), (2.0, "y", 1), keys=["r1", "r2"])
    assert b.settle(sp)  # folded: b holds the windows, in step
    a = WindowStore(path)
    refused = next(d for d in a.due(sp, bound=10 * S) if d.gk == '["x"]')
    a.fail(sp, refused, "out: refused")
    assert [d.gk for d in b.due(sp, bound=10 * S)] == ['["y"]']
    assert b.stats("w")["refused_windows"] == 1
    assert a.retry_failed(sp) == 1
    assert [d.gk for d in b.due(sp, bound=10 * S)] == ['["x"]', '["y"]']
    a.close()
    b.close()
