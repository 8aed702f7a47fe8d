"""Regression tests: the classic ways acknowledged streams leak, each must nack."""

import pytest

import ackflow
from ackflow.sinks import MemorySink
from ackflow.testing import FailingSink, ListSource
from helpers import FAST, bodies

pytestmark = pytest.mark.spark


def outcome(spark, flow, src):
    ackflow.run(flow, spark=spark, **FAST)
    return src.final()


def test_child_written_but_sibling_failed(spark):
    src = ListSource(bodies([{"n": 1}]))
    sink = FailingSink(fail_if=lambda r: r["c"] == 1)
    flow = ackflow.Flow(src).flat_map(lambda r: [{"c": 0}, {"c": 1}], name="kids").to(sink)
    assert outcome(spark, flow, src) == {"m0": "dead_lettered"}
    assert [r["c"] for r in sink.rows] == [0]  # the sibling did reach the sink


def test_broadcast_with_one_branch_failed(spark):
    src = ListSource(bodies([{"n": 1}]))
    flow = ackflow.Flow(src).broadcast(MemorySink("ok"), FailingSink(raise_if=lambda r: True))
    assert outcome(spark, flow, src) == {"m0": "dead_lettered"}


def test_group_whose_write_failed(spark):
    src = ListSource(bodies([{"k": 1, "n": i} for i in range(3)]))
    flow = ackflow.Flow(src).group_by("k").agg("count(*) AS c").to(FailingSink(fail_if=lambda r: True))
    assert set(outcome(spark, flow, src).values()) == {"dead_lettered"}


def test_exception_in_the_middle_of_a_sink_write(spark):
    class Half(MemorySink):
        def write_partition(self, batch_id, partition, rows):
            super().write_partition(batch_id, partition, rows.slice(0, 1))
            raise ConnectionError("lost the database half way")

    # one message: its write fails half way, every time: never acked, a dead letter
    src = ListSource(bodies([{"n": 0}]))
    assert outcome(spark, ackflow.Flow(src).to(Half("half")), src) == {"m0": "dead_lettered"}
    # four: every write fails half way, a systemic failure: never acked, given back
    from ackflow.core.errors import SystemicFailure

    src = ListSource(bodies([{"n": i} for i in range(4)]))
    with pytest.raises(SystemicFailure, match="lost the database half way"):
        ackflow.run(
            ackflow.Flow(src).to(Half("half")),
            spark=spark,
            systemic_stop_after_s=1,
            systemic_backoff_s=0.05,
            **FAST,
        )
    assert set(src.final().values()) == {"released"}
