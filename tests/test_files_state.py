"""The Files source's state store: per-row updates, retention of gone files, a file that
arrives again is a new arrival, an old state.json is taken over, scans are bounded.
Driven by hand (no Spark)."""

import json
import logging
import os

import pytest

from ackflow.core.errors import ConfigError
from ackflow.sources import Files
from ackflow.sources import files as files_mod
from ackflow.sources.files_state import read_state


def drop(folder, name, lines):
    tmp = os.path.join(folder, "." + name + ".tmp")
    with open(tmp, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.rename(tmp, os.path.join(folder, name))


def opened(folder, **kw):
    src = Files(folder, **kw)
    src.configure(max_inflight=1000, error_sink=False)
    src.open()
    return src


def read_all(src, rounds=200):
    """Pull and ack until nothing comes (bounded)."""
    got = []
    for _ in range(rounds):
        batch = src.pull(500, 0.02)
        if not batch:
            src._scan()
            batch = src.pull(500, 0.02)
            if not batch:
                return got
        src.ack(batch)
        got.extend(batch)
    raise AssertionError("still reading after 200 rounds")


def by_name(folder):
    return {e["name"]: e for e in read_state(folder).values()}


def test_record_a_file_dropped_in_again_on_the_same_inode_is_read_again(tmp_path):
    # cp -p / rsync -a / tar x re-create a deleted file with its size and mtime; the file
    # system may reuse the inode. Here the very inode comes back (renamed out and in).
    # Before: the fingerprint matched the done entry and the file was skipped silently.
    drop(tmp_path, "export.jsonl", ['{"n": 1}', '{"n": 2}'])
    src = opened(tmp_path, done="record")
    first = read_all(src)
    assert len(first) == 2 and by_name(tmp_path)["export.jsonl"]["done"]
    ino = os.stat(tmp_path / "export.jsonl").st_ino
    os.rename(tmp_path / "export.jsonl", tmp_path / ".away")
    src._scan()  # the pass notices the absence: the done entry is forgotten
    assert read_state(tmp_path) == {}
    os.rename(tmp_path / ".away", tmp_path / "export.jsonl")
    assert os.stat(tmp_path / "export.jsonl").st_ino == ino
    again = read_all(src)
    assert [json.loads(d.body)["n"] for d in again] == [1, 2]
    assert {d.key for d in again}.isdisjoint(d.key for d in first)  # a new arrival
    src.close()
    restarted = opened(tmp_path, done="record")  # and only once
    assert read_all(restarted) == []
    restarted.close()


def test_record_a_file_recreated_between_two_scans_is_read_again_and_said(tmp_path, caplog):
    # The window the absence cannot cover (deleted and re-created between two passes):
    # the same inode, size and mtime, but the ctime (which cp -p cannot set) differs.
    drop(tmp_path, "export.jsonl", ['{"n": 1}'])
    src = opened(tmp_path, done="record")
    first = read_all(src)
    st = os.stat(tmp_path / "export.jsonl")
    with open(tmp_path / "export.jsonl", "w") as f:  # the same bytes again, in place
        f.write('{"n": 1}\n')
    os.utime(tmp_path / "export.jsonl", ns=(st.st_atime_ns, st.st_mtime_ns))
    now = os.stat(tmp_path / "export.jsonl")
    assert (now.st_ino, now.st_size, now.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)
    with caplog.at_level(logging.WARNING, logger="ackflow.sources.files"):
        again = read_all(src)
    assert [json.loads(d.body)["n"] for d in again] == [1]
    assert again[0].key != first[0].key
    assert any("another ctime" in r.getMessage() and "export.jsonl" in r.getMessage() for r in caplog.records)
    src.close()


def test_retention_forgets_gone_files_and_keeps_present_ones(tmp_path, caplog):
    for i in range(3):
        drop(tmp_path, f"f{i}.jsonl", ['{"n": 1}'])
    src = opened(tmp_path, done="record")
    read_all(src)
    assert sorted(by_name(tmp_path)) == ["f0.jsonl", "f1.jsonl", "f2.jsonl"]
    os.remove(tmp_path / "f1.jsonl")
    src._scan()
    assert sorted(by_name(tmp_path)) == ["f0.jsonl", "f2.jsonl"]  # before: kept forever
    src.close()
    # an unfinished instance whose file is gone is forgotten too, and said
    drop(tmp_path, "half.jsonl", ['{"n": 1}', '{"n": 2}'])
    src = opened(tmp_path, done="record")
    got = src.pull(1, 0.05)
    src.ack(got)
    src.close()
    assert by_name(tmp_path)["half.jsonl"]["committed"] == 1
    os.remove(tmp_path / "half.jsonl")
    with caplog.at_level(logging.WARNING, logger="ackflow.sources.files"):
        src = opened(tmp_path, done="record")
    assert "half.jsonl" not in by_name(tmp_path)
    assert any("before it was finished" in r.getMessage() for r in caplog.records)
    src.close()


def test_an_old_state_json_is_taken_over_with_its_progress(tmp_path):
    drop(tmp_path, "half.jsonl", [json.dumps({"n": i}) for i in range(5)])
    drop(tmp_path, "done.jsonl", ['{"n": 9}'])
    drop(tmp_path, "older.jsonl", ['{"n": 7}', '{"n": 8}'])
    fp = {
        n: (lambda st: [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns])(os.stat(tmp_path / n))
        for n in ("half.jsonl", "done.jsonl")
    }
    os.makedirs(tmp_path / "_ackflow")
    with open(tmp_path / "_ackflow" / "state.json", "w") as f:  # as d2a9abf wrote it
        json.dump(
            {
                "version": 2,
                "files": {
                    "aaaaaaaaaaaaaaaa": {
                        "name": "half.jsonl",
                        "fingerprint": fp["half.jsonl"],
                        "committed": 3,
                        "dead": 1,
                    },
                    "bbbbbbbbbbbbbbbb": {
                        "name": "done.jsonl",
                        "fingerprint": fp["done.jsonl"],
                        "committed": 1,
                        "dead": 0,
                        "done": True,
                    },
                    "older.jsonl": {"committed": 1, "dead": 0},  # before instance ids existed
                },
            },
            f,
        )
    src = opened(tmp_path, done="record")
    got = read_all(src)
    keys = sorted(d.key for d in got)
    assert keys[:2] == ["half.jsonl@aaaaaaaaaaaaaaaa:4", "half.jsonl@aaaaaaaaaaaaaaaa:5"]
    assert [json.loads(d.body)["n"] for d in got if d.key.startswith("older")] == [8]
    assert len(got) == 3  # done.jsonl is not read again
    src.close()
    assert not (tmp_path / "_ackflow" / "state.json").exists()
    assert (tmp_path / "_ackflow" / "state.json.migrated").exists()
    st = by_name(tmp_path)
    assert st["half.jsonl"]["committed"] == 5 and st["half.jsonl"]["dead"] == 1
    assert all(e["done"] for e in st.values())


def test_scanning_is_bounded_per_step_and_in_open_files(tmp_path, monkeypatch):
    monkeypatch.setattr(files_mod, "SCAN_CHUNK", 7)
    monkeypatch.setattr(files_mod, "MAX_OPEN", 5)
    for i in range(40):
        drop(tmp_path, f"f{i:02d}.jsonl", [json.dumps({"f": i, "n": n}) for n in range(3)])
    src = Files(tmp_path, scan_interval_s=0)
    src.configure(max_inflight=1000, error_sink=False)
    src.open()
    assert len(src._files) == 5  # a pass waits for open files to finish
    got, most_open = [], 0
    for _ in range(400):
        batch = src.pull(4, 0.01)
        most_open = max(most_open, len(src._files))
        src.ack(batch)
        got.extend(batch)
        if len(got) == 120:
            break
    assert most_open <= 5
    assert sorted((json.loads(d.body)["f"], json.loads(d.body)["n"]) for d in got) == [
        (i, n) for i in range(40) for n in range(3)
    ]
    src.close()
    assert len(os.listdir(tmp_path / "done")) == 40
    assert read_state(tmp_path) == {}  # moved files leave no row


def test_a_scan_interval_that_would_never_scan_is_refused(tmp_path):
    for bad in (float("nan"), float("inf"), -1):  # before: nan never scanned again
        with pytest.raises(ConfigError, match="scan_interval_s must be >= 0 seconds"):
            Files(tmp_path, scan_interval_s=bad)
