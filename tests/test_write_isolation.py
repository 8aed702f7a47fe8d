"""A sink's write that raises for its whole partition because of one row's data (the
mirror rule: a failure that is not a message's never makes it a dead letter). The
partition's messages used to fail together, come back together and be dead-lettered
together: 9 good messages with the poison one. Now, while the sink wrote other
partitions of the same job, they are run again in halves until the poison one fails
alone; only it is dead-lettered. With single messages and with blocks."""

import json
import os

import pytest

import ackflow
from ackflow.core.policy import RetryPolicy
from ackflow.embedded import EmbeddedQueue
from ackflow.sinks import Memory
from ackflow.sources import EmbeddedQueue as EmbeddedSource
from ackflow.testing import KeyedSink
from helpers import run_local


def poison_row(row):
    return row["n"] < 0


@pytest.mark.parametrize("blocks", [False, True])
def test_a_partition_write_that_raises_for_one_row_dead_letters_only_that_message(tmp_path, blocks):
    db = str(tmp_path / "q.db")
    q = EmbeddedQueue(db)
    q.publish("q", [json.dumps({"n": -7 if i == 7 else i}).encode() for i in range(40)])
    q.close()
    src = EmbeddedSource(db, "q", policy=RetryPolicy(max_deliveries=2, backoff_s=0.01))
    if not blocks:
        src.use_blocks = lambda on: False
    sink, dead = KeyedSink(raise_if=poison_row), Memory("dead")
    report = run_local(ackflow.Flow(src).to(sink).on_error(dead), until_idle=1.0)
    assert (report.split > 0) is blocks
    assert report.acked == 39 and report.dead_lettered == 1
    assert report.bisections >= 1
    assert [json.loads(r["body"])["n"] for r in dead.rows] == [-7]
    assert sorted(r["n"] for r in sink.rows.values()) == [i for i in range(40) if i != 7]
    assert not sink.conflicts


class BadRecord(ValueError):
    """A user's own error for a record it cannot take: a row's data by its base class,
    though its name is on no list."""


class RecordSink(KeyedSink):
    def write_partition(self, batch_id, partition, rows):
        if any(poison_row(r) for r in rows.to_pylist()):
            raise BadRecord("record 7 has a negative n")
        return super().write_partition(batch_id, partition, rows)


def test_an_error_class_of_the_user_s_own_is_a_row_s_data_by_what_it_derives_from(tmp_path):
    """The executor classifies a write's error by its class and bases, not by its name
    (before: by the name in the text, so ``BadRecord(ValueError)`` dead-lettered its
    partition's good messages with the poison one)."""
    db = str(tmp_path / "q.db")
    q = EmbeddedQueue(db)
    q.publish("q", [json.dumps({"n": -7 if i == 7 else i}).encode() for i in range(40)])
    q.close()
    src = EmbeddedSource(db, "q", policy=RetryPolicy(max_deliveries=2, backoff_s=0.01))
    sink, dead = RecordSink(), Memory("dead")
    report = run_local(ackflow.Flow(src).to(sink).on_error(dead), until_idle=1.0)
    assert report.acked == 39 and report.dead_lettered == 1
    assert [json.loads(r["body"])["n"] for r in dead.rows] == [-7]
    assert "[a row's data] BadRecord: record 7 has a negative n" in dead.rows[0]["error"]


def test_a_sink_whose_every_partition_fails_is_not_bisected(tmp_path):
    """Every partition raising (a sink down, not a row): nothing to isolate, no extra jobs;
    the systemic judge sees the failures as before."""
    db = str(tmp_path / "q.db")
    q = EmbeddedQueue(db)
    q.publish("q", [json.dumps({"n": -i - 1}).encode() for i in range(40)])
    q.close()
    src = EmbeddedSource(db, "q", policy=RetryPolicy(max_deliveries=1))
    src.use_blocks = lambda on: False
    dead = Memory("dead")
    flow = ackflow.Flow(src).to(KeyedSink(raise_if=poison_row)).on_error(dead)
    report = run_local(flow, until_idle=0.5, systemic_after=0)  # (the judge off: each its own)
    assert report.bisections == 0
    assert report.acked == 0 and report.dead_lettered == 40 and len(dead.rows) == 40


#: the job ids (the batch id and its job's suffix) a Recording sink was asked to write
JOB_IDS: list[str] = []


class Recording(KeyedSink):
    def write_partition(self, batch_id, partition, rows):
        JOB_IDS.append(batch_id)
        return super().write_partition(batch_id, partition, rows)


def test_running_a_partition_again_keeps_the_bisection_budget(tmp_path):
    """Found by review: nested runs again spent more jobs than ``max_bisect_jobs``, and a
    half left without budget got another job's failure. Now a batch never runs more jobs
    than its budget, a half past it keeps its own failure (retried later), and the run
    still ends with only the poison message dead-lettered."""
    db = str(tmp_path / "q.db")
    q = EmbeddedQueue(db)
    q.publish("q", [json.dumps({"n": -5 if i == 5 else i}).encode() for i in range(64)])
    q.close()
    src = EmbeddedSource(db, "q", policy=RetryPolicy(max_deliveries=6, backoff_s=0.01))
    src.use_blocks = lambda on: False
    sink, dead = Recording(raise_if=poison_row), Memory("dead")
    JOB_IDS.clear()
    report = run_local(
        ackflow.Flow(src).to(sink).on_error(dead),
        until_idle=1.0,
        batch_size=64,
        max_bisect_jobs=4,
        systemic_after=0,
    )
    jobs: dict[str, set[str]] = {}
    for job in JOB_IDS:  # batch ids: 20261129T070240-bfa70b-000001, then a job's suffix
        jobs.setdefault(job[:29], set()).add(job)
    assert jobs and max(len(j) for j in jobs.values()) <= 4
    assert report.acked == 63 and report.dead_lettered == 1
    assert [json.loads(r["body"])["n"] for r in dead.rows] == [-5]
    assert all("bisection gave up" not in f["error"] for f in report.failures)


class Cut(KeyedSink):
    """Raises a connection error (its database went away mid-job) for the partition
    holding a marked row; writes the others."""

    def write_partition(self, batch_id, partition, rows):
        if any(poison_row(r) for r in rows.to_pylist()):
            raise ConnectionResetError("connection to the database was lost")
        return super().write_partition(batch_id, partition, rows)


def test_a_partition_whose_write_met_its_infrastructure_is_not_run_again(tmp_path):
    """The sink's database away mid-job (some partitions written, others not): running
    the failed ones again at once would wait on it again, job after job; they are
    retried after their backoff instead (found: the chaos soak's database outages)."""
    db = str(tmp_path / "q.db")
    q = EmbeddedQueue(db)
    q.publish("q", [json.dumps({"n": -7 if i == 7 else i}).encode() for i in range(40)])
    q.close()
    src = EmbeddedSource(db, "q", policy=RetryPolicy(max_deliveries=1))
    src.use_blocks = lambda on: False
    dead = Memory("dead")
    report = run_local(
        ackflow.Flow(src).to(Cut(raise_if=poison_row)).on_error(dead), until_idle=0.5, systemic_after=0
    )
    assert report.bisections == 0
    assert report.dead_lettered > 1  # the partition's messages failed together, as before
    assert all("ConnectionResetError" in r["error"] for r in dead.rows)


def test_no_partition_runs_again_where_a_message_s_rows_depend_on_its_batch(spark, tmp_path):
    """Found by review: a group's row is keyed by its members; run again in halves, a
    message alone makes a group row of another key beside the one written (counted
    twice). A flow with group_by (or a window, dedupe, grouped_within, transform) keeps
    the partition's failure as before."""
    db = str(tmp_path / "q.db")
    q = EmbeddedQueue(db)
    q.publish("q", [json.dumps({"n": -7 if i == 7 else i, "g": i % 3}).encode() for i in range(40)])
    q.close()
    src = EmbeddedSource(db, "q", policy=RetryPolicy(max_deliveries=1))
    dead = Memory("dead")
    flow = (
        ackflow.Flow(src).group_by("g").agg("min(n) AS n").to(KeyedSink(raise_if=poison_row)).on_error(dead)
    )
    from ackflow.engine.loop import Engine

    spark.conf.set("spark.sql.adaptive.enabled", "false")  # the groups in 4 partitions
    try:
        report = Engine(
            flow, spark=spark, handle_signals=False, until_idle=0.5, batch_size=40, systemic_after=0
        ).run()
    finally:
        spark.conf.set("spark.sql.adaptive.enabled", "true")
    assert report.bisections == 0
    assert report.dead_lettered >= 1


class Blip(KeyedSink):
    """Raises a connection error once (its database restarted mid-job) for the
    partition holding a marked row, while the file ``flag`` exists; writes the others."""

    def __init__(self, flag, **kw):
        super().__init__(**kw)
        self.flag = flag

    def __getstate__(self):
        return {**super().__getstate__(), "flag": self.flag}

    def __setstate__(self, state):
        flag = state.pop("flag")
        super().__setstate__(state)
        self.flag = flag

    def write_partition(self, batch_id, partition, rows):
        if os.path.exists(self.flag) and any(poison_row(r) for r in rows.to_pylist()):
            os.unlink(self.flag)
            raise ConnectionResetError("server closed the connection unexpectedly")
        return super().write_partition(batch_id, partition, rows)


def test_a_write_that_met_an_outage_while_the_sink_wrote_other_rows_is_given_back(tmp_path):
    """Found by review: the sink wrote other partitions, so it "worked", and the
    messages of the partition whose write met a database restart were failed as their
    own: a delivery spent each, dead letters at the last one (good data). Now an error
    that is not a row's data, while the sink wrote, is given back (no delivery spent)
    up to twice per message, as a suspect; the messages then land."""
    db = str(tmp_path / "q.db")
    q = EmbeddedQueue(db)
    q.publish("q", [json.dumps({"n": -7 if i == 7 else i}).encode() for i in range(40)])
    q.close()
    flag = tmp_path / "blip"
    flag.write_text("1")
    src = EmbeddedSource(db, "q", policy=RetryPolicy(max_deliveries=1))
    src.use_blocks = lambda on: False
    sink, dead = Blip(str(flag), raise_if=None), Memory("dead")
    report = run_local(ackflow.Flow(src).to(sink).on_error(dead), until_idle=2.0)
    assert not flag.exists()  # the outage was met
    assert report.acked == 40 and report.dead_lettered == 0 and not dead.rows
    assert report.released > 0 and report.bisections == 0
    assert sorted(r["n"] for r in sink.rows.values()) == sorted(-7 if i == 7 else i for i in range(40))


class Unreachable(KeyedSink):
    """The executor of partition 1 cannot reach the database: its write always meets a
    connection error; the sink writes the other partitions."""

    def write_partition(self, batch_id, partition, rows):
        if partition == 1:
            raise ConnectionResetError("server closed the connection unexpectedly")
        return super().write_partition(batch_id, partition, rows)


@pytest.mark.parametrize("lasts", [False, True])
def test_a_partial_outage_dead_letters_nothing_and_stops_the_run_if_it_lasts(tmp_path, lasts, caplog):
    """Before, the messages of the failing partitions were given back twice, then failed
    as their own: a delivery spent each, dead letters at the last one (good data). Now
    they are given back, no delivery spent, while the outage lasts: they land when they
    meet a partition that works. Once it has lasted systemic_stop_after_s, the run stops
    with SystemicFailure, naming the sink and the error, and what was not written is
    still queued."""
    from ackflow.core.errors import SystemicFailure

    db = str(tmp_path / "q.db")
    q = EmbeddedQueue(db)
    q.publish("q", [json.dumps({"n": i}).encode() for i in range(400)])
    q.close()
    src = EmbeddedSource(db, "q", policy=RetryPolicy(max_deliveries=1))
    src.use_blocks = lambda on: False
    sink, dead = Unreachable(), Memory("dead")
    opts = {"until_idle": 1.0, "batch_size": 20, "systemic_backoff_s": 0.01, "systemic_max_backoff_s": 2.0}
    flow = ackflow.Flow(src).to(sink).on_error(dead)
    if lasts:
        with pytest.raises(SystemicFailure, match="server closed the connection") as stopped:
            run_local(flow, systemic_stop_after_s=0.5, **opts)
        assert stopped.value.step == sink.name
    else:
        report = run_local(flow, systemic_stop_after_s=600, **opts)
        assert report.acked == 400 and report.released > 0
    assert not dead.rows
    assert f"a partial outage of {sink.name!r} (it wrote other rows): given back while" in caplog.text
    q = EmbeddedQueue(db)
    try:  # what was not written is still queued (given back, no delivery spent)
        left = {json.loads(m.body)["n"] for m in q.lease("q", 1000, visibility_timeout=60)}
    finally:
        q.close()
    written = {r["n"] for r in sink.rows.values()}
    assert left | written == set(range(400)) and not left & written
    assert bool(left) is lasts
