"""The Iceberg sink: on Spark with pyiceberg's SQL catalog on SQLite (one snapshot per
batch, refused rows fail alone), on a PostgreSQL catalog (a commit whose record failed
is caught up, the table ends exact), and no password in errors or reprs."""

import json

import pyarrow.parquet as pq
import pytest

import ackflow
from ackflow import faults
from ackflow.core.errors import ConfigError
from ackflow.sinks import Iceberg
from lake import ITEMS, assert_exactly_once, iceberg_rows, publish_orders, queue_left, run_refusing_orders


@pytest.mark.spark
def test_a_run_is_exact_with_one_snapshot_per_batch_and_refused_rows_fail_alone(spark,
                                                                                tmp_path):
    catalog = f"sqlite:///{tmp_path / 'catalog.db'}"
    made = Iceberg(catalog, "shop.items")
    made._cat().create_namespace("shop")
    made._cat().create_table("shop.items", schema=ITEMS)  # qty int32, made beforehand
    sink = Iceberg(catalog, "shop.items")
    report, expected = run_refusing_orders(spark, sink)
    assert_exactly_once(iceberg_rows(catalog, "shop.items"), expected)
    table = sink._load()
    ours = [s for s in table.snapshots()
            if "ackflow.batch" in s.summary.additional_properties]
    assert len(ours) == len(table.snapshots()) == report.batches
    total = 0
    for s in ours:  # each snapshot adds exactly its batch's files
        props = s.summary.additional_properties
        total += sum(pq.ParquetFile(f"{sink.data_dir()}/{f}").metadata.num_rows
                     for f in json.loads(props["ackflow.files"]))
        assert table.scan(snapshot_id=s.snapshot_id).to_arrow().num_rows == total


@pytest.mark.slow
def test_on_a_postgresql_catalog_a_commit_whose_record_failed_is_caught_up(postgres, tmp_path):
    """The catalog in PostgreSQL (the in-process executor, no JVM): the second batch's
    snapshot is committed, then the record fails; the batch fails, its messages come
    again, the next commit records the snapshot's keys and leaves their rows out."""
    from ackflow.engine.loop import Engine
    from ackflow.sources import EmbeddedQueue

    db = str(tmp_path / "q.db")
    expected, poison = publish_orders(db, 300, seed=3)
    catalog = {"type": "sql", "uri": postgres.dsn.replace("postgresql://",
                                                          "postgresql+psycopg://"),
               "warehouse": f"file://{tmp_path / 'warehouse'}"}
    (tmp_path / "warehouse").mkdir()

    def order_items(order):
        if order.get("poison"):
            raise ValueError("poison")
        return [{"order": order["order"], "line": j} for j in range(order["items"])]

    src = EmbeddedQueue(db, "orders", policy=ackflow.RetryPolicy(max_deliveries=5,
                                                                 backoff_s=0.01))
    flow = ackflow.Flow(src).flat_map(order_items, name="items").to(
        Iceberg(catalog, "pg_shop.items"))
    faults.arm("iceberg.after_commit", "raise", nth=2)
    try:
        report = Engine(flow, executor="local", batch_size=60, max_inflight=180,
                        until_idle=0.5, batch_timeout_s=0.05).run()
        assert faults.hits("iceberg.after_commit") >= 2, "the point was never reached"
    finally:
        faults.disarm()
    assert report.nacked > 0 and report.dead_lettered == len(poison)
    assert_exactly_once(iceberg_rows(catalog, "pg_shop.items"), expected)
    assert queue_left(db) == 0


def test_the_catalog_password_never_shows(tmp_path):
    url = "postgresql+psycopg://app:hunter2secret@127.0.0.1:1/db"
    sink = Iceberg(url, "ns.t")
    assert "hunter2secret" not in repr(sink)
    with pytest.raises(ConfigError) as e:
        sink.open()
    assert "hunter2secret" not in str(e.value) and "cannot" in str(e.value)
    with pytest.raises(ConfigError, match="does not exist"):
        Iceberg(f"sqlite:///{tmp_path / 'c.db'}", "ns.absent", create=False).open()
    with pytest.raises(ConfigError, match=r"namespace\.name"):
        Iceberg(f"sqlite:///{tmp_path / 'c.db'}", "plain")


@pytest.mark.spark
def test_the_demo_into_an_iceberg_table_checks_out(spark, tmp_path, capsys):
    from ackflow.cli import main

    assert main(["demo", "--sink", "iceberg", "--messages", "600", "--workdir", str(tmp_path),
                 "--master", "local[2]", "--until-idle", "0.5", "--json"]) == 0
    check = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["check"]
    assert check["ok"] and check["sink"] == "iceberg" and check["duplicate_rows"] == 0
