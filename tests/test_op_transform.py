"""transform(fn): the DataFrame escape hatch must keep the lineage, or nothing is acked."""

import pytest

import ackflow
from ackflow.sinks import MemorySink
from ackflow.testing import ListSource
from helpers import FAST, bodies

pytestmark = pytest.mark.spark


def test_a_transform_that_keeps_lineage_works(spark):
    from pyspark.sql import functions as F

    src = ListSource(bodies([{"a": i} for i in range(20)]))
    sink = MemorySink()
    report = ackflow.run(ackflow.Flow(src).transform(lambda df: df.withColumn("b", F.col("a") * 3),
                                                     name="triple").to(sink), spark=spark, **FAST)
    assert sorted(r["b"] for r in sink.rows) == [3 * i for i in range(20)]
    assert report.acked == 20


def test_a_transform_that_loses_lineage_fails_naming_the_step(spark):
    src = ListSource(bodies([{"a": 1}]))
    with pytest.raises(ackflow.FlowError, match=r"step 'narrow'.*lost ackflow's column"):
        ackflow.run(ackflow.Flow(src).transform(lambda df: df.select("a"), name="narrow")
                    .to(MemorySink()), spark=spark, **FAST)
    assert src.final() == {"m0": "released"}


def test_fabricated_ids_fail_the_batch(spark):
    from pyspark.sql import functions as F

    src = ListSource(bodies([{"a": i} for i in range(5)]))
    report = ackflow.run(ackflow.Flow(src).transform(
        lambda df: df.withColumn("__af_id", F.col("__af_id") + 1_000_000), name="forge")
        .to(MemorySink()), spark=spark, **FAST)
    assert report.acked == 0
    assert all(f.step == "forge" and "fabricated" in f.error for f in src.failures.values())


def test_rows_removed_inside_a_transform_are_not_acked(spark):
    src = ListSource(bodies([{"a": i} for i in range(6)]))
    ackflow.run(ackflow.Flow(src).transform(lambda df: df.where("a < 3"), name="cut")
                .to(MemorySink()), spark=spark, **FAST)
    final = src.final()
    assert [final[f"m{i}"] for i in range(6)] == ["acked"] * 3 + ["dead_lettered"] * 3
    assert "lineage lost" in src.failures["m4"].error
