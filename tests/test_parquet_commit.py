"""The Parquet sink's commit: a recorded batch is never lost, check and record are one
atomic step, one writer per path (driver-side, no Spark job needed)."""

import errno
import os
import signal
import subprocess
import sys
import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ackflow import faults
from ackflow.core.errors import ConfigError
from ackflow.sinks import ParquetSink


def stage(sink, batch, keys, start=0):
    rows = pa.table({"n": list(range(start, start + len(keys))), "__af_key": keys})
    return [sink.write_partition(batch, 0, rows).token]


def written(out):
    if not [n for n in os.listdir(out) if n.startswith("batch=")]:
        return []
    return sorted(pq.read_table(out).column("n").to_pylist())


@pytest.fixture
def sink(tmp_path):
    s = ParquetSink(tmp_path / "out")
    s.open()
    yield s
    s.close()
    faults.disarm()


def redeliver(sink, batch, keys):
    """The message comes again (it was nacked): stage and commit its rows anew."""
    sink.commit(batch, stage(sink, batch, keys))


@pytest.mark.parametrize("how", ["eio", "fault"])
def test_a_failed_rename_after_the_record_undoes_it_and_the_redelivery_writes(
    sink, tmp_path, monkeypatch, how
):
    tokens = stage(sink, "b1", ["a", "b"])
    if how == "eio":
        real = os.rename

        def broken(src, dst):
            if "batch=" in str(dst):
                raise OSError(errno.EIO, "Input/output error")
            return real(src, dst)

        monkeypatch.setattr(os, "rename", broken)
    else:
        faults.arm("parquet.after_record", "raise")
    with pytest.raises((OSError, faults.InjectedFault)):
        sink.commit("b1", tokens)
    sink.abort("b1", tokens)  # what the engine does after a failed commit
    monkeypatch.undo()
    faults.disarm()
    redeliver(sink, "b2", ["a", "b"])  # before the fix: keys found, rows dropped: gone
    assert written(tmp_path / "out") == [0, 1]


def test_a_recorded_batch_whose_undo_fails_is_kept_and_finished_at_the_next_start(
    sink, tmp_path, monkeypatch
):
    tokens = stage(sink, "b1", ["a", "b"])
    faults.arm("parquet.after_record", "raise")
    real_db = ParquetSink._db
    calls = []

    def db_failing_the_undo(self, **how):
        calls.append(1)
        if len(calls) > 1:  # the record's connection works, the undo's does not
            raise OSError(errno.EIO, "manifest unreadable")
        return real_db(self, **how)

    monkeypatch.setattr(ParquetSink, "_db", db_failing_the_undo)
    with pytest.raises(faults.InjectedFault):
        sink.commit("b1", tokens)
    monkeypatch.setattr(ParquetSink, "_db", real_db)
    sink.abort("b1", tokens)  # recorded: must not delete it
    assert os.listdir(tmp_path / "out" / "_staging") == ["b1"]
    sink.close()
    ParquetSink(tmp_path / "out").open()  # the next start rolls forward
    assert written(tmp_path / "out") == [0, 1]


def test_two_batch_threads_with_the_same_key_write_it_once(sink, tmp_path, monkeypatch):
    """Forced interleaving: batch A has checked its keys and waits; batch B, holding the
    same key (a redelivery in a new batch), commits meanwhile. The check and the record
    must be one atomic step, so B sees A's key and drops its row."""
    from ackflow.core import key_runs

    a_checked, b_done = threading.Event(), threading.Event()
    real = key_runs.insert_if_all_new  # the check (and, for a fresh batch, the record)

    def slow_check(db, texts, count, at, batch):
        fresh = real(db, texts, count, at, batch)
        if threading.current_thread().name == "A":
            a_checked.set()
            b_done.wait(2.0)  # with the fix B is blocked until A recorded: this times out
        return fresh

    monkeypatch.setattr(key_runs, "insert_if_all_new", slow_check)
    ta, tb = stage(sink, "bA", ["k"]), stage(sink, "bB", ["k"], start=10)
    errors = []

    def commit(batch, tokens, after=None):
        try:
            sink.commit(batch, tokens)
        except Exception as e:  # noqa: BLE001
            errors.append(e)
        finally:
            if after is not None:
                after.set()

    a = threading.Thread(target=commit, args=("bA", ta), name="A")
    a.start()
    assert a_checked.wait(10)
    b = threading.Thread(target=commit, args=("bB", tb, b_done), name="B")
    b.start()
    a.join(20)
    b.join(20)
    assert not errors
    assert len(written(tmp_path / "out")) == 1


HOLDER = """
import sys, time
from ackflow.sinks import ParquetSink
s = ParquetSink(sys.argv[1]); s.open(); print("open", flush=True); time.sleep(60)
"""


def test_a_second_process_on_the_same_path_is_refused_until_the_first_dies(tmp_path):
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        os.makedirs(out / "_staging" / "live-batch")  # the first writer's batch in progress
        with pytest.raises(ConfigError, match="another process is writing"):
            ParquetSink(out).open()
        assert os.path.isdir(out / "_staging" / "live-batch")  # not cleaned away
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
    s = ParquetSink(out)
    s.open()  # a dead process holds no lock
    s.close()


def test_retention_forgets_old_keys_and_says_what_that_costs(tmp_path, monkeypatch):
    """dedupe_retention_s: keys older than that are forgotten; a message redelivered after
    that is written again (the documented trade-off), one within it is not."""
    import time as clock

    s = ParquetSink(tmp_path / "out", dedupe_retention_s=100)
    s.open()
    try:
        s.commit("b1", stage(s, "b1", ["old"]))
        real = clock.time
        monkeypatch.setattr(clock, "time", lambda: real() + 1000)  # much later
        s.commit("b2", stage(s, "b2", ["new"], start=1))
        s.commit("b3", stage(s, "b3", ["old", "new"], start=2))  # both come again
        assert written(tmp_path / "out") == [0, 1, 2]  # "old" expired: written again
    finally:
        s.close()
    with pytest.raises(ConfigError, match="dedupe_retention_s must be positive"):
        ParquetSink(tmp_path / "x", dedupe_retention_s=0)


def test_a_row_without_a_key_is_not_committed(sink, tmp_path):
    """A null row key (a transform that nulled it) cannot be recorded: the batch fails
    rather than being written with a key a redelivery could not find."""
    with pytest.raises(ValueError, match="no row key"):
        sink.commit("b1", stage(sink, "b1", ["k1", None]))
    assert written(tmp_path / "out") == []
    sink.commit("b2", stage(sink, "b2", ["k1", "k2"]))
    assert written(tmp_path / "out") == [0, 1]


@settings(max_examples=200, deadline=None, derandomize=True)
@given(keys=st.lists(st.text(), max_size=40))
def test_keys_go_into_the_manifest_exactly_as_they_are(keys):
    """The manifest keeps every key as it is (as runs): quotes, backslashes, control
    characters, characters beyond the BMP, repeats once, a key holding NUL. A key cut or
    changed would merge two rows' keys and drop one."""
    import sqlite3

    from ackflow.core import key_runs

    for extra in ([], ['q"\\\n\t\U0001f600', "\x7f\u2028"], ["a\x00b", "a\x00c"]):
        db = sqlite3.connect(":memory:")
        db.execute(key_runs.SCHEMA)
        key_runs.insert_new(db, [*keys, *extra], 1.0, "b1")
        runs = db.execute("SELECT stem, marks, first, last FROM key_runs").fetchall()
        got = [s if n < 0 else f"{s}{n}{'!' * m}" for s, m, a, b in runs for n in range(a, b + 1)]
        assert sorted(got) == sorted({*keys, *extra})


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    keys=st.lists(
        st.one_of(
            st.text(max_size=8),
            st.sampled_from(["\ud800", "a\udfffb", '"', "\\", "\u2028", "\x7f", "\U0001f600", "\x1f"]),
        ),
        max_size=10,
    )
)
def test_keys_text_reads_back_as_the_keys_in_python_and_in_sqlite(keys):
    """The keys' JSON text (msgspec writes it, json where msgspec cannot: a lone
    surrogate) reads back as the same keys, in order, in Python and in SQLite's json_each
    (what the record inserts)."""
    import json
    import sqlite3

    from ackflow.core.durable import keys_text

    text = keys_text(keys)
    assert json.loads(text) == keys
    db = sqlite3.connect(":memory:")
    # (sqlite3 cannot bind lone surrogates; json_each cuts a string at NUL)
    if not any("\ud800" <= c <= "\udfff" or c == "\x00" for k in keys for c in k):
        rows = "SELECT value FROM json_each(?) ORDER BY key"
        got = [r[0] for r in db.execute(rows, (text,))]
        assert got == keys == [r[0] for r in db.execute(rows, (json.dumps(keys, ensure_ascii=False),))]


def test_a_staged_file_no_receipt_names_is_not_shown(sink, tmp_path):
    """A task that failed after writing its file (its rows failed: their messages come
    again) leaves it in the batch's staging folder, as does one that died mid-write. The
    commit shows only the files the receipts name: shown, those rows would be written
    again by the redelivery, whose keys were never recorded."""
    tokens = stage(sink, "b1", ["a"])
    failed = sink.write_partition("b1", 1, pa.table({"n": [7], "__af_key": ["x"]}))  # no receipt
    assert failed.token is not None
    (tmp_path / "out" / "_staging" / "b1" / ".part-00002.parquet.tmp").write_bytes(b"half")
    sink.commit("b1", tokens)
    assert sorted(os.listdir(tmp_path / "out" / "batch=b1")) == ["part-00000.parquet"]
    redeliver(sink, "b2", ["x"])
    assert written(tmp_path / "out") == [0, 0]  # a (n=0) from b1, x once (n=0 in b2)


def test_an_undone_record_keeps_the_keys_another_batch_wrote(sink, tmp_path):
    """A batch holding one key written before and one new fails after its record (the
    rename): the undo takes back only the new key. Taking back the old one too would let
    the next redelivery write its row a second time."""
    sink.commit("b1", stage(sink, "b1", ["a"]))
    tokens = stage(sink, "b2", ["a", "c"], start=10)
    faults.arm("parquet.after_record", "raise")
    with pytest.raises(faults.InjectedFault):
        sink.commit("b2", tokens)
    faults.disarm()
    sink.abort("b2", tokens)
    redeliver(sink, "b3", ["a", "c"])
    assert written(tmp_path / "out") == [0, 1]  # a once (from b1), c once (from b3)


def test_close_while_a_failing_commit_drops_its_connection_releases_the_writer_lock(
    sink, tmp_path, monkeypatch
):
    """close() on another thread while a commit fails inside its transaction (found by
    review: close() saw the connection, the commit dropped it, close() then failed on
    None before releasing the writer's flock, and a restart was refused)."""
    from ackflow.sinks import parquet

    sink.commit("b1", stage(sink, "b1", ["a"]))
    tokens = stage(sink, "b2", ["b"])  # staged before fsync fails
    inside, closing = threading.Event(), threading.Event()

    def failing_fsync(path):
        inside.set()
        closing.wait(5)
        raise OSError(errno.EIO, "fsync failed")

    monkeypatch.setattr(parquet, "fsync_dir", failing_fsync)
    errors = []

    def commit():
        try:
            sink.commit("b2", tokens)
        except OSError as e:
            errors.append(e)

    t = threading.Thread(target=commit)
    t.start()
    assert inside.wait(5)
    closer = threading.Thread(target=sink.close)
    closer.start()
    time.sleep(0.3)  # close() waits on the commit's lock by now
    closing.set()
    t.join(10)
    closer.join(10)
    monkeypatch.undo()
    assert errors and "fsync failed" in str(errors[0])
    again = ParquetSink(tmp_path / "out")
    again.open()  # the writer's lock was released
    again.close()
