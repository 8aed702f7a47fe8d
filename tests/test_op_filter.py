"""filter: dropped rows emit nothing; a message with no rows left is acked."""

import pytest

import ackflow
from ackflow.sinks import MemorySink
from ackflow.testing import ListSource
from helpers import FAST, bodies

pytestmark = pytest.mark.spark


def test_python_filter_acks_dropped_messages(spark):
    src = ListSource(bodies([{"n": i} for i in range(60)]))
    sink = MemorySink()
    report = ackflow.run(
        ackflow.Flow(src).filter(lambda r: r["n"] % 3 == 0, name="thirds").to(sink), spark=spark, **FAST
    )
    assert sorted(r["n"] for r in sink.rows) == list(range(0, 60, 3))
    assert report.acked == 60 and set(src.final().values()) == {"acked"}


def test_column_filter_and_sql_string_filter(spark):
    from pyspark.sql import functions as F

    src = ListSource(bodies([{"n": i, "s": "x" if i % 2 else None} for i in range(40)]))
    sink = MemorySink()
    flow = (
        ackflow.Flow(src)
        .filter(F.col("n") >= 10, name="big")
        .filter("s IS NOT NULL", name="has_s")  # null-valued predicates drop the row
        .to(sink)
    )
    report = ackflow.run(flow, spark=spark, **FAST)
    assert sorted(r["n"] for r in sink.rows) == [i for i in range(10, 40) if i % 2]
    assert report.acked == 40


def test_a_raising_predicate_fails_its_message(spark):
    src = ListSource(bodies([{"n": 1}, {"n": 0}]))
    ackflow.run(
        ackflow.Flow(src).filter(lambda r: 1 / r["n"] > 0, name="inv").to(MemorySink()), spark=spark, **FAST
    )
    assert src.final() == {"m0": "acked", "m1": "dead_lettered"}
    assert src.failures["m1"].error.startswith("ZeroDivisionError")


def test_filtered_rows_do_not_reach_later_column_steps(spark):
    # 10 / n would fail the whole job (ANSI) for n == 0 if the filter did not guard it
    src = ListSource(bodies([{"n": i} for i in range(5)]))
    sink = MemorySink()
    report = ackflow.run(
        ackflow.Flow(src).filter("n != 0", name="nz").with_columns(inv="10 DIV n", name="inv").to(sink),
        spark=spark,
        **FAST,
    )
    assert report.bisections == 0 and report.acked == 5
    assert sorted(r["inv"] for r in sink.rows) == [2, 3, 5, 10]
