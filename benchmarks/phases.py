"""The phases of ``benchmarks.run``: each measures one pipeline (ackflow's, or a
baseline's) in a process of its own, with the helpers that load its input and
measure its CPU and memory. ``python -m benchmarks.run --phase NAME`` runs one."""

from __future__ import annotations

import json
import os
import resource
import time
from typing import Any

QUEUE = "bench"
FIELDS = "id BIGINT, sku STRING, qty BIGINT, price DOUBLE"
#: How long a measured run waits idle before it ends (not counted as its time). A quorum
#: queue with 200 000 messages sends the first delivery of a 65 535 prefetch after ~1.3 s
#: (measured): a shorter wait ended the run before any message came (acked 0).
IDLE_S = 3.0


def cpu_s() -> float:
    """This process's CPU seconds (all its threads; child processes are not counted)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def children_cpu() -> float:
    """CPU seconds of the child processes this process waited for: in a run, the
    RabbitMQ source's consumer process (``rabbitmq_remote``: it ends when the source
    closes; the JVM lives on and its Python workers are its own children)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
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


def phase_rmq_limit(url: str, queue: str, n: int, prefetch: int, broker: int | None = None) -> dict[str, Any]:
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
    return {
        "messages": done,
        "seconds": secs,
        "rate": done / secs,
        "rss_mb": rss_mb(),
        "driver_cpu_us": cpu / max(1, done) * 1e6,
        **({"broker_cpu_us": broker_cpu / max(1, done) * 1e6} if broker else {}),
    }


def body(i: int) -> bytes:
    """A 100-byte JSON message."""
    b = json.dumps(
        {
            "id": i,
            "sku": f"sku-{i % 977:04d}",
            "qty": 1 + i % 7,
            "price": round(1 + (i % 1000) / 10, 2),
            "pad": "",
        },
        separators=(",", ":"),
    )
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
    return {
        "messages": done,
        "seconds": secs,
        "rate": done / secs if secs else 0.0,
        "rss_mb": rss_mb(),
        "driver_cpu_us": cpu / max(1, done) * 1e6,
        **extra,
    }


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

    schema = pa.schema(
        [("id", pa.int64()), ("sku", pa.string()), ("qty", pa.int64()), ("price", pa.float64())]
    )
    for b in batches:
        rows = [parse(json.loads(x)) for x in b.column("body").to_pylist()]
        yield pa.RecordBatch.from_pylist(rows, schema=schema)


def arrow_parse_rows(batches: Any) -> Any:
    """``parse`` over Arrow batches of already-parsed rows (Structured Streaming's UDF)."""
    import pyarrow as pa

    schema = pa.schema(
        [("id", pa.int64()), ("sku", pa.string()), ("qty", pa.int64()), ("price", pa.float64())]
    )
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
    return measured(
        done,
        secs,
        cpu,
        jvm_rss_mb=rss_mb(jvm) if jvm else None,
        spark_cpu_us=(tree_cpu(jvm) - s0) / max(1, done) * 1e6,
        jvm_cpu_us=(own_cpu(jvm) - j0) / max(1, done) * 1e6,
        batch_p50_s=pct(latencies, 0.5),
        batch_p99_s=pct(latencies, 0.99),
    )


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
        df = (
            spark.readStream.schema(schema)
            .option("maxFilesPerTrigger", max(1, batch // 20_000))
            .json(directory)
            .drop("pad")
            .mapInArrow(arrow_parse_rows, FIELDS)
            .withColumn("total", F.col("qty") * F.col("price"))
        )
        q = (
            df.writeStream.format("parquet")
            .option("path", target)
            .option("checkpointLocation", target + "-checkpoint")
            .trigger(availableNow=True)
            .start()
        )
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
    return measured(n, secs, cpu, spark_cpu_us=spark_cpu / n * 1e6, jvm_cpu_us=jvm_cpu / n * 1e6)


def phase_ackflow(
    db: str,
    n: int,
    batch: int,
    inflight: int,
    out: str,
    *,
    dsn: str | None = None,
    url: str | None = None,
    queue: str = QUEUE,
    files: str | None = None,
    table: str = "parquet",
    broker: int | None = None,
    shape: bool = False,
    kafka: str | None = None,
    columns: bool = False,
) -> dict[str, Any]:
    import ackflow
    from ackflow.engine import Engine
    from ackflow.sinks import Delta, Iceberg, MemorySink, Parquet, Postgres, Sink
    from ackflow.sources import EmbeddedQueue, Files, RabbitMQ
    from benchmarks.phases_kafka import JOINED, KAFKA_GROUP, _Joined

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
        if kafka is not None:  # a log needs a place for dead letters (there are none)
            source: Any = _Joined(
                kafka,
                queue,
                f"ackflow-{queue}",
                config=KAFKA_GROUP,
                attempts_path=os.path.join(path + "-state", "attempts.db"),
            )
            return (
                ackflow.Flow(source)
                .map(parse, name="parse", schema=FIELDS)
                .with_columns(total="qty * price")
                .to(sink)
                .on_error(MemorySink("dead"))
            )
        if files is not None:
            source = Files(files, "jsonl", done="record")
        elif url is not None:
            source = RabbitMQ(url, queue, reject_to_dlx=True)
        else:
            source = EmbeddedQueue(db, queue)
        if shape:  # the columns are inferred, stored and evolved (issue 30)
            return ackflow.Flow(source).map(lambda r: r, name="record").to(sink)
        if columns:  # Column steps only: parse's check as a filter (no Python step)
            return ackflow.Flow(source).filter("qty > 0").with_columns(total="qty * price").to(sink)
        return (
            ackflow.Flow(source)
            .map(parse, name="parse", schema=FIELDS)
            .with_columns(total="qty * price")
            .to(sink)
        )

    warm = files + "-warmup" if files else None
    if warm:
        write_files(warm, batch)
    Engine(
        flow("warmup", out + "-warmup", warm),
        spark=spark,
        batch_size=batch,
        max_inflight=inflight,
        until_idle=0.2,
        handle_signals=False,
    ).run()
    peak = [0.0]

    def sample(report: Any, window: Any) -> None:
        peak[0] = max(peak[0], rss_mb())

    jvm = jvm_pid()
    c0, s0, j0, b0, k0 = cpu_s(), tree_cpu(jvm), own_cpu(jvm), tree_cpu(broker), children_cpu()
    JOINED.clear()
    t0 = time.monotonic()
    report = Engine(
        flow(queue, out, files),
        spark=spark,
        batch_size=batch,
        max_inflight=inflight,
        until_idle=IDLE_S,
        handle_signals=False,
        progress=sample,
    ).run()
    cpu, spark_cpu, jvm_cpu = cpu_s() - c0, tree_cpu(jvm) - s0, own_cpu(jvm) - j0
    broker_cpu = tree_cpu(broker) - b0
    consumer_cpu = children_cpu() - k0
    secs = report.elapsed_s - IDLE_S  # the idle wait at the end is not work
    # a Kafka run: the group join (the broker's wait for members) apart, as in kafka_limit
    join = {}
    if JOINED:
        after = time.monotonic() - IDLE_S - JOINED[0]
        join = {"join_s": JOINED[0] - t0, "rate_after_join": report.acked / after}
    if report.acked != n:
        raise SystemExit(
            f"ackflow acked {report.acked} of {n} messages (pulled "
            f"{report.pulled}, nacked {report.nacked}, dead-lettered "
            f"{report.dead_lettered}, redelivered {report.redelivered}, "
            f"{report.elapsed_s:.1f} s)"
        )
    return measured(
        report.acked,
        secs,
        cpu,
        rss_peak_mb=peak[0],
        spark_cpu_us=spark_cpu / max(1, report.acked) * 1e6,
        jvm_cpu_us=jvm_cpu / max(1, report.acked) * 1e6,
        jvm_rss_mb=rss_mb(jvm) if jvm else None,
        batch_p50_s=report.batch_p50_s,
        batch_p99_s=report.batch_p99_s,
        nacked=report.nacked,
        dead_lettered=report.dead_lettered,
        batches=report.batches,
        jobs=report.jobs,
        schema_versions=sum(report.schema_versions.values()),
        **({"broker_cpu_us": broker_cpu / max(1, report.acked) * 1e6} if broker else {}),
        **({"consumer_cpu_us": consumer_cpu / max(1, report.acked) * 1e6} if consumer_cpu > 0 else {}),
        **join,
    )


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
            from ackflow.sources.rabbitmq_blocks import expand  # (a block's own messages)

            latencies.extend(now - json.loads(d.body)["ts"] for d in expand(deliveries))
            return stale

    def timed_parse(r: dict[str, Any]) -> dict[str, Any]:
        return parse(r["m"])

    spark = ackflow.session("local[*]")
    engine = Engine(
        ackflow.Flow(Timed(url, queue, reject_to_dlx=True))
        .map(timed_parse, name="parse", schema=FIELDS)
        .with_columns(total="qty * price")
        .to(Parquet(out)),
        spark=spark,
        handle_signals=False,
    )
    published = [0]
    warm_batches = [-1]  # the batches done when timing began (Spark's warm-up ones before)

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
            if ts > 0 and warm_batches[0] < 0:
                warm_batches[0] = len(engine.batch_seconds)
            ch.basic_publish("", queue, json.dumps({"ts": ts, "m": json.loads(body(i))}), props)
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
    steady = list(engine.batch_seconds)[max(0, warm_batches[0]) :]  # as the latencies: after warm-up
    return measured(
        report.acked,
        secs,
        cpu,
        latency_p50_s=pct(lat, 0.5),
        latency_p99_s=pct(lat, 0.99),
        latency_max_s=max(lat, default=0.0),
        timed=len(lat),
        batches=report.batches,
        batch_p50_s=pct(steady, 0.5),
        batch_p99_s=pct(steady, 0.99),
        batch_p99_with_warmup_s=report.batch_p99_s,
    )


def pg_rows(bodies: list[bytes], keys: list[str]) -> list[tuple[Any, ...]]:
    out = []
    for b, k in zip(bodies, keys, strict=True):
        r = parse(json.loads(b))
        out.append((r["id"], r["sku"], r["qty"], r["price"], r["qty"] * r["price"], k))
    return out


PG_TABLE = (
    "CREATE TABLE {} (id bigint, sku text, qty bigint, price double precision, "
    "total double precision, ackflow_key text PRIMARY KEY)"
)


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
                cur.execute("CREATE TEMP TABLE IF NOT EXISTS stage (LIKE bench_limit) ON COMMIT DELETE ROWS")
                with cur.copy("COPY stage FROM STDIN") as cp:
                    for r in rows:
                        cp.write_row(r)
                cur.execute(
                    "INSERT INTO bench_limit SELECT * FROM stage ON CONFLICT "
                    "(ackflow_key) DO UPDATE SET id = EXCLUDED.id, sku = EXCLUDED.sku, "
                    "qty = EXCLUDED.qty, price = EXCLUDED.price, total = EXCLUDED.total"
                )
            conn.commit()
            q.ack(QUEUE, [(m.row_id, m.deliveries) for m in leased])
            done += len(leased)
        return measured(done, time.perf_counter() - t0, cpu_s() - c0)
