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
def test_a_run_is_exact_with_one_snapshot_per_batch_and_refused_rows_fail_alone(spark, tmp_path):
    catalog = f"sqlite:///{tmp_path / 'catalog.db'}"
    made = Iceberg(catalog, "shop.items")
    made._cat().create_namespace("shop")
    made._cat().create_table("shop.items", schema=ITEMS)  # qty int32, made beforehand
    sink = Iceberg(catalog, "shop.items", evolve=False)  # (evolve=True widens qty to long)
    report, expected = run_refusing_orders(spark, sink)
    assert_exactly_once(iceberg_rows(catalog, "shop.items"), expected)
    table = sink._load()
    ours = [s for s in table.snapshots() if "ackflow.batch" in s.summary.additional_properties]
    assert len(ours) == len(table.snapshots()) == report.batches
    total = 0
    for s in ours:  # each snapshot adds exactly its batch's files
        props = s.summary.additional_properties
        total += sum(
            pq.ParquetFile(f"{sink.data_dir()}/{f}").metadata.num_rows
            for f in json.loads(props["ackflow.files"])
        )
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
    catalog = {
        "type": "sql",
        "uri": postgres.dsn.replace("postgresql://", "postgresql+psycopg://"),
        "warehouse": f"file://{tmp_path / 'warehouse'}",
    }
    (tmp_path / "warehouse").mkdir()

    def order_items(order):
        if order.get("poison"):
            raise ValueError("poison")
        return [{"order": order["order"], "line": j} for j in range(order["items"])]

    src = EmbeddedQueue(db, "orders", policy=ackflow.RetryPolicy(max_deliveries=5, backoff_s=0.01))
    flow = ackflow.Flow(src).flat_map(order_items, name="items").to(Iceberg(catalog, "pg_shop.items"))
    faults.arm("iceberg.after_commit", "raise", nth=2)
    try:
        report = Engine(
            flow, executor="local", batch_size=60, max_inflight=180, until_idle=0.5, batch_timeout_s=0.05
        ).run()
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

    assert (
        main(
            [
                "demo",
                "--sink",
                "iceberg",
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
    assert check["ok"] and check["sink"] == "iceberg" and check["duplicate_rows"] == 0


def test_every_file_of_a_snapshot_is_durable_before_its_keys_are_recorded(tmp_path, monkeypatch):
    """Each fsync's path is recorded (a wrapper around os.fsync), and the moment the
    keys are recorded: the commit's data files, the manifests it wrote, its manifest
    list, its metadata JSON and their folders come before. Another writer commits
    right after our commit: its metadata is not what ours needs (before the fix: only
    the metadata JSON re-loaded after the commit, the other writer's, was fsynced)."""
    import os

    import pyarrow as pa
    from pyiceberg.table import Transaction

    from ackflow.sinks.lakehouse import KeyManifest

    sink = Iceberg(f"sqlite:///{tmp_path / 'cat.db'}", "ns.t")
    sink.open()
    sink.prepare(pa.schema([("n", pa.int64())]))

    def stage(batch, keys, start):
        rows = pa.table({"n": list(range(start, start + len(keys))), "__af_key": keys})
        return [sink.write_partition(batch, 0, rows).token]

    sink.commit("b1", stage("b1", ["a", "b"], 0))  # a first snapshot and manifest
    log, ours = [], {}
    real_fsync, real_record, real_commit = os.fsync, KeyManifest.record, Transaction.commit_transaction

    def fsync(fd):
        log.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    def record(*a, **kw):
        log.append("RECORD")
        return real_record(*a, **kw)

    def commit_then_another_writer(self):
        table = real_commit(self)
        if not ours:
            ours["metadata"] = self._table.metadata_location
            other = pa.table({"n": pa.array([99], pa.int64()), "ackflow_key": pa.array([None], pa.string())})
            sink._cat().load_table("ns.t").append(other.cast(sink.target))
        return table

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(KeyManifest, "record", staticmethod(record))
    monkeypatch.setattr(Transaction, "commit_transaction", commit_then_another_writer)
    sink.commit("b2", stage("b2", ["c", "d", "e"], 10))
    monkeypatch.undo()

    table = sink._load()
    snap = next(s for s in table.snapshots() if s.summary.additional_properties.get("ackflow.batch") == "b2")
    assert table.current_snapshot().snapshot_id != snap.snapshot_id  # the other writer's
    written = [m for m in snap.manifests(table.io) if m.added_snapshot_id == snap.snapshot_id]
    data = [e.data_file.file_path for m in written for e in m.fetch_manifest_entry(table.io)]
    needed = {
        p.removeprefix("file://")
        for p in [ours["metadata"], snap.manifest_list, *(m.manifest_path for m in written), *data]
    }
    assert written and data and len(needed) >= 4
    needed |= {os.path.dirname(p) for p in needed}
    before = set(log[: log.index("RECORD")])
    assert needed <= before, f"not durable before the keys were recorded: {needed - before}"
    sink.close()


@pytest.mark.parametrize("point", Iceberg.SYNC_POINTS)
def test_an_error_at_each_durability_step_is_caught_up_by_the_next_commit(tmp_path, point):
    """The snapshot is in the catalog, the commit fails at one of its fsync steps (the
    batch fails, its messages come again): the next commit finds the snapshot by its
    sequence number, records its keys, and the redelivered row is left out."""
    import sqlite3

    import pyarrow as pa

    sink = Iceberg(f"sqlite:///{tmp_path / 'cat.db'}", "ns.t")
    sink.open()
    sink.prepare(pa.schema([("n", pa.int64())]))

    def stage(batch, keys, start):
        rows = pa.table({"n": list(range(start, start + len(keys))), "__af_key": keys})
        return [sink.write_partition(batch, 0, rows).token]

    faults.arm(point, "raise")
    try:
        tokens = stage("b1", ["a", "b"], 0)
        with pytest.raises(faults.InjectedFault):
            sink.commit("b1", tokens)
        sink.abort("b1", tokens)
    finally:
        faults.disarm()
    sink.commit("b2", stage("b2", ["b", "c"], 10))  # b delivered again
    t = sink._load().scan().to_arrow()
    assert sorted(zip(t.column("ackflow_key").to_pylist(), t.column("n").to_pylist(), strict=True)) == [
        ("a", 0),
        ("b", 1),
        ("c", 11),
    ]
    with sqlite3.connect(sink.manifest_path) as m:
        assert m.execute("SELECT sum(recovered) FROM batches").fetchone()[0] == 1
    sink.close()


@pytest.mark.slow
def test_history_stays_bounded_over_hundreds_of_commits_and_dedupe_still_holds(tmp_path):
    """300 small commits into a table made elsewhere (no retention properties): the
    sink sets them, expires old snapshots and deletes the files only they referenced.
    Metadata JSON files, snapshots, manifest lists and manifests stay bounded (before:
    one of each per batch, every JSON holding every snapshot); every row is there once,
    a batch delivered again after its snapshot expired is still left out (the key
    manifest dedupes, not the history), and a commit whose record failed after many
    expiries is still caught up."""
    import os

    import pyarrow as pa

    from ackflow.sinks.iceberg import RETENTION

    catalog = f"sqlite:///{tmp_path / 'cat.db'}"
    sink = Iceberg(catalog, "ns.t")
    sink._cat().create_namespace("ns")
    sink._cat().create_table("ns.t", schema=pa.schema([("n", pa.int64()), ("ackflow_key", pa.string())]))
    sink.open()
    sink.prepare(pa.schema([("n", pa.int64())]))
    keep = sink.keep_snapshots
    folder = os.path.join(sink.location, "metadata")

    def commit(i, keys=None):
        keys = keys or [f"k{i}-{j}" for j in range(3)]
        rows = pa.table({"n": [i] * len(keys), "__af_key": keys})
        sink.commit(f"b{i}", [sink.write_partition(f"b{i}", 0, rows).token])

    worst = {"json": 0, "avro": 0, "snapshots": 0}
    for i in range(300):
        commit(i)
        if i % 25 == 24:
            names = os.listdir(folder)
            worst["json"] = max(worst["json"], sum(n.endswith(".metadata.json") for n in names))
            worst["avro"] = max(worst["avro"], sum(n.endswith(".avro") for n in names))
            worst["snapshots"] = max(worst["snapshots"], len(sink._load().snapshots()))
    table = sink._load()
    assert all(table.properties.get(k) == v for k, v in RETENTION.items())
    assert worst["json"] <= 11 + 1  # previous-versions-max 10, and the current one
    assert worst["snapshots"] <= 2 * keep + 1
    assert worst["avro"] <= 4 * keep + 101  # lists of kept snapshots + unmerged manifests
    assert len(table.current_snapshot().manifests(table.io)) <= 101
    commit(1000, keys=["k3-0", "k3-1", "new"])  # b3 delivered again, long expired
    faults.arm("iceberg.after_commit", "raise")
    try:
        with pytest.raises(faults.InjectedFault):
            commit(1001, keys=["late"])
    finally:
        faults.disarm()
    commit(1002, keys=["late", "last"])  # "late" delivered again: caught up, left out
    t = sink._load().scan().to_arrow()
    keys = t.column("ackflow_key").to_pylist()
    assert len(keys) == len(set(keys)) == 300 * 3 + 3
    assert sorted(k for k, n in zip(keys, t.column("n").to_pylist(), strict=True) if n >= 1000) == [
        "last",
        "late",
        "new",
    ]
    sink.close()
