"""Named fault points: every point listed exists in the code, and arming the boundaries
between a durable write and the settlement loses nothing and writes nothing twice."""

import json
import os
import re

import pyarrow.parquet as pq
import pytest

import ackflow
from ackflow import faults
from ackflow.embedded import EmbeddedQueue
from ackflow.sinks import ParquetSink
from ackflow.sources import EmbeddedQueueSource
from helpers import FAST

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src", "ackflow")


def test_every_listed_point_sits_in_the_code():
    text = ""
    for root, _, files in os.walk(SRC):
        for f in files:
            if f.endswith(".py") and f != "faults.py":
                text += open(os.path.join(root, f)).read()
    named = set(re.findall(r'"([a-z]+\.[a-z_]+)"', text))
    missing = sorted(set(faults.POINTS) - named - {"doc.example"})
    assert not missing, f"fault points listed but never placed: {missing}"


def test_unknown_points_and_actions_are_refused():
    with pytest.raises(ValueError, match="unknown fault point"):
        faults.arm("no.such.point")
    with pytest.raises(ValueError, match="must be 'raise' or 'exit'"):
        faults.arm("batch.after_job", "explode")
    assert faults.parse("a.b=exit@3, c.d=raise") == {"a.b": ("exit", 3), "c.d": ("raise", 1)}


@pytest.mark.spark
@pytest.mark.parametrize(
    "point",
    [
        "batch.after_job",
        "batch.after_commit",
        "engine.mid_ack",
        "embedded.before_ack",
        "parquet.after_record",
    ],
)
def test_a_fault_at_each_boundary_then_a_restart_ends_exact(spark, tmp_path, point):
    """Arm the point to raise on its first hit, run until it fires (the run stops or the
    batch fails), then run again from the durable state: every message's row exactly
    once in Parquet, the queue empty."""
    db, out = str(tmp_path / "q.db"), tmp_path / "out"
    n = 60
    EmbeddedQueue(db).publish(
        "in", [json.dumps({"n": i}).encode() for i in range(n)], msg_ids=[f"m{i}" for i in range(n)]
    )

    def run():
        src = EmbeddedQueueSource(
            db, "in", visibility_timeout=0.5, policy=ackflow.RetryPolicy(max_deliveries=10, backoff_s=0.01)
        )
        return ackflow.run(
            ackflow.Flow(src).to(ParquetSink(out)),
            spark=spark,
            **{**FAST, "until_idle": 1.0, "keepalive_s": 0.1},
        )

    faults.arm(point, "raise")
    try:
        try:
            run()
        except faults.InjectedFault:
            pass  # an infrastructure failure stops the run; its messages are the queue's
        assert faults.hits(point) >= 1, "the point was never reached"
    finally:
        faults.disarm()
    run()  # the restart
    got = pq.read_table(out).column("n").to_pylist()
    assert sorted(got) == list(range(n)), (len(got), len(set(got)))
    assert EmbeddedQueue(db).stats("in")["ready"] == 0


@pytest.mark.parametrize("point", ["postgres.before_commit", "postgres.after_commit"])
def test_a_fault_inside_the_postgres_write_ends_exact(postgres, pg_table, tmp_path, point):
    """The points inside a task's PostgreSQL transaction, armed in this process: the
    in-process executor runs the tasks here (on Spark they run in Python workers, armed
    through ACKFLOW_FAULTS). Before COMMIT the rows are rolled back; after it they are in
    the table but the task never reported them: the batch fails, its messages come
    again and are written in place. Either way: every row exactly once, queue empty."""
    import psycopg
    from psycopg import sql

    from ackflow.engine.loop import Engine
    from ackflow.sinks import Postgres

    db = str(tmp_path / "q.db")
    n = 40
    EmbeddedQueue(db).publish(
        "in", [json.dumps({"n": i}).encode() for i in range(n)], msg_ids=[f"m{i}" for i in range(n)]
    )
    src = EmbeddedQueueSource(
        db, "in", visibility_timeout=2.0, policy=ackflow.RetryPolicy(max_deliveries=5, backoff_s=0.01)
    )
    flow = (
        ackflow.Flow(src)
        .flat_map(lambda r: [r, {"n": r["n"] + 1000}], name="two")
        .to(Postgres(postgres.dsn, pg_table, create=True))
    )
    faults.arm(point, "raise", nth=2)
    try:
        report = Engine(
            flow,
            executor="local",
            batch_size=10,
            max_inflight=40,
            until_idle=0.3,
            batch_timeout_s=0.05,
            keepalive_s=0.5,
        ).run()
        assert faults.hits(point) >= 2, "the point was never reached"
    finally:
        faults.disarm()
    # the failed write's messages came again: nacked, or (read in a block) split
    assert report.acked == n and report.nacked + report.split >= 1, report
    with psycopg.connect(postgres.dsn) as c:
        rows = c.execute(sql.SQL("SELECT ackflow_key, n FROM {}").format(sql.Identifier(pg_table))).fetchall()
    assert len(rows) == 2 * n and len({k for k, _ in rows}) == 2 * n
    assert sorted(v for _, v in rows) == sorted([*range(n), *range(1000, 1000 + n)])
    assert EmbeddedQueue(db).stats("in")["ready"] == 0
