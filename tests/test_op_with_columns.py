"""with_columns: Spark Column expressions; a job-level failure is bisected to the poison."""

import pytest

import ackflow
from ackflow.core import ConfigError, FlowError
from ackflow.sinks import MemorySink
from ackflow.testing import ListSource
from helpers import FAST, bodies

pytestmark = pytest.mark.spark


def test_column_expressions_compute_in_spark(spark):
    from pyspark.sql import functions as F

    src = ListSource(bodies([{"qty": i, "price": 2.5} for i in range(30)]))
    sink = MemorySink()
    flow = (
        ackflow.Flow(src).with_columns(total=F.col("qty") * F.col("price"), label="concat('q', qty)").to(sink)
    )
    ackflow.run(flow, spark=spark, **FAST)
    assert sorted((r["qty"], r["total"], r["label"]) for r in sink.rows) == [
        (i, i * 2.5, f"q{i}") for i in range(30)
    ]


def test_an_ansi_cast_error_is_bisected_to_the_poison_message(spark, caplog):
    from pyspark.sql import functions as F

    rows = [{"v": str(i)} for i in range(64)]
    rows[41] = {"v": "forty-one"}  # CAST fails the whole job under ANSI mode
    src = ListSource(bodies(rows))
    sink = MemorySink()
    flow = ackflow.Flow(src).with_columns(n=F.col("v").cast("int"), name="cast").to(sink)
    report = ackflow.run(flow, spark=spark, **{**FAST, "batch_size": 64, "until_idle": 0.5})
    assert src.final()["m41"] == "dead_lettered"
    assert "CAST_INVALID_INPUT" in src.failures["m41"].error
    assert src.failures["m41"].step == "cast"
    assert report.acked == 63 and sorted(r["n"] for r in sink.rows) == [i for i in range(64) if i != 41]
    assert 1 <= report.bisections <= 2 * 7  # about log2(64) levels, two halves each
    assert "retrying as" in caplog.text


def test_bisection_is_bounded(spark):
    from pyspark.sql import functions as F

    rows = [{"v": f"x{i}"} for i in range(32)]  # every message is poison, each its own way
    src = ListSource(bodies(rows))
    report = ackflow.run(
        ackflow.Flow(src).with_columns(n=F.col("v").cast("int"), name="cast").to(MemorySink()),
        spark=spark,
        **{**FAST, "batch_size": 32, "max_bisect_jobs": 6},
    )
    assert report.dead_lettered == 32 and report.acked == 0
    assert report.jobs <= 6
    assert any("bisection gave up" in f.error for f in src.failures.values())


def test_an_unknown_column_fails_at_the_first_batch_naming_the_step(spark):
    src = ListSource(bodies([{"a": 1}]))
    with pytest.raises(FlowError, match="step 'oops'"):
        ackflow.run(
            ackflow.Flow(src).with_columns(b="no_such_column + 1", name="oops").to(MemorySink()),
            spark=spark,
            **FAST,
        )
    assert src.final() == {"m0": "released"}  # nothing acked, given back for later


def test_with_columns_refuses_python_values():
    with pytest.raises(ConfigError, match="must be a Spark Column"):
        ackflow.Flow(ListSource([])).with_columns(x=3)
