"""Sinks: Parquet appears atomically per batch; a failing write never acks."""

import os

import pyarrow.parquet as pq
import pytest

import ackflow
from ackflow.embedded import EmbeddedQueue
from ackflow.sinks import EmbeddedQueueSink, ParquetSink
from ackflow.testing import FailingSink, ListSource
from helpers import FAST, bodies

pytestmark = pytest.mark.spark


def test_parquet_batches_become_visible_whole(spark, tmp_path):
    out = tmp_path / "out"
    src = ListSource(bodies([{"n": i, "s": f"v{i}"} for i in range(300)]))
    report = ackflow.run(ackflow.Flow(src).to(ParquetSink(out)), spark=spark, **FAST)
    assert report.acked == 300
    batches = sorted(n for n in os.listdir(out) if n.startswith("batch="))
    assert len(batches) == report.batches
    assert os.listdir(out / "_staging") == []  # everything committed, nothing left staged
    table = pq.read_table(out)
    assert sorted(table.column("n").to_pylist()) == list(range(300))


def test_parquet_staging_of_a_crashed_run_is_invisible_and_cleared(spark, tmp_path):
    out = tmp_path / "out"
    staged = out / "_staging" / "deadbeef"
    staged.mkdir(parents=True)
    (staged / "part-00000.parquet").write_bytes(b"half a file")
    src = ListSource(bodies([{"n": 1}]))
    ackflow.run(ackflow.Flow(src).to(ParquetSink(out)), spark=spark, **FAST)
    assert not staged.exists()
    assert pq.read_table(out).column("n").to_pylist() == [1]


def test_a_failed_commit_fails_the_batch(spark, tmp_path):
    """A commit that fails every batch is a systemic failure: nothing acked, nothing
    dead-lettered, the messages given back, the staged files aborted, the run stopped."""
    from ackflow.core.errors import SystemicFailure

    class BrokenCommit(ParquetSink):
        def commit(self, batch_id, tokens):
            raise OSError("disk full")

    out = tmp_path / "out"
    src = ListSource(bodies([{"n": i} for i in range(10)]))
    with pytest.raises(SystemicFailure, match="disk full") as e:
        ackflow.run(
            ackflow.Flow(src).to(BrokenCommit(out, name="pq")),
            spark=spark,
            systemic_stop_after_s=1,
            systemic_backoff_s=0.05,
            **FAST,
        )
    assert e.value.step == "pq"
    assert not src.dead_letters and set(src.final().values()) == {"released"}
    assert not [n for n in os.listdir(out) if n.startswith("batch=")]
    assert os.listdir(out / "_staging") == []  # aborted


def test_a_sink_raising_mid_write_fails_the_poison_message_not_its_partition(spark):
    """The write of the partition holding row 13 raises; the other partition is written:
    the failed partition's messages run again in halves until row 13's fails alone
    (before 0.6.15 every message of that partition failed with it)."""
    src = ListSource(bodies([{"n": i} for i in range(20)]))
    sink = FailingSink(raise_if=lambda r: r["n"] == 13)
    report = ackflow.run(
        ackflow.Flow(src).to(sink), spark=spark, **{**FAST, "batch_size": 20, "until_idle": 0.5}
    )
    failed = {k for k, v in src.final().items() if v != "acked"}
    assert failed == {"m13"}
    assert report.bisections >= 1
    assert report.acked + report.dead_lettered == 20
    assert all("sink exploded mid-write" in src.failures[k].error for k in failed)
    assert not any(r["n"] == 13 for r in sink.rows)


def test_embedded_queue_sink_chains_pipelines(spark, tmp_path):
    db = str(tmp_path / "q.db")
    src = ListSource(bodies([{"n": i} for i in range(25)]))
    ackflow.run(
        ackflow.Flow(src)
        .map(lambda r: {"n": r["n"], "id": f"x{r['n']}"}, name="tag")
        .to(EmbeddedQueueSink(db, "next", id_column="id")),
        spark=spark,
        **FAST,
    )
    q = EmbeddedQueue(db)
    assert q.stats("next")["ready"] == 25
    assert {m["msg_id"] for m in q.peek("next", 100)} == {f"x{i}" for i in range(25)}


def test_console_sink_prints_rows_on_the_driver(spark, capsys):
    from ackflow.sinks import ConsoleSink

    src = ListSource(bodies([{"n": i} for i in range(3)]))
    report = ackflow.run(ackflow.Flow(src).to(ConsoleSink(limit=2)), spark=spark, **FAST)
    out = capsys.readouterr().out
    assert report.acked == 3
    assert out.count("[console ") == 2 and "{'n': 0}" in out


def test_parquet_writes_a_redelivered_message_once(spark, tmp_path):
    out = tmp_path / "out"
    msgs = bodies([{"n": i, "k": [i, i + 1]} for i in range(120)])

    def flow(src):
        return (
            ackflow.Flow(src).flat_map(lambda r: ({"n": r["n"], "v": v} for v in r["k"])).to(ParquetSink(out))
        )

    keys = [f"id{i}" for i in range(120)]
    ackflow.run(flow(ListSource(msgs[:80], keys=keys[:80])), spark=spark, **FAST)
    # as after a crash: messages 40-79 come again (written, never acked), with new ones
    report = ackflow.run(flow(ListSource(msgs[40:], keys=keys[40:])), spark=spark, **FAST)
    assert report.acked == 80
    got = sorted(zip(*pq.read_table(out, columns=["n", "v"]).to_pydict().values(), strict=True))
    assert got == sorted((i, v) for i in range(120) for v in (i, i + 1))


def test_parquet_finishes_a_batch_recorded_before_a_crash_and_drops_unrecorded(spark, tmp_path):
    out = tmp_path / "out"
    sink = ParquetSink(out)
    sink.open()
    import pyarrow as pa

    rows = pa.table({"n": [1, 2], "__af_key": ["a", "b"]})
    token = sink.write_partition("b1", 0, rows).token
    sink.write_partition("b2", 0, pa.table({"n": [3], "__af_key": ["c"]}))
    real_rename = os.rename

    def crash_on_rename(src, dst):
        raise KeyboardInterrupt("killed between the record and the rename")

    os.rename = crash_on_rename
    try:
        with pytest.raises(KeyboardInterrupt):
            sink.commit("b1", [token])
    finally:
        os.rename = real_rename
    assert not [n for n in os.listdir(out) if n.startswith("batch=")]
    sink.close()  # the process died: it holds no lock any more
    ParquetSink(out).open()  # the restart
    assert sorted(os.listdir(out / "_staging")) == []
    assert pq.read_table(out).column("n").to_pylist() == [1, 2]
