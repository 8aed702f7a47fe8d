"""The Delta Lake sink on Spark: one version per batch, refused rows fail only their
messages, the schema is checked at start, two processes (and an outside writer) share
one table, partitions, and what vacuum removes."""

import json
import os
import threading

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

import ackflow
from ackflow.core.errors import ConfigError, FlowError
from ackflow.sinks import Delta
from ackflow.testing import ListSource
from helpers import FAST, bodies, wait_until
from lake import ITEMS, assert_exactly_once, delta_rows, publish_orders, queue_left, run_refusing_orders


@pytest.mark.spark
def test_a_run_is_exact_with_one_version_per_batch_and_refused_rows_fail_alone(spark, tmp_path):
    """A table made beforehand with an int32 ``qty``: an order whose qty does not fit
    fails alone (dead-lettered by the sink's step), poison fails in its step, every
    other order's items are in the table once; each batch is one version, and time
    travel to version v shows exactly the batches up to v."""
    path = str(tmp_path / "items")
    DeltaTable.create(path, ITEMS)
    report, expected = run_refusing_orders(spark, Delta(path))
    assert_exactly_once(delta_rows(path), expected)
    dt = DeltaTable(path)
    commits = sorted((c for c in dt.history() if "ackflow.batch" in c), key=lambda c: c["version"])
    assert [c["version"] for c in commits] == list(range(1, dt.version() + 1))
    assert len(commits) == report.batches == len({c["ackflow.batch"] for c in commits})
    total = 0
    for c in commits:  # time travel: each version adds exactly its batch's files
        files = c["ackflow.files"]
        added = sum(pa.parquet.ParquetFile(os.path.join(path, f)).metadata.num_rows for f in files)
        total += added
        assert DeltaTable(path, version=c["version"]).to_pyarrow_table().num_rows == total


@pytest.mark.spark
def test_a_column_the_table_lacks_fails_its_rows_when_it_came_from_the_data(spark, tmp_path):
    """The columns were inferred from the bodies, so one message with fields the table
    lacks must not stop the run (a restart would meet it first again: a crash loop). Its
    message fails naming the column; the others are written; the table is not changed
    (``evolve=False``: with evolution the table takes the column, tests/test_sink_evolution)."""
    path = str(tmp_path / "t")
    DeltaTable.create(path, pa.schema([("n", pa.int64()), ("ackflow_key", pa.string())]))
    src = ListSource(
        bodies([{"n": 1, "city": "Oslo", "zip": "0150"}, {"n": 2}, {"n": 3}]),
        policy=ackflow.RetryPolicy(max_deliveries=1),
    )
    report = ackflow.run(ackflow.Flow(src).to(Delta(path, evolve=False)), spark=spark, **FAST)
    assert src.final() == {"m0": "dead_lettered", "m1": "acked", "m2": "acked"}
    assert src.failures["m0"].step == "delta" and "column 'city'" in src.failures["m0"].error
    assert "has no such column" in src.failures["m0"].error and report.acked == 2
    table = DeltaTable(path)
    assert table.schema().to_arrow().names == ["n", "ackflow_key"]
    assert sorted(table.to_pyarrow_table().column("n").to_pylist()) == [2, 3]


@pytest.mark.spark
def test_a_type_from_the_data_is_written_value_by_value_in_the_tables_type(spark, tmp_path):
    """One 1.5 in the first batch makes the inferred column a double; the table's is a
    long. That stopped the run (a crash loop), and refusing the column would fail every
    later integer: the values are cast one by one, and only 1.5 fails. A data field
    named like the sink's key column in another case fails alone too."""
    path = str(tmp_path / "t")
    DeltaTable.create(path, pa.schema([("n", pa.int64()), ("ackflow_key", pa.string())]))
    src = ListSource(
        bodies([{"n": 1.5}, {"n": 2}, {"n": 3, "Ackflow_Key": "m1"}]),
        policy=ackflow.RetryPolicy(max_deliveries=1),
    )
    ackflow.run(ackflow.Flow(src).to(Delta(path)), spark=spark, **FAST)
    assert src.final() == {"m0": "dead_lettered", "m1": "acked", "m2": "dead_lettered"}
    assert "cannot store 1.5" in src.failures["m0"].error
    assert "own key column" in src.failures["m2"].error
    table = DeltaTable(path).to_pyarrow_table()
    assert table.column("n").to_pylist() == [2] and table.column("ackflow_key").to_pylist() == ["m1"]


@pytest.mark.spark
def test_a_column_the_flow_makes_and_the_table_lacks_stops_the_run_and_names_it(spark, tmp_path):
    path = str(tmp_path / "t")
    DeltaTable.create(path, pa.schema([("n", pa.int64()), ("ackflow_key", pa.string())]))
    src = ListSource(bodies([{"n": 1}]))
    with pytest.raises(FlowError) as e:
        ackflow.run(
            ackflow.Flow(src).with_columns(city="'Oslo'", zip="'0150'").to(Delta(path, evolve=False)),
            spark=spark,
            **FAST,
        )
    assert "has no column(s) city, zip" in str(e.value) and path in str(e.value)
    assert src.final() == {"m0": "released"}  # given back, not failed
    assert DeltaTable(path).version() == 0  # the table was not changed
    with pytest.raises(ConfigError, match="no Delta table"):
        Delta(tmp_path / "absent", create=False).open()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        Delta(tmp_path / "file").open()


@pytest.mark.slow
def test_two_processes_and_an_outside_writer_share_one_table(tmp_path):
    """Two ackflow processes (in-process executor, no JVM) consume two queues holding the
    same messages (same ids) into one table while an outside writer appends to it: the
    commits interleave under optimistic concurrency, nothing is lost, and each
    message's rows are in the table once (the second process finds their keys)."""
    path = str(tmp_path / "shared")
    queues = [str(tmp_path / "a.db"), str(tmp_path / "b.db")]
    expected = set()
    for q in queues:
        expected, _ = publish_orders(q, 400, seed=9)
    outside = pa.table(
        {
            "order": pa.array([-1], pa.int64()),
            "line": pa.array([0], pa.int64()),
            "sku": ["outside"],
            "qty": pa.array([0], pa.int64()),
            "ackflow_key": pa.array([None], pa.string()),
        }
    )
    stop, appended = threading.Event(), []

    def writer():
        wait_until(lambda: DeltaTable.is_deltatable(path) or stop.is_set(), timeout=60)
        while not stop.is_set() and len(appended) < 200:
            write_deltalake(path, outside, mode="append")
            appended.append(1)

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    import subprocess
    import sys

    from lake import PIPELINE

    env = {**os.environ, "AF_SINKS": "delta", "AF_DELTA": path}
    procs = [
        subprocess.Popen(
            [sys.executable, PIPELINE, q], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for q in queues
    ]
    try:
        outs = [p.communicate(timeout=150) for p in procs]
    finally:
        stop.set()
        t.join(30)
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    assert all(queue_left(q) == 0 for q in queues)
    assert appended, "the outside writer never wrote"
    rows = [r for r in delta_rows(path) if r[0] >= 0]
    assert_exactly_once(rows, expected)
    dt = DeltaTable(path)
    assert dt.to_pyarrow_table(columns=["sku"]).column("sku").to_pylist().count("outside") == len(appended)
    ours = [c for c in dt.history() if "ackflow.seq" in c]
    assert sorted(int(c["ackflow.seq"]) for c in ours) == list(range(1, len(ours) + 1))
    assert len(dt.history()) == 1 + len(ours) + len(appended)  # no commit lost
    import sqlite3

    with sqlite3.connect(os.path.join(path, "_ackflow", "keys.db")) as m:
        dropped = int(m.execute("SELECT v FROM meta WHERE k = 'dropped'").fetchone()[0])
    assert dropped > 0  # the later process found the other's keys and left its rows out


def test_partitions_and_vacuum_of_files_no_version_references(tmp_path):
    """partition_by writes one folder per value (any value: escaped), read back by
    deltalake and polars; the files of a batch that never committed are in no version
    and ``vacuum(full=True)`` removes them (and nothing else)."""
    import polars as pl

    path = str(tmp_path / "p")
    sink = Delta(path, partition_by="day")
    sink.open()
    sink.prepare(pa.schema([("n", pa.int64()), ("day", pa.string())]))
    days = ["2026-11-01", "a b/../%x", None]

    def stage(batch, keys, start):
        rows = pa.table(
            {
                "n": list(range(start, start + len(keys))),
                "day": [days[i % 3] for i in range(len(keys))],
                "__af_key": keys,
            }
        )
        return [sink.write_partition(batch, 0, rows).token]

    sink.commit("b1", stage("b1", ["a", "b", "c"], 0))
    orphan = stage("b2", ["d", "e"], 10)  # a crash before the commit: never committed
    sink.commit("b3", stage("b3", ["c", "f"], 20))  # c came again: left out
    sink.close()
    frame = pl.read_delta(path).sort("n")
    assert frame.select("n", "day").rows() == [(0, days[0]), (1, days[1]), (2, None), (21, days[1])]
    dt = DeltaTable(path)
    before = sorted(dt.to_pyarrow_table().column("n").to_pylist())
    stray = {f["path"] for t in orphan for f in json.loads(t)["files"]}
    removed = dt.vacuum(retention_hours=0, enforce_retention_duration=False, dry_run=False, full=True)
    assert {os.path.normpath(p) for p in removed} >= {os.path.normpath(p) for p in stray}
    assert not any(os.path.exists(os.path.join(path, p)) for p in stray)
    assert sorted(DeltaTable(path).to_pyarrow_table().column("n").to_pylist()) == before
    assert os.path.exists(os.path.join(path, "_ackflow", "keys.db"))


@pytest.mark.spark
def test_the_demo_into_a_delta_table_checks_out(spark, tmp_path, capsys):
    from ackflow.cli import main

    assert (
        main(
            [
                "demo",
                "--sink",
                "delta",
                "--messages",
                "600",
                "--workdir",
                str(tmp_path),
                "--master",
                "local[2]",
                "--until-idle",
                "0.5",
                "--json",
            ]
        )
        == 0
    )
    check = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["check"]
    assert check["ok"] and check["sink"] == "delta" and check["duplicate_rows"] == 0
    assert DeltaTable(str(tmp_path / "orders.delta")).version() >= 1


@pytest.mark.spark
def test_an_empty_partition_value_fails_its_message_never_read_back_as_null(spark, tmp_path):
    """Delta stores an empty string partition value as null: such a row would read back
    as null silently. It fails alone, naming the column; null and real values land."""
    path = str(tmp_path / "t")
    days = ["2024-01-01", "", None, "2024-01-02"]
    src = ListSource(
        [json.dumps({"n": i, "day": d}) for i, d in enumerate(days)],
        policy=ackflow.RetryPolicy(max_deliveries=1),
    )
    report = ackflow.run(
        ackflow.Flow(src).to(Delta(path, partition_by="day")), spark=spark, **{**FAST, "batch_size": 4}
    )
    assert report.acked == 3 and report.dead_lettered == 1
    assert "'day' is an empty string" in src.dead_letters["m1"].error
    got = DeltaTable(path).to_pyarrow_table(columns=["n", "day"]).to_pylist()
    assert sorted((r["n"], r["day"]) for r in got) == [(0, "2024-01-01"), (2, None), (3, "2024-01-02")]
