"""Windows' task side and state store, without Spark: assignment, partials, merges,
the watermark, applied keys, and what a crash between two durable steps leaves."""

from __future__ import annotations

import datetime as dt
import pickle
import sqlite3

import pyarrow as pa
import pytest

from ackflow import faults
from ackflow.core.errors import ConfigError
from ackflow.flow import Flow
from ackflow.state.partials import contribute, to_us
from ackflow.state.spec import window_flow
from ackflow.state.store import StateError, WindowStore, read_view
from ackflow.state.winlog import folded
from ackflow.testing import ListSource
from ackflow.windows import (
    avg,
    count,
    count_distinct,
    count_window,
    duration_us,
    first,
    hopping,
    last,
    max_,
    min_,
    python,
    session,
    sum_,
    tumbling,
)

S = 1_000_000


def spec(kind, aggs=None, **kw):
    kw.setdefault("time", None if kind.__class__.__name__ == "Count" else "t")
    aggs = aggs or [count(), sum_("v").alias("total")]
    return window_flow(Flow(ListSource([])), kind, aggs=aggs, by="k", name="w", **kw).spec


def rows(*recs):
    return pa.Table.from_pylist([{"t": t, "k": k, "v": v} for t, k, v in recs])


def fold(sp, table, keys, watermark=None, applied=()):
    return contribute(sp, table, keys, watermark, set(applied))


def test_window_starts():
    assert tumbling("10s").starts(25 * S) == [20 * S]
    assert hopping("10s", every="5s").starts(12 * S) == [5 * S, 10 * S]
    assert hopping("10s", every="5s").starts(10 * S) == [5 * S, 10 * S]
    assert hopping("9s", every="3s").starts(7 * S) == [0, 3 * S, 6 * S]
    with pytest.raises(ConfigError, match="cannot exceed"):
        hopping("5s", every="10s")
    assert duration_us("1.5 min", "x") == 90 * S
    with pytest.raises(ConfigError, match="not a duration"):
        duration_us("soon", "x")
    with pytest.raises(ConfigError, match="longer than 31 000 years"):  # (a window's end: an int64)
        tumbling("300000000 days")


def test_event_times_in_every_shape_and_refusals():
    base = to_us("2024-03-01T12:00:00Z")
    assert to_us(dt.datetime(2024, 3, 1, 12)) == base
    assert to_us("2024-03-01T13:00:00+01:00") == base
    assert to_us(base / S) == base
    assert to_us(dt.date(2024, 3, 1)) == base - 12 * 3600 * S
    for bad in ("yesterday", True, float("nan"), [1]):
        with pytest.raises(ValueError):
            to_us(bad)


def test_rows_fold_into_partials_and_each_row_has_one_fate():
    sp = spec(tumbling("10s"))

    def iso(sec):
        return (dt.datetime(1970, 1, 1, tzinfo=dt.UTC) + dt.timedelta(seconds=sec)).isoformat()

    table = pa.Table.from_pylist(
        [
            {"t": iso(1), "k": "a", "v": 2},
            {"t": iso(3), "k": "a", "v": 3},
            {"t": iso(12), "k": "b", "v": None},
            {"t": None, "k": "a", "v": 1},  # no event time: fails
            {"t": "later", "k": "a", "v": 1},  # not a time: fails
            {"t": iso(0.5), "k": "a", "v": 9},  # below the watermark: late
            {"t": iso(4), "k": "a", "v": 100},  # applied already: adds nothing
        ]
    )
    keys = [f"m{i}" for i in range(7)]
    parts, failed, late = fold(sp, table, keys, watermark=1 * S, applied={"m6"})
    assert sorted(failed) == [3, 4]
    assert "is null" in failed[3] and "ISO 8601" in failed[4]
    assert late == [5] and parts.late == 1 and parts.applied == 1
    assert parts.keys == ["m0", "m1", "m2"]
    assert parts.as_parts()[0][(("a",), 0, 10 * S)] == (2, [2, 5])
    assert parts.as_parts()[0][(("b",), 10 * S, 20 * S)] == (1, [1, None])  # a null sums to nothing
    assert parts.max_t == 12 * S


def test_aggregates_match_their_definitions():
    aggs = [
        count(),
        count("v").alias("n_v"),
        sum_("v"),
        min_("v"),
        max_("v"),
        avg("v"),
        count_distinct("v"),
        first("v"),
        last("v"),
        python(Median(), "v").alias("median"),
    ]
    sp = spec(tumbling("1h"), aggs=aggs)
    values = [5, None, 3, 9, 3]
    table = rows(*[(float(i), "a", v) for i, v in enumerate(values)])
    parts, failed, _ = fold(sp, table, [f"r{i}" for i in range(5)])
    assert not failed
    (accs_rows,) = parts.as_parts()[0].values()
    out = {a.name: a.finish(acc) for a, acc in zip(sp.aggs, accs_rows[1], strict=True)}
    assert out == {
        "count": 5,
        "n_v": 4,
        "sum_v": 20,
        "min_v": 3,
        "max_v": 9,
        "avg_v": 5.0,
        "count_distinct_v": 3,
        "first_v": 5,
        "last_v": 3,
        "median": 4.0,
    }


class Median:
    """A Python aggregator: the median of the values (keeps them all)."""

    def init(self):
        return []

    def add(self, acc, value):
        return [*acc, value]

    def merge(self, a, b):
        return a + b

    def finish(self, acc):
        s = sorted(acc)
        return (s[(len(s) - 1) // 2] + s[len(s) // 2]) / 2


@pytest.fixture
def store(tmp_path):
    s = WindowStore(str(tmp_path / "windows.db"))
    yield s
    s.close()


def test_batches_merge_and_a_key_applied_twice_is_refused(store):
    sp = spec(tumbling("10s"))
    p1, _, _ = fold(sp, rows((1.0, "a", 2), (11.0, "a", 1)), ["x", "y"])
    p2, _, _ = fold(sp, rows((2.0, "a", 5)), ["z"])
    assert store.apply(sp, [p1]) == 2
    store.apply(sp, [p2])
    assert store.mark("w")["watermark"] == 11 * S
    w, applied = read_view(store.path, "w", ["x", "z", "q"])
    assert (w, applied) == (11 * S, {"x", "z"})
    again, _, _ = fold(sp, rows((3.0, "a", 7)), ["x"])  # a task that did not see x applied
    with pytest.raises(StateError, match="applied already"):
        store.apply(sp, [again])
    due = store.due(sp, bound=10 * S)
    assert [
        (d.values, d.start, [a.finish(x) for a, x in zip(sp.aggs, d.accs, strict=True)]) for d in due
    ] == [(("a",), 0, [2, 7])]


def test_sessions_merge_across_batches_and_a_bridge_joins_two(store):
    sp = spec(session("5s"))
    p1, _, _ = fold(sp, rows((0.0, "a", 1), (2.0, "a", 1), (20.0, "a", 1)), ["a", "b", "c"])
    assert sorted((s, e) for (_, s, e) in p1.as_parts()[0]) == [(0, 7 * S), (20 * S, 25 * S)]
    store.apply(sp, [p1])
    p2, _, _ = fold(sp, rows((10.0, "a", 1)), ["d"])  # 10+5 < 20: still apart
    store.apply(sp, [p2])
    assert len(store.due(sp, bound=100 * S)) == 3
    # 6 joins [0, 7) and [10, 15); 13 and 17 are one partial that reaches [20, 25)
    p3, _, _ = fold(sp, rows((6.0, "a", 1), (13.0, "a", 1), (17.0, "a", 1)), ["e", "f", "g"])
    assert sorted((s, e) for (_, s, e) in p3.as_parts()[0]) == [(6 * S, 11 * S), (13 * S, 22 * S)]
    store.apply(sp, [p3])
    (one,) = store.due(sp, bound=100 * S)
    assert (one.start, one.end, one.accs[0]) == (0, 25 * S, 7)


def test_count_windows_fill_in_order_and_keep_their_index_after_deletion(store):
    sp = spec(count_window(3))
    p1, _, _ = fold(sp, rows(*[(0, "a", i) for i in range(4)]), [f"k{i}" for i in range(4)])
    store.apply(sp, [p1])
    (full,) = store.due(sp, bound=None)
    assert (full.start, full.accs) == (0, [3, 3])
    store.done(sp, [full])
    p2, _, _ = fold(sp, rows(*[(0, "a", 10) for _ in range(3)]), ["k4", "k5", "k6"])
    store.apply(sp, [p2])
    (second,) = store.due(sp, bound=None)
    assert (second.start, second.accs) == (1, [3, 23])  # 3 + 10 + 10, then one row open


def test_watermark_trails_by_lateness_and_closes_every_window_when_quiet(store):
    sp = spec(hopping("10s", every="5s"), lateness="5s")
    p, _, _ = fold(sp, rows((100.0, "a", 1), (93.0, "b", 1)), ["x", "y"])
    store.apply(sp, [p])
    assert store.mark("w")["watermark"] == 95 * S
    assert [d.start for d in store.due(sp, bound=95 * S)] == [85 * S]  # [85, 95) only
    assert store.close_open(sp) == 110 * S  # the end of the last window with data
    assert sorted(d.start for d in store.due(sp, bound=110 * S)) == [85 * S, 90 * S, 95 * S, 100 * S]
    assert store.close_open(sp) is None


def test_update_mode_writes_changed_windows_then_the_closed_one_last(store):
    sp = spec(tumbling("10s"), output="update")
    p, _, _ = fold(sp, rows((1.0, "a", 1)), ["x"])
    store.apply(sp, [p])
    (d,) = store.due(sp, bound=0)
    assert not d.close
    store.done(sp, [d])
    assert store.due(sp, bound=0) == []  # clean until changed
    p, _, _ = fold(sp, rows((2.0, "a", 1)), ["y"])
    store.apply(sp, [p])
    (d,) = store.due(sp, bound=10 * S)
    assert d.close and d.accs == [2, 2]


def test_a_crash_inside_the_state_transaction_leaves_nothing(store):
    sp = spec(tumbling("10s"))
    p, _, _ = fold(sp, rows((1.0, "a", 1)), ["x"])
    faults.arm("state.before_commit", "raise")
    with pytest.raises(faults.InjectedFault):
        store.apply(sp, [p])
    assert read_view(store.path, "w", ["x"]) == (None, set())
    assert store.due(sp, bound=100 * S) == []
    store.apply(sp, [p])  # the redelivery is applied once
    assert store.due(sp, bound=100 * S)[0].accs == [1, 1]


def test_forget_drops_only_old_keys(store):
    sp = spec(tumbling("10s"), remember="1h")
    p, _, _ = fold(sp, rows((1.0, "a", 1)), ["old"])
    store.apply(sp, [p], now=0.0)
    p, _, _ = fold(sp, rows((2.0, "a", 1)), ["new"])
    store.apply(sp, [p], now=5000.0)
    assert store.forget(sp, now=5000.0) == 1
    assert read_view(store.path, "w", ["old", "new"])[1] == {"new"}


def test_state_is_committed_durably(store):
    db = sqlite3.connect(store.path)
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert store.db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    sp = spec(tumbling("10s"))
    p, _, _ = fold(sp, rows((1.0, "a", 1)), ["x"])
    store.apply(sp, [p])
    assert db.execute("SELECT count(*) FROM windows").fetchone()[0] == 0  # (one row in the log)
    [(_, _, _, rows_in, _, state, error)] = folded(db, "w")  # another reader: the log replayed
    assert (pickle.loads(state), rows_in, error) == ((("a",), [1, 1]), 1, None)
    store.close()  # the log folded into the table
    values, accs = pickle.loads(db.execute("SELECT state FROM windows").fetchone()[0])
    assert (values, accs) == (("a",), [1, 1])
    assert folded(db, "w") is None


def test_configuration_errors_name_the_window():
    src = Flow(ListSource([]))
    with pytest.raises(ConfigError, match=r"time= .* is needed"):
        src.window(tumbling("1s"), aggs=[count()])
    with pytest.raises(ConfigError, match="session windows are written once"):
        src.window(session("1s"), time="t", aggs=[count()], output="update")
    with pytest.raises(ConfigError, match=r"used twice"):
        src.window(tumbling("1s"), time="t", by="count", aggs=[count()])
    with pytest.raises(ConfigError, match=r"aggregates from ackflow\.windows"):
        src.window(tumbling("1s"), time="t", aggs=["sum(v)"])


def test_keys_holding_nul_or_any_text_are_applied_whole_and_refused_twice(store):
    """The applied keys go in as one JSON array (SQLite); a key holding NUL (which
    SQLite's JSON functions would cut there, making "x\\0a" and "x\\0b" one key) goes row
    by row: each key is its own, and each is refused a second time."""
    sp = spec(tumbling("10s"))
    keys = ["x\x00a", "x\x00b", 'q"uote', "ünï"]
    p, _, _ = fold(sp, rows(*[(1.0, "a", 1)] * len(keys)), keys)
    assert store.apply(sp, [p]) == len(keys)
    assert read_view(store.path, "w", [*keys, "x"])[1] == set(keys)
    for k in keys:
        again, _, _ = fold(sp, rows((2.0, "a", 1)), [k])
        with pytest.raises(StateError, match="applied already"):
            store.apply(sp, [again])


def test_a_float_key_of_zero_and_minus_zero_keeps_each_windows_own_text(store):
    """0.0 and -0.0 are one Python dict key but two key texts in the store: each window
    keeps the text its own rows gave it, as when the driver made them (a text made per
    key value in the task once split window 0 into two results)."""
    sp = spec(tumbling("10s"))
    first, _, _ = fold(sp, rows((1.0, 0.0, 1)), ["r1"])
    store.apply(sp, [first])
    second, _, _ = fold(sp, rows((2.0, 0.0, 1), (12.0, -0.0, 1)), ["r2", "r3"])
    store.apply(sp, [second])
    held = sorted(((w[0], w[1], w[3]) for w in folded(store.db, "w")), key=lambda w: w[1])
    assert held == [("[0.0]", 0, 2), ("[-0.0]", 10 * S, 1)]


def test_the_open_windows_held_in_memory_follow_every_write(store, monkeypatch):
    """The driver holds an operator's open windows between batches. Another handle's
    write (another process), a commit that failed, and a window written and deleted
    each make it read the store again; past HOLD_MAX it reads per batch. Every count
    stays exact, through tokens pickled as tasks send them."""
    import ackflow.state.held as store_mod

    sp = spec(tumbling("10s"))

    def put(target, t, key):
        p, _, _ = fold(sp, rows((t, "a", 1)), [key])
        target.apply(sp, [pickle.loads(pickle.dumps(p))])

    def counts():
        return [(d.start, d.accs[0]) for d in store.due(sp, bound=100 * S)]

    put(store, 1.0, "k1")
    other = WindowStore(store.path)
    try:
        put(other, 2.0, "k2")  # another writer of the same operator
    finally:
        other.close()
    put(store, 3.0, "k3")
    assert counts() == [(0, 3)]
    faults.arm("state.before_commit", "raise")
    with pytest.raises(faults.InjectedFault):
        put(store, 4.0, "k4")
    put(store, 4.0, "k4")
    assert counts() == [(0, 4)]

    class LostReply(sqlite3.Connection):  # the server committed, and the reply was lost
        def execute(self, query, *args):
            out = super().execute(query, *args)
            if query == "COMMIT":
                raise ConnectionError("the reply to COMMIT was lost")
            return out

    real = store.db
    store.db = sqlite3.connect(store.path, factory=LostReply, isolation_level=None, check_same_thread=False)
    with pytest.raises((ConnectionError, sqlite3.OperationalError)):  # (and no transaction to roll back)
        put(store, 4.5, "k4.5")
    store.db.close()
    store.db = real
    put(store, 4.7, "k4.7")
    assert counts() == [(0, 6)]
    store.done(sp, store.due(sp, bound=100 * S))  # written and deleted
    put(store, 5.0, "k5")
    assert counts() == [(0, 1)]
    monkeypatch.setattr(store_mod, "HOLD_MAX", 0)
    put(store, 6.0, "k6")
    put(store, 7.0, "k7")
    assert counts() == [(0, 3)]
    assert store._open["w"] is None  # (read per batch now)
