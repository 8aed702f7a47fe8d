"""Delta Lake and Iceberg, the protocol they share: a crash at each boundary of a commit
(files written / table committed / keys recorded, before the ack) and a restart give
each message's rows exactly once; a batch committed before a crash is recognised and
never committed twice; a redelivered message's rows are not added again."""

import os
import sqlite3
import threading
import time

import pyarrow as pa
import pytest

from ackflow import faults
from ackflow.sinks import Delta, Iceberg
from lake import (
    assert_exactly_once,
    dead_ids,
    delta_rows,
    iceberg_rows,
    publish_orders,
    queue_left,
    run_local,
)

pytestmark = pytest.mark.slow


def tables(tmp_path, kind):
    env = {
        "AF_QUEUE": str(tmp_path / "q.db"),
        "AF_SINKS": kind,
        "AF_DELTA": str(tmp_path / "delta"),
        "AF_CATALOG": f"sqlite:///{tmp_path / 'catalog.db'}",
        "AF_TABLE": "shop.items",
    }

    def rows():
        if kind == "delta":
            return delta_rows(env["AF_DELTA"])
        return iceberg_rows(env["AF_CATALOG"], env["AF_TABLE"])

    def manifest():
        if kind == "delta":
            return os.path.join(env["AF_DELTA"], "_ackflow", "keys.db")
        return str(tmp_path / "warehouse" / "shop" / "items" / "_ackflow" / "keys.db")

    return env, rows, manifest


@pytest.mark.parametrize("kind", ["delta", "iceberg"])
@pytest.mark.parametrize("moment", ["before_commit", "after_commit", "after_record"])
def test_a_crash_at_each_commit_boundary_then_a_restart_ends_exact(tmp_path, kind, moment):
    """The process exits at once (like SIGKILL) at the point on its second commit, then
    runs again to the end: every message's rows exactly once, poison dead-lettered,
    the queue empty. After the table commit the next start finds the unrecorded batch
    by its sequence number and records its keys; after the record the redelivered rows
    are left out."""
    env, rows, manifest = tables(tmp_path, kind)
    expected, poison = publish_orders(env["AF_QUEUE"], 200, seed=5)
    point = f"{kind}.{moment}"
    crashed = run_local({**env, "ACKFLOW_FAULTS": f"{point}=exit@2"})
    assert crashed.returncode == 137, crashed.stderr[-2000:]
    assert f"fault point {point!r}" in crashed.stderr
    first = rows()
    assert first and len(first) < len(expected)  # one batch landed, then the crash
    done = run_local(env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_exactly_once(rows(), expected)
    assert queue_left(env["AF_QUEUE"]) == 0
    assert dead_ids(env["AF_QUEUE"]) == poison
    with sqlite3.connect(manifest()) as m:
        recovered = m.execute("SELECT sum(recovered) FROM batches").fetchone()[0]
        dropped = int(m.execute("SELECT v FROM meta WHERE k = 'dropped'").fetchone()[0])
        seqs = [r[0] for r in m.execute("SELECT seq FROM batches ORDER BY seq")]
    assert seqs == list(range(1, len(seqs) + 1))  # one sequence number per committed batch
    if moment == "after_commit":
        assert recovered == 1  # the batch the crash left unrecorded: recognised, not redone
        assert dropped > 0  # its messages came again; their rows were left out
    if moment == "after_record":
        assert recovered == 0 and dropped > 0


def stage(sink, batch, keys, start=0):
    rows = pa.table({"n": list(range(start, start + len(keys))), "__af_key": keys})
    return [sink.write_partition(batch, 0, rows).token]


def make(kind, tmp_path, **options):
    if kind == "delta":
        sink = Delta(tmp_path / "t", **options)
    else:
        sink = Iceberg(f"sqlite:///{tmp_path / 'cat.db'}", "ns.t", **options)
    sink.open()
    sink.prepare(pa.schema([("n", pa.int64())]))
    return sink


def content(sink):
    if isinstance(sink, Delta):
        from deltalake import DeltaTable

        t = DeltaTable(sink.path).to_pyarrow_table()
    else:
        t = sink._load().scan().to_arrow()
    return sorted(zip(t.column("ackflow_key").to_pylist(), t.column("n").to_pylist(), strict=True), key=str)


@pytest.mark.parametrize("kind", ["delta", "iceberg"])
def test_a_failed_record_after_the_commit_is_caught_up_in_the_same_process(tmp_path, kind):
    """The table commit succeeds, the manifest's record fails (the batch fails and its
    messages come again): the next commit finds the batch in the table, records its keys,
    and the redelivered rows are left out. Files of a batch that failed before its
    commit are removed by abort."""
    sink = make(kind, tmp_path)
    try:
        faults.arm(sink.POINTS[1], "raise")
        tokens = stage(sink, "b1", ["a", "b"])
        with pytest.raises(faults.InjectedFault):
            sink.commit("b1", tokens)
        sink.abort("b1", tokens)  # what the engine does: the files are in the table, kept
        assert content(sink) == [("a", 0), ("b", 1)]
        sink.commit("b2", stage(sink, "b2", ["b", "c"], start=10))  # b redelivered
        assert content(sink) == [("a", 0), ("b", 1), ("c", 11)]
        faults.arm(sink.POINTS[0], "raise")
        tokens = stage(sink, "b3", ["d"], start=20)
        with pytest.raises(faults.InjectedFault):
            sink.commit("b3", tokens)
        sink.abort("b3", tokens)
        folder = sink.data_dir()
        staged = [f for f in os.listdir(folder) if f.startswith("part-ackflow-")]
        assert len(staged) == 2  # b1's and b2's (rewritten without b); b3's removed
        sink.commit("b4", stage(sink, "b4", ["d", "a"], start=30))
        assert content(sink) == [("a", 0), ("b", 1), ("c", 11), ("d", 30)]
    finally:
        faults.disarm()
        sink.close()


@pytest.mark.parametrize("kind", ["delta", "iceberg"])
def test_a_refused_value_fails_only_its_row_and_a_type_the_table_cannot_take_stops(tmp_path, kind):
    from ackflow.core.errors import FlowError

    sink = make(kind, tmp_path, evolve=False)  # evolution: tests/test_sink_evolution.py
    narrow = (
        Delta(tmp_path / "narrow", evolve=False)
        if kind == "delta"
        else Iceberg(f"sqlite:///{tmp_path / 'cat.db'}", "ns.narrow", evolve=False)
    )
    narrow.open()
    narrow.prepare(pa.schema([pa.field("n", pa.int32())]))
    rows = pa.table({"n": pa.array([1, 2**40, 3], pa.int64()), "__af_key": ["a", "b", "c"]})
    narrow.prepare(rows.schema.remove(1))  # int64 into int32: value by value
    result = narrow.write_partition("b1", 0, rows)
    assert list(result.failed) == [1] and "cannot store" in result.failed[1]
    narrow.commit("b1", [result.token])
    assert content(narrow) == [("a", 1), ("c", 3)]
    with pytest.raises(FlowError, match=r"cannot take column\(s\) n \(string"):
        sink.prepare(pa.schema([("n", pa.string())]))
    with pytest.raises(FlowError, match=r"has no column\(s\) city, zip"):
        sink.prepare(pa.schema([("n", pa.int64()), ("city", pa.string()), ("zip", pa.int32())]))
    sink.close()
    narrow.close()


def test_a_table_made_again_does_not_inherit_the_old_tables_keys(tmp_path):
    """An Iceberg table dropped and created again at the same location finds the old key
    manifest there: the sink refuses to start rather than leave rows out."""
    from ackflow.core.errors import FlowError

    sink = make("iceberg", tmp_path)
    sink.commit("b1", stage(sink, "b1", ["a"]))
    sink.close()
    catalog = sink._cat()
    catalog.drop_table("ns.t")
    again = Iceberg(f"sqlite:///{tmp_path / 'cat.db'}", "ns.t")
    again.prepare(pa.schema([("n", pa.int64())]))  # created anew, at the same location
    with pytest.raises(FlowError, match="belongs to another table"):  # stops the run
        again.commit("b2", stage(again, "b2", ["a"]))


@pytest.mark.parametrize("kind", ["delta", "iceberg"])
def test_a_commit_that_loses_the_race_to_another_writer_is_retried(tmp_path, kind, monkeypatch):
    """Another writer commits between the moment the sink read the table and its commit:
    the commit conflicts, is retried on top of the winner, and both writes are kept."""
    sink = make(kind, tmp_path)
    sink.commit("b1", stage(sink, "b1", ["a"]))
    other = pa.table({"n": pa.array([99], pa.int64()), "ackflow_key": pa.array([None], pa.string())})
    if kind == "delta":
        from deltalake import DeltaTable, write_deltalake

        stale = DeltaTable(sink.path)  # read before the other writer's commit
        write_deltalake(sink.path, other, mode="append")
        monkeypatch.setattr(sink, "_dt", lambda: stale)
        sink.commit("b2", stage(sink, "b2", ["b"], start=1))
        assert DeltaTable(sink.path).version() == 3  # 0 create, 1 b1, 2 other, 3 b2 (retried)
    else:
        import ackflow.sinks.iceberg as iceberg_module

        stale = sink._load()
        sink._load().append(other.cast(sink.target))
        real, calls, waits = type(sink)._load, [], []

        def load_stale_once(self):
            calls.append(1)
            return stale if len(calls) == 2 else real(self)  # the commit's first read

        monkeypatch.setattr(type(sink), "_load", load_stale_once)
        # time.sleep is global: other threads of the test process (a run's loops) keep
        # their real sleep; only this thread's waits are the commit's
        here, real_sleep = threading.current_thread(), time.sleep

        def sleep(seconds):
            if threading.current_thread() is here:
                waits.append(seconds)
            else:
                real_sleep(seconds)

        monkeypatch.setattr(iceberg_module.time, "sleep", sleep)
        sink.commit("b2", stage(sink, "b2", ["b"], start=1))
        monkeypatch.undo()
        assert len(waits) == 1  # the first attempt lost (CommitFailedException), then retried
        assert len(sink._load().snapshots()) == 3
    keys = sorted(k for k, _ in content(sink) if k is not None)
    assert keys == ["a", "b"] and len(content(sink)) == 3


def test_two_processes_creating_one_iceberg_table_at_once_both_go_on(tmp_path, monkeypatch):
    """The catalog checks for the namespace, then inserts it: another process inserting
    between the two made the slower one's insert fail on a unique constraint, and its run
    stopped (seen in CI with two Kafka pipelines starting together). The create is tried
    again and finds the winner's namespace and table."""
    from pyiceberg.catalog.sql import SqlCatalog

    first = Iceberg(f"sqlite:///{tmp_path / 'cat.db'}", "ns.t")
    second = Iceberg(f"sqlite:///{tmp_path / 'cat.db'}", "ns.t")
    first.open(), second.open()
    real = SqlCatalog.namespace_exists

    def the_other_wins_between(self, namespace):
        if self is second._cat() and not raced:
            raced.append(1)
            first.prepare(pa.schema([("n", pa.int64())]))  # creates namespace and table
            return False  # what this process saw just before
        return real(self, namespace)

    raced: list[int] = []
    monkeypatch.setattr(SqlCatalog, "namespace_exists", the_other_wins_between)
    second.prepare(pa.schema([("n", pa.int64())]))
    assert raced
    first.commit("b1", stage(first, "b1", ["a"]))
    second.commit("b1", stage(second, "b1", ["b"]))
    assert sorted(k for k, _ in content(second)) == ["a", "b"]


@pytest.mark.parametrize("kind", ["delta", "iceberg"])
def test_with_key_columns_the_first_write_of_a_key_wins(tmp_path, kind):
    """``key=["sku"]``: those columns identify a row instead of ackflow's row key (no
    ``ackflow_key`` column); a later row with a written key is left out, in the same
    batch or a later one."""
    if kind == "delta":
        sink = Delta(tmp_path / "t", key="sku")
    else:
        sink = Iceberg(f"sqlite:///{tmp_path / 'cat.db'}", "ns.t", key=["sku"])
    sink.open()
    sink.prepare(pa.schema([("sku", pa.string()), ("qty", pa.int64())]))

    def stage_rows(batch, skus, qty):
        rows = pa.table(
            {"sku": skus, "qty": [qty] * len(skus), "__af_key": [f"{batch}-{i}" for i in range(len(skus))]}
        )
        return [sink.write_partition(batch, 0, rows).token]

    sink.commit("b1", stage_rows("b1", ["x", "y", "x"], 1))
    sink.commit("b2", stage_rows("b2", ["y", "z"], 2))
    if kind == "delta":
        from deltalake import DeltaTable

        t = DeltaTable(sink.path).to_pyarrow_table()
    else:
        t = sink._load().scan().to_arrow()
    assert t.column_names == ["sku", "qty"]
    assert sorted(zip(t.column("sku").to_pylist(), t.column("qty").to_pylist(), strict=True)) == [
        ("x", 1),
        ("y", 1),
        ("z", 2),
    ]
    sink.close()


@pytest.mark.parametrize("kind", ["delta", "iceberg"])
def test_a_key_in_two_partitions_of_one_batch_is_written_once_and_runs_are_checked_exactly(tmp_path, kind):
    """The commit's quick way (each file's keys as runs, one search per run) must see a
    key two tasks both hold (a run ``m1..m3`` and a run ``m3..m4``), and a key inside a
    recorded run; anything else is written."""
    sink = make(kind, tmp_path)
    try:
        parts = [
            pa.table({"n": [1, 2, 3], "__af_key": ["m1", "m2", "m3"]}),
            pa.table({"n": [30, 4], "__af_key": ["m3", "m4"]}),
        ]
        sink.commit("b1", [sink.write_partition("b1", p, rows).token for p, rows in enumerate(parts)])
        assert dict(content(sink)) == {"m1": 1, "m2": 2, "m3": 3, "m4": 4}
        sink.commit("b2", stage(sink, "b2", ["m4", "m5", "m4!"], start=20))  # m4 ends run m1..m4
        assert dict(content(sink)) == {"m1": 1, "m2": 2, "m3": 3, "m4": 4, "m4!": 22, "m5": 21}
        sink.commit("b3", stage(sink, "b3", ["m6", "m7"], start=40))  # fresh: the quick way
        assert len(content(sink)) == 8
    finally:
        sink.close()


@pytest.mark.parametrize("kind", ["delta", "iceberg"])
def test_a_committed_batch_survives_the_abort_after_a_later_sink_failed(tmp_path, kind):
    """Broadcast(Delta, Postgres): Delta commits, Postgres' commit fails, the engine aborts
    every sink of the batch. Before, the abort deleted the committed batch's files: the
    table pointed at missing files and the redelivered rows were left out as written."""
    sink = make(kind, tmp_path)
    try:
        tokens = stage(sink, "b1", ["a", "b"])
        sink.commit("b1", tokens)
        sink.abort("b1", tokens)  # what abort_all does when a later sink's commit fails
        assert content(sink) == [("a", 0), ("b", 1)]
        sink.commit("b2", stage(sink, "b2", ["a", "b"], start=10))  # redelivered
        assert content(sink) == [("a", 0), ("b", 1)]
    finally:
        sink.close()


def test_keys_of_a_typed_partition_column_match_after_a_crash_between_commit_and_record(tmp_path):
    """key=["order", "line"] with partition_by="order" (an integer): keys recovered from
    the files of an unrecorded commit take the partition value from the path; before,
    as a string ("7" is not 7), so the redelivered rows were added again."""
    sink = Delta(tmp_path / "t", key=["order", "line"], partition_by="order")
    sink.open()
    sink.prepare(pa.schema([("order", pa.int64()), ("line", pa.int64()), ("v", pa.string())]))

    def staged(batch):
        rows = pa.table({"order": [7, 7], "line": [0, 1], "v": ["x", "y"], "__af_key": ["k0", "k1"]})
        return [sink.write_partition(batch, 0, rows).token]

    try:
        faults.arm(sink.POINTS[1], "raise")  # after the table commit, before the record
        with pytest.raises(faults.InjectedFault):
            sink.commit("b1", staged("b1"))
        faults.disarm()
        sink.commit("b2", staged("b2"))  # the messages come again
        from deltalake import DeltaTable

        t = DeltaTable(sink.path).to_pyarrow_table()
        assert sorted(t.column("line").to_pylist()) == [0, 1]
    finally:
        faults.disarm()
        sink.close()


@pytest.mark.parametrize("kind", ["delta", "iceberg"])
def test_hostile_values_fail_their_rows_only(tmp_path, kind):
    """A timestamp Python cannot hold (year 33 658) used to raise while its error was
    being written, failing every row of the partition; a null key value with key= would
    have made every later null-keyed row count as written."""
    if kind == "delta":
        sink = Delta(tmp_path / "t", key="sku")
    else:
        sink = Iceberg(f"sqlite:///{tmp_path / 'cat.db'}", "ns.t", key=["sku"])
    sink.open()
    schema = pa.schema([("sku", pa.string()), ("at", pa.timestamp("us"))])
    sink.prepare(schema)
    rows = pa.table(
        {
            "sku": ["a", "b", None, "d"],
            "at": pa.array([1, 10**15, 2, 3], pa.timestamp("s")),
            "__af_key": ["k0", "k1", "k2", "k3"],
        }
    )
    sink.prepare(rows.schema.remove(2))
    try:
        result = sink.write_partition("b1", 0, rows)
        assert sorted(result.failed) == [1, 2]
        assert "cannot store" in result.failed[1] and "'sku' has no value" in result.failed[2]
        sink.commit("b1", [result.token])
    finally:
        sink.close()


@pytest.mark.parametrize("kind", ["delta", "iceberg"])
def test_a_flow_column_named_like_the_key_column_stops_the_run_at_start(tmp_path, kind):
    from ackflow.core.errors import FlowError

    sink = Delta(tmp_path / "t") if kind == "delta" else Iceberg(f"sqlite:///{tmp_path / 'cat.db'}", "ns.t")
    sink.open()
    with pytest.raises(FlowError, match="writes a column 'ackflow_key'"):
        sink.prepare(pa.schema([("n", pa.int64()), ("ackflow_key", pa.string())]))
    sink.close()


def test_a_sink_that_cannot_go_on_stops_the_run_from_its_commit():
    """A FlowError from a commit (a key manifest of another table) is not this batch's
    data: before, it became per-message failures, retried and then dead-lettered in
    bulk; now the other sinks are aborted and the run stops with it."""
    from types import SimpleNamespace

    from ackflow.core.errors import FlowError
    from ackflow.engine.batch import commit_all
    from ackflow.sinks.base import Sink

    aborted = []

    class Stuck(Sink):
        def write_partition(self, batch_id, partition, rows):
            raise AssertionError("not used")

        def commit(self, batch_id, tokens):
            raise FlowError(self.name, "the key manifest belongs to another table")

        def abort(self, batch_id, tokens):
            aborted.append(self.name)

    plan = SimpleNamespace(sinks=[Stuck("one"), Stuck("two")])
    with pytest.raises(FlowError, match="another table"):
        commit_all(plan, "b1", {})
    assert aborted == ["one", "two"]


@pytest.mark.parametrize("kind", ["delta", "iceberg"])
def test_the_table_commit_is_fsynced_before_its_keys_are_recorded(tmp_path, kind, monkeypatch):
    """delta-rs and pyiceberg write the log entry / metadata file without fsync; the keys
    recorded next are fsynced, so a power cut could keep the keys and lose the commit
    (the redelivered rows then left out for good). The sink fsyncs them itself."""
    sink = make(kind, tmp_path)
    synced = []
    real = os.fsync

    def record(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", record)
    try:
        sink.commit("b1", stage(sink, "b1", ["a"]))
    finally:
        monkeypatch.undo()
        sink.close()
    if kind == "delta":
        assert os.path.join(sink.path, "_delta_log", f"{1:020d}.json") in synced
    else:
        assert any(p.endswith(".metadata.json") for p in synced)


@pytest.mark.parametrize("kind", ["delta", "iceberg"])
def test_a_lost_key_manifest_stops_the_run_instead_of_writing_rows_twice(tmp_path, kind):
    """The manifest was deleted (or manifest= changed): before, a new one was adopted and
    every redelivered row written again. Now the table's commits of another application
    id stop the run, naming the manifest."""
    from ackflow.core.errors import FlowError

    sink = make(kind, tmp_path)
    sink.commit("b1", stage(sink, "b1", ["a"]))
    sink.close()
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(sink.manifest_path + suffix):
            os.remove(sink.manifest_path + suffix)
    with pytest.raises(FlowError, match="another key manifest"):  # at start, or first commit
        again = make(kind, tmp_path)
        again.commit("b2", stage(again, "b2", ["a"]))


def test_a_partition_value_too_long_for_a_folder_name_fails_only_its_rows(tmp_path):
    """A value whose folder name (``day=<escaped>``) passes the file system's 255 bytes
    made the whole partition's write raise ENAMETOOLONG (an OS error, not a row's data:
    the partition's good messages failed with it). Now its rows fail alone, saying why."""
    sink = Delta(tmp_path / "t", partition_by="day")
    sink.open()
    sink.prepare(pa.schema([("n", pa.int64()), ("day", pa.string())]))
    try:
        days = ["2024-01-01", "é" * 50, "x" * 300, None]  # 50 x é: 300 bytes escaped
        rows = pa.table({"n": [0, 1, 2, 3], "day": days, "__af_key": ["m0", "m1", "m2", "m3"]})
        result = sink.write_partition("b1", 0, rows)
        assert sorted(result.failed) == [1, 2]
        assert "folder name of 304 bytes" in result.failed[1] and "'day'" in result.failed[2]
        sink.commit("b1", [result.token])
        from deltalake import DeltaTable

        got = DeltaTable(sink.path).to_pyarrow_table(columns=["n", "day"]).to_pylist()
        assert sorted((r["n"], r["day"]) for r in got) == [(0, "2024-01-01"), (3, None)]
    finally:
        sink.close()
