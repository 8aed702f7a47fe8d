"""on_error(sink): given-up messages go to the user's sink, settled only once written."""

import json

import pyarrow.parquet as pq
import pytest

import ackflow
from ackflow.sinks import MemorySink, ParquetSink
from ackflow.sinks.base import PartitionResult
from ackflow.testing import ListSource
from helpers import FAST, bodies

pytestmark = pytest.mark.spark


def parse(r):
    if r["n"] == 3:
        raise ValueError("three")
    return r


def test_dead_letters_go_to_the_error_sink_with_provenance(spark, tmp_path):
    src = ListSource(
        bodies([{"n": i} for i in range(6)]), policy=ackflow.RetryPolicy(max_deliveries=2, backoff_s=0.01)
    )
    report = ackflow.run(
        ackflow.Flow(src)
        .map(parse, name="parse")
        .to(MemorySink())
        .on_error(ParquetSink(tmp_path / "dlq", name="dlq")),
        spark=spark,
        **FAST,
    )
    assert src.settled["m3"] == ["nacked", "acked"]  # retried, then settled once written
    assert report.dead_lettered == 1 and report.acked == 5
    (row,) = pq.read_table(tmp_path / "dlq").to_pylist()
    assert (row["message"], row["step"], row["error"], row["deliveries"]) == (
        "m3",
        "parse",
        "ValueError: three",
        2,
    )
    assert json.loads(row["body"]) == {"n": 3} and json.loads(row["headers"]) == {}


class BrokenSink(MemorySink):
    def write_partition(self, batch_id, partition, rows):
        return PartitionResult(failed={i: "no space" for i in range(rows.num_rows)})


def test_a_failing_error_sink_means_nack_never_drop(spark):
    src = ListSource(bodies([{"n": 3}]), policy=ackflow.RetryPolicy(max_deliveries=1, backoff_s=0.05))
    report = ackflow.run(
        ackflow.Flow(src).map(parse, name="parse").to(MemorySink()).on_error(BrokenSink("dlq")),
        spark=spark,
        **{**FAST, "until_idle": 0.4},
    )
    assert set(src.settled["m0"]) == {"nacked"} and len(src.settled["m0"]) >= 2
    assert report.dead_lettered == 0 and report.acked == 0
