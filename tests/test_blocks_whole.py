"""Blocks whose Spark job fails as a whole (issue 32): a poison message that fails the
whole job (an ANSI cast error) in each of two blocks of one batch. The bisection ends at
the blocks; each failing alone as the whole did used to go to the systemic judge under
the block's label, be given back as a suspect (released: a delivery spent on a quorum
queue), and come back as a new block under a new label, a new suspect. A block is split
instead: its messages come one by one, and each poison one is dead-lettered alone."""

import json

import pyarrow.parquet as pq
import pytest

import ackflow
from ackflow.core.policy import RetryPolicy
from ackflow.embedded import EmbeddedQueue
from ackflow.sinks import Memory, Parquet
from ackflow.sources import EmbeddedQueue as EmbeddedSource
from ackflow.sources import RabbitMQ
from amqp import count, names, publish_many, setup

pytestmark = pytest.mark.spark

POISON = {10: "ten", 100: "a hundred"}


def rows():
    return [{"v": POISON.get(i, str(i))} for i in range(128)]


@pytest.mark.parametrize("kind", ["embedded", "rabbitmq"])
def test_blocks_failing_the_job_as_a_whole_are_split_never_given_back(spark, rabbitmq, tmp_path, kind):
    from pyspark.sql import functions as F

    policy = RetryPolicy(max_deliveries=2, backoff_s=0.01)
    if kind == "embedded":
        db = str(tmp_path / "q.db")
        q = EmbeddedQueue(db)
        q.publish("q", [json.dumps(r).encode() for r in rows()])
        q.close()
        src = EmbeddedSource(db, "q", policy=policy)
    else:
        queue = names("whole")
        setup(rabbitmq.url, queue=queue, arguments={"x-dead-letter-exchange": "ackflow-tests-dlx"})
        publish_many(rabbitmq.url, queue, rows(), ids=[f"m{i}" for i in range(128)])
        src = RabbitMQ(rabbitmq.url, queue, policy=policy)
    out, dead = str(tmp_path / "out"), Memory("dead")
    flow = (
        ackflow.Flow(src).with_columns(n=F.col("v").cast("int"), name="cast").to(Parquet(out)).on_error(dead)
    )
    report = ackflow.run(flow, spark=spark, batch_size=128, max_inflight=256, until_idle=1.0)
    assert report.split == 128  # both blocks split, none given back
    # a single poison message may be given back as a suspect (its job failed as the
    # whole did, and nothing else in its batch had written yet): the judge's own rule
    assert report.released <= len(POISON)
    assert report.given_back_systemic == 0 and report.systemic_episodes == 0
    assert report.acked == 126 and report.dead_lettered == 2
    assert sorted(json.loads(r["body"])["v"] for r in dead.rows) == sorted(POISON.values())
    assert all(r["step"] == "cast" for r in dead.rows)
    written = pq.read_table(out).column("n").to_pylist()
    assert sorted(written) == [i for i in range(128) if i not in POISON]
    if kind == "rabbitmq":
        assert count(rabbitmq.url, queue) == 0
