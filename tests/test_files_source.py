"""The file-directory source: lines as messages, per-file committed lines, files
picked up as they appear, finished files moved to done/, dead letters beside them."""

import json
import os

import pytest

import ackflow
from ackflow.core.errors import ConfigError
from ackflow.core.ledger import Failure
from ackflow.core.policy import RetryPolicy
from ackflow.sinks import Memory
from ackflow.sources import Files
from ackflow.sources.files_state import read_state
from helpers import FAST

pytestmark = pytest.mark.spark


def drop_file(folder, name, lines):
    """Write elsewhere, then rename into the directory (atomic)."""
    tmp = os.path.join(folder, "." + name + ".tmp")
    with open(tmp, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.rename(tmp, os.path.join(folder, name))


def state(folder):
    """The state of each file instance, by file name (progress fields only)."""
    files = read_state(folder)
    return {e["name"]: {k: e[k] for k in ("committed", "dead", "done") if k in e} for e in files.values()}


def line_of(key):
    """'f.jsonl@<instance id>:3' -> ('f.jsonl', 3)."""
    name, _, rest = key.partition("@")
    return name, int(rest.rpartition(":")[2])


def check(row):
    if row.get("bad"):
        raise ValueError(f"row {row['n']} is bad")
    return row


def test_jsonl_csv_and_text_lines_become_messages(spark, tmp_path):
    for fmt, lines, expect in [
        ("jsonl", ['{"n": 1}', "", '{"n": 2}'], [{"n": 1}, {"n": 2}]),
        ("csv", ["n,city", "1,Oslo", "2,Rome"], [{"n": "1", "city": "Oslo"}, {"n": "2", "city": "Rome"}]),
        ("text", ["hello", "world"], [{"body": "hello"}, {"body": "world"}]),
    ]:
        folder = tmp_path / fmt
        folder.mkdir()
        drop_file(folder, "a.txt", lines)
        sink = Memory()
        report = ackflow.run(ackflow.Flow(Files(folder, fmt)).to(sink), spark=spark, **FAST)
        assert report.acked == len(expect)
        assert sorted(sink.rows, key=json.dumps) == sorted(expect, key=json.dumps)
        assert os.listdir(folder / "done") == ["a.txt"]  # finished: moved
        assert state(folder) == {}  # forgotten once moved


def test_poison_lines_are_dead_lettered_and_the_file_says_so(spark, tmp_path):
    drop_file(
        tmp_path,
        "orders.jsonl",
        [json.dumps({"n": i, "bad": i in (3, 7)}) for i in range(10)] + ["{not json"],
    )
    src = Files(tmp_path, policy=RetryPolicy(max_deliveries=2, backoff_s=0.05))
    sink = Memory()
    report = ackflow.run(ackflow.Flow(src).map(check, name="check").to(sink), spark=spark, **FAST)
    assert report.acked == 8 and report.dead_lettered == 3
    with open(tmp_path / "done" / "orders.jsonl.dead.jsonl") as f:
        dead = [json.loads(x) for x in f]
    assert {(d["line"], d["step"]) for d in dead} == {(4, "check"), (8, "check"), (11, "decode")}
    assert all(d["deliveries"] == 2 and d["file"] == "orders.jsonl" for d in dead)


def test_record_mode_keeps_files_and_new_files_are_picked_up(spark, tmp_path):
    drop_file(tmp_path, "1.jsonl", ['{"n": 1}'])
    src = Files(tmp_path, done="record", scan_interval_s=0.1)
    sink = Memory()
    import threading

    threading.Timer(1.0, drop_file, args=(tmp_path, "2.jsonl", ['{"n": 2}', '{"n": 3}'])).start()
    report = ackflow.run(ackflow.Flow(src).to(sink), spark=spark, **{**FAST, "until_idle": 2.5})
    assert report.acked == 3
    assert sorted(r["n"] for r in sink.rows) == [1, 2, 3]
    st = state(tmp_path)
    assert st["1.jsonl"] == {"committed": 1, "dead": 0, "done": True}
    assert st["2.jsonl"]["done"] and st["2.jsonl"]["committed"] == 2
    assert sorted(os.listdir(tmp_path)) == ["1.jsonl", "2.jsonl", "_ackflow"]
    # a second run finds nothing new to do
    again = ackflow.run(ackflow.Flow(Files(tmp_path, done="record")).to(Memory()), spark=spark, **FAST)
    assert again.pulled == 0


def test_commit_never_passes_a_line_in_flight_and_resume_rereads_it(tmp_path):
    """Driven by hand (no Spark): lines 1-5 pulled, 2-5 acked, line 1 still in flight:
    the committed line stays 0; a restart reads every line from 1 again."""
    drop_file(tmp_path, "f.jsonl", [json.dumps({"n": i}) for i in range(5)])
    src = Files(tmp_path)
    src.open()
    got = src.pull(10, 0.1)
    assert [line_of(d.key) for d in got] == [("f.jsonl", i) for i in range(1, 6)]
    src.ack(got[1:])
    assert state(tmp_path)["f.jsonl"]["committed"] == 0
    src.close()  # the process dies with line 1 in flight
    again = Files(tmp_path)
    again.open()
    assert [d.key for d in again.pull(10, 0.1)] == [d.key for d in got]  # the same identity
    again.close()


def test_failed_lines_come_back_after_the_backoff(tmp_path):
    drop_file(tmp_path, "f.jsonl", ['{"n": 1}', '{"n": 2}'])
    src = Files(tmp_path, policy=RetryPolicy(max_deliveries=3, backoff_s=0.05))
    src.open()
    first = src.pull(10, 0.1)
    src.ack(first[1:])
    src.fail([(first[0], Failure("map", "boom"))])
    assert state(tmp_path)["f.jsonl"]["committed"] == 0
    retried = src.pull(10, 1.0)
    assert [(line_of(d.key), d.delivery_count) for d in retried] == [(("f.jsonl", 1), 2)]
    src.ack(retried)
    assert os.listdir(tmp_path / "done") == ["f.jsonl"]
    src.close()


def test_not_a_directory_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="not a directory"):
        Files(tmp_path / "nope").open()
    with pytest.raises(ConfigError, match="format"):
        Files(tmp_path, "parquet")


PULLED = {}


class CountingFiles(Files):
    def pull(self, max_messages, timeout):
        got = super().pull(max_messages, timeout)
        for d in got:
            PULLED[d.key] = PULLED.get(d.key, 0) + 1
        return got


def fails_first_time(row):
    """Line 2 fails until it was delivered alone twice: in its block (a failure that
    splits the block, counted nowhere), then alone once (nacked, retried after the
    backoff)."""
    alone = [n for k, n in PULLED.items() if k.endswith(":2")]
    if row["n"] == 1 and (not alone or alone[0] < 2):
        raise ConnectionError("a transient failure")
    return row


def test_an_idle_run_waits_for_the_retries_the_source_holds(tmp_path):
    """A line failing once, with a retry's backoff (1 s) longer than until_idle (0.3 s):
    before, the run ended as idle with the line waiting in memory for its retry (its file
    never finished in that run); now it is retried, acked and its file finished."""
    from ackflow.engine.loop import Engine

    PULLED.clear()
    drop_file(tmp_path, "f.jsonl", [json.dumps({"n": i}) for i in range(3)])
    src = CountingFiles(tmp_path, policy=RetryPolicy(max_deliveries=3, backoff_s=1.0))
    sink = Memory()
    report = Engine(
        ackflow.Flow(src).map(fails_first_time, name="flaky").to(sink),
        executor="local",
        until_idle=0.3,
        batch_timeout_s=0.05,
        handle_signals=False,
    ).run()
    assert report.nacked == 1 and report.acked == 3
    assert sorted(r["n"] for r in sink.rows) == [0, 1, 2]
    assert os.path.exists(tmp_path / "done" / "f.jsonl")
