"""flow.window(...): acked at the state commit, results written once under stable keys,
late rows never dropped, windows that close when data stops, and state that survives a
restart and a crash between any two durable steps (the in-process executor: the same
task code as Spark's, no JVM; Spark itself in the doctest and test_window_exactness)."""

from __future__ import annotations

import json

import pytest

import ackflow
from ackflow import faults
from ackflow import windows as w
from ackflow.cli import main
from ackflow.core.errors import FlowError
from ackflow.core.policy import RetryPolicy
from ackflow.flow import Flow, branch
from ackflow.sinks import MemorySink
from ackflow.testing import KeyedSink, ListSource


def msgs(*recs):
    return [json.dumps({"t": t, "k": k, "v": v}) for t, k, v in recs]


def run(flow, tmp_path, **kw):
    kw.setdefault("until_idle", 1.0)
    kw.setdefault("batch_size", 4)
    return ackflow.run(flow, executor="local", state_dir=str(tmp_path), **kw)


def results(sink):
    return sorted((r["k"], r["window_start"].second, r["n"], r["total"]) for r in sink.rows.values())


AGGS = [w.count().alias("n"), w.sum_("v").alias("total")]


def test_messages_are_acked_at_the_state_commit_and_windows_written_once(tmp_path):
    src = ListSource(msgs((0.1, "a", 1), (0.2, "b", 2), (0.5, "a", 3), (1.1, "a", 4), (1.3, "b", 5)))
    out = KeyedSink("out")
    flow = Flow(src).window(w.tumbling("1s"), by="k", time="t", aggs=AGGS, idle=0.1, name="per_s").to(out)
    report = run(flow, tmp_path, until_idle=1.5)
    assert set(src.final().values()) == {"acked"} and report.acked == 5, src.failures
    assert results(out) == [("a", 0, 2, 4), ("a", 1, 1, 4), ("b", 0, 1, 2), ("b", 1, 1, 5)]
    assert not out.conflicts and set(out.writes.values()) == {1}
    assert all(k.startswith("w:per_s:") for k in out.rows)


def test_a_crash_after_the_state_commit_is_not_counted_twice(tmp_path):
    # the commit is durable, then the batch fails before any ack: the messages come
    # again, their rows are applied already, and they are acked without a second count
    src = ListSource(msgs(*[(0.1 * i, "a", i) for i in range(8)]), policy=RetryPolicy(max_deliveries=4))
    out = KeyedSink("out")
    flow = Flow(src).window(w.tumbling("1s"), by="k", time="t", aggs=AGGS, idle=0.1).to(out)
    faults.arm("state.after_commit", "raise")
    try:
        run(flow, tmp_path, until_idle=1.5)
    finally:
        faults.disarm()
    assert set(src.final().values()) == {"acked"}
    again = [k for k, s in src.settled.items() if s[:-1]]  # given back, then acked
    assert len(again) == 4 and all(src.settled[k] == ["released", "acked"] for k in again)
    assert results(out) == [("a", 0, 8, sum(range(8)))]


def test_a_crash_between_writing_results_and_deleting_them_rewrites_the_same_rows(tmp_path):
    src = ListSource(msgs((0.1, "a", 1), (0.4, "a", 2), (1.5, "b", 3)))
    out = KeyedSink("out")
    flow = Flow(src).window(w.tumbling("1s"), by="k", time="t", aggs=AGGS, idle=0.1).to(out)
    faults.arm("state.after_output", "raise")
    try:
        run(flow, tmp_path, until_idle=1.5)
    finally:
        faults.disarm()
    assert results(out) == [("a", 0, 2, 3), ("b", 1, 1, 3)]
    assert not out.conflicts and max(out.writes.values()) == 2  # written again, same row


def test_an_output_down_for_a_while_holds_results_not_messages(tmp_path):
    """The window's output raises for a while: the messages are acked at the state
    commit all the same (none given back, none dead-lettered), the results wait in the
    store, and once the output answers each is written exactly once."""
    import time

    down_until = time.monotonic() + 1.5
    src = ListSource(msgs(*[(0.1 * i, "ab"[i % 2], i) for i in range(30)]))
    out = KeyedSink("out", raise_if=lambda row: time.monotonic() < down_until)
    flow = Flow(src).window(w.tumbling("1s"), by="k", time="t", aggs=AGGS, idle=0.1).to(out)
    window = flow.sinks[0]
    report = run(flow, tmp_path, until_idle=3.0)
    assert report.acked == 30 and report.dead_lettered == 0 and report.nacked == 0
    assert window.emit_failures > 0  # it was down when results came due
    want = sorted(
        (
            k,
            s,
            sum(1 for i in range(30) if "ab"[i % 2] == k and int(0.1 * i) == s),
            sum(i for i in range(30) if "ab"[i % 2] == k and int(0.1 * i) == s),
        )
        for k in "ab"
        for s in range(3)
    )
    assert results(out) == want
    assert not out.conflicts and set(out.writes.values()) == {1}


def test_late_rows_fail_their_message_with_the_reason_or_go_to_on_late(tmp_path):
    recs = [(10.0, "a", 1), (10.5, "a", 1), (1.0, "a", 7)]  # the third is 9 s behind
    src = ListSource(msgs(*recs[:2]) + msgs(recs[2]))
    out = KeyedSink("out")
    flow = Flow(src).window(w.tumbling("1s"), by="k", time="t", aggs=AGGS, lateness="2s").to(out)
    run(flow, tmp_path / "a", batch_size=2, max_concurrent_batches=1)  # the late row's batch second
    assert src.final() == {"m0": "acked", "m1": "acked", "m2": "dead_lettered"}
    assert src.failures["m2"].step == "window_1"
    assert src.failures["m2"].error.startswith("late: event time 1.0 < watermark 1970-01-01T00:00:08")

    src = ListSource(msgs(*recs[:2]) + msgs(recs[2]))
    late = MemorySink("late")
    flow = Flow(src).window(w.tumbling("1s"), by="k", time="t", aggs=AGGS, lateness="2s", on_late=late)
    run(flow.to(KeyedSink("out")), tmp_path / "b", batch_size=2, max_concurrent_batches=1)
    assert set(src.final().values()) == {"acked"}
    assert [(r["t"], r["v"]) for r in late.rows] == [(1.0, 7)]


def test_windows_close_when_data_stops_and_state_carries_over_a_restart(tmp_path, capsys):
    out = KeyedSink("out")
    first = ListSource(msgs((0.1, "a", 1), (0.2, "a", 2)), name="first")
    flow = Flow(first).window(w.tumbling("1s"), by="k", time="t", aggs=AGGS, idle=60)
    run(flow.to(out), tmp_path)
    assert out.rows == {}  # idle for 60 s not reached: the window stays open, in state
    assert main(["state", "show", str(tmp_path), "--json"]) == 0
    (op,) = json.loads(capsys.readouterr().out)
    assert (op["window"], op["watermark"], op["open_windows"], op["rows_applied"]) == (
        "window_1",
        "1970-01-01T00:00:00.200000Z",
        1,
        2,
    )
    assert op["open"] == [
        {
            "keys": ["a"],
            "start": "1970-01-01T00:00:00Z",
            "end": "1970-01-01T00:00:01Z",
            "rows": 2,
            "unwritten_changes": True,
        }
    ]
    second = ListSource(msgs((0.3, "a", 4)), name="first", keys=["m9"])
    flow = Flow(second).window(w.tumbling("1s"), by="k", time="t", aggs=AGGS, idle=0.1)
    run(flow.to(out), tmp_path, until_idle=2.0)
    assert results(out) == [("a", 0, 3, 7)]


def test_update_mode_upserts_after_each_batch(tmp_path):
    src = ListSource(msgs(*[(0.1 * i, "a", 1) for i in range(6)]))
    out = KeyedSink("out")
    flow = Flow(src).window(w.tumbling("1s"), by="k", time="t", aggs=AGGS, output="update", idle=0.1)
    run(flow.to(out), tmp_path, batch_size=2, max_concurrent_batches=1)
    assert results(out) == [("a", 0, 6, 6)]
    (key,) = out.rows
    assert out.writes[key] >= 2  # written as it grew, the last value is the whole window


def test_several_windows_on_one_stream_and_session_and_count_windows(tmp_path):
    recs = [(0.0, "a", 1), (0.5, "a", 2), (3.0, "a", 3), (3.2, "b", 4), (3.4, "a", 5)]
    src = ListSource(msgs(*recs))
    sessions, counts = KeyedSink("sessions"), KeyedSink("counts")
    flow = Flow(src).broadcast(
        branch().window(w.session("1s"), by="k", time="t", aggs=AGGS, idle=0.1, name="s").to(sessions),
        branch().window(w.count_window(2), by="k", aggs=AGGS, name="c").to(counts),
    )
    run(flow, tmp_path, until_idle=2.5, batch_size=10)
    got = sorted((r["k"], r["window_start"].timestamp(), r["n"], r["total"]) for r in sessions.rows.values())
    assert got == [("a", 0.0, 2, 3), ("a", 3.0, 2, 8), ("b", 3.2, 1, 4)]
    # count windows: "a" has 4 rows -> two full windows; "b" one row -> still open
    assert sorted((r["k"], r["window_index"], r["n"], r["total"]) for r in counts.rows.values()) == [
        ("a", 0, 2, 3),
        ("a", 1, 2, 8),
    ]


def test_a_flow_without_a_place_for_state_is_refused_at_start():
    flow = Flow(ListSource(msgs((0.1, "a", 1)))).window(w.tumbling("1s"), time="t", aggs=AGGS).to(KeyedSink())
    with pytest.raises(FlowError, match="give the run state_dir="):
        ackflow.run(flow, executor="local", until_idle=0.2)


def test_a_result_the_output_refuses_is_kept_aside_and_the_others_are_written(tmp_path, capsys):
    """One window's row cannot be written (the sink refuses it; another's Python
    aggregator raises in finish): both stay in the state store with the reason, and
    every other window is written; nothing holds back the windows after them."""

    class Picky:
        def init(self):
            return 0

        def add(self, acc, value):
            return acc + value

        def merge(self, a, b):
            return a + b

        def finish(self, acc):
            if acc == 13:
                raise ValueError("13 is unlucky")
            return acc

    recs = [(0.1, "a", 1), (0.2, "b", 13), (0.3, "c", 5), (1.5, "a", 2), (1.6, "c", 7)]
    src = ListSource(msgs(*recs))
    out = KeyedSink("out", fail_if=lambda r: r["k"] == "c" and r["n"] == 1 and r["total"] == 5)
    aggs = [*AGGS, w.python(Picky(), "v", name="lucky")]
    flow = Flow(src).window(w.tumbling("1s"), by="k", time="t", aggs=aggs, idle=0.1).to(out)
    run(flow, tmp_path, until_idle=1.5)
    assert set(src.final().values()) == {"acked"}  # the rows were counted: acked
    assert results(out) == [("a", 0, 1, 1), ("a", 1, 1, 2), ("c", 1, 1, 7)]
    assert main(["state", "show", str(tmp_path), "--json"]) == 0
    (op,) = json.loads(capsys.readouterr().out)
    assert op["refused_windows"] == 2
    reasons = sorted(x["refused"] for x in op["open"])
    assert "13 is unlucky" in reasons[0] and "row refused by the sink" in reasons[1], reasons


def test_a_column_without_values_yet_and_times_out_of_range(tmp_path):
    """An aggregate's column that no row of a batch has (all null: not sent to the
    sink) sums to nothing instead of failing the batch; an event time in milliseconds
    given as seconds (year 55 000) fails its own message, naming the likely mistake."""
    bodies = [
        json.dumps({"t": 0.1, "k": "a"}),
        json.dumps({"t": 0.2, "k": "a", "v": None}),
        json.dumps({"t": 1_795_000_000_000, "k": "a", "v": 1}),
    ]
    src = ListSource(bodies)
    out = KeyedSink("out")
    flow = Flow(src).window(w.tumbling("1s"), by="k", time="t", aggs=AGGS, idle=0.1).to(out)
    run(flow, tmp_path, until_idle=1.5, batch_size=10)
    assert src.final() == {"m0": "acked", "m1": "acked", "m2": "dead_lettered"}
    assert "milliseconds? give seconds" in src.failures["m2"].error
    assert results(out) == [("a", 0, 2, None)]


@pytest.mark.parametrize(
    "kind, t",
    [
        (w.tumbling("1s"), "0001-01-01T00:00:00+05:00"),  # before the year 1 in UTC
        (w.hopping("2 days", every="1 day"), "0001-01-01T00:00:00"),  # its window starts before
        (w.hopping("2 days", every="1 day"), -62_135_596_800),  # the same, in epoch seconds
        (w.tumbling("1s"), -100_000_000_000),  # epoch seconds before the year 1
        (w.tumbling("2 days"), "9999-12-31T12:00:00"),  # its window ends after the year 9999
        (w.session("1 day"), "9999-12-31T12:00:00"),
    ],
)
def test_a_time_whose_window_is_outside_the_years_1_to_9999_fails_alone(tmp_path, kind, t):
    """Such a window's result cannot be written (a datetime holds the years 1-9999):
    it was folded into the state, its write failed as an outage, and because windows are
    written in order every later window waited behind it, forever. Found by review."""
    good = 1_704_067_200 if isinstance(t, int) else "2024-01-01T00:00:00"  # one kind of time
    src = ListSource([json.dumps({"t": t, "k": "a"}), json.dumps({"t": good, "k": "b"})])
    out = KeyedSink("out")
    flow = Flow(src).window(kind, by="k", time="t", aggs=[w.count().alias("n")], idle=0.1).to(out)
    run(flow, tmp_path, until_idle=1.5, batch_size=10)
    assert src.final() == {"m0": "dead_lettered", "m1": "acked"}
    assert "year" in src.failures["m0"].error, src.failures["m0"].error
    assert {r["k"] for r in out.rows.values()} == {"b"}


@pytest.mark.parametrize("op", ["window", "dedupe"])
@pytest.mark.parametrize("bad", ['["x"]', '{"z": 1}'])
def test_a_key_value_that_is_a_list_or_an_object_never_stops_the_run(tmp_path, op, bad):
    """A message whose key is a list or an object, first in its batch, made the batch's
    key column nested, and the operator's prepare stopped the run (FlowError "keys must
    be plain values"); the message came back after a restart: a crash loop made by data.
    Found by review. Now the run goes on and every message is settled."""
    bodies = [
        f'{{"k": {bad}, "t": 0.2}}',
        '{"k": "a", "t": 0.1}',
        '{"k": "a", "t": 0.3}',
        '{"k": "b", "t": 0.4}',
    ]
    src, out = ListSource(bodies), MemorySink()
    flow = (
        Flow(src).window(w.tumbling("1s"), by="k", time="t", idle=0.2, aggs=[w.count()]).to(out)
        if op == "window"
        else Flow(src).dedupe("k", within="1h", time="t").to(out)
    )
    report = run(flow, tmp_path, until_idle=1.5, batch_size=1)
    assert report.acked + report.dead_lettered == len(bodies)
    assert set(src.final().values()) <= {"acked", "dead_lettered"}
    assert all(f.step in (op + "_1", "decode") or "k" in f.error for f in src.dead_letters.values())


def test_state_in_postgresql_counts_once_after_a_crash_and_has_one_driver(postgres):
    """state=PostgresState(dsn): the tasks read the watermark and the applied keys from
    the server, the driver merges there; a crash after the state commit is not counted
    twice, and a second process on the same window's state is refused at start."""
    import uuid

    from ackflow.core.errors import FlowError
    from ackflow.state import pg

    state = w.PostgresState(postgres.dsn, schema=f"win_{uuid.uuid4().hex[:8]}")
    src = ListSource(msgs(*[(0.1 * i, "a", i) for i in range(8)]), policy=RetryPolicy(max_deliveries=4))
    out = KeyedSink("out")
    flow = Flow(src).window(w.tumbling("1s"), by="k", time="t", aggs=AGGS, idle=0.1, state=state).to(out)
    faults.arm("state.after_commit", "raise")
    try:
        ackflow.run(flow, executor="local", batch_size=4, until_idle=1.5)  # no state_dir needed
    finally:
        faults.disarm()
    assert set(src.final().values()) == {"acked"}
    assert results(out) == [("a", 0, 8, sum(range(8)))]
    held = pg.open_store(state, "window_1")
    try:
        again = Flow(ListSource(msgs((5.0, "a", 1)))).window(
            w.tumbling("1s"), by="k", time="t", aggs=AGGS, state=state
        )
        with pytest.raises(FlowError, match="another process drives this window's state"):
            ackflow.run(again.to(KeyedSink("out")), executor="local", until_idle=0.2)
    finally:
        held.close()


class _TakenElsewhere(ListSource):
    """A source whose given-back messages another consumer takes: they never return."""

    def release(self, deliveries):
        for d in deliveries:
            self._record(d, "released")


@pytest.mark.parametrize("hold_s", [0.3, 600.0])
def test_messages_given_back_that_never_return_hold_the_watermark_for_back_hold_s(
    tmp_path, monkeypatch, caplog, hold_s
):
    """A batch fails as a whole (its state commit) and its messages, given back, are
    taken by another consumer. The watermark waits for them (their windows are not
    closed behind their back) for BACK_HOLD_S, then moves on with a warning: a later
    key's window is written. Held longer than the run, it is not written in the run."""
    from ackflow.engine import settle

    monkeypatch.setattr(settle, "BACK_HOLD_S", hold_s)
    src = _TakenElsewhere(
        msgs(*[(0.1 * i, "a", 1) for i in range(1, 5)], *[(5 + 0.1 * i, "b", 1) for i in range(4)])
    )
    out = KeyedSink("out")
    flow = Flow(src).window(w.tumbling("1s"), by="k", time="t", aggs=AGGS, idle=0.1).to(out)
    faults.arm("state.before_commit", "raise")
    try:
        with caplog.at_level("WARNING", logger="ackflow.engine"):
            # (one batch at a time: the failed one settles first, so the success after it
            # ends the systemic episode; the other order would leave it open, and the run
            # would never be idle)
            report = run(flow, tmp_path, until_idle=2.5, max_concurrent_batches=1)
    finally:
        faults.disarm()
    assert report.given_back_systemic == 4 and report.dead_lettered == 0
    final = src.final()
    gone = {k for k, v in final.items() if v == "released"}  # the batch whose commit failed
    a, b = {f"m{i}" for i in range(4)}, {f"m{i}" for i in range(4, 8)}
    assert gone in (a, b) and all(final[k] == "acked" for k in (a | b) - gone), final
    other = ("b", 5, 4, 4) if gone == a else ("a", 0, 4, 4)  # the window the hold is about
    expired = "given back have not come back in" in caplog.text
    if hold_s < 1:
        assert expired and results(out) == [other]
    else:
        assert not expired and results(out) == []


def test_state_in_postgresql_reconnects_only_once_its_own_old_session_has_ended(postgres):
    """After the server cut the driver's connection, it reconnects and takes the window's
    lock again. While its own old session still holds the lock (the server has not
    ended it yet), the reconnect is "away" (the batch is given back and tried later), not
    a second driver; once the old session ends, the lock is the new session's."""
    import time
    import uuid

    import psycopg

    from ackflow.core.errors import StoreAway
    from ackflow.state import pg

    state = w.PostgresState(postgres.dsn, schema=f"win_{uuid.uuid4().hex[:8]}")
    store = pg.open_store(state, "window_1")
    try:
        old = store.db.conn.info.backend_pid
        with pytest.raises(StoreAway, match="the previous session still holds the window's lock"):
            store.db._reopen()
        with psycopg.connect(postgres.dsn, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (old,))
            deadline = time.monotonic() + 10
            while True:
                try:
                    new = store.db._reopen()
                    break
                except StoreAway:  # (the server ends the old session in its own time)
                    assert time.monotonic() < deadline, "the old session never ended"
                    time.sleep(0.05)
            holder = admin.execute(
                "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted"
                " AND objid = hashtext(%s)::oid",
                (f"ackflow-window:{state.schema}:window_1",),
            ).fetchall()
            assert holder == [(new.info.backend_pid,)] and new.info.backend_pid != old
            new.close()
    finally:
        store.close()


def test_state_in_postgresql_away_mid_run_loses_and_doubles_nothing(postgres, tmp_path):
    """The state's database stops for a few seconds mid-run: batches fail as a whole
    (given back or retried, never dead-lettered), and once it answers the run ends with
    every message acked and every window's count exact (none missing, none twice)."""
    import uuid
    from collections import Counter

    from helpers import Outage

    state = w.PostgresState(postgres.dsn, schema=f"win_{uuid.uuid4().hex[:8]}", connect_timeout=2)
    recs = [(0.05 * i, "abc"[i % 3], 1) for i in range(300)]
    src = ListSource(msgs(*recs), policy=RetryPolicy(max_deliveries=40, backoff_s=0.2, max_backoff_s=1.0))
    out = KeyedSink("out")
    flow = Flow(src).window(w.tumbling("1s"), by="k", time="t", aggs=AGGS, idle=0.5, state=state).to(out)
    applied = f'SELECT coalesce(sum(hi - lo + 1), 0) FROM "{state.schema}".applied_runs'  # (row keys)
    with Outage(postgres, applied, at_least=20) as outage:
        report = run(flow, tmp_path, batch_size=5, until_idle=3.0)
    assert outage.happened, "the database was never stopped"
    assert report.dead_lettered == 0 and set(src.final().values()) == {"acked"}, src.failures
    assert report.nacked + report.given_back_systemic > 0  # it did see the outage
    expected = Counter((k, int(t)) for t, k, _ in recs)
    assert {(k, s): n for k, s, n, _ in results(out)} == dict(expected)
