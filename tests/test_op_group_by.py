"""group_by(...).agg(...) within a batch: a group row carries every member's id."""

import pytest

import ackflow
from ackflow.sinks import MemorySink
from ackflow.testing import FailingSink, ListSource
from helpers import FAST, bodies

pytestmark = pytest.mark.spark

BATCH = {**FAST, "batch_size": 100, "max_inflight": 100, "until_idle": 0.5}


def test_groups_aggregate_and_every_member_is_acked(spark):
    from pyspark.sql import functions as F

    src = ListSource(bodies([{"k": i % 4, "v": i} for i in range(40)]))
    sink = MemorySink()
    report = ackflow.run(
        ackflow.Flow(src)
        .group_by("k")
        .agg(F.sum("v").alias("total"), "count(*) AS n", name="per_k")
        .to(sink),
        spark=spark,
        **BATCH,
    )
    assert sorted((r["k"], r["total"], r["n"]) for r in sink.rows) == [
        (k, sum(i for i in range(40) if i % 4 == k), 10) for k in range(4)
    ]
    assert report.acked == 40 and report.rows_written == {"memory": 4}


def test_a_failed_group_write_fails_every_member(spark):
    src = ListSource(bodies([{"k": i % 3, "v": i} for i in range(12)]))
    sink = FailingSink(fail_if=lambda r: r["k"] == 1)
    ackflow.run(ackflow.Flow(src).group_by("k").agg("sum(v) AS s").to(sink), spark=spark, **BATCH)
    members = {f"m{i}" for i in range(12) if i % 3 == 1}
    assert {k for k, v in src.final().items() if v != "acked"} == members
    assert all(src.failures[m].step == "failing" for m in members)


def test_failed_and_filtered_rows_keep_their_own_outcome_through_a_group(spark):
    def check(r):
        if r["v"] == 5:
            raise ValueError("five")
        return r

    src = ListSource(bodies([{"k": i % 2, "v": i} for i in range(10)]))
    sink = MemorySink()
    ackflow.run(
        ackflow.Flow(src)
        .map(check, name="check")
        .filter(lambda r: r["v"] != 8, name="no8")
        .group_by("k")
        .agg("sum(v) AS s")
        .map(lambda r: {**r, "s2": r["s"] * 2}, name="x2")
        .to(sink),
        spark=spark,
        **BATCH,
    )
    final = src.final()
    assert final["m5"] == "dead_lettered" and src.failures["m5"].step == "check"
    assert final["m8"] == "acked"  # filtered before grouping: acked on purpose
    assert sorted((r["k"], r["s"], r["s2"]) for r in sink.rows) == [(0, 12, 24), (1, 20, 40)]


def test_a_python_error_after_grouping_fails_every_member(spark):
    def boom(r):
        if r["k"] == 0:
            raise RuntimeError("no zeros")
        return r

    src = ListSource(bodies([{"k": i % 2, "v": i} for i in range(6)]))
    ackflow.run(
        ackflow.Flow(src).group_by("k").agg("sum(v) AS s").map(boom, name="boom").to(MemorySink()),
        spark=spark,
        **BATCH,
    )
    assert {k for k, v in src.final().items() if v != "acked"} == {"m0", "m2", "m4"}
    assert src.failures["m2"].step == "boom"
