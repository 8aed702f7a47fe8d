"""Open windows held in Arrow columns (state/columns.py) against the same windows held
as a Python dict: random batches split over tasks (floats of every magnitude, integer and
text keys, nulls, a NaN or a -0.0 that sends a task to the row-by-row fold, a column
whose type changes between batches, keys with quotes and non-ASCII text, infinities, a
window reopened after it was written), results written as the watermark passes, a result
refused and tried again, folds, another handle folding, restarts. Every result is the
same to the bit, and so is the store, after each batch as a reader sees it. Without Spark.
(Made richer from a reviewer's fuzz.)"""

from __future__ import annotations

import datetime as dt
import hashlib
import pickle
import random
import sqlite3

import pyarrow as pa
import pytest

from ackflow.flow import Flow
from ackflow.state import columns, held, winlog
from ackflow.state.partials import contribute
from ackflow.state.spec import window_flow
from ackflow.state.store import WindowStore
from ackflow.state.window_sink import WindowSink
from ackflow.testing import KeyedSink, ListSource
from ackflow.windows import avg, count, hopping, max_, min_, sum_, tumbling

S = 1_000_000
AGGS = [count(), count("v").alias("n_v"), sum_("v"), min_("v"), max_("v"), avg("v")]


def spec(kind):
    return window_flow(Flow(ListSource([])), kind, aggs=AGGS, by=["k", "j"], time="t", name="w").spec


def exact(value):
    """Floats as their hex text (== then sees every bit, and 1 is not 1.0)."""
    if isinstance(value, float):
        return ("float", value.hex(), repr(value))
    if isinstance(value, (list, tuple)):
        return type(value)(exact(v) for v in value)
    return value


KEYS = ["a", "b", None, "é", 'q"t', "back\\s", "€x", "", "1"]
OPS = ("settle", "restart", "other", "fail", "retry", "cut")


def value(rnd, kind):
    if rnd.random() < 0.15:
        return None
    if kind == "int":  # (sums past 2**53: no float holds them)
        return rnd.choice([1, -3, 7, 10**15, -(10**15), 0, 2**53 - 1])
    big = [0.1, 0.2, 0.3, 1e16, -1e16, 1.0, 3.3e-5, -2.5, 7e12, float("inf"), -float("inf"), 1e308]
    return rnd.choice(big) * rnd.choice([1, rnd.random()])


def batches(seed):
    """A run's batches: each the tasks' rows (t, k, j, v) and what happens after it."""
    rnd = random.Random(seed)
    t, out = 100.0, []
    for _ in range(rnd.randint(8, 16)):
        kind = "int" if rnd.random() < 0.15 else "float"  # (the column's type in this batch)
        tasks = []
        for _ in range(rnd.randint(1, 3)):
            rows = []
            odd = kind == "float" and rnd.random() < 0.06  # (this task folds row by row)
            for i in range(rnd.randint(1, 12)):
                v = rnd.choice([float("nan"), -0.0]) if odd and i == 0 else value(rnd, kind)
                at = t + rnd.random() * 15 if rnd.random() > 0.1 else t - 30 + rnd.random() * 30
                rows.append((at, rnd.choice(KEYS), rnd.choice([1, 2, -5]), v))  # (at: a window reopened)
            tasks.append(rows)
        t += rnd.random() * 8
        out.append((tasks, [op for op in OPS if rnd.random() < 0.2]))
    return out


def shown(path):
    """What ``ackflow state show`` reads: the windows table with the log replayed."""
    db = sqlite3.connect(path)
    try:
        rows = winlog.folded(db, "w")
        if rows is None:
            rows = db.execute(
                'SELECT gk, start, "end", nrows, dirty, state, error FROM windows WHERE op = ?', ("w",)
            ).fetchall()
        return sorted((r[0], r[1], r[2], r[3], exact(pickle.loads(r[5]))) for r in rows)
    finally:
        db.close()


IN_ARROW: list[bool] = []  # per due windows held in columns: made in Arrow unless they cannot be


def made(sp, due):
    """The output rows of ``due`` as the window sink makes them (from the columns'
    table where it has one; windows whose values differ in type go one at a time),
    each row's values exact and its columns' types (but a null's: a column of nulls
    only, typed from a dict's values, has the null type)."""
    if isinstance(due, held.DueTable):
        table = due.table
        past = any(  # (an average of integers past 2**53 is made in Python: Python divides exactly)
            pa.types.is_integer(table.column(c).type)
            and max(abs(v) for v in table.column(c).to_pylist()) > 2**53
            for c in table.column_names
            if c.startswith("a") and c.endswith("s")
        )
        made_in_arrow = columns.results(table, sp.by, [(a.name, a.fn) for a in sp.aggs]) is not None
        IN_ARROW.append(made_in_arrow != past)  # (False: made in Python when it need not, or not)
    sink, out = WindowSink(sp, KeyedSink("out")), []
    while due:
        table, rows = sink._table_or_refuse(due)
        assert rows and list(rows) == list(due[: len(rows)])  # (none refused: the first ones)
        types = {f.name: str(f.type) for f in table.schema}
        for row in table.to_pylist():
            out.append([(k, exact(v), None if v is None else types[k]) for k, v in row.items()])
        due = due[len(rows) :]
    return out


def run(path, sp, plan):
    """The results written, in order, what a reader saw after each batch, and the
    windows table at the end."""
    store = WindowStore(path)
    written, seen, n = [], [], 0
    for tasks, ops in plan:
        parts = []
        for rows in tasks:
            table = pa.Table.from_pylist([{"t": t, "k": k, "j": j, "v": v} for t, k, j, v in rows])
            keys = [f"r{n + i}" for i in range(len(rows))]
            n += len(rows)
            part, failed, _ = contribute(sp, table, keys, None, set())
            assert not failed
            parts.append(pickle.loads(pickle.dumps(part)))  # (as a task's token travels)
        store.apply(sp, parts, event_max=max(int(r[0] * S) for rows in tasks for r in rows))
        due = store.due(sp, store.mark("w")["watermark"], limit=3 if "cut" in ops else 5000)
        if "fail" in ops and due:  # the output refused one
            store.fail(sp, due[0], "refused")
            due = due[1:]
        if due:
            written.append(made(sp, due))
        written += [(d.gk, d.start, d.end, exact(list(d.values)), exact(d.accs)) for d in due]
        store.done(sp, due)
        if "retry" in ops:
            store.retry_failed(sp)
        if "settle" in ops:
            store.settle(sp)
        seen.append(shown(path))
        if "other" in ops:  # another handle folds the log
            other = WindowStore(path)
            other.stats("w")
            other.close()
        if "restart" in ops:  # killed: nothing folded
            store.db.close()
            store.scratch.close()
            store = WindowStore(path)
    store.retry_failed(sp)
    store.close_open(sp)
    due = store.due(sp, store.mark("w")["watermark"])
    written.append(made(sp, due) if due else None)
    written += [(d.gk, d.start, d.end, exact(list(d.values)), exact(d.accs)) for d in due]
    store.done(sp, due)
    store.close()
    db = sqlite3.connect(path)
    try:
        rows = db.execute(
            'SELECT gk, start, "end", nrows, error, state FROM windows ORDER BY gk, start'
        ).fetchall()
    finally:
        db.close()
    return written, seen, [(*r[:5], exact(list(pickle.loads(r[5])[1]))) for r in rows]


@pytest.mark.parametrize("seed", range(16))
def test_columns_and_dict_hold_the_same_windows_to_the_bit(tmp_path, monkeypatch, seed):
    monkeypatch.setattr(winlog, "COMPACT_EVERY", 3)
    monkeypatch.setattr(held, "COLUMNS_AGAIN", 2)
    sp = spec(hopping("20s", every="5s") if seed % 2 else tumbling("10s"))
    plan = batches(seed)
    got = {}
    IN_ARROW.clear()
    for mode in (True, False):
        monkeypatch.setattr(columns, "ENABLED", mode)
        got[mode] = run(str(tmp_path / f"{mode}.db"), sp, plan)
    assert got[True][0], "no window was written"
    assert all(IN_ARROW), "due windows held in columns were made the other way than they should"
    assert got[True] == got[False]


def test_a_batch_the_columns_cannot_take_turns_them_into_a_dict_and_back(tmp_path, monkeypatch):
    monkeypatch.setattr(held, "COLUMNS_AGAIN", 1)
    sp = spec(tumbling("10s"))
    store = WindowStore(str(tmp_path / "w.db"))

    def apply(rows, n):
        table = pa.Table.from_pylist([{"t": t, "k": "a", "j": 1, "v": v} for t, v in rows])
        part, _, _ = contribute(sp, table, [f"r{n}-{i}" for i in range(len(rows))], None, set())
        store.apply(sp, [pickle.loads(pickle.dumps(part))], event_max=0)

    apply([(1.0, 1.5)], 0)
    assert isinstance(store._open["w"], columns.Columns)
    apply([(2.0, float("nan"))], 1)  # (a NaN: folded row by row)
    assert isinstance(store._open["w"], dict)
    apply([(3.0, 2.5)], 2)  # (one batch in Python: COLUMNS_AGAIN)
    assert isinstance(store._open["w"], dict)
    apply([(4.0, 2.5)], 3)  # the NaN's window holds a NaN: it cannot be columns
    assert isinstance(store._open["w"], dict)
    apply([(14.0, 2.5)], 4)
    store.done(sp, store.due(sp, 10 * S))  # written: the NaN's window is gone
    apply([(15.0, 1.0)], 5)
    apply([(16.0, 1.0)], 6)
    assert isinstance(store._open["w"], columns.Columns)
    due = store.due(sp, 20 * S)
    assert isinstance(due, held.DueTable)
    (one,) = due
    assert (one.start, one.accs[:3]) == (10 * S, [3, 3, 4.5])
    table = columns.results(due.table, sp.by, [(a.name, a.fn) for a in sp.aggs])  # (made in Arrow)
    assert table.to_pylist() == [
        {
            "k": "a",
            "j": 1,
            "window_start": dt.datetime.fromtimestamp(10, dt.UTC),
            "window_end": dt.datetime.fromtimestamp(20, dt.UTC),
            "count": 3,
            "n_v": 3,
            "sum_v": 4.5,
            "min_v": 1.0,
            "max_v": 2.5,
            "avg_v": 1.5,
        }
    ]
    store.close()


def test_integer_sums_no_float_holds_merge_in_columns_and_survive_a_restart(tmp_path):
    # found by review: the guard against a sum past 2**63 cast the integers to floats
    # with a safe cast, which refused 2**53 + 1: every later batch failed, for any key
    sp = spec(tumbling("10s"))
    path = str(tmp_path / "w.db")
    store = WindowStore(path)

    def apply(n, *rows):
        table = pa.Table.from_pylist([{"t": t, "k": k, "j": 1, "v": v} for t, k, v in rows])
        part, _, _ = contribute(sp, table, [f"r{n}-{i}" for i in range(len(rows))], None, set())
        store.apply(sp, [pickle.loads(pickle.dumps(part))], event_max=0)

    apply(0, (1.0, "a", 2**53 - 1))
    apply(1, (2.0, "a", 2))
    apply(2, (3.0, "b", 1))
    assert isinstance(store._open["w"], columns.Columns)
    store.db.close()
    store.scratch.close()
    store = WindowStore(path)
    apply(3, (4.0, "c", 1), (5.0, "a", 10**16 + 1))
    due = store.due(sp, 10 * S)
    got = {d.values[0]: d.accs[2] for d in due}
    assert got == {"a": 2**53 + 1 + 10**16 + 1, "b": 1, "c": 1}
    # an average of integers no float holds: made in Python (exact division), not in Arrow
    assert isinstance(due, held.DueTable)
    assert columns.results(due.table, sp.by, [(a.name, a.fn) for a in sp.aggs]) is None
    table, _ = WindowSink(sp, KeyedSink("out"))._table_or_refuse(due)
    avg_of = {r["k"]: r["avg_v"] for r in table.to_pylist()}
    assert avg_of == {"a": (2**53 + 1 + 10**16 + 1) / 3, "b": 1.0, "c": 1.0}
    store.close()


def test_results_a_sink_refuses_from_windows_held_in_columns_wait_and_are_written_once(tmp_path):
    # (from a reviewer's probe) the refusals of a sink given rows made in Arrow
    sp = spec(tumbling("10s"))
    out = KeyedSink("out", fail_if=lambda r: r["k"] in ("b", "d"))
    sink = WindowSink(sp, out)
    sink.bind_state(str(tmp_path / "w.db"))
    sink.open()
    sink._stopped.set()  # (no timer: this test writes the results)
    sink._ticker.join()
    store = sink._store
    recs = [{"t": float(t), "k": k, "j": 1, "v": float(t)} for t in range(0, 40, 3) for k in "abcde"]
    part, _, _ = contribute(sp, pa.Table.from_pylist(recs), [f"r{i}" for i in range(len(recs))], None, set())
    store.apply(sp, [pickle.loads(pickle.dumps(part))], event_max=0)
    assert isinstance(store._open["w"], columns.Columns)
    store.close_open(sp)
    assert isinstance(store.due(sp, sink.bound()), held.DueTable)
    assert sink.emit() == 12  # 4 windows of a, c and e; b's and d's refused
    assert len(out.rows) == 12 and not out.conflicts
    assert store.stats("w")["refused_windows"] == 8
    assert len(store.due(sp, sink.bound())) == 0  # (refused: not tried again in this run)
    out.fail_if = None
    store.retry_failed(sp)
    assert sink.emit() == 8
    assert len(out.rows) == 20 and set(out.writes.values()) == {1} and not out.conflicts
    assert {r["k"] for r in out.rows.values()} == set("abcde")
    assert store.stats("w")["open_windows"] == 0
    sink.close()


def test_result_row_keys_sort_by_window_start_and_tell_windows_apart():
    # (sorted by start, a sink's key manifest takes them side by side: window_sink._window_keys)
    from ackflow.state.window_sink import _window_keys

    starts = (-(10**15), -1, 0, 1, 59_999_999, 60_000_000, 2**62)
    slots = [(gk, start) for gk in ('["a"]', '["b"]', "[1]", '["a\\u0000"]') for start in starts]
    keys = _window_keys("w", slots)
    assert len(set(keys)) == len(keys)
    assert keys == _window_keys("w", list(slots))  # the same in every run
    in_key_order = [start for _, (_, start) in sorted(zip(keys, slots, strict=True))]
    assert in_key_order == sorted(in_key_order)
    assert all(k.startswith("w:w:") for k in keys)
    assert not set(_window_keys("v", slots)) & set(keys)  # another operator's windows
    # output="update": the keys of before 0.6.7 (open windows have rows under them)
    old = ["w:w:" + hashlib.sha256(f"w\x00{gk}\x00{start}".encode()).hexdigest()[:32] for gk, start in slots]
    assert _window_keys("w", slots, by_start=False) == old
    assert [k[:4] + k[21:] for k in keys] == old  # (the same digest after the start)
