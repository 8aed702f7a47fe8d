"""What effectively-once costs the Delta and Iceberg sinks per batch, with 10 million rows
in the table (issue 16: measure the dedupe design at that size).

    .venv/bin/python -m benchmarks.table_keys                        # 0 and 10M rows
    .venv/bin/python -m benchmarks.table_keys --rows 0,1000000 --batch 5000

For each table size it makes the table (rows of the shape ackflow writes, with their
``ackflow_key``) and the sink's key manifest holding those keys, then times the
driver's ``commit`` of batches of ``--batch`` fresh rows staged by ``write_partition``
(the already-written check in the manifest, the table commit, the record), one commit
of a batch that is all redelivered rows (every key found: no table commit), and, for
comparison, the design the sinks did not take: an anti-join of the batch's keys with
the table's key column (reading that column of the whole table, as a MERGE on the key
without file pruning has to). Prints a table and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from ackflow.core import key_runs
from ackflow.sinks import Delta, Iceberg
from ackflow.sinks.lakehouse import KeyManifest, TableSink

SCHEMA = pa.schema(
    [("id", pa.int64()), ("sku", pa.string()), ("qty", pa.int64()), ("ackflow_key", pa.string())]
)


def rows(lo: int, hi: int) -> pa.Table:
    ids = pa.array(range(lo, hi), pa.int64())
    keys = pc.binary_join_element_wise("orders-", pc.utf8_lpad(pc.cast(ids, pa.string()), 12, "0"), "#0", "")
    return pa.table(
        {
            "id": ids,
            "sku": pc.cast(pc.remainder(ids, 977), pa.string()),
            "qty": pc.remainder(ids, 7),
            "ackflow_key": keys,
        },
        schema=SCHEMA,
    )


def make(kind: str, folder: str) -> TableSink:
    sink: TableSink
    if kind == "delta":
        sink = Delta(os.path.join(folder, "t"))
    else:
        sink = Iceberg(f"sqlite:///{folder}/catalog.db", "bench.t")
    sink.open()
    sink.prepare(SCHEMA.remove(3))
    return sink


def fill(kind: str, sink: TableSink, n: int) -> float:
    """n rows in the table (1M-row appends) and their keys in the manifest."""
    from deltalake import write_deltalake

    started = time.monotonic()
    for lo in range(0, n, 1_000_000):
        chunk = rows(lo, min(n, lo + 1_000_000))
        if kind == "delta":
            write_deltalake(sink.path, chunk, mode="append")  # type: ignore[attr-defined]
        else:
            sink._load().append(chunk.cast(sink.target))  # type: ignore[attr-defined]
        db = KeyManifest(sink.manifest_path).connect()
        try:
            db.execute("BEGIN IMMEDIATE")
            key_runs.insert_new(db, chunk.column("ackflow_key").to_pylist(), time.time(), None)
            db.execute("COMMIT")
        finally:
            db.close()
    return time.monotonic() - started


def commit_ms(sink: TableSink, batch_id: str, keys: list[str], start: int) -> float:
    data = pa.table(
        {
            "id": pa.array(range(start, start + len(keys)), pa.int64()),
            "sku": ["x"] * len(keys),
            "qty": [1] * len(keys),
            "__af_key": keys,
        }
    )
    tokens = [
        sink.write_partition(batch_id, p, data.slice(o, len(keys) // 2)).token
        for p, o in enumerate((0, len(keys) // 2))
    ]  # two partitions, as on 2 cores
    started = time.perf_counter()
    sink.commit(batch_id, tokens)
    return (time.perf_counter() - started) * 1000


def anti_join_ms(kind: str, sink: TableSink, keys: list[str]) -> float:
    started = time.perf_counter()
    if kind == "delta":
        from deltalake import DeltaTable

        column = (
            DeltaTable(sink.path)
            .to_pyarrow_table(  # type: ignore[attr-defined]
                columns=["ackflow_key"]
            )
            .column("ackflow_key")
        )
    else:
        column = (
            sink._load()
            .scan(  # type: ignore[attr-defined]
                selected_fields=("ackflow_key",)
            )
            .to_arrow()
            .column("ackflow_key")
        )
    pc.sum(pc.is_in(pa.array(keys), value_set=column.combine_chunks())).as_py()
    return (time.perf_counter() - started) * 1000


def measure(kind: str, n: int, batch: int, rounds: int) -> dict[str, Any]:
    folder = tempfile.mkdtemp(prefix=f"af-{kind}-keys-")
    try:
        sink = make(kind, folder)
        fill_s = fill(kind, sink, n)
        fresh = [
            commit_ms(sink, f"f{r}", [f"new-{r}-{i:08d}#0" for i in range(batch)], n + r * batch)
            for r in range(rounds)
        ]
        again = [f"orders-{i:012d}#0" for i in range(0, max(n, 1), max(1, n // batch))][:batch]
        if n == 0:
            again = [f"new-0-{i:08d}#0" for i in range(batch)]
        redelivered = commit_ms(sink, "again", again, 0)
        anti = anti_join_ms(kind, sink, [f"new-x-{i:08d}#0" for i in range(batch)])
        size = os.path.getsize(sink.manifest_path)
        sink.close()
        return {
            "sink": kind,
            "rows": n,
            "fill_s": fill_s,
            "manifest_mb": size / 2**20,
            "commit_fresh_ms_median": statistics.median(fresh),
            "commit_fresh_ms_max": max(fresh),
            "commit_redelivered_ms": redelivered,
            "anti_join_ms": anti,
        }
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", default="0,10000000")
    p.add_argument("--batch", type=int, default=10_000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sinks", default="delta,iceberg")
    p.add_argument("--out", default="benchmarks/results/table_keys.json")
    a = p.parse_args()
    results = [
        measure(kind, int(n), a.batch, a.rounds) for kind in a.sinks.split(",") for n in a.rows.split(",")
    ]
    print(
        f"{'sink':<8} {'rows':>11} {'commit ms (median/max)':>23} {'redelivered ms':>15} "
        f"{'anti-join ms':>13} {'manifest MB':>12}"
    )
    for r in results:
        print(
            f"{r['sink']:<8} {r['rows']:>11,} {r['commit_fresh_ms_median']:>14.0f} / "
            f"{r['commit_fresh_ms_max']:<6.0f} {r['commit_redelivered_ms']:>15.0f} "
            f"{r['anti_join_ms']:>13.0f} {r['manifest_mb']:>12.0f}"
        )
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"batch": a.batch, "results": results}, f, indent=2)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
