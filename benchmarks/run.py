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
* ackflow_rmq -- ackflow end to end from a RabbitMQ classic queue to Parquet;
* rmq_limit_quorum, ackflow_rmq_quorum -- the same on a quorum queue;
* ss_files   -- Spark Structured Streaming on its own ground: ``readStream.json`` over
                JSON-lines files, the same Python function as an Arrow UDF
                (``mapInArrow``), the same SQL, ``writeStream.parquet`` with a checkpoint,
                ``trigger(availableNow=True)``;
* ackflow_files -- ackflow's Files source over the same files into Parquet;
* ackflow_delta   -- ackflow end to end into a Delta Lake table (``sinks.Delta``);
* ackflow_iceberg -- ackflow end to end into an Iceberg table (``sinks.Iceberg``, SQL
                     catalog on SQLite). Both are compared with ``ackflow`` (the Parquet
                     sink) in the same run;
* latency    -- RabbitMQ at a low rate (``--latency-rate``, 200 msg/s, for
                ``--latency-seconds``) with the engine's default settings: publish-to-ack
                latency p50 / p99 (each body carries its publish time).

Every phase reports the driver process's own CPU per message (``getrusage`` of the
Python driver: the JVM and the Python workers are other processes and not counted),
and Spark's (the JVM and its Python workers, from ``/proc``), split into the JVM's own
and its Python workers'.

``--sweep 5000,10000,25000,50000`` runs ackflow_rmq at each batch size (window three
batches) beside one rmq_limit and prints the spread; ``--repeat 3`` runs every phase
three times and reports the median run (each run's rate is kept in the JSON).

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
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

QUEUE = "bench"
PHASES = ("limit", "peer", "ackflow", "pg_limit", "ackflow_pg", "rmq_limit", "ackflow_rmq",
          "rmq_limit_quorum", "ackflow_rmq_quorum", "ss_files", "ackflow_files", "latency",
          "ackflow_delta", "ackflow_iceberg", "shape_fixed", "shape_evolving")
RATIOS = (("shape_evolving", "shape_fixed"), ("ackflow", "limit"), ("ackflow", "peer"),
          ("ackflow_pg", "pg_limit"),
          ("ackflow_rmq", "rmq_limit"), ("ackflow_rmq_quorum", "rmq_limit_quorum"),
          ("ackflow_files", "ss_files"), ("ackflow_delta", "ackflow"),
          ("ackflow_iceberg", "ackflow"))
FIELDS = "id BIGINT, sku STRING, qty BIGINT, price DOUBLE"
#: How long a measured run waits idle before it ends (not counted as its time). A quorum
#: queue with 200 000 messages sends the first delivery of a 65 535 prefetch after ~1.3 s
#: (measured): a shorter wait ended the run before any message came (acked 0).
IDLE_S = 3.0


def cpu_s() -> float:
    """This process's CPU seconds (all its threads; child processes are not counted)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def tree_cpu(pid: int | None) -> float:
    """CPU seconds of process ``pid`` and its live descendants (and the children it
    waited for): the JVM with its Python workers, or the broker."""
    if pid is None:
        return 0.0
    tick = os.sysconf("SC_CLK_TCK")
    kids: dict[int, list[int]] = {}
    cpu: dict[int, float] = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    fields = f.read().rsplit(") ", 1)[1].split()
            except (OSError, IndexError):
                continue
            kids.setdefault(int(fields[1]), []).append(int(p))
            cpu[int(p)] = sum(int(x) for x in fields[11:15]) / tick
    total, todo = 0.0, [pid]
    while todo:
        q = todo.pop()
        total += cpu.get(q, 0.0)
        todo += kids.get(q, [])
    return total


def own_cpu(pid: int | None) -> float:
    """CPU seconds of process ``pid`` alone (the JVM without its Python workers)."""
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(") ", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def queue_args(qtype: str) -> dict[str, Any]:
    """Benchmark queues have a dead-letter exchange (ackflow's reject_to_dlx checks it)."""
    return {"x-queue-type": qtype, "x-dead-letter-exchange": "bench-dlx"}


def declare_queue(ch: Any, queue: str, qtype: str) -> None:
    """The queue and its dead-letter exchange, bound to a queue (reject_to_dlx proves at
    start that dead letters reach one)."""
    ch.exchange_declare("bench-dlx", "fanout", durable=True)
    ch.queue_declare("bench-dead", durable=True, arguments={"x-max-length": 100_000})
    ch.queue_bind("bench-dead", "bench-dlx")
    ch.queue_declare(queue, durable=True, arguments=queue_args(qtype))


def rmq_queue(phase: str) -> str:
    return QUEUE + ("-quorum" if phase.endswith("quorum") else "")


def publish_rmq(url: str, queue: str, n: int, qtype: str = "classic") -> None:
    import pika

    from ackflow.sinks.rabbitmq import publish_confirmed

    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    declare_queue(ch, queue, qtype)
    ch.queue_purge(queue)
    conn.close()
    props = pika.BasicProperties(delivery_mode=2)
    for start in range(0, n, 50_000):
        msgs = [(queue, body(i), props) for i in range(start, min(n, start + 50_000))]
        if publish_confirmed(url, "", msgs):
            raise SystemExit("benchmark messages were not confirmed by the broker")


def phase_rmq_limit(url: str, queue: str, n: int, prefetch: int,
                    broker: int | None = None) -> dict[str, Any]:
    import pika

    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.basic_qos(prefetch_count=min(prefetch, 65535))
    done = 0
    t0 = time.perf_counter()
    c0, b0 = cpu_s(), tree_cpu(broker)
    last_tag = 0
    for method, _, _ in ch.consume(queue, inactivity_timeout=2):
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
    cpu, broker_cpu = cpu_s() - c0, tree_cpu(broker) - b0
    conn.close()
    return {"messages": done, "seconds": secs, "rate": done / secs, "rss_mb": rss_mb(),
            "driver_cpu_us": cpu / max(1, done) * 1e6,
            **({"broker_cpu_us": broker_cpu / max(1, done) * 1e6} if broker else {})}


def body(i: int) -> bytes:
    """A 100-byte JSON message."""
    b = json.dumps({"id": i, "sku": f"sku-{i % 977:04d}", "qty": 1 + i % 7,
                    "price": round(1 + (i % 1000) / 10, 2), "pad": ""}, separators=(",", ":"))
    pad = max(0, 100 - len(b))
    return b.replace('"pad":""', '"pad":"' + "x" * pad + '"').encode()


def publish(db: str, n: int, queue: str = QUEUE, make: Any = None) -> None:
    from ackflow.embedded import EmbeddedQueue

    make = make or body
    q = EmbeddedQueue(db)
    for start in range(0, n, 50_000):
        q.publish(queue, [make(i) for i in range(start, min(n, start + 50_000))])
    q.close()


#: the shape phases: a new field every SHAPE_EVERY messages (evolving) or one field
SHAPE_EVERY = 10_000


def shaped(evolving: bool, n: int = 200_000) -> Any:
    """A message maker: ``body(i)`` plus one field ``f<k>``. Evolving: k changes every
    :data:`SHAPE_EVERY` messages, so a new column arrives that often. Fixed: k cycles
    over the same names (``i % (n / SHAPE_EVERY)``), so every column is in the first
    batch and the columns never change. Both end with the same columns, as sparse,
    from messages of the same size: the difference is the cost of evolving."""
    kinds = max(1, n // SHAPE_EVERY)

    def make(i: int) -> bytes:
        k = i // SHAPE_EVERY if evolving else i % kinds
        return body(i)[:-1] + f',"f{k}":{i}}}'.encode()
    return make


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


def measured(done: int, secs: float, cpu: float, **extra: Any) -> dict[str, Any]:
    return {"messages": done, "seconds": secs, "rate": done / secs if secs else 0.0,
            "rss_mb": rss_mb(), "driver_cpu_us": cpu / max(1, done) * 1e6, **extra}


def phase_limit(db: str, n: int, batch: int) -> dict[str, Any]:
    from ackflow.embedded import EmbeddedQueue

    q = EmbeddedQueue(db)
    q.claim_consumer(QUEUE)
    done = 0
    t0, c0 = time.perf_counter(), cpu_s()
    while done < n:
        leased = q.lease(QUEUE, batch, visibility_timeout=300)
        if not leased:
            break
        q.ack(QUEUE, [(m.row_id, m.deliveries) for m in leased])
        done += len(leased)
    return measured(done, time.perf_counter() - t0, cpu_s() - c0)


def arrow_parse(batches: Any) -> Any:
    """``parse`` over Arrow batches of JSON bodies (the peer's Python step)."""
    import pyarrow as pa

    schema = pa.schema([("id", pa.int64()), ("sku", pa.string()), ("qty", pa.int64()),
                        ("price", pa.float64())])
    for b in batches:
        rows = [parse(json.loads(x)) for x in b.column("body").to_pylist()]
        yield pa.RecordBatch.from_pylist(rows, schema=schema)


def arrow_parse_rows(batches: Any) -> Any:
    """``parse`` over Arrow batches of already-parsed rows (Structured Streaming's UDF)."""
    import pyarrow as pa

    schema = pa.schema([("id", pa.int64()), ("sku", pa.string()), ("qty", pa.int64()),
                        ("price", pa.float64())])
    for b in batches:
        yield pa.RecordBatch.from_pylist([parse(r) for r in b.to_pylist()], schema=schema)


def phase_peer(db: str, n: int, batch: int, out: str) -> dict[str, Any]:
    import pyarrow as pa
    from pyspark.sql import functions as F

    from ackflow.embedded import EmbeddedQueue
    from ackflow.spark.session import session

    spark = session("local[*]")
    q = EmbeddedQueue(db)
    parallelism = spark.sparkContext.defaultParallelism

    def one(bodies: list[bytes]) -> float:
        t = time.perf_counter()
        table = pa.table({"body": pa.array(bodies, pa.binary())})
        per = max(1, -(-len(bodies) // parallelism))
        table = pa.Table.from_batches(table.to_batches(max_chunksize=per))
        df = spark.createDataFrame(table).mapInArrow(arrow_parse, FIELDS)
        df = df.withColumn("total", F.col("qty") * F.col("price"))
        df.write.mode("append").parquet(out)
        return time.perf_counter() - t

    one([body(i) for i in range(batch)])  # warm-up: Python workers, JIT
    latencies = []
    done = 0
    jvm = jvm_pid()
    t0, c0, s0, j0 = time.perf_counter(), cpu_s(), tree_cpu(jvm), own_cpu(jvm)
    while done < n:
        leased = q.lease(QUEUE, batch, visibility_timeout=3600)
        if not leased:
            break
        latencies.append(one([m.body for m in leased]))
        done += len(leased)
    secs, cpu = time.perf_counter() - t0, cpu_s() - c0
    return measured(done, secs, cpu, jvm_rss_mb=rss_mb(jvm) if jvm else None,
                    spark_cpu_us=(tree_cpu(jvm) - s0) / max(1, done) * 1e6,
                    jvm_cpu_us=(own_cpu(jvm) - j0) / max(1, done) * 1e6,
                    batch_p50_s=pct(latencies, 0.5), batch_p99_s=pct(latencies, 0.99))


def write_files(directory: str, n: int, per_file: int = 20_000) -> None:
    """The messages as JSON-lines files (written aside, then renamed in)."""
    os.makedirs(directory, exist_ok=True)
    for k, start in enumerate(range(0, n, per_file)):
        tmp = os.path.join(directory, f".part-{k:05d}.jsonl")
        with open(tmp, "wb") as f:
            f.write(b"\n".join(body(i) for i in range(start, min(n, start + per_file))) + b"\n")
        os.rename(tmp, os.path.join(directory, f"part-{k:05d}.jsonl"))


def phase_ss_files(src: str, n: int, batch: int, out: str) -> dict[str, Any]:
    """Structured Streaming over the same files: its file source, the same Python function
    as an Arrow UDF, the same SQL, its Parquet sink with a checkpoint."""
    from pyspark.sql import functions as F

    from ackflow.spark.session import session

    spark = session("local[*]")
    schema = FIELDS + ", pad STRING"

    def run(directory: str, target: str) -> float:
        t = time.perf_counter()
        df = (spark.readStream.schema(schema).option("maxFilesPerTrigger", max(
            1, batch // 20_000)).json(directory).drop("pad")
              .mapInArrow(arrow_parse_rows, FIELDS)
              .withColumn("total", F.col("qty") * F.col("price")))
        q = (df.writeStream.format("parquet").option("path", target)
             .option("checkpointLocation", target + "-checkpoint")
             .trigger(availableNow=True).start())
        q.awaitTermination()
        return time.perf_counter() - t

    warm = src + "-warmup"
    write_files(warm, batch)
    run(warm, out + "-warmup")
    jvm = jvm_pid()
    t0, c0, s0, j0 = time.perf_counter(), cpu_s(), tree_cpu(jvm), own_cpu(jvm)
    secs = run(src, out)
    cpu, spark_cpu, jvm_cpu = cpu_s() - c0, tree_cpu(jvm) - s0, own_cpu(jvm) - j0
    rows = spark.read.parquet(out).count()
    if rows != n:
        raise SystemExit(f"ss_files wrote {rows} rows of {n}")
    assert time.perf_counter() - t0 >= secs
    return measured(n, secs, cpu, spark_cpu_us=spark_cpu / n * 1e6,
                    jvm_cpu_us=jvm_cpu / n * 1e6)


def phase_ackflow(db: str, n: int, batch: int, inflight: int, out: str, *,
                  dsn: str | None = None, url: str | None = None, queue: str = QUEUE,
                  files: str | None = None, table: str = "parquet",
                  broker: int | None = None, shape: bool = False) -> dict[str, Any]:
    import ackflow
    from ackflow.engine import Engine
    from ackflow.sinks import Delta, Iceberg, Parquet, Postgres, Sink
    from ackflow.sources import EmbeddedQueue, Files, RabbitMQ

    spark = ackflow.session("local[*]")

    def flow(queue: str, path: str, files: str | None) -> ackflow.Flow:
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
        if files is not None:
            source: Any = Files(files, "jsonl", done="record")
        elif url is not None:
            source = RabbitMQ(url, queue, reject_to_dlx=True)
        else:
            source = EmbeddedQueue(db, queue)
        if shape:  # the columns are inferred, stored and evolved (issue 30)
            return ackflow.Flow(source).map(lambda r: r, name="record").to(sink)
        return (ackflow.Flow(source)
                .map(parse, name="parse", schema=FIELDS)
                .with_columns(total="qty * price")
                .to(sink))

    warm = files + "-warmup" if files else None
    if warm:
        write_files(warm, batch)
    Engine(flow("warmup", out + "-warmup", warm), spark=spark, batch_size=batch,
           max_inflight=inflight, until_idle=0.2, handle_signals=False).run()
    peak = [0.0]

    def sample(report: Any, window: Any) -> None:
        peak[0] = max(peak[0], rss_mb())

    jvm = jvm_pid()
    c0, s0, j0, b0 = cpu_s(), tree_cpu(jvm), own_cpu(jvm), tree_cpu(broker)
    report = Engine(flow(queue, out, files), spark=spark, batch_size=batch,
                    max_inflight=inflight, until_idle=IDLE_S, handle_signals=False,
                    progress=sample).run()
    cpu, spark_cpu, jvm_cpu = cpu_s() - c0, tree_cpu(jvm) - s0, own_cpu(jvm) - j0
    broker_cpu = tree_cpu(broker) - b0
    secs = report.elapsed_s - IDLE_S  # the idle wait at the end is not work
    if report.acked != n:
        raise SystemExit(f"ackflow acked {report.acked} of {n} messages (pulled "
                         f"{report.pulled}, nacked {report.nacked}, dead-lettered "
                         f"{report.dead_lettered}, redelivered {report.redelivered}, "
                         f"{report.elapsed_s:.1f} s)")
    return measured(report.acked, secs, cpu, rss_peak_mb=peak[0],
                    spark_cpu_us=spark_cpu / max(1, report.acked) * 1e6,
                    jvm_cpu_us=jvm_cpu / max(1, report.acked) * 1e6,
                    jvm_rss_mb=rss_mb(jvm) if jvm else None,
                    batch_p50_s=report.batch_p50_s, batch_p99_s=report.batch_p99_s,
                    nacked=report.nacked, dead_lettered=report.dead_lettered,
                    batches=report.batches, jobs=report.jobs,
                    schema_versions=sum(report.schema_versions.values()),
                    **({"broker_cpu_us": broker_cpu / max(1, report.acked) * 1e6}
                       if broker else {}))


def phase_latency(url: str, rate: float, seconds: float, out: str) -> dict[str, Any]:
    """Publish ``rate`` msg/s for ``seconds`` while ackflow runs with its default settings;
    each body carries its publish time; the latency is taken when the broker is sent the
    message's ack."""
    import threading

    import pika

    import ackflow
    from ackflow.engine import Engine
    from ackflow.sinks import Parquet
    from ackflow.sources import RabbitMQ

    queue = "latency"
    conn = pika.BlockingConnection(pika.URLParameters(url))
    declare_queue(conn.channel(), queue, "classic")
    conn.close()
    latencies: list[float] = []

    class Timed(RabbitMQ):  # type: ignore[misc,valid-type]
        def _ack_now(self, deliveries: Any) -> Any:
            stale = super()._ack_now(deliveries)
            now = time.time()
            latencies.extend(now - json.loads(d.body)["ts"] for d in deliveries)
            return stale

    def timed_parse(r: dict[str, Any]) -> dict[str, Any]:
        return parse(r["m"])

    spark = ackflow.session("local[*]")
    engine = Engine(ackflow.Flow(Timed(url, queue, reject_to_dlx=True))
                    .map(timed_parse, name="parse", schema=FIELDS)
                    .with_columns(total="qty * price").to(Parquet(out)),
                    spark=spark, handle_signals=False)
    published = [0]

    def publisher() -> None:
        c = pika.BlockingConnection(pika.URLParameters(url))
        ch = c.channel()
        props = pika.BasicProperties(delivery_mode=2)
        warm_until = time.monotonic() + 15  # Spark's first jobs are not low-load latency
        start = time.monotonic()
        i = 0
        while time.monotonic() - start < seconds + 15:
            due = start + i / rate
            pause = due - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            ts = time.time() if time.monotonic() >= warm_until else -1.0
            ch.basic_publish("", queue, json.dumps({"ts": ts, "m": json.loads(body(i))}),
                             props)
            i += 1
        published[0] = i
        c.close()
        time.sleep(5)
        engine.request_stop()

    t = threading.Thread(target=publisher, daemon=True)
    t0, c0 = time.perf_counter(), cpu_s()
    t.start()
    report = engine.run()
    cpu, secs = cpu_s() - c0, time.perf_counter() - t0
    t.join()
    lat = [x for x in latencies if x < 1e8]  # warm-up messages carry ts = -1
    if report.acked != published[0]:
        raise SystemExit(f"latency: acked {report.acked} of {published[0]}")
    return measured(report.acked, secs, cpu, latency_p50_s=pct(lat, 0.5),
                    latency_p99_s=pct(lat, 0.99), latency_max_s=max(lat, default=0.0),
                    timed=len(lat), batches=report.batches, batch_p50_s=report.batch_p50_s,
                    batch_p99_s=report.batch_p99_s)


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
        t0, c0 = time.perf_counter(), cpu_s()
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
        return measured(done, time.perf_counter() - t0, cpu_s() - c0)


def run_phase(name: str, args: list[str], broker: int | None = None) -> dict[str, Any]:
    """Run one phase in a fresh process; ``broker``: the broker's pid. The phase reports
    the broker's CPU over its measured section (``broker_cpu_us``, per message); the CPU
    over the whole process (Spark's start, the warm-up batch, the idle wait at the end
    included) is ``broker_total_cpu_us``."""
    b0 = tree_cpu(broker)
    r = subprocess.run([sys.executable, "-m", "benchmarks.run", "--phase", name, *args,
                        *(["--broker-pid", str(broker)] if broker else [])],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"phase {name} failed:\n{r.stderr[-3000:]}")
    res: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    if broker is not None:
        res["broker_total_cpu_us"] = (tree_cpu(broker) - b0) / max(1, res["messages"]) * 1e6
    return res


def one_phase(a: argparse.Namespace) -> dict[str, Any]:
    """Run the phase ``a.phase`` in this process."""
    name, out = a.phase, os.path.join(a.dir, a.phase)
    if name == "limit":
        return phase_limit(a.db, a.messages, a.batch_size)
    if name == "peer":
        return phase_peer(a.db, a.messages, a.batch_size, out)
    if name == "pg_limit":
        return phase_pg_limit(a.db, a.messages, a.batch_size, a.dsn)
    if name.startswith("rmq_limit"):
        return phase_rmq_limit(a.url, rmq_queue(name), a.messages, a.max_inflight,
                               a.broker_pid)
    if name == "ss_files":
        return phase_ss_files(a.files, a.messages, a.batch_size, out)
    if name == "latency":
        return phase_latency(a.url, a.latency_rate, a.latency_seconds, out)
    if name == "ackflow_files":
        return phase_ackflow(a.db, a.messages, a.batch_size, a.max_inflight, out,
                             files=a.files)
    if name.startswith("shape_"):
        publish(a.db, a.batch_size, "warmup")
        return phase_ackflow(a.db, a.messages, a.batch_size, a.max_inflight, out, shape=True)
    if a.url:
        publish_rmq(a.url, "warmup", a.batch_size)
    else:
        publish(a.db, a.batch_size, "warmup")
    table = name.removeprefix("ackflow_") if name in ("ackflow_delta", "ackflow_iceberg") \
        else "parquet"
    return phase_ackflow(a.db, a.messages, a.batch_size, a.max_inflight, out, dsn=a.dsn,
                         url=a.url, queue=rmq_queue(name) if a.url else QUEUE, table=table,
                         broker=a.broker_pid)


def prepare(name: str, n: int, tmp: str, url: str | None) -> list[str]:
    """Load the phase's input; the arguments that point the phase at it."""
    db = os.path.join(tmp, f"{name}.db")
    if "rmq" in name:
        publish_rmq(url or "", rmq_queue(name), n, "quorum" if name.endswith("quorum")
                    else "classic")
        return ["--db", db, "--url", url or ""]
    if name == "latency":
        return ["--db", db, "--url", url or ""]
    if "files" in name:
        files = os.path.join(tmp, f"{name}-in")
        shutil.rmtree(files, ignore_errors=True)
        write_files(files, n)
        return ["--db", db, "--files", files]
    publish(db, n, make=shaped(name == "shape_evolving", n) if name.startswith("shape_")
            else None)
    return ["--db", db]


def clean(tmp: str, name: str) -> None:
    """Remove what a run of phase ``name`` left (output, warm-up output, checkpoints,
    input), so that the next run starts from nothing (a Structured Streaming checkpoint
    left behind would make it read nothing)."""
    import glob

    for path in glob.glob(os.path.join(glob.escape(tmp), glob.escape(name) + "*")):
        rest = os.path.basename(path)[len(name):]
        if rest and rest[0] not in "-.":  # a longer phase name's
            continue
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.remove(path)


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    best = sorted(runs, key=lambda r: r["rate"])[len(runs) // 2]
    return {**best, "runs": [round(r["rate"]) for r in runs]} if len(runs) > 1 else best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--messages", type=int, default=200_000)
    p.add_argument("--batch-size", type=int, default=25_000)
    p.add_argument("--max-inflight", type=int, default=75_000)
    p.add_argument("--out", default="benchmarks/results/latest.json")
    p.add_argument("--rss", default=None, help="comma-separated message counts: ackflow RSS only")
    p.add_argument("--sweep", default=None,
                   help="comma-separated batch sizes: ackflow_rmq at each (and one rmq_limit)")
    p.add_argument("--queue-type", default="classic", choices=("classic", "quorum"),
                   help="the queue --sweep runs on")
    p.add_argument("--repeat", type=int, default=1, help="runs per phase; the median is shown")
    p.add_argument("--latency-rate", type=float, default=200.0)
    p.add_argument("--latency-seconds", type=float, default=60.0)
    p.add_argument("--ack-hold", type=float, default=None,
                   help="RabbitMQ source: seconds acks of a younger batch are held (1.0)")
    p.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    p.add_argument("--db", default=None, help=argparse.SUPPRESS)
    p.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--dsn", default=None, help=argparse.SUPPRESS)
    p.add_argument("--url", default=None, help=argparse.SUPPRESS)
    p.add_argument("--files", default=None, help=argparse.SUPPRESS)
    p.add_argument("--broker-pid", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--phases", default=",".join(PHASES), help="comma-separated phases to run")
    a = p.parse_args()

    if a.phase:
        if a.ack_hold is not None:
            from ackflow.sources import rabbitmq

            rabbitmq.ACK_HOLD_S = a.ack_hold
        res = one_phase(a)
        res["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(res))
        return

    common = ["--batch-size", str(a.batch_size), "--max-inflight", str(a.max_inflight),
              "--latency-rate", str(a.latency_rate), "--latency-seconds", str(a.latency_seconds),
              *(["--ack-hold", str(a.ack_hold)] if a.ack_hold is not None else [])]
    results: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform(),
                    "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
                                       / 2**30, 1)},
        "settings": {"messages": a.messages, "batch_size": a.batch_size,
                     "max_inflight": a.max_inflight, "message_bytes": len(body(0)),
                     "repeat": a.repeat},
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
        elif a.sweep:
            sweep(a, results, tmp)
        else:
            phases = [x for x in a.phases.split(",") if x]
            unknown = set(phases) - set(PHASES)
            if unknown:
                raise SystemExit(f"unknown phases {sorted(unknown)}; choose from {PHASES}")
            with contextlib.ExitStack() as stack:
                dsn = url = None
                broker = None
                if any("pg" in x for x in phases):
                    from ackflow.servers import PostgresServer

                    dsn = stack.enter_context(PostgresServer()).dsn
                if any("rmq" in x or x == "latency" for x in phases):
                    from ackflow.servers import RabbitMQServer

                    server = stack.enter_context(RabbitMQServer())
                    url, broker = server.url, server.proc.pid if server.proc else None
                for name in phases:
                    runs = []
                    for _ in range(a.repeat):
                        extra = prepare(name, a.messages, tmp, url)
                        if "pg" in name:
                            extra += ["--dsn", dsn or ""]
                        runs.append(run_phase(name, ["--dir", tmp, "--messages",
                                                     str(a.messages), *common, *extra],
                                              broker if "rmq" in name else None))
                        clean(tmp, name)
                    results[name] = median_run(runs)
                    print(f"  {name}: {results[name]['rate']:,.0f} msg/s", file=sys.stderr)
            ratios = {}
            for a_name, b_name in RATIOS:
                if a_name in results and b_name in results:
                    ratios[f"{a_name}_vs_{b_name}"] = (results[a_name]["rate"]
                                                        / results[b_name]["rate"])
            results["ratios"] = ratios
            print_table(phases, results)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {a.out}")


def workers_cpu(r: dict[str, Any]) -> float | None:
    """CPU per message of Spark's Python workers: the JVM's tree without the JVM."""
    if r.get("spark_cpu_us") is None or r.get("jvm_cpu_us") is None:
        return None
    return float(r["spark_cpu_us"] - r["jvm_cpu_us"])


def print_table(phases: list[str], results: dict[str, Any]) -> None:
    print(f"{'phase':<19} {'msg/s':>9} {'batch p50/p99 s':>16} {'CPU µs/msg: driver':>19} "
          f"{'Spark':>6} {'(JVM':>6} {'Python)':>7} {'broker':>7} {'driver RSS':>11}  runs")

    def us(v: float | None) -> str:
        return f"{v:.1f}" if v is not None else "-"

    for name in phases:
        r = results[name]
        lat = (f"{r.get('batch_p50_s', 0):.2f}/{r.get('batch_p99_s', 0):.2f}"
               if r.get("batch_p50_s") else "-")
        print(f"{name:<19} {r['rate']:>9,.0f} {lat:>16} {us(r['driver_cpu_us']):>19} "
              f"{us(r.get('spark_cpu_us')):>6} {us(r.get('jvm_cpu_us')):>6} "
              f"{us(workers_cpu(r)):>7} {us(r.get('broker_cpu_us')):>7} "
              f"{r['max_rss_mb']:>8.0f} MB  {r.get('runs', '')}")
    if "latency" in results:
        r = results["latency"]
        print(f"latency at {r['messages'] / r['seconds']:.0f} msg/s: publish-to-ack p50 "
              f"{r['latency_p50_s']:.2f} s, p99 {r['latency_p99_s']:.2f} s, max "
              f"{r['latency_max_s']:.2f} s ({r['timed']} timed messages)")
    for k, v in results["ratios"].items():
        print(f"{k.replace('_vs_', ' / ')} = {v:.2f}")


def sweep(a: argparse.Namespace, results: dict[str, Any], tmp: str) -> None:
    """ackflow_rmq at each batch size of ``--sweep`` (window: three batches)."""
    from ackflow.servers import RabbitMQServer

    name = "ackflow_rmq" + ("_quorum" if a.queue_type == "quorum" else "")
    limit = "rmq_limit" + ("_quorum" if a.queue_type == "quorum" else "")
    rows = {}
    with RabbitMQServer() as server:
        extra = prepare(limit, a.messages, tmp, server.url)
        broker = server.proc.pid if server.proc else None
        rows["limit"] = run_phase(limit, ["--dir", tmp, "--messages", str(a.messages),
                                          "--max-inflight", "65535", *extra], broker)
        for size in [int(x) for x in a.sweep.split(",")]:
            runs = []
            for _ in range(a.repeat):
                extra = prepare(name, a.messages, tmp, server.url)
                hold = ["--ack-hold", str(a.ack_hold)] if a.ack_hold is not None else []
                runs.append(run_phase(name, ["--dir", tmp, "--messages", str(a.messages), *hold,
                                             "--batch-size", str(size),
                                             "--max-inflight", str(3 * size), *extra],
                                      broker))
                shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
            rows[str(size)] = median_run(runs)
            print(f"  batch {size}: {rows[str(size)]['rate']:,.0f} msg/s", file=sys.stderr)
    results["sweep"] = rows
    best = max(r["rate"] for k, r in rows.items() if k != "limit")
    print(f"{'batch':>8} {'msg/s':>9} {'vs best':>8} {'vs limit':>9} "
          f"{'CPU µs/msg: driver':>19} {'Spark':>6} {'broker':>7}")
    for k, r in rows.items():
        size = "limit" if k == "limit" else f"{int(k):,}"
        vs = ("", "") if k == "limit" else (f"{r['rate'] / best:.2f}",
                                            f"{r['rate'] / rows['limit']['rate']:.2f}")
        print(f"{size:>8} {r['rate']:>9,.0f} {vs[0]:>8} {vs[1]:>9} {r['driver_cpu_us']:>19.1f} "
              f"{r.get('spark_cpu_us', 0):>6.1f} {r.get('broker_cpu_us', 0):>7.1f}")
    results["sweep_spread"] = min(r["rate"] for k, r in rows.items() if k != "limit") / best


if __name__ == "__main__":
    main()
