"""The Files source: a file's name is not its identity (daily drops reuse names), and its
bytes are untrusted. Driver-side tests, plus one end to end into a keyed sink."""

import errno
import json
import os

import pyarrow.parquet as pq
import pytest

import ackflow
from ackflow import faults
from ackflow.core.ledger import Failure
from ackflow.core.policy import RetryPolicy
from ackflow.sinks import ParquetSink
from ackflow.sources import Files
from helpers import FAST


def drop(folder, name, lines, raw=None):
    tmp = os.path.join(folder, "." + name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(raw if raw is not None else ("\n".join(lines) + "\n").encode())
    os.rename(tmp, os.path.join(folder, name))


def opened(folder, **kw):
    src = Files(folder, **kw)
    src.configure(max_inflight=100, error_sink=False)
    src.open()
    return src


def pull(src, n=100):
    return src.pull(n, 0.05)


def test_a_same_name_file_renamed_in_while_the_first_is_read_is_read_too(tmp_path):
    drop(tmp_path, "orders.jsonl", ['{"n": 1}', '{"n": 2}'])
    src = opened(tmp_path)
    first = pull(src)
    drop(tmp_path, "orders.jsonl", ['{"n": 3}'])  # tomorrow's drop replaces the name
    src.ack(first)  # the first instance finishes: before, the NEW file went to done/ unread
    src._scan()
    second = pull(src)
    assert [json.loads(d.body)["n"] for d in second] == [3]
    assert {d.key for d in second}.isdisjoint(d.key for d in first)
    src.ack(second)
    src.close()
    assert sorted(os.listdir(tmp_path / "done")) == ["orders.jsonl"]  # only the second was
    # still in the folder when it finished; the first had been replaced (nothing to move)


def test_done_never_overwrites_an_earlier_file_or_its_dead_letters(tmp_path):
    src = opened(tmp_path, policy=RetryPolicy(max_deliveries=1))
    for day in (1, 2):
        drop(tmp_path, "orders.jsonl", [json.dumps({"day": day}), "not json"])
        src._scan()
        got = pull(src)
        src.ack([d for d in got if d.body.startswith(b"{")])
        src.fail([(d, Failure("decode", f"bad on day {day}")) for d in got if not d.body.startswith(b"{")])
    src.close()
    done = sorted(os.listdir(tmp_path / "done"))
    assert len(done) == 4, done  # two files, two dead-letter files
    days = sorted(
        json.loads(open(tmp_path / "done" / n).readline())["day"]
        for n in done
        if not n.endswith(".dead.jsonl")
    )
    assert days == [1, 2]
    errors = sorted(
        json.loads(open(tmp_path / "done" / n).read())["error"] for n in done if n.endswith(".dead.jsonl")
    )
    assert errors == ["bad on day 1", "bad on day 2"]


def test_record_mode_reads_a_reused_name_again(tmp_path):
    drop(tmp_path, "orders.jsonl", ['{"n": 1}'])
    src = opened(tmp_path, done="record")
    src.ack(pull(src))
    drop(tmp_path, "orders.jsonl", ['{"n": 2}'])  # before: skipped forever
    src._scan()
    got = pull(src)
    assert [json.loads(d.body)["n"] for d in got] == [2]
    src.ack(got)
    src.close()
    again = opened(tmp_path, done="record")  # a restart finds nothing new
    assert pull(again) == []
    again.close()


def test_the_identity_survives_a_restart_and_is_written_before_any_line(tmp_path):
    drop(tmp_path, "f.jsonl", ['{"n": 1}'])
    src = opened(tmp_path)
    keys = [d.key for d in pull(src)]
    src.close()  # died with the line in flight, nothing settled
    again = opened(tmp_path)
    assert [d.key for d in pull(again)] == keys
    again.close()


def test_non_utf8_csv_lines_and_headers_fail_alone_never_in_pull(tmp_path):
    drop(tmp_path, "a.csv", [], raw=b"id,name\n1,ok\n2,\xff\xfebad\n3,a,too many\n\x00,nul\n")
    drop(tmp_path, "b.csv", [], raw=b"id,\xffname\n1,x\n")
    src = opened(tmp_path, format="csv")
    got = {d.key: d.body for d in pull(src)}  # before: UnicodeDecodeError out of pull()
    good = [json.loads(b) for b in got.values() if b.startswith(b"{")]
    assert sorted(r["id"] for r in good) == sorted(["1", "\x00"])
    assert sum(1 for b in got.values() if b.startswith(b"\xff")) == 3  # fail in "decode"
    src.close()


def test_failed_lines_waiting_for_retry_count_against_the_window(tmp_path):
    drop(tmp_path, "big.jsonl", [json.dumps({"n": i}) for i in range(500)])
    src = Files(tmp_path, policy=RetryPolicy(max_deliveries=100, backoff_s=60))
    src.configure(max_inflight=20, error_sink=False)
    src.open()
    for _ in range(50):  # a sink failing everything: each pull is failed at once
        got = pull(src, 20)
        src.fail([(d, Failure("sink", "down")) for d in got])
        held = sum(len(f.bodies) for f in src._files.values())
        assert held <= 20  # before: grew by 20 per round, to 500
    src.close()


def test_a_state_write_that_fails_loses_nothing(tmp_path):
    drop(tmp_path, "f.jsonl", ['{"n": 1}', '{"n": 2}'])
    src = opened(tmp_path)
    got = pull(src)
    faults.arm("files.before_commit", "raise")
    try:
        with pytest.raises(faults.InjectedFault):
            src.ack(got)
    finally:
        faults.disarm()
    src.close()
    again = opened(tmp_path)
    assert [d.key for d in pull(again)] == [d.key for d in got]  # read again, same keys
    again.close()


@pytest.mark.spark
def test_tomorrows_file_of_the_same_name_is_written_by_a_keyed_sink(spark, tmp_path):
    inbox, out = tmp_path / "in", tmp_path / "out"
    inbox.mkdir()
    for _day in (1, 2):
        drop(inbox, "orders.jsonl", [json.dumps({"n": i}) for i in range(3)])  # same content
        report = ackflow.run(
            ackflow.Flow(Files(inbox)).to(ParquetSink(out)), spark=spark, **{**FAST, "until_idle": 1.0}
        )
        assert report.acked == 3
    # before: the second day's keys equalled the first's, and Parquet dropped its rows
    assert sorted(pq.read_table(out).column("n").to_pylist()) == [0, 0, 1, 1, 2, 2]


def test_dead_letters_of_a_replaced_instance_and_its_successor_are_both_kept(tmp_path):
    src = opened(tmp_path, policy=RetryPolicy(max_deliveries=1))
    drop(tmp_path, "f.jsonl", ["bad one"])
    src._scan()
    first = pull(src)
    assert len(first) == 1
    drop(tmp_path, "f.jsonl", ["bad two"])  # replaces the name while the first is read
    src.fail([(d, Failure("decode", "first")) for d in first])
    src._scan()
    second = pull(src)
    src.fail([(d, Failure("decode", "second")) for d in second])
    src.close()
    dead = sorted(
        json.loads(open(tmp_path / "done" / n).read())["error"]
        for n in os.listdir(tmp_path / "done")
        if n.endswith(".dead.jsonl")
    )
    assert dead == ["first", "second"]  # neither overwrote the other


@pytest.mark.parametrize("err", [errno.EXDEV, errno.EPERM])
def test_a_file_that_cannot_be_moved_is_reported_left_and_the_source_keeps_reading(
    tmp_path, monkeypatch, caplog, err
):
    # done/ on another file system (EXDEV) or a sticky drop folder (EPERM). Before: the
    # error escaped ack, and every restart retried the move inside open() and crashed.
    real_replace = os.replace

    def replace(src, dst, *a, **kw):
        if os.path.basename(os.fspath(src)) == "a.jsonl":
            raise OSError(err, os.strerror(err), os.fspath(src))
        return real_replace(src, dst, *a, **kw)

    monkeypatch.setattr(os, "replace", replace)
    drop(tmp_path, "a.jsonl", ['{"n": 1}', '{"n": 2}'])
    src = opened(tmp_path)
    first = pull(src)
    with caplog.at_level("ERROR", logger="ackflow.sources.files"):
        src.ack(first)  # the move fails: reported, not raised
    msgs = [r.getMessage() for r in caplog.records if "cannot be moved" in r.getMessage()]
    assert msgs and "a.jsonl" in msgs[0] and os.strerror(err) in msgs[0], msgs
    assert src.status()["files_unmovable"] == 1
    assert os.strerror(err) in src.status()["unmovable"]
    assert (tmp_path / "a.jsonl").exists()  # left in place
    drop(tmp_path, "b.jsonl", ['{"n": 3}'])
    src._scan()
    second = pull(src)
    assert [json.loads(d.body)["n"] for d in second] == [3]  # a is not read again
    src.ack(second)
    src.close()
    assert os.listdir(tmp_path / "done") == ["b.jsonl"]
    caplog.clear()
    for _ in range(2):  # restarts: no crash, a is remembered (not read), its move tried once
        again = opened(tmp_path)
        assert pull(again) == []
        assert again.status()["files_unmovable"] == 1
        again._scan()
        again.close()
    tries = [r for r in caplog.records if "cannot be moved" in r.getMessage()]
    assert len(tries) == 2  # once per run, not once per scan
    monkeypatch.setattr(os, "replace", real_replace)  # fixed by the operator
    fixed = opened(tmp_path)
    assert pull(fixed) == []
    fixed.close()
    assert sorted(os.listdir(tmp_path / "done")) == ["a.jsonl", "b.jsonl"]
    assert not (tmp_path / "a.jsonl").exists()
