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
@pytest.mark.parametrize("point", ["batch.after_job", "batch.after_commit", "engine.mid_ack",
                                   "embedded.before_ack", "parquet.after_record"])
def test_a_fault_at_each_boundary_then_a_restart_ends_exact(spark, tmp_path, point):
    """Arm the point to raise on its first hit, run until it fires (the run stops or the
    batch fails), then run again from the durable state: every message's row exactly
    once in Parquet, the queue empty."""
    db, out = str(tmp_path / "q.db"), tmp_path / "out"
    n = 60
    EmbeddedQueue(db).publish("in", [json.dumps({"n": i}).encode() for i in range(n)],
                              msg_ids=[f"m{i}" for i in range(n)])

    def run():
        src = EmbeddedQueueSource(db, "in", visibility_timeout=0.5,
                                  policy=ackflow.RetryPolicy(max_deliveries=10, backoff_s=0.01))
        return ackflow.run(ackflow.Flow(src).to(ParquetSink(out)), spark=spark,
                           **{**FAST, "until_idle": 1.0, "keepalive_s": 0.1})

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
