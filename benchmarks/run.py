"""Benchmarks: the source's limit, a hand-written peer, and ackflow, on the same data.

    .venv/bin/python -m benchmarks.run                      # 200k messages, ~2 minutes
    .venv/bin/python -m benchmarks.run --messages 50000     # quicker
    .venv/bin/python -m benchmarks.run --rss 200000,2000000 # driver memory vs stream length

Each phase runs in a fresh process (its own JVM), warmed up with one batch first,
over 100-byte JSON messages in the embedded queue:

* limit   -- lease + ack of every message in batches, no processing at all;
* peer    -- the same Spark transforms and Parquet output, batch by batch from a plain
             driver loop that leases and never settles (what a user would hand-write);
* ackflow -- end to end: pull, Spark job with receipts, Parquet commit, settlement;
* pg_limit   -- what PostgreSQL takes: the same rows parsed on the driver and written
                with COPY + INSERT ... ON CONFLICT, in batch-size transactions, no Spark;
* ackflow_pg -- ackflow end to end into the Postgres sink (upserts on the row key);
* rmq_limit  -- what RabbitMQ gives: raw pika consume with manual acks (multiple=True
                every 1000) at the same prefetch as ackflow's window, no processing;
* ackflow_rmq -- ackflow end to end from a RabbitMQ queue to Parquet;
* ackflow_delta   -- ackflow end to end into a Delta Lake table (``sinks.Delta``);
* ackflow_iceberg -- ackflow end to end into an Iceberg table (``sinks.Iceberg``, SQL
                     catalog on SQLite). Both are compared with ``ackflow`` (the Parquet
                     sink) in the same run.

The Postgres and RabbitMQ phases run against throwaway servers (``ackflow.servers``)
on loopback.
``--phases limit,peer`` picks phases.

It prints a table and writes JSON (``--out``, default benchmarks/results/latest.json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any

QUEUE = "bench"
PHASES = ("limit", "peer", "ackflow", "pg_limit", "ackflow_pg", "rmq_limit", "ackflow_rmq",
          "ackflow_delta", "ackflow_iceberg")
RATIOS = (("ackflow", "limit"), ("ackflow", "peer"), ("ackflow_pg", "pg_limit"),
          ("ackflow_rmq", "rmq_limit"), ("ackflow_delta", "ackflow"),
          ("ackflow_iceberg", "ackflow"))


def publish_rmq(url: str, queue: str, n: int) -> None:
    import pika

    from ackflow.sinks.rabbitmq import publish_confirmed

    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.queue_declare(queue, durable=True)
    ch.queue_purge(queue)
    conn.close()
    props = pika.BasicProperties(delivery_mode=2)
    for start in range(0, n, 50_000):
        msgs = [(queue, body(i), props) for i in range(start, min(n, start + 50_000))]
        if publish_confirmed(url, "", msgs):
            raise SystemExit("benchmark messages were not confirmed by the broker")


def phase_rmq_limit(url: str, n: int, prefetch: int) -> dict[str, Any]:
    import pika

    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.basic_qos(prefetch_count=min(prefetch, 65535))
    done = 0
    t0 = time.perf_counter()
    last_tag = 0
    for method, _, _ in ch.consume(QUEUE, inactivity_timeout=2):
        if method is None:
            break
        done += 1
        last_tag = method.delivery_tag
        if done % 1000 == 0:
            ch.basic_ack(last_tag, multiple=True)
        if done >= n:
            break
    ch.basic_ack(last_tag, multiple=True)
    secs = time.perf_counter() - t0
    conn.close()
    return {"messages": done, "seconds": secs, "rate": done / secs, "rss_mb": rss_mb()}


def body(i: int) -> bytes:
    """A 100-byte JSON message."""
    b = json.dumps({"id": i, "sku": f"sku-{i % 977:04d}", "qty": 1 + i % 7,
                    "price": round(1 + (i % 1000) / 10, 2), "pad": ""}, separators=(",", ":"))
    pad = max(0, 100 - len(b))
    return b.replace('"pad":""', '"pad":"' + "x" * pad + '"').encode()


def publish(db: str, n: int, queue: str = QUEUE) -> None:
    from ackflow.embedded import EmbeddedQueue

    q = EmbeddedQueue(db)
    for start in range(0, n, 50_000):
        q.publish(queue, [body(i) for i in range(start, min(n, start + 50_000))])
    q.close()


def parse(r: dict[str, Any]) -> dict[str, Any]:
    if r["qty"] <= 0:
        raise ValueError("qty must be positive")
    return {"id": r["id"], "sku": r["sku"], "qty": r["qty"], "price": r["price"]}


def rss_mb(pid: int | str = "self") -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def jvm_pid() -> int | None:
    me = str(os.getpid())
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    if f.read().split(") ", 1)[1].split()[1] == me:
                        with open(f"/proc/{p}/comm") as c:
                            if "java" in c.read():
                                return int(p)
            except (OSError, IndexError):
                continue
    return None


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))] if xs else 0.0


# -- phases (each in its own process) --------------------------------------------------------


def phase_limit(db: str, n: int, batch: int) -> dict[str, Any]:
    from ackflow.embedded import EmbeddedQueue

    q = EmbeddedQueue(db)
    q.claim_consumer(QUEUE)
    done = 0
    t0 = time.perf_counter()
    while done < n:
        leased = q.lease(QUEUE, batch, visibility_timeout=300)
        if not leased:
            break
        q.ack(QUEUE, [(m.row_id, m.deliveries) for m in leased])
        done += len(leased)
    secs = time.perf_counter() - t0
    return {"messages": done, "seconds": secs, "rate": done / secs, "rss_mb": rss_mb()}


def phase_peer(db: str, n: int, batch: int, out: str) -> dict[str, Any]:
    import pyarrow as pa
    from pyspark.sql import functions as F

    from ackflow.embedded import EmbeddedQueue
    from ackflow.spark.session import session

    spark = session("local[*]")
    q = EmbeddedQueue(db)
    schema = "id BIGINT, sku STRING, qty BIGINT, price DOUBLE"
    parallelism = spark.sparkContext.defaultParallelism

    def transform(batches):
        for b in batches:
            rows = [parse(json.loads(x)) for x in b.column("body").to_pylist()]
            yield pa.RecordBatch.from_pylist(rows, schema=pa.schema(
                [("id", pa.int64()), ("sku", pa.string()), ("qty", pa.int64()),
                 ("price", pa.float64())]))

    def one(bodies: list[bytes]) -> float:
        t = time.perf_counter()
        table = pa.table({"body": pa.array(bodies, pa.binary())})
        per = max(1, -(-len(bodies) // parallelism))
        table = pa.Table.from_batches(table.to_batches(max_chunksize=per))
        df = spark.createDataFrame(table).mapInArrow(transform, schema)
        df = df.withColumn("total", F.col("qty") * F.col("price"))
        df.write.mode("append").parquet(out)
        return time.perf_counter() - t

    one([body(i) for i in range(batch)])  # warm-up: Python workers, JIT
    latencies = []
    done = 0
    t0 = time.perf_counter()
    while done < n:
        leased = q.lease(QUEUE, batch, visibility_timeout=3600)
        if not leased:
            break
        latencies.append(one([m.body for m in leased]))
        done += len(leased)
    secs = time.perf_counter() - t0
    jvm = jvm_pid()
    return {"messages": done, "seconds": secs, "rate": done / secs, "rss_mb": rss_mb(),
            "jvm_rss_mb": rss_mb(jvm) if jvm else None,
            "batch_p50_s": pct(latencies, 0.5), "batch_p99_s": pct(latencies, 0.99)}


def phase_ackflow(db: str, n: int, batch: int, inflight: int, out: str,
                  dsn: str | None = None, url: str | None = None,
                  table: str = "parquet") -> dict[str, Any]:
    import ackflow
    from ackflow.engine import Engine
    from ackflow.sinks import Delta, Iceberg, Parquet, Postgres, Sink
    from ackflow.sources import EmbeddedQueue, RabbitMQ

    spark = ackflow.session("local[*]")

    def flow(queue: str, path: str) -> ackflow.Flow:
        sink: Sink
        if dsn is not None:
            sink = Postgres(dsn, f"bench_{queue}", create=True)
        elif table == "delta":
            sink = Delta(path)
        elif table == "iceberg":
            os.makedirs(path, exist_ok=True)
            sink = Iceberg(f"sqlite:///{path}/catalog.db", f"bench.{queue}")
        else:
            sink = Parquet(path)
        source = (RabbitMQ(url, queue, reject_to_dlx=True) if url is not None
                  else EmbeddedQueue(db, queue))
        return (ackflow.Flow(source)
                .map(parse, name="parse", schema="id BIGINT, sku STRING, qty BIGINT, price DOUBLE")
                .with_columns(total="qty * price")
                .to(sink))

    Engine(flow("warmup", out + "-warmup"), spark=spark, batch_size=batch, max_inflight=inflight,
           until_idle=0.2, handle_signals=False).run()
    peak = [0.0]

    def sample(report: Any, window: Any) -> None:
        peak[0] = max(peak[0], rss_mb())

    report = Engine(flow(QUEUE, out), spark=spark, batch_size=batch, max_inflight=inflight,
                    until_idle=0.5, handle_signals=False, progress=sample).run()
    secs = report.elapsed_s - 0.5  # the idle wait at the end is not work
    jvm = jvm_pid()
    return {"messages": report.acked, "seconds": secs, "rate": report.acked / secs,
            "rss_mb": rss_mb(), "rss_peak_mb": peak[0], "jvm_rss_mb": rss_mb(jvm) if jvm else None,
            "batch_p50_s": report.batch_p50_s, "batch_p99_s": report.batch_p99_s,
            "nacked": report.nacked, "dead_lettered": report.dead_lettered}


def pg_rows(bodies: list[bytes], keys: list[str]) -> list[tuple[Any, ...]]:
    out = []
    for b, k in zip(bodies, keys, strict=True):
        r = parse(json.loads(b))
        out.append((r["id"], r["sku"], r["qty"], r["price"], r["qty"] * r["price"], k))
    return out


PG_TABLE = "CREATE TABLE {} (id bigint, sku text, qty bigint, price double precision, " \
    "total double precision, ackflow_key text PRIMARY KEY)"


def phase_pg_limit(db: str, n: int, batch: int, dsn: str) -> dict[str, Any]:
    import psycopg

    from ackflow.embedded import EmbeddedQueue

    q = EmbeddedQueue(db)
    with psycopg.connect(dsn) as conn:
        conn.execute(PG_TABLE.format("bench_limit"))
        conn.commit()
        done = 0
        t0 = time.perf_counter()
        while done < n:
            leased = q.lease(QUEUE, batch, visibility_timeout=3600)
            if not leased:
                break
            rows = pg_rows([m.body for m in leased], [m.key for m in leased])
            with conn.cursor() as cur:
                cur.execute("CREATE TEMP TABLE IF NOT EXISTS stage (LIKE bench_limit) "
                            "ON COMMIT DELETE ROWS")
                with cur.copy("COPY stage FROM STDIN") as cp:
                    for r in rows:
                        cp.write_row(r)
                cur.execute("INSERT INTO bench_limit SELECT * FROM stage ON CONFLICT "
                            "(ackflow_key) DO UPDATE SET id = EXCLUDED.id, sku = EXCLUDED.sku, "
                            "qty = EXCLUDED.qty, price = EXCLUDED.price, total = EXCLUDED.total")
            conn.commit()
            q.ack(QUEUE, [(m.row_id, m.deliveries) for m in leased])
            done += len(leased)
        secs = time.perf_counter() - t0
    return {"messages": done, "seconds": secs, "rate": done / secs, "rss_mb": rss_mb()}


def run_phase(name: str, args: list[str]) -> dict[str, Any]:
    r = subprocess.run([sys.executable, "-m", "benchmarks.run", "--phase", name, *args],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"phase {name} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--messages", type=int, default=200_000)
    p.add_argument("--batch-size", type=int, default=25_000)
    p.add_argument("--max-inflight", type=int, default=75_000)
    p.add_argument("--out", default="benchmarks/results/latest.json")
    p.add_argument("--rss", default=None, help="comma-separated message counts: ackflow RSS only")
    p.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    p.add_argument("--db", default=None, help=argparse.SUPPRESS)
    p.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--dsn", default=None, help=argparse.SUPPRESS)
    p.add_argument("--url", default=None, help=argparse.SUPPRESS)
    p.add_argument("--phases", default=",".join(PHASES), help="comma-separated phases to run")
    a = p.parse_args()

    if a.phase:
        if a.phase == "limit":
            res = phase_limit(a.db, a.messages, a.batch_size)
        elif a.phase == "peer":
            res = phase_peer(a.db, a.messages, a.batch_size, os.path.join(a.dir, "peer"))
        elif a.phase == "pg_limit":
            res = phase_pg_limit(a.db, a.messages, a.batch_size, a.dsn)
        elif a.phase == "rmq_limit":
            res = phase_rmq_limit(a.url, a.messages, a.max_inflight)
        else:
            if a.url:
                publish_rmq(a.url, "warmup", a.batch_size)
            else:
                publish(a.db, a.batch_size, "warmup")
            table = a.phase.removeprefix("ackflow_") if a.phase in (
                "ackflow_delta", "ackflow_iceberg") else "parquet"
            res = phase_ackflow(a.db, a.messages, a.batch_size, a.max_inflight,
                                os.path.join(a.dir, a.phase), a.dsn, a.url, table)
        res["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(res))
        return

    common = ["--batch-size", str(a.batch_size), "--max-inflight", str(a.max_inflight)]
    results: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform()},
        "settings": {"messages": a.messages, "batch_size": a.batch_size,
                     "max_inflight": a.max_inflight, "message_bytes": len(body(0))},
    }
    with tempfile.TemporaryDirectory(prefix="ackflow-bench-") as tmp:
        if a.rss:
            rows = []
            for n in [int(x) for x in a.rss.split(",")]:
                db = os.path.join(tmp, f"rss-{n}.db")
                publish(db, n)
                r = run_phase("ackflow", ["--db", db, "--dir", tmp, "--messages", str(n), *common])
                rows.append({"messages": n, **r})
                os.remove(db)
            results["rss"] = rows
            base = rows[0]["max_rss_mb"]
            print(f"{'messages':>10} {'msg/s':>9} {'driver peak RSS MB':>19} {'vs first':>9}")
            for r in rows:
                print(f"{r['messages']:>10,} {r['rate']:>9,.0f} {r['max_rss_mb']:>19.0f} "
                      f"{r['max_rss_mb'] / base - 1:>+9.1%}")
        else:
            phases = [x for x in a.phases.split(",") if x]
            unknown = set(phases) - set(PHASES)
            if unknown:
                raise SystemExit(f"unknown phases {sorted(unknown)}; choose from {PHASES}")
            with contextlib.ExitStack() as stack:
                dsn = url = None
                if any("pg" in x for x in phases):
                    from ackflow.servers import PostgresServer

                    dsn = stack.enter_context(PostgresServer()).dsn
                if any("rmq" in x for x in phases):
                    from ackflow.servers import RabbitMQServer

                    url = stack.enter_context(RabbitMQServer()).url
                for name in phases:
                    db = os.path.join(tmp, f"{name}.db")
                    extra = []
                    if "rmq" in name:
                        publish_rmq(url, QUEUE, a.messages)
                        extra = ["--url", url]
                    else:
                        publish(db, a.messages)
                    if "pg" in name:
                        extra = ["--dsn", dsn]
                    results[name] = run_phase(name, ["--db", db, "--dir", tmp,
                                                     "--messages", str(a.messages), *common,
                                                     *extra])
            ratios = {}
            for a_name, b_name in RATIOS:
                if a_name in results and b_name in results:
                    ratios[f"{a_name}_vs_{b_name}"] = (results[a_name]["rate"]
                                                        / results[b_name]["rate"])
            results["ratios"] = ratios
            print(f"{'phase':<15} {'msg/s':>10} {'batch p50 s':>12} {'batch p99 s':>12} "
                  f"{'driver RSS MB':>14}")
            for name in phases:
                r = results[name]
                print(f"{name:<15} {r['rate']:>10,.0f} {r.get('batch_p50_s', 0):>12.3f} "
                      f"{r.get('batch_p99_s', 0):>12.3f} {r['max_rss_mb']:>14.0f}")
            for k, v in ratios.items():
                print(f"{k.replace('_vs_', ' / ')} = {v:.2f}")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
