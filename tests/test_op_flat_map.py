"""flat_map: each child keeps its parent's id; acked only if every child was written."""

import pytest

import ackflow
from ackflow.sinks import MemorySink
from ackflow.testing import FailingSink, ListSource
from helpers import FAST, bodies

pytestmark = pytest.mark.spark


def explode(r):
    return [{"n": r["n"], "k": k} for k in range(r["n"] % 4)]


def test_children_are_all_written_and_zero_children_acks(spark):
    src = ListSource(bodies([{"n": i} for i in range(40)]))
    sink = MemorySink()
    report = ackflow.run(ackflow.Flow(src).flat_map(explode, name="explode").to(sink), spark=spark, **FAST)
    assert sorted((r["n"], r["k"]) for r in sink.rows) == sorted(
        (i, k) for i in range(40) for k in range(i % 4)
    )
    assert report.acked == 40  # n % 4 == 0 yields no child: acked on purpose


def test_one_child_refused_by_the_sink_nacks_the_parent(spark):
    src = ListSource(bodies([{"n": i} for i in range(20)]))
    sink = FailingSink(fail_if=lambda r: r["n"] == 7 and r["k"] == 2)
    ackflow.run(ackflow.Flow(src).flat_map(explode, name="explode").to(sink), spark=spark, **FAST)
    assert src.final()["m7"] == "dead_lettered"  # siblings k=0,1 were written, still not acked
    assert src.failures["m7"].step == "failing"
    assert {(r["n"], r["k"]) for r in sink.rows} >= {(7, 0), (7, 1)}
    assert all(v == "acked" for k, v in src.final().items() if k != "m7")


def test_a_child_failing_a_later_step_nacks_the_parent(spark):
    def check(r):
        if r["n"] == 6 and r["k"] == 1:
            raise KeyError("sku")
        return r

    src = ListSource(bodies([{"n": i} for i in range(8)]))
    ackflow.run(
        ackflow.Flow(src).flat_map(explode, name="explode").map(check, name="check").to(MemorySink()),
        spark=spark,
        **FAST,
    )
    assert src.final()["m6"] == "dead_lettered"
    assert (src.failures["m6"].step, src.failures["m6"].error) == ("check", "KeyError: 'sku'")
    assert sum(v == "acked" for v in src.final().values()) == 7


def test_a_message_keeps_the_failure_of_its_earliest_step(spark):
    """Three children of one message fail in three places: m_early, then z_late, then the
    sink a_sink. The dead letter names m_early (min of the text says a_sink, max z_late)."""

    def early(r):
        if r["c"] == 0:
            raise ValueError("the cause")
        return r

    def late(r):
        if r["c"] == 1:
            raise ValueError("late")
        return r

    src = ListSource(['{"n": 1}'])
    flow = (
        ackflow.Flow(src)
        .flat_map(lambda r: [{"n": r["n"], "c": c} for c in range(3)], name="kids")
        .map(early, name="m_early")
        .map(late, name="z_late")
        .to(FailingSink(fail_if=lambda r: r["c"] == 2, name="a_sink"))
    )
    ackflow.run(flow, spark=spark, **FAST)
    assert src.failures["m0"].step == "m_early"
    assert "the cause" in src.failures["m0"].error
