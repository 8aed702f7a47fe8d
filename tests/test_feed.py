"""A local master's batches reach the Python workers through a file (spark/feed.py):
the same outcome, message by message, as through ``createDataFrame``; the files live
as long as their job; a dead process's directory is swept by the next one. And the
small machine's JVM compiles with C1 (session.quick_jit)."""

import json
import os
import subprocess
import sys

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import ackflow
from ackflow.embedded import EmbeddedQueue
from ackflow.sinks import MemorySink
from ackflow.sources import EmbeddedQueueSource
from ackflow.spark import compile as compile_module
from ackflow.spark import feed
from ackflow.spark import plan as plan_module
from ackflow.spark.compile import CompiledFlow
from ackflow.spark.feed import Feeds, fed, sweep_dead
from ackflow.spark.session import quick_jit
from helpers import FAST
from test_hostile import KNOWN, nested

POLICY = ackflow.RetryPolicy(max_deliveries=2, backoff_s=0.01)


def check(r):
    if isinstance(r.get("qty"), int) and r["qty"] % 5 == 0:
        raise ValueError(f"qty {r['qty']} is poison")
    return r


def outcome(spark, tmp_path, bodies, on, monkeypatch, fuse=True, fast=True):
    """(rows by message, dead letters by message) of one run with the feed on or off,
    the map and the writer in one pass or in two, and JSON read by msgspec where it
    certainly reads as the exact reader (spark/decode.py's fast_json) or by the exact
    reader alone."""
    db = str(tmp_path / f"q-{on}-{fuse}-{fast}.db")
    EmbeddedQueue(db).publish("in", bodies, headers=[{"n": str(i)} for i in range(len(bodies))])
    src = EmbeddedQueueSource(db, "in", policy=POLICY)
    src.headers_field = "meta"
    sink, dead = MemorySink(), MemorySink(name="dead")
    writes, feeds = [], []
    real = Feeds.write
    monkeypatch.setattr(
        Feeds, "write", lambda self, t, b: writes.append(b) or feeds.append(self) or real(self, t, b)
    )
    one_pass = []
    real_write = CompiledFlow._write
    monkeypatch.setattr(
        CompiledFlow,
        "_write",
        lambda self, *a, **kw: one_pass.append(len(a) > 5 and a[5] is not None) or real_write(self, *a, **kw),
    )
    spark.conf.set("spark.ackflow.feed", "true" if on else "false")
    readers = []  # the reader each segment's and sampler's tasks were given (fast_json=)
    for module, name in ((compile_module, "make_segment"), (plan_module, "make_sampler")):
        maker = getattr(module, name)
        monkeypatch.setattr(
            module, name, lambda *a, maker=maker, **kw: readers.append(kw["fast_json"]) or maker(*a, **kw)
        )
    spark.conf.set("spark.ackflow.fuse", "true" if fuse else "false")
    spark.conf.set("spark.ackflow.fastjson", "true" if fast else "false")
    try:
        ackflow.run(
            ackflow.Flow(src).map(check, name="check").to(sink).on_error(dead),
            spark=spark,
            **{**FAST, "until_idle": 0.5, "systemic_stop_after_s": 15},
        )
    finally:
        spark.conf.unset("spark.ackflow.feed")
        spark.conf.unset("spark.ackflow.fuse")
        spark.conf.unset("spark.ackflow.fastjson")
    # the paths under test were the ones taken
    assert bool(writes) == on and set(one_pass) == {fuse} and set(readers) == {fast}
    for f in feeds:  # every job's file gone with it (bisections and locate too)
        assert os.listdir(f.dir) == [feed.LOCK]
    rows = sorted(json.dumps(r, sort_keys=True, default=str) for r in sink.rows)
    letters = sorted((r["body"], r["step"], r["error"]) for r in dead.rows)
    return rows, letters


@pytest.mark.spark
@settings(
    max_examples=int(os.environ.get("ACKFLOW_HOSTILE_EXAMPLES", "5")),
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@example(bodies=[*KNOWN, b'{"qty": 10}', b'{"qty": 11, "m": {"x": [1, 2]}}'])
@given(
    bodies=st.lists(
        st.one_of(
            st.sampled_from(KNOWN),
            st.binary(max_size=32),
            st.dictionaries(st.sampled_from(["qty", "a", "b"]), nested, max_size=3).map(
                lambda d: json.dumps(d).encode()
            ),
        ),
        min_size=1,
        max_size=30,
    )
)
def test_the_file_and_the_dataframe_give_each_message_the_same_outcome(
    spark, tmp_path_factory, monkeypatch, bodies
):
    """Hostile bodies (the fuzz's known cases and drawn ones), headers, a poison step:
    every row written and every dead letter (body, step, reason) are the same whether
    the messages went through the file or through ``createDataFrame``, whether the
    map and the writer ran in one pass or in two (JVM rows between them), and whether
    JSON was read by msgspec where it certainly reads alike, or by the exact reader only."""
    tmp = tmp_path_factory.mktemp("feed")
    fused = outcome(spark, tmp, bodies, True, monkeypatch)
    assert fused == outcome(spark, tmp, bodies, False, monkeypatch)
    assert fused == outcome(spark, tmp, bodies, True, monkeypatch, fuse=False)
    assert fused == outcome(spark, tmp, bodies, True, monkeypatch, fast=False)


def crash(r):
    if r.get("qty") == 13:
        os._exit(7)  # the Python worker dies: the whole job fails, bisection finds the message
    return r


@pytest.mark.spark
def test_a_message_that_kills_the_worker_is_found_alike_through_the_file_and_the_dataframe(
    spark, tmp_path, monkeypatch
):
    """A job that fails as a whole (a message that kills its Python worker) is bisected
    down to that message on either path: the same rows written and the same message
    dead-lettered at the same step, and every job's file gone (the halves' too)."""
    bodies = [json.dumps({"qty": q, "n": i}).encode() for i, q in enumerate([1, 2, 13, 4])]

    def run(on):
        db = str(tmp_path / f"crash-{on}.db")
        EmbeddedQueue(db).publish("in", bodies)
        sink, dead = MemorySink(), MemorySink(name="dead")
        feeds = []
        real = Feeds.write
        monkeypatch.setattr(Feeds, "write", lambda self, t, b: feeds.append(self) or real(self, t, b))
        spark.conf.set("spark.ackflow.feed", "true" if on else "false")
        try:
            ackflow.run(
                ackflow.Flow(EmbeddedQueueSource(db, "in", policy=POLICY))
                .map(crash, name="crash")
                .to(sink)
                .on_error(dead),
                spark=spark,
                **{**FAST, "until_idle": 0.5, "systemic_stop_after_s": 30},
            )
        finally:
            spark.conf.unset("spark.ackflow.feed")
        assert bool(feeds) == on
        for f in feeds:
            assert os.listdir(f.dir) == [feed.LOCK]
        rows = sorted(r["n"] for r in sink.rows)
        letters = [(r["body"], r["step"], r["error"].split(":", 1)[0]) for r in dead.rows]
        return rows, letters

    on, off = run(True), run(False)
    assert on == off
    assert on[0] == [0, 1, 3] and [(b, s) for b, s, _ in on[1]] == [(bodies[2], "crash")], on


def test_a_file_lives_as_long_as_its_batch_and_holds_one_record_batch_per_partition(tmp_path):
    feeds = Feeds()
    table = pa.table({"n": list(range(10))})
    path, parts = feeds.write(pa.Table.from_batches(table.to_batches(max_chunksize=4)), "b1")
    other, _ = feeds.write(table, "b2")
    assert parts == 3
    # what a task of partition 1 and 2 reads (its input: the partition indices)
    read = fed(path, lambda batches: iter(list(batches)))(iter([pa.record_batch({"id": [1, 2]})]))
    assert [b.column(0).to_pylist() for b in read] == [[4, 5, 6, 7], [8, 9]]
    feeds.release("b1")
    assert not os.path.exists(path) and os.path.exists(other)
    feeds.release("b1")  # twice: nothing to do
    feeds.release("b2")
    assert os.listdir(feeds.dir) == [feed.LOCK]
    # what Spark would hand the function: pieces of at most maxRecordsPerBatch
    pieces = fed(path_again := feeds.write(table, "b3")[0], lambda b: iter(list(b)), max_rows=3)(
        iter([pa.record_batch({"id": [0]})])
    )
    assert [b.num_rows for b in pieces] == [3, 3, 3, 1]
    feeds.release("b3")
    assert not os.path.exists(path_again)


def test_a_feed_directory_removed_under_a_running_process_is_made_again():
    """A cleaner of the temporary folder may remove it while the run is quiet."""
    import shutil

    feeds = Feeds()
    shutil.rmtree(feeds.dir)
    path, parts = feeds.write(pa.table({"n": [1, 2]}), "b1")
    assert parts == 1 and os.path.exists(path)


def test_the_directory_of_a_dead_process_is_swept_and_a_living_ones_kept(tmp_path, monkeypatch):
    """Dead or alive is told by the directory's lock, not by a pid (containers sharing
    the temporary folder do not share pids): a living owner holds it."""
    monkeypatch.setattr(feed.tempfile, "gettempdir", lambda: str(tmp_path))
    for name in ("dead", "living"):
        os.makedirs(tmp_path / f"{feed.PREFIX}1-{name}")
        (tmp_path / f"{feed.PREFIX}1-{name}" / "a.arrow").write_bytes(b"x")
        (tmp_path / f"{feed.PREFIX}1-{name}" / feed.LOCK).write_bytes(b"")
    os.makedirs(tmp_path / f"{feed.PREFIX}1-nolock")  # not ours to judge
    os.makedirs(tmp_path / "someone-elses")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time; f = open(sys.argv[1], 'w'); fcntl.flock(f, fcntl.LOCK_EX);"
            " print('held', flush=True); time.sleep(60)",
            str(tmp_path / f"{feed.PREFIX}1-living" / feed.LOCK),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        sweep_dead()
        assert sorted(os.listdir(tmp_path)) == sorted(
            [f"{feed.PREFIX}1-living", f"{feed.PREFIX}1-nolock", "someone-elses"]
        )
        mine = Feeds()  # its own directory is locked by itself: a second sweep keeps it
        sweep_dead()
        assert os.path.isdir(mine.dir)
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.spark
def test_a_batch_whose_file_cannot_be_written_goes_through_the_jvm(spark, tmp_path, monkeypatch):
    """A full or unwritable temporary folder costs speed only: every message is written."""
    db = str(tmp_path / "q.db")
    EmbeddedQueue(db).publish("in", [json.dumps({"qty": i}).encode() for i in range(1, 40, 5)])

    def full(self, table, batch_id):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Feeds, "write", full)
    sink = MemorySink()
    report = ackflow.run(ackflow.Flow(EmbeddedQueueSource(db, "in")).to(sink), spark=spark, **FAST)
    assert report.acked == 8 and sorted(r["qty"] for r in sink.rows) == list(range(1, 40, 5))


@pytest.mark.parametrize(
    "cores, env, opts, want",
    [
        (2, {}, "", "-XX:TieredStopAtLevel=1"),
        (16, {}, "", ""),
        (2, {"ACKFLOW_JIT": "full"}, "", ""),
        (16, {"ACKFLOW_JIT": "quick"}, "-Dx=1", "-Dx=1 -XX:TieredStopAtLevel=1"),
        (2, {}, "-XX:TieredStopAtLevel=4", "-XX:TieredStopAtLevel=4"),  # one's own wins
        (2, {"PYSPARK_GATEWAY_PORT": "1"}, "", ""),  # a JVM already runs: no-op
    ],
)
def test_a_small_machines_local_driver_compiles_with_c1(monkeypatch, cores, env, opts, want):
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    for k in ("ACKFLOW_JIT", "PYSPARK_GATEWAY_PORT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("SPARK_SUBMIT_OPTS", opts)
    quick_jit()
    assert os.environ["SPARK_SUBMIT_OPTS"] == want
