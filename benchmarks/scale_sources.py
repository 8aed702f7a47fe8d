"""Sources at scale: the cost per operation must stay flat as the numbers grow ten-fold.

    .venv/bin/python -m benchmarks.scale_sources                 # the defaults below
    .venv/bin/python -m benchmarks.scale_sources --files 2000,20000 --rows 0,200000

Three phases, each bounded in size (and so in time: about a minute on two busy cores):

* **files**: N small files (2 lines each) dropped in a folder, read by the Files source
  driven directly (no Spark: what is timed is the source's own work, the scan, the state
  store and the settlement), for ``done="record"`` and ``done="move"``. Reported: the
  cost per file from ``open()`` to the last settlement, and the longest single ``pull``
  or ``ack`` call (a scan is done in bounded steps, so it never blocks settling long).
* **state**: the Files source's state store holding R recorded instances; timed: the
  record of a new instance and one settlement's progress update (each one transaction,
  fsynced), and a lookup by name. For scale, the JSON state file that d2a9abf rewrote
  whole at each of those, at the same R.
* **offsets**: an :class:`~ackflow.core.offsets.OffsetTracker` with one declared gap of
  length L (a stream resuming below its first kept offset), then a settle past it: time
  and peak memory.

Prints a table per phase and one JSON object (also written to ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import tracemalloc
from typing import Any

from ackflow.core.offsets import OffsetTracker
from ackflow.sources import Files
from ackflow.sources.files_state import FileStates, new_id

LINES = 2


def _fill(folder: str, n: int) -> None:
    for i in range(n):
        tmp = os.path.join(folder, f".f{i}.tmp")
        with open(tmp, "w") as f:
            f.write("".join(json.dumps({"f": i, "n": k}) + "\n" for k in range(LINES)))
        os.rename(tmp, os.path.join(folder, f"f{i:06d}.jsonl"))


def files_phase(n: int, done: str) -> dict[str, Any]:
    folder = tempfile.mkdtemp(prefix="af-scale-files-")
    try:
        _fill(folder, n)
        src = Files(folder, done=done, scan_interval_s=0.05)
        src.configure(max_inflight=2000, error_sink=False)
        began = time.perf_counter()
        src.open()
        opened = time.perf_counter() - began
        got, longest, calls = 0, 0.0, 0
        while got < n * LINES:
            t = time.perf_counter()
            batch = src.pull(1000, 0.05)
            t2 = time.perf_counter()
            src.ack(batch)
            t3 = time.perf_counter()
            longest = max(longest, t2 - t, t3 - t2)
            calls += 1
            got += len(batch)
            if time.perf_counter() - began > 300:
                raise RuntimeError(f"files phase: {got} of {n * LINES} lines after 300 s")
        took = time.perf_counter() - began
        src.close()
        return {"files": n, "done": done, "open_s": round(opened, 3), "total_s": round(took, 2),
                "us_per_file": round(took / n * 1e6), "longest_call_ms": round(longest * 1e3, 1),
                "pull_ack_calls": calls}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _median_ms(fn: Any, rounds: int) -> float:
    for i in range(min(5, rounds)):  # warm-up
        fn(-1 - i)
    times = []
    for i in range(rounds):
        t = time.perf_counter()
        fn(i)
        times.append((time.perf_counter() - t) * 1e3)
    return round(statistics.median(times), 3)


def state_phase(rows: int, rounds: int, json_too: bool) -> dict[str, Any]:
    folder = tempfile.mkdtemp(prefix="af-scale-state-")
    try:
        states = FileStates(os.path.join(folder, "state.db"))
        ids = []
        for lo in range(0, rows, 50_000):  # recorded in large transactions (fill only)
            with states.tx():
                for i in range(lo, min(rows, lo + 50_000)):
                    fid = new_id()
                    ids.append(fid)
                    states.insert(fid, f"f{i:07d}.jsonl", (1, i, 100, 1_700_000_000 + i), i)
                    states.set_status(fid, "done")

        if not ids:  # one row, so that a settlement updates something
            with states.tx():
                ids.append(new_id())
                states.insert(ids[0], "f.jsonl", (1, 0, 100, 1), 1)
        states.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # the fill's WAL is not timed

        def insert(i: int) -> None:
            with states.tx():
                states.insert(new_id(), f"new-{i}.jsonl", (1, 10**9 + i, 100, 1), 1)

        def progress(i: int) -> None:
            with states.tx():
                states.progress([(ids[i * 7919 % len(ids)], i, 0)])

        out: dict[str, Any] = {"rows": rows, "insert_ms": _median_ms(insert, rounds),
                               "settle_ms": _median_ms(progress, rounds),
                               "lookup_ms": _median_ms(
                                   lambda i: states.by_name(f"f{i * 7919 % max(rows, 1):07d}.jsonl"),
                                   rounds)}
        states.close()
        size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
        out["store_mb"] = round(size / 1e6, 1)
        if json_too:  # d2a9abf: the whole state.json rewritten and fsynced per change
            entries = {new_id(): {"name": f"f{i:07d}.jsonl", "fingerprint": [1, i, 100, i],
                                  "committed": 2, "dead": 0, "done": True} for i in range(rows)}
            path = os.path.join(folder, "state.json")

            def rewrite(_: int) -> None:
                with open(path + ".tmp", "w") as f:
                    json.dump({"version": 2, "files": entries}, f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(path + ".tmp", path)

            out["old_json_write_ms"] = _median_ms(rewrite, 3)
            out["old_json_mb"] = round(os.path.getsize(path) / 1e6, 1)
        return out
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def offsets_phase(length: int) -> dict[str, Any]:
    tracemalloc.start()
    t = time.perf_counter()
    tracker = OffsetTracker(start=0)
    tracker.pulled(0)
    tracker.gap(1, length + 1)
    tracker.pulled(length + 1)
    tracker.settled_many([0, length + 1])
    took = time.perf_counter() - t
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert tracker.committed == length + 2
    return {"gap": length, "us": round(took * 1e6, 1), "peak_kb": round(peak / 1024, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", default="2000,20000", help="folder sizes (default 2000,20000)")
    p.add_argument("--rows", default="0,20000,200000",
                   help="recorded instances in the state store (default 0,20000,200000)")
    p.add_argument("--gaps", default="1000,1000000,1000000000")
    p.add_argument("--rounds", type=int, default=100, help="timed writes per store size")
    p.add_argument("--out", default="benchmarks/results/scale_sources.json")
    args = p.parse_args()

    files = [files_phase(int(n), done) for n in args.files.split(",") for done in ("record", "move")]
    print(f"{'files':>8} {'done':>7} {'open s':>7} {'total s':>8} {'µs/file':>8} "
          f"{'longest call ms':>16}")
    for r in files:
        print(f"{r['files']:>8,} {r['done']:>7} {r['open_s']:>7} {r['total_s']:>8} "
              f"{r['us_per_file']:>8} {r['longest_call_ms']:>16}")

    state = [state_phase(int(n), args.rounds, json_too=int(n) > 0) for n in args.rows.split(",")]
    print(f"\n{'rows':>8} {'insert ms':>10} {'settle ms':>10} {'lookup ms':>10} {'store MB':>9} "
          f"{'old json ms':>12} {'old json MB':>12}")
    for r in state:
        print(f"{r['rows']:>8,} {r['insert_ms']:>10} {r['settle_ms']:>10} {r['lookup_ms']:>10} "
              f"{r['store_mb']:>9} {r.get('old_json_write_ms', '-'):>12} "
              f"{r.get('old_json_mb', '-'):>12}")

    offsets = [offsets_phase(int(n)) for n in args.gaps.split(",")]
    print(f"\n{'gap':>14} {'µs':>8} {'peak KiB':>9}")
    for r in offsets:
        print(f"{r['gap']:>14,} {r['us']:>8} {r['peak_kb']:>9}")

    result = {"files": files, "state": state, "offsets": offsets}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
