"""The Files source at scale and in odd states: thousands of small files, a restart in
the middle with lines in flight, done="record" and done="move". Every line is settled,
and read twice only if it was in flight at the restart (with the same key). Driven by
hand (no Spark): what is measured is the source's own cost (scan, state store, settle).

Before (d2a9abf) each new file rewrote and fsynced the whole state.json: 1,000 new files
took 11 s to open and 27 s to read here, 2,000 took 50 s."""

import json
import os
import time

import pytest

from ackflow.sources import Files
from ackflow.sources.files_state import read_state

FILES = int(os.environ.get("ACKFLOW_SCALE_FILES", "3000"))
LINES = 2


def fill(folder, n):
    for i in range(n):
        tmp = folder / f".f{i}.tmp"
        tmp.write_text("".join(json.dumps({"f": i, "n": k}) + "\n" for k in range(LINES)))
        os.rename(tmp, folder / f"f{i:05d}.jsonl")


def start(folder, done):
    src = Files(folder, done=done, scan_interval_s=0.05)
    src.configure(max_inflight=2000, error_sink=False)
    src.open()
    return src


@pytest.mark.parametrize("done", ["record", "move"])
def test_thousands_of_files_with_a_restart_in_the_middle(tmp_path, done):
    fill(tmp_path, FILES)
    total = FILES * LINES
    began = time.monotonic()
    src = start(tmp_path, done)
    acked: dict[str, int] = {}  # key -> times settled
    in_flight_at_restart: list[str] = []
    while not in_flight_at_restart:  # the first half, then a crash
        batch = src.pull(500, 0.05)
        settle = batch
        if len(acked) + len(batch) >= total // 2:  # the last 50 are in flight at the crash
            settle, in_flight_at_restart = batch[:-50], [d.key for d in batch[-50:]]
        src.ack(settle)
        for d in settle:
            acked[d.key] = acked.get(d.key, 0) + 1
        assert time.monotonic() - began < 60, "first half too slow"
    src.close()  # died with the last 50 in flight
    src = start(tmp_path, done)
    deadline = time.monotonic() + 60
    while len(acked) < total:
        batch = src.pull(500, 0.05)
        src.ack(batch)
        for d in batch:
            acked[d.key] = acked.get(d.key, 0) + 1
        assert time.monotonic() < deadline, f"{len(acked)} of {total} lines after 60 s"
    src.close()
    took = time.monotonic() - began
    assert len(acked) == total
    twice = sorted(k for k, n in acked.items() if n > 1)
    assert set(twice) <= set(in_flight_at_restart)  # only what was in flight came again
    assert all(n <= 2 for n in acked.values())
    left = read_state(tmp_path)
    if done == "record":
        assert len(left) == FILES and all(e["done"] for e in left.values())
        # a third start reads nothing and keeps every row
        again = start(tmp_path, done)
        assert again.pull(500, 0.2) == []
        again.close()
    else:
        assert left == {} and len(os.listdir(tmp_path / "done")) == FILES
    assert took < 30, f"{FILES} files took {took:.1f} s"  # measured ~2 s (d2a9abf: minutes)
