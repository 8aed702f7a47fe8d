"""flow.dedupe(by, within=...): the first row of a key is written once, repeats inside
the horizon are dropped (their messages acked), and neither a redelivery, a failed job
nor a crash between the sink's commit and the claims' lets a second row of one key
through or drops a row whose first was never written (the in-process executor: the
same task code as Spark's; Spark itself in the doctest and the PostgreSQL test)."""

from __future__ import annotations

import json
import sqlite3

import pytest

import ackflow
from ackflow import faults
from ackflow import windows as w
from ackflow.cli import main
from ackflow.core.errors import ConfigError, FlowError
from ackflow.core.policy import RetryPolicy
from ackflow.flow import Flow
from ackflow.testing import KeyedSink, ListSource


def msgs(*recs):
    return [json.dumps({"order": o, "t": t, "n": n}) for o, t, n in recs]


def run(flow, tmp_path, **kw):
    kw.setdefault("until_idle", 1.0)
    kw.setdefault("batch_size", 2)
    kw.setdefault("max_concurrent_batches", 1)
    return ackflow.run(flow, executor="local", state_dir=str(tmp_path), **kw)


def written(sink):
    return sorted((r["order"], r["n"]) for r in sink.rows.values())


def claims(tmp_path):
    db = sqlite3.connect(tmp_path / "windows.db")
    try:
        return sorted(db.execute("SELECT k, owner, done FROM dedupe").fetchall())
    finally:
        db.close()


def test_the_first_row_of_a_key_is_written_and_repeats_are_dropped_and_acked(tmp_path, capsys):
    # repeats in the same batch (o1 twice in the first), in later batches, and a key
    # seen again after the horizon (by event time) is a first again
    src = ListSource(
        msgs(("o1", 0, 1), ("o1", 1, 2), ("o2", 2, 3), ("o1", 5, 4), ("o2", 20, 5), ("o1", 11, 6))
    )
    out = KeyedSink("out")
    flow = Flow(src).dedupe("order", within="10s", time="t", name="once").to(out)
    report = run(flow, tmp_path)
    assert set(src.final().values()) == {"acked"} and report.acked == 6
    assert written(out) == [("o1", 1), ("o1", 6), ("o2", 3), ("o2", 5)]
    assert not out.conflicts and set(out.writes.values()) == {1}
    assert report.rows_written == {"out": 4}
    # a first per span: o1 at 0 and 11, o2 at 2 and 20
    assert [(k, done) for k, _, done in claims(tmp_path)] == [('["o1"]', 1)] * 2 + [('["o2"]', 1)] * 2
    assert main(["state", "show", str(tmp_path), "--json"]) == 0
    (op,) = json.loads(capsys.readouterr().out)
    assert op == {
        "dedupe": "once",
        "claims": 4,
        "uncommitted_claims": 0,
        "newest_claim": "1970-01-01T00:00:20Z",
    }
    assert main(["state", "show", str(tmp_path)]) == 0
    assert "once (dedupe): 4 claims, 0 not committed" in capsys.readouterr().out


def test_repeats_are_dropped_across_runs_and_by_the_wall_clock_without_time(tmp_path):
    out = KeyedSink("out")
    first = ListSource(msgs(("o1", 0, 1), ("o2", 0, 2)), keys=["a", "b"])
    run(Flow(first).dedupe(["order"], within="1h").to(out), tmp_path)
    second = ListSource(msgs(("o1", 0, 3), ("o3", 0, 4)), keys=["c", "d"])
    run(Flow(second).dedupe(["order"], within="1h").to(out), tmp_path)
    assert set(second.final().values()) == {"acked"}
    assert written(out) == [("o1", 1), ("o2", 2), ("o3", 4)]


def test_a_redelivered_first_is_written_again_in_place_and_its_repeat_dropped(tmp_path):
    """The sink committed the rows, then the process failed before the claims were
    marked (the fault point): every message of the job comes again. The first row's
    own message is its claim's owner: written again under the same key; the repeat,
    delivered with it, is dropped. One row, no conflict."""
    src = ListSource(msgs(("o1", 0, 1), ("o1", 1, 2)), policy=RetryPolicy(max_deliveries=3))
    out = KeyedSink("out")
    flow = Flow(src).dedupe("order", within="1h", time="t").to(out)
    faults.arm("dedupe.after_output", "raise")
    try:
        run(flow, tmp_path)
    finally:
        faults.disarm()
    assert src.settled["m0"] == ["released", "acked"]
    assert set(src.settled["m1"][:-1]) == {"released"} and src.settled["m1"][-1] == "acked"
    assert written(out) == [("o1", 1)] and not out.conflicts
    assert out.writes[next(iter(out.rows))] == 2  # the same row, twice: in place
    assert claims(tmp_path) == [('["o1"]', "m0", 1)]


def test_a_repeat_waits_while_the_first_is_unsettled_and_is_then_dropped(tmp_path):
    """A job's claim is left uncommitted (its sink's commit failed after the rows were
    durable, as a crash would leave it): a repeat in a later batch must not be written
    (a second row of the key) nor dropped while the first may still fail: it waits (in
    flight for a second, then run again, no delivery spent) and comes again; once the
    first's redelivery committed, it is a repeat."""
    src = ListSource(msgs(("o1", 0, 1), ("x", 0, 0), ("o1", 1, 2)), policy=RetryPolicy(max_deliveries=6))
    out = KeyedSink("out", fail_commits={1: "after"})
    flow = Flow(src).dedupe("order", within="1h", time="t").to(out)
    run(flow, tmp_path, until_idle=2.0)
    assert set(src.final().values()) == {"acked"}
    assert written(out) == [("o1", 1), ("x", 0)] and not out.conflicts
    # m0 and m1 were given back behind m2: m2 ran while its first was unsettled, waited
    # (in flight for a second, run again, no delivery spent), then was dropped
    assert src.settled["m2"] == ["acked"] and src.deliveries["m2"] == 1  # waited in flight
    assert src.settled["m0"] == src.settled["m1"] == ["released", "acked"]


def test_a_row_the_sink_refuses_gives_up_its_claim(tmp_path):
    # o1's first row is refused for good (dead-lettered): it never reached the sink,
    # so the next o1 is a first, not a repeat of a dead letter
    src = ListSource(msgs(("o1", 0, 1), ("o1", 1, 2)))
    out = KeyedSink("out", fail_if=lambda r: r["n"] == 1)
    run(Flow(src).dedupe("order", within="1h", time="t").to(out), tmp_path, batch_size=1)
    assert src.final() == {"m0": "dead_lettered", "m1": "acked"}
    assert written(out) == [("o1", 2)]


def test_bad_times_fail_their_message_and_bad_configuration_fails_at_build_or_start(tmp_path):
    src = ListSource(msgs(("o1", None, 1), ("o2", "noon", 2), ("o3", "1970-01-01T00:00:03Z", 3)))
    out = KeyedSink("out")
    run(Flow(src).dedupe("order", within="1h", time="t").to(out), tmp_path)
    assert src.final() == {"m0": "dead_lettered", "m1": "dead_lettered", "m2": "acked"}
    assert "time column 't'" in src.failures["m1"].error and "ISO 8601" in src.failures["m1"].error
    flow = Flow(ListSource(msgs(("o1", 0, 1))))
    with pytest.raises(ConfigError, match="within must be a positive"):
        flow.dedupe("order", within=0)
    with pytest.raises(ConfigError, match="by= takes"):
        flow.dedupe([], within="1h")
    with pytest.raises(FlowError, match="give the run state_dir="):
        ackflow.run(flow.dedupe("order", within="1h").to(KeyedSink()), executor="local", until_idle=0.2)
    missing = ListSource(msgs(("o1", 0, 1)))
    with pytest.raises(FlowError, match=r"\['nope'\] are not among"):
        run(Flow(missing).dedupe("nope", within="1h").to(KeyedSink()), tmp_path)


def test_dedupe_before_a_window_counts_each_key_once(tmp_path):
    src = ListSource(msgs(("o1", 0.1, 1), ("o1", 0.2, 1), ("o2", 0.3, 1), ("o1", 0.4, 1)))
    out = KeyedSink("out")
    flow = (
        Flow(src)
        .dedupe("order", within="1h", time="t")
        .to(Flow(src).window(w.tumbling("1s"), time="t", aggs=[w.count().alias("n")], idle=0.1).to(out).sink)
    )
    run(flow, tmp_path, until_idle=1.5)
    assert set(src.final().values()) == {"acked"}
    assert [r["n"] for r in out.rows.values()] == [2]


def test_old_claims_are_forgotten(tmp_path):
    src = ListSource(msgs(*[(f"o{i}", i * 10, i) for i in range(6)]))
    run(Flow(src).dedupe("order", within="15s", time="t", remember=0.001).to(KeyedSink("out")), tmp_path)
    # the newest claim is at 50 s: those before 35 s are gone
    assert [k for k, _, _ in claims(tmp_path)] == ['["o4"]', '["o5"]']


def test_on_spark_with_state_in_postgresql_one_row_per_key_after_a_failed_commit(spark, postgres, pg_table):
    """Spark tasks claim in PostgreSQL (several tasks of a batch at once: the advisory
    lock makes one the first); the sink is PostgreSQL too. The first commit of the
    claims fails after the rows were written: the owners come again and are written in
    place. One row per order, the first's, and every claim committed."""
    import uuid

    import psycopg

    from ackflow.sinks import Postgres

    state = w.PostgresState(postgres.dsn, schema=f"dd_{uuid.uuid4().hex[:8]}")
    recs = [(f"o{i % 7}", i, i) for i in range(40)]  # o0..o6, each about 6 times
    src = ListSource(msgs(*recs), policy=RetryPolicy(max_deliveries=10, backoff_s=0.05))
    flow = (
        Flow(src)
        .dedupe("order", within="1h", time="t", state=state, name="orders")
        .to(Postgres(postgres.dsn, pg_table, create=True))
    )
    faults.arm("dedupe.after_output", "raise")
    try:
        ackflow.run(flow, spark=spark, batch_size=10, until_idle=1.0, max_concurrent_batches=2)
    finally:
        faults.disarm()
    assert set(src.final().values()) == {"acked"}, src.failures
    with psycopg.connect(postgres.dsn) as c:
        rows = sorted(c.execute(f'SELECT "order", n FROM "{pg_table}"').fetchall())
        held = c.execute(
            f'SELECT count(*), sum(done) FROM "{state.schema}".dedupe WHERE op = %s', ("orders",)
        ).fetchone()
    assert [o for o, _ in rows] == [f"o{i}" for i in range(7)]  # one row each
    assert all(n % 7 == int(o[1:]) for o, n in rows)  # a row of that order (which one: the first to claim)
    assert held == (7, 7)


# -- the review's cases (each lost or doubled a row before it was mended) -------------------


def test_a_repeat_in_the_job_of_a_first_the_sink_refuses_is_not_dropped(tmp_path):
    # m0 (bad for the sink) claims o1, m1 repeats it in the same job: dropped only once
    # m0's row is written; it was refused, so m1 comes again and is the first
    src = ListSource(msgs(("o1", 0, 1), ("o1", 1, 2), ("o2", 2, 3), ("o3", 3, 4)))
    out = KeyedSink("out", fail_if=lambda r: r["n"] == 1)
    run(Flow(src).dedupe("order", within="1h", time="t").to(out), tmp_path, batch_size=4)
    assert src.final() == {"m0": "dead_lettered", "m1": "acked", "m2": "acked", "m3": "acked"}
    assert written(out) == [("o1", 2), ("o2", 3), ("o3", 4)]
    assert src.settled["m1"] == ["acked"] and src.deliveries["m1"] == 1  # waited in flight


def test_a_first_whose_write_raised_keeps_its_claim_uncommitted(tmp_path):
    # the inner sink raised for m0's partition: its claim is not marked committed, so
    # m1 (the repeat) waits instead of being dropped for a row that does not exist
    src = ListSource(msgs(("o1", 0, 1), ("o1", 1, 2)), policy=RetryPolicy(max_deliveries=3, backoff_s=0.01))
    out = KeyedSink("out", raise_if=lambda r: r["n"] == 1)
    run(Flow(src).dedupe("order", within="1h", time="t", remember=1).to(out), tmp_path, batch_size=1)
    # m1 is written once m0's claim was abandoned (remember); m0, if it comes again after
    # that, is a repeat of m1 (acked), else a dead letter: either way one row of o1
    assert src.final()["m1"] == "acked" and src.final()["m0"] in ("acked", "dead_lettered")
    assert written(out) == [("o1", 2)]


def test_a_row_dated_far_in_the_future_forgets_no_claim(tmp_path):
    import time

    now = time.time()
    src = ListSource(msgs(("o1", now - 10, 1), ("typo", 2.5e11, 2), ("o1", now - 9, 3)))
    out = KeyedSink("out")
    run(Flow(src).dedupe("order", within="1h", time="t", remember=0.001).to(out), tmp_path, batch_size=1)
    assert written(out) == [("o1", 1), ("typo", 2)]


def test_an_owner_that_comes_back_after_a_later_first_is_still_written(tmp_path):
    # m0 (t=0) fails its commit and comes back after m1 (t=2 h), a first of its own:
    # m0 is a horizon older than m1's claim, so it is not m1's repeat: written
    src = ListSource(
        msgs(("o1", 0, 1), ("o1", 7200, 2)), policy=RetryPolicy(max_deliveries=3, backoff_s=0.01)
    )
    out = KeyedSink("out", fail_commits={1: "before"})
    run(Flow(src).dedupe("order", within="1h", time="t").to(out), tmp_path, batch_size=1)
    assert set(src.final().values()) == {"acked"}
    assert written(out) == [("o1", 1), ("o1", 2)]


def test_null_keys_are_not_one_key(tmp_path):
    src = ListSource([json.dumps({"order": None, "n": 1}), json.dumps({"order": None, "n": 2})])
    out = KeyedSink("out")
    run(Flow(src).dedupe("order", within="1h").to(out), tmp_path, batch_size=1)
    assert set(src.final().values()) == {"acked"} and sorted(r["n"] for r in out.rows.values()) == [1, 2]


def test_waiting_never_spends_a_delivery_with_batches_at_once(tmp_path):
    # a source that counts a give-back as a delivery (a quorum queue) would dead-letter
    # a message given back at each wait: waits stay in flight, nothing is given back
    for _ in range(3):
        src = ListSource([json.dumps({"order": "o1", "n": i}) for i in range(4)])  # max_deliveries=1
        out = KeyedSink("out")
        run(
            Flow(src).dedupe("order", within="1h").to(out),
            tmp_path / str(_),
            batch_size=1,
            max_concurrent_batches=2,
        )
        assert set(src.final().values()) == {"acked"}, src.failures
        assert len(out.rows) == 1


def test_a_refusal_by_one_branch_of_a_broadcast_keeps_the_claim(tmp_path):
    """Branch a wrote m0's row, branch b refused it: the claim stays (owned by m0: the
    refusal does not prove the row unwritten), so m1 waits (in flight) instead of becoming a second
    row in a at once. m0 ends as a dead letter; once its claim is ``remember`` old it is
    abandoned and m1 is a first (the documented cost of a partial broadcast failure)."""
    from ackflow.sinks import Broadcast

    src = ListSource(msgs(("o1", 0, 1), ("o1", 1, 2)), policy=RetryPolicy(max_deliveries=2, backoff_s=0.01))
    a, b = KeyedSink("a"), KeyedSink("b", fail_if=lambda r: r["n"] == 1)
    flow = Flow(src).dedupe("order", within="1h", time="t", remember=3).to(Broadcast(a, b))
    run(flow, tmp_path, batch_size=1, until_idle=1.5)
    assert src.final() == {"m0": "dead_lettered", "m1": "acked"}
    assert src.deliveries["m1"] == 1  # it waited in flight: never given back, nothing spent
    assert written(a) == [("o1", 1), ("o1", 2)] and written(b) == [("o1", 2)]


def test_postgres_state_needs_a_name():
    flow = Flow(ListSource(msgs(("o1", 0, 1))))
    with pytest.raises(ConfigError, match="give name="):
        flow.dedupe("order", within="1h", state=w.PostgresState("postgresql://u@127.0.0.1/db"))


def test_a_repeat_is_matched_to_its_own_first_when_a_partition_holds_two(tmp_path):
    # o1 at 0 and 200 are two firsts (within 100 s); the first is refused: its repeat at
    # 10 must not be dropped against the first at 200
    src = ListSource(msgs(("o1", 0, 1), ("o1", 10, 2), ("o1", 200, 3)), policy=RetryPolicy(max_deliveries=2))
    out = KeyedSink("out", fail_if=lambda r: r["n"] == 1)
    run(Flow(src).dedupe("order", within="100s", time="t").to(out), tmp_path, batch_size=3)
    assert src.final() == {"m0": "dead_lettered", "m1": "acked", "m2": "acked"}
    assert written(out) == [("o1", 2), ("o1", 3)]


def test_an_abandoned_claim_never_hides_a_committed_one(tmp_path):
    import time

    db = sqlite3.connect(tmp_path / "windows.db")
    from ackflow.state.store import SCHEMA

    db.executescript(SCHEMA)
    old = time.time() - 7200  # an uncommitted claim at t=0, two hours old; a committed one at 150
    db.execute("INSERT INTO dedupe VALUES ('dedupe_1', '[\"o1\"]', 'gone', 'j0', 0, ?, 0)", (old,))
    db.execute(
        "INSERT INTO dedupe VALUES ('dedupe_1', '[\"o1\"]', 'm9', 'j1', 150000000, ?, 1)", (time.time(),)
    )
    db.commit()
    db.close()
    src = ListSource(msgs(("o1", 75, 2)))
    out = KeyedSink("out")
    run(Flow(src).dedupe("order", within="100s", time="t").to(out), tmp_path)
    assert src.final() == {"m0": "acked"} and out.rows == {}  # a repeat of the committed first


def test_without_time_a_repeat_that_waited_is_measured_from_its_firsts_commit(tmp_path):
    # the span of a first by the wall clock starts at its commit: the repeat that waited
    # for it is inside; a within shorter than a wait could be is refused
    src = ListSource(msgs(("o1", 0, 1), ("x", 0, 0), ("o1", 1, 2)), policy=RetryPolicy(max_deliveries=6))
    out = KeyedSink("out", fail_commits={1: "after"})
    run(Flow(src).dedupe("order", within="10s").to(out), tmp_path, until_idle=2.0)
    assert set(src.final().values()) == {"acked"}
    assert written(out) == [("o1", 1), ("x", 0)]
    with pytest.raises(ConfigError, match="within must be at least 10 s"):
        Flow(src).dedupe("order", within="1s")


def test_dedupe_after_grouped_within_and_a_remember_of_nothing_are_refused():
    flow = Flow(ListSource(msgs(("o1", 0, 1)))).grouped_within(2, 0.5, "order")
    with pytest.raises(ConfigError, match="dedupe after grouped_within is not built"):
        flow.dedupe("order", within="1h").to(KeyedSink()).validate()
    with pytest.raises(ConfigError, match="remember must be a positive duration"):
        Flow(ListSource(msgs(("o1", 0, 1)))).dedupe("order", within="1h", remember=0)


SHARED_CLAIMS = """
import json, sys, time
import ackflow
from ackflow import windows as w
from ackflow.core.policy import RetryPolicy
from ackflow.flow import Flow
from ackflow.sinks import Postgres
from ackflow.testing import ListSource

dsn, schema, table, who, state_dir, start = sys.argv[1:7]
bodies = [json.dumps({"order": f"o{i % 10}", "t": i, "n": f"{who}{i}"}) for i in range(40)]
policy = RetryPolicy(max_deliveries=20, backoff_s=0.05)
src = ListSource(bodies, keys=[f"{who}-m{i}" for i in range(40)], policy=policy)
state = w.PostgresState(dsn, schema=schema)
flow = Flow(src).dedupe("order", within="1h", time="t", state=state, name="orders")
flow = flow.to(Postgres(dsn, table, create=True))
time.sleep(max(0.0, float(start) - time.time()))  # both start their claims together
ackflow.run(flow, executor="local", state_dir=state_dir, batch_size=2, until_idle=1.0)
print(json.dumps(src.final()))
"""


def test_two_processes_sharing_postgresql_claims_write_one_row_per_key(postgres, pg_table, tmp_path):
    """Two processes (two runs, each its own messages of the same ten orders) dedupe
    against one PostgreSQL state and write one table: one row per order in all, every
    message acked in both, every claim committed. Schema, state tables and the sink's
    table are created by both at once."""
    import subprocess
    import sys
    import time
    import uuid

    import psycopg

    schema = f"dd_{uuid.uuid4().hex[:8]}"
    start = time.time() + 4
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                SHARED_CLAIMS,
                postgres.dsn,
                schema,
                pg_table,
                who,
                str(tmp_path / who),
                str(start),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for who in ("a", "b")
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
        assert set(json.loads(out.splitlines()[-1]).values()) == {"acked"}, out
    with psycopg.connect(postgres.dsn) as c:
        rows = sorted(c.execute(f'SELECT "order", n FROM "{pg_table}"').fetchall())
        held = c.execute(
            f'SELECT count(*), sum(done) FROM "{schema}".dedupe WHERE op = %s', ("orders",)
        ).fetchone()
    assert [o for o, _ in rows] == [f"o{i}" for i in range(10)], rows  # one row each, from either process
    assert all(int(n[1:]) % 10 == int(o[1:]) for o, n in rows)
    assert held == (10, 10)


def test_postgresql_state_away_mid_run_dead_letters_nothing_and_ends_one_row_per_key(postgres, tmp_path):
    """The claims' database stops for a few seconds mid-run: every claim fails alike (a
    systemic failure: given back or retried, never dead-lettered); once it is back the
    run ends with every message acked, one row per key, every claim committed."""
    import uuid

    import psycopg

    from helpers import Outage

    state = w.PostgresState(postgres.dsn, schema=f"dd_{uuid.uuid4().hex[:8]}", connect_timeout=2)
    recs = [(f"o{i % 30}", i, i) for i in range(240)]
    src = ListSource(msgs(*recs), policy=RetryPolicy(max_deliveries=40, backoff_s=0.2, max_backoff_s=1.0))
    out = KeyedSink("out")
    flow = Flow(src).dedupe("order", within="1h", time="t", state=state, name="orders").to(out)
    with Outage(postgres, f'SELECT count(*) FROM "{state.schema}".dedupe', at_least=5) as outage:
        report = run(flow, tmp_path, batch_size=4, until_idle=3.0)
    assert outage.happened, "the database was never stopped"
    assert report.dead_lettered == 0 and set(src.final().values()) == {"acked"}, src.failures
    assert report.nacked + report.given_back_systemic > 0  # it did see the outage
    assert sorted(r["order"] for r in out.rows.values()) == sorted(f"o{i}" for i in range(30))
    with psycopg.connect(postgres.dsn) as c:
        held = c.execute(f'SELECT count(*), sum(done) FROM "{state.schema}".dedupe').fetchone()
    assert held == (30, 30)


def test_a_nested_key_is_refused_with_the_way_to_it_and_deduped_through_a_column(spark, tmp_path):
    """A key inside a struct (``c.id``) is refused at the first batch with the fix in the
    message (nothing acked); given a column of its own it dedupes: one row per id,
    the repeats acked."""
    bodies = [json.dumps({"c": {"id": i % 3, "name": f"n{i}"}, "n": i}) for i in range(9)]
    src = ListSource(bodies)
    with pytest.raises(FlowError, match=r"with_columns\(c_id='c.id'\)"):
        run(Flow(src).dedupe("c.id", within="1h").to(KeyedSink("out")), tmp_path / "a")
    assert "acked" not in set(src.final().values())
    src = ListSource(bodies)
    out = KeyedSink("out")
    flow = Flow(src).with_columns(c_id="c.id").dedupe("c_id", within="1h").to(out)
    ackflow.run(flow, spark=spark, state_dir=str(tmp_path / "b"), batch_size=3, until_idle=1.0)
    assert set(src.final().values()) == {"acked"}
    assert sorted(r["c_id"] for r in out.rows.values()) == [0, 1, 2]


def test_a_repeat_waiting_when_the_run_stops_is_given_back_and_the_next_run_writes_one_row(tmp_path):
    """The run is stopped while a repeat waits for its first (whose write keeps failing):
    the repeat is given back (no delivery spent), neither acked as the repeat of a row
    that does not exist nor dead-lettered; the next run writes the key's row once."""
    import time

    from ackflow.engine import Engine

    src = ListSource(msgs(("o1", 0, 1), ("o1", 1, 2)), policy=RetryPolicy(max_deliveries=50, backoff_s=0.2))
    out = KeyedSink("out", raise_if=lambda r: r["n"] == 1)  # m0's write fails: its claim stays open
    flow = Flow(src).dedupe("order", within="1h", time="t").to(out)
    saw = []
    deadline = time.monotonic() + 20

    def stop_when_parked(report, window):
        if engine.parked:
            saw.append(len(engine.parked))
        if saw or time.monotonic() > deadline:
            engine.request_stop()

    engine = Engine(
        flow,
        executor="local",
        state_dir=str(tmp_path),
        batch_size=1,
        max_concurrent_batches=1,
        handle_signals=False,
        progress=stop_when_parked,
    )
    engine.run()
    assert saw, "the repeat never waited"
    assert src.settled["m1"][-1] == "released" and "acked" not in src.settled["m1"], src.settled
    assert not src.dead_letters and written(out) == []
    again = KeyedSink("out")
    report = run(Flow(src).dedupe("order", within="1h", time="t").to(again), tmp_path, until_idle=2.0)
    assert src.final() == {"m0": "acked", "m1": "acked"} and report.dead_lettered == 0
    assert written(again) == [("o1", 1)] and not again.conflicts
