"""The Parquet sink's commit cost as its key manifest grows (issue: it must stay flat).

    .venv/bin/python -m benchmarks.manifest                          # 0, 1M, 10M keys
    .venv/bin/python -m benchmarks.manifest --keys 0,100000 --batch 5000

For each manifest size it fills ``_manifest.db`` with that many recorded row keys (a
message id + position, each key a run of its own: the manifest's worst shape), then
times ``commit`` of batches of ``--batch`` fresh rows (zero-padded ids, again one run
per key) staged by ``write_partition`` (the driver-side work of one batch:
the already-written check, the record of the batch and its keys, the rename), and one
commit of a batch that is all redelivered rows (every key found). It prints a table
and writes JSON (``--out``, default benchmarks/results/manifest.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import pyarrow as pa

from ackflow.core import key_runs
from ackflow.sinks import ParquetSink


def fill(sink: ParquetSink, n: int) -> float:
    """Record ``n`` keys (in 100k-row transactions, as many commits would have)."""
    started = time.monotonic()
    db = sink._db()
    try:
        now = time.time()
        for lo in range(0, n, 100_000):
            db.execute("BEGIN IMMEDIATE")
            keys = [f"orders-{i:012d}#{i % 3}" for i in range(lo, min(n, lo + 100_000))]
            key_runs.insert_new(db, keys, now, None)
            db.execute("COMMIT")
    finally:
        db.close()
    return time.monotonic() - started


def commit_ms(sink: ParquetSink, batch_id: str, keys: list[str]) -> float:
    rows = pa.table({"n": list(range(len(keys))), "__af_key": keys})
    tokens = [sink.write_partition(batch_id, 0, rows).token]
    started = time.perf_counter()
    sink.commit(batch_id, tokens)
    return (time.perf_counter() - started) * 1000


def measure(n: int, batch: int, rounds: int) -> dict[str, float]:
    folder = tempfile.mkdtemp(prefix="af-manifest-")
    try:
        sink = ParquetSink(os.path.join(folder, "out"))
        sink.open()
        fill_s = fill(sink, n)
        fresh = [commit_ms(sink, f"f{r}", [f"new-{r}-{i:08d}" for i in range(batch)]) for r in range(rounds)]
        seen = (
            commit_ms(sink, "again", [f"orders-{i:012d}#{i % 3}" for i in range(min(n, batch))])
            if n
            else None
        )
        size = os.path.getsize(sink.manifest) + (
            os.path.getsize(sink.manifest + "-wal") if os.path.exists(sink.manifest + "-wal") else 0
        )
        sink.close()
        return {
            "keys": n,
            "fill_s": round(fill_s, 1),
            "commit_ms_median": round(statistics.median(fresh), 1),
            "commit_ms_max": round(max(fresh), 1),
            "redelivered_commit_ms": None if seen is None else round(seen, 1),
            "manifest_mb": round(size / 1e6, 1),
        }
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keys", default="0,1000000,10000000")
    p.add_argument("--batch", type=int, default=10_000, help="rows per batch (default 10000)")
    p.add_argument("--rounds", type=int, default=5, help="fresh batches timed per size")
    p.add_argument("--out", default="benchmarks/results/manifest.json")
    args = p.parse_args()
    results = [measure(int(k), args.batch, args.rounds) for k in args.keys.split(",")]
    print(
        f"{'keys':>12} {'commit ms (median)':>19} {'max':>8} {'redelivered ms':>15} "
        f"{'manifest MB':>12} {'fill s':>8}"
    )
    for r in results:
        again = "-" if r["redelivered_commit_ms"] is None else r["redelivered_commit_ms"]
        print(
            f"{r['keys']:>12,} {r['commit_ms_median']:>19} {r['commit_ms_max']:>8} "
            f"{again:>15} {r['manifest_mb']:>12} {r['fill_s']:>8}"
        )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"batch": args.batch, "results": results}, f, indent=2)
    print(json.dumps({"batch": args.batch, "results": results}))


if __name__ == "__main__":
    main()
