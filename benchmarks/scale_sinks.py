"""Per-batch commit cost of each keyed sink as batches accumulate (issue 29: "cost per
operation flat at ten times the sizes").

    .venv/bin/python -m benchmarks.scale_sinks                         # every sink, 100 / 1 000
    .venv/bin/python -m benchmarks.scale_sinks --sinks iceberg --first 1000 --total 10000

For each sink it drives the driver's own path, batch after batch, without Spark: a
batch of ``--rows`` fresh rows is staged by ``write_partition`` (what a task does) and
committed by ``commit`` (what the driver does), and the wall time of the two is that
batch's cost. It reports the median cost of batches ``1..first`` and of the last
``first`` batches of ``total``, and their ratio (flat: about 1); then ``first`` more
batches into the aged sink in turns with ``first`` into a fresh one, and the ratio of
their medians (the same load on the machine for both: flat is about 1 even when other
processes slow the whole run down). For Iceberg it also
reports the table's metadata files (JSON and Avro: count and bytes) and snapshots at the
end. Each sink stops at ``--max-seconds`` (the sizes it reached are printed). Sinks:
``iceberg``, ``delta``, ``delta_full_log`` (``keep_versions=None``: as before the log
was trimmed), ``parquet`` (its manifest), ``postgres`` (a throwaway server,
needs Debian's ``postgresql``), ``embedded`` (the embedded queue sink) and ``rabbitmq``
(a throwaway broker; each batch is one partition published with confirms on its own
connection into a queue capped at 100 000 messages). For Delta it also reports the
entries of ``_delta_log`` at the end (bounded by ``keep_versions``). Prints a table and
writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import pyarrow as pa

from ackflow.sinks.base import ROW_KEY, Sink

SCHEMA = pa.schema([("id", pa.int64()), ("sku", pa.string()), ("qty", pa.int64())])


def batch(n: int, rows: int) -> pa.Table:
    lo = n * rows
    ids = list(range(lo, lo + rows))
    return pa.table(
        {
            "id": ids,
            "sku": [f"s{i % 977}" for i in ids],
            "qty": [i % 7 for i in ids],
            ROW_KEY: [f"m{i}#0" for i in ids],
        }
    )


def make(kind: str, folder: str, dsn: str | None, amqp: str | None = None) -> Sink:
    from ackflow import sinks

    sink: Sink
    if kind == "iceberg":
        sink = sinks.Iceberg(f"sqlite:///{folder}/catalog.db", "bench.t")
    elif kind == "delta":
        sink = sinks.Delta(os.path.join(folder, "t"))
    elif kind == "delta_full_log":  # the log left to the format's 30-day retention
        sink = sinks.Delta(os.path.join(folder, "t"), keep_versions=None)
    elif kind == "parquet":
        sink = sinks.Parquet(os.path.join(folder, "p"))
    elif kind == "postgres":
        assert dsn is not None
        sink = sinks.Postgres(dsn, f"bench_{int(time.time() * 1000)}", create=True)
    elif kind == "embedded":
        sink = sinks.EmbeddedQueue(os.path.join(folder, "q.db"), "out")
    elif kind == "rabbitmq":
        assert amqp is not None
        import pika

        conn = pika.BlockingConnection(pika.URLParameters(amqp))
        ch = conn.channel()
        ch.exchange_declare("bench", "direct", durable=True)
        ch.queue_declare("bench-out", durable=True, arguments={"x-max-length": 100_000})
        ch.queue_bind("bench-out", "bench", routing_key="bench-out")
        conn.close()
        sink = sinks.RabbitMQSink(amqp, "bench", routing_key="bench-out")
    else:
        raise SystemExit(f"unknown sink {kind!r}")
    sink.open()
    sink.prepare(SCHEMA)
    return sink


def one(sink: Sink, n: int, rows: int) -> float:
    """Stage and commit batch ``n``; its wall time in seconds."""
    started = time.perf_counter()
    bid = f"b{n:07d}"
    result = sink.write_partition(bid, 0, batch(n, rows))
    assert not result.failed, result.failed
    sink.commit(bid, [result.token] if result.token else [])
    return time.perf_counter() - started


def iceberg_facts(sink: Any) -> dict[str, Any]:
    table = sink._load()
    folder = os.path.join(sink.location, "metadata")
    names = os.listdir(folder)
    size = sum(os.path.getsize(os.path.join(folder, n)) for n in names)
    current = table.current_snapshot()
    return {
        "metadata_json": sum(n.endswith(".metadata.json") for n in names),
        "avro_files": sum(n.endswith(".avro") for n in names),
        "metadata_bytes": size,
        "snapshots": len(table.snapshots()),
        "manifests_in_current": len(current.manifests(table.io)) if current else 0,
    }


def interleaved(
    kind: str, aged: Sink, done: int, first: int, rows: int, dsn: str | None, amqp: str | None
) -> dict[str, Any]:
    """``first`` more batches into the aged sink, each beside one into a fresh sink (its
    batches 1..first), in turns: both see the same load on the machine, so their ratio
    shows what the history costs even when other processes slow everything down."""
    folder = tempfile.mkdtemp(prefix=f"ackflow-scale-{kind}-fresh-")
    fresh = make(kind, folder, dsn, amqp)
    try:
        old, new = [], []
        for i in range(first):
            new.append(one(fresh, i, rows))
            old.append(one(aged, done + i, rows))
        m_old, m_new = statistics.median(old) * 1000, statistics.median(new) * 1000
        return {
            "interleaved_aged_ms": round(m_old, 2),
            "interleaved_fresh_ms": round(m_new, 2),
            "interleaved_ratio": round(m_old / m_new, 2),
        }
    finally:
        fresh.close()
        shutil.rmtree(folder, ignore_errors=True)


def measure(
    kind: str, first: int, total: int, rows: int, max_s: float, dsn: str | None, amqp: str | None = None
) -> dict[str, Any]:
    folder = tempfile.mkdtemp(prefix=f"ackflow-scale-{kind}-")
    sink = make(kind, folder, dsn, amqp)
    try:
        costs: list[float] = []
        deadline = time.monotonic() + max_s
        while len(costs) < total and time.monotonic() < deadline:
            costs.append(one(sink, len(costs), rows))
        done = len(costs)
        head, tail = costs[:first], costs[-first:] if done >= 2 * first else []
        out: dict[str, Any] = {
            "sink": kind,
            "rows_per_batch": rows,
            "batches": done,
            "planned": total,
            "first_n": len(head),
            "median_first_ms": round(statistics.median(head) * 1000, 2),
            "median_last_ms": round(statistics.median(tail) * 1000, 2) if tail else None,
            "p99_last_ms": (round(sorted(tail)[int(len(tail) * 0.99) - 1] * 1000, 2) if tail else None),
            "mean_first_ms": round(statistics.fmean(head) * 1000, 2),
            "mean_last_ms": round(statistics.fmean(tail) * 1000, 2) if tail else None,
            "max_ms": round(max(costs) * 1000, 1),
            "seconds": round(sum(costs), 1),
        }
        out["ratio"] = round(out["median_last_ms"] / out["median_first_ms"], 2) if tail else None
        if kind == "iceberg":
            out.update(iceberg_facts(sink))
        if kind.startswith("delta"):
            out["log_entries"] = len(os.listdir(os.path.join(sink.path, "_delta_log")))
        if tail:
            out.update(interleaved(kind, sink, done, first, rows, dsn, amqp))
        return out
    finally:
        sink.close()
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sinks", default="iceberg,delta,parquet,postgres,embedded,rabbitmq")
    p.add_argument("--first", type=int, default=100, help="the batches compared (N)")
    p.add_argument("--total", type=int, default=1000, help="batches in all (10 N)")
    p.add_argument("--rows", type=int, default=10, help="rows per batch")
    p.add_argument("--max-seconds", type=float, default=600.0, help="per sink")
    p.add_argument("--out", default=None, help="write the JSON here too")
    a = p.parse_args(argv)
    kinds = [k.strip() for k in a.sinks.split(",") if k.strip()]
    server: Any = None
    broker: Any = None
    dsn = amqp = None
    results = []
    try:
        if "postgres" in kinds:
            from ackflow.servers import PostgresServer

            server = PostgresServer().start()
            dsn = server.dsn
        if "rabbitmq" in kinds:
            from ackflow.servers import RabbitMQServer

            broker = RabbitMQServer().start()
            amqp = broker.url
        for kind in kinds:
            r = measure(kind, a.first, a.total, a.rows, a.max_seconds, dsn, amqp)
            results.append(r)
            print(json.dumps(r), flush=True)
    finally:
        if server is not None:
            server.close()
        if broker is not None:
            broker.close()
    head = (
        f"{'sink':<9} {'batches':>8} {'median 1..N ms':>15} {'median last N ms':>17} "
        f"{'ratio':>6} {'mean 1..N':>10} {'mean last N':>12} {'p99 last N':>11} "
        f"{'aged/fresh in turns':>20}"
    )
    print("\n" + head)
    fmt: Callable[[Any], str] = lambda v: "-" if v is None else str(v)  # noqa: E731
    for r in results:
        print(
            f"{r['sink']:<9} {r['batches']:>8} {r['median_first_ms']:>15} "
            f"{fmt(r['median_last_ms']):>17} {fmt(r['ratio']):>6} {r['mean_first_ms']:>10} "
            f"{fmt(r['mean_last_ms']):>12} {fmt(r['p99_last_ms']):>11} "
            f"{fmt(r.get('interleaved_ratio')):>20}"
        )
    report = {"first": a.first, "total": a.total, "rows": a.rows, "results": results}
    print(json.dumps(report))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
