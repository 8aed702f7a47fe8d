"""join with a static DataFrame: the stream side's ids carry through."""

import pytest

import ackflow
from ackflow.core import ConfigError
from ackflow.sinks import MemorySink
from ackflow.testing import ListSource
from helpers import FAST, bodies

pytestmark = pytest.mark.spark


@pytest.fixture
def skus(spark):
    return spark.createDataFrame([("a", 1.5), ("b", 2.0), ("b", 2.5)], "sku STRING, price DOUBLE")


def run(spark, flow):
    return ackflow.run(flow, spark=spark, **FAST)


def test_inner_join_drops_unmatched_rows_like_a_filter(spark, skus):
    src = ListSource(bodies([{"sku": s, "qty": 1} for s in ("a", "b", "zzz")]))
    sink = MemorySink()
    report = run(spark, ackflow.Flow(src).join(skus, "sku", name="prices").to(sink))
    assert sorted((r["sku"], r["price"]) for r in sink.rows) == [("a", 1.5), ("b", 2.0), ("b", 2.5)]
    assert report.acked == 3  # "zzz" had no price: dropped like a filter, acked


def test_left_join_keeps_unmatched_rows_and_two_matches_need_both_writes(spark, skus):
    from ackflow.testing import FailingSink

    src = ListSource(bodies([{"sku": s, "qty": 1} for s in ("a", "b", "zzz")]))
    sink = FailingSink(fail_if=lambda r: r["price"] == 2.5)
    run(spark, ackflow.Flow(src).join(skus, "sku", "left").to(sink))
    assert src.final() == {"m0": "acked", "m1": "dead_lettered", "m2": "acked"}
    assert ("zzz", None) in {(r["sku"], r["price"]) for r in sink.rows}


def test_semi_and_anti_joins_filter(spark, skus):
    semi, anti = MemorySink("semi"), MemorySink("anti")
    for how, sink in (("left_semi", semi), ("left_anti", anti)):
        src = ListSource(bodies([{"sku": s} for s in ("a", "b", "c")]))
        report = run(spark, ackflow.Flow(src).join(skus, "sku", how).to(sink))
        assert report.acked == 3
    assert sorted(r["sku"] for r in semi.rows) == ["a", "b"]
    assert [r["sku"] for r in anti.rows] == ["c"]


def test_joins_that_fabricate_rows_are_refused(spark, skus):
    with pytest.raises(ConfigError, match="right or full join"):
        ackflow.Flow(ListSource([])).join(skus, "sku", "right")
    with pytest.raises(ConfigError, match="static Spark DataFrame"):
        ackflow.Flow(ListSource([])).join({"sku": "a"}, "sku")


def test_data_columns_that_clash_with_the_static_side_fail_their_rows_not_the_run(spark, skus):
    """The stream's columns come from the data. A field named like a static column
    ("Price", Spark's case-insensitive twin of "price") used to stop the run at the
    first batch (a crash loop), or make every job fail on an ambiguous reference; a
    first batch without the join column at all stopped it too. Now the rows holding the
    clashing field fail alone, and a missing join column is null (matches nothing)."""
    policy = ackflow.RetryPolicy(max_deliveries=1)
    src = ListSource(
        bodies([{"sku": "a", "qty": 1}, {"sku": "b", "Price": 9.0}, {"sku": "a", "Price": None}]),
        policy=policy,
    )
    sink = MemorySink()
    run(spark, ackflow.Flow(src).join(skus, "sku", name="prices").to(sink))
    assert src.final() == {"m0": "acked", "m1": "dead_lettered", "m2": "acked"}
    assert src.failures["m1"].step == "prices" and "'Price'" in src.failures["m1"].error
    assert sorted(r["price"] for r in sink.rows) == [1.5, 1.5]
    assert all("Price" not in r for r in sink.rows)

    src = ListSource(bodies([{"qty": 1}, {"qty": 2}]), policy=policy)  # no "sku" anywhere
    sink = MemorySink()
    report = run(spark, ackflow.Flow(src).join(skus, "sku", "left", name="prices").to(sink))
    assert report.acked == 2 and sorted((r["qty"], r["price"]) for r in sink.rows) == [(1, None), (2, None)]


def test_a_static_column_the_flow_itself_makes_twice_still_stops(spark, skus):
    src = ListSource(bodies([{"sku": "a"}]))
    with pytest.raises(ackflow.FlowError, match="exist on both sides"):
        run(spark, ackflow.Flow(src).with_columns(price="1.0").join(skus, "sku").to(MemorySink()))
    assert src.final() == {"m0": "released"}


def test_a_repeat_failed_in_one_attempt_keeps_the_keys_of_the_others(spark, tmp_path):
    """A message matches three static rows and a flat_map makes two rows of each. The
    flat_map of the first repeat met fails in the first attempt (one failed row, not two):
    the other repeats' rows are written, the message retried. Numbered after the steps,
    the retry renumbered the repeats, and a sink that keeps the first write of a key
    (Parquet's manifest) took rows of one repeat for another's: lost, and acked."""
    import os

    import pyarrow.parquet as pq

    from ackflow.core.policy import RetryPolicy
    from ackflow.sinks import ParquetSink

    stock = spark.createDataFrame([("k", "north"), ("k", "south"), ("k", "west")], "sku STRING, wh STRING")
    marker = str(tmp_path / "failed-once")

    def pair(r):
        if not os.path.exists(marker):  # the first repeat this job meets fails, once
            open(marker, "w").close()
            raise TimeoutError("the first attempt times out")
        return [{**r, "i": i} for i in range(2)]

    src = ListSource(bodies([{"sku": "k", "n": 1}]), policy=RetryPolicy(max_deliveries=3, backoff_s=0.05))
    out = str(tmp_path / "out")
    flow = (
        ackflow.Flow(src)
        .join(stock, "sku")  # the columns given: no sampling run
        .flat_map(pair, name="pair", schema="sku STRING, n BIGINT, wh STRING, i BIGINT")
        .to(ParquetSink(out))
    )
    report = run(spark, flow)
    assert report.acked == 1 and src.deliveries["m0"] == 2
    rows = pq.read_table(out).to_pylist()
    assert sorted((r["wh"], r["i"]) for r in rows) == [
        (w, i) for w in ("north", "south", "west") for i in (0, 1)
    ]
