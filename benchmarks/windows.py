"""Benchmark phases of windows (issue 31), on the same JSON-lines files with event times:

* ``ss_windows``: Structured Streaming's file source, ``withWatermark`` and
  ``groupBy(window(ts, "1 minute"), key).agg(count, sum)`` in append mode into Parquet,
  with a checkpoint, ``trigger(availableNow=True)``;
* ``ackflow_windows``: ackflow's Files source, the same parse as the other phases, a
  one-minute tumbling window per key (count, sum) in the state store, into Parquet;
* ``ackflow_windows_base``: the same flow without the window (rows into Parquet).

Messages carry ``key`` (10 000 of them) and ``ts`` (1 000 messages per second of event
time, in order). The ackflow phases also report the state store's size and the driver's
peak RSS.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from benchmarks.phases import IDLE_S, cpu_s, jvm_pid, measured, own_cpu, rss_mb, tree_cpu

PHASES = ("ss_windows", "ackflow_windows", "ackflow_windows_base")
RATIOS = (("ackflow_windows", "ss_windows"), ("ackflow_windows", "ackflow_windows_base"))
KEYS = 10_000
START = 1_795_000_000.0
SCHEMA = "id BIGINT, key STRING, ts DOUBLE, qty BIGINT, price DOUBLE"


def body(i: int) -> bytes:
    return json.dumps(
        {"id": i, "key": f"k{i % KEYS:05d}", "ts": START + i / 1000, "qty": 1 + i % 7, "price": 1 + i % 100},
        separators=(",", ":"),
    ).encode()


def write_files(directory: str, n: int, per_file: int = 20_000) -> None:
    os.makedirs(directory, exist_ok=True)
    for k, start in enumerate(range(0, n, per_file)):
        tmp = os.path.join(directory, f".part-{k:05d}.jsonl")
        with open(tmp, "wb") as f:
            f.write(b"\n".join(body(i) for i in range(start, min(n, start + per_file))) + b"\n")
        os.rename(tmp, os.path.join(directory, f"part-{k:05d}.jsonl"))


def parse(r: dict[str, Any]) -> dict[str, Any]:
    if r["qty"] <= 0:
        raise ValueError("qty must be positive")
    return {"id": r["id"], "key": r["key"], "ts": r["ts"], "total": r["qty"] * r["price"]}


def phase_ss_windows(src: str, n: int, batch: int, out: str) -> dict[str, Any]:
    from pyspark.sql import functions as F

    from ackflow.spark.session import session

    spark = session("local[*]")

    def run(directory: str, target: str) -> float:
        t = time.perf_counter()
        df = (
            spark.readStream.schema(SCHEMA)
            .option("maxFilesPerTrigger", max(1, batch // 20_000))
            .json(directory)
            .withColumn("ts", F.col("ts").cast("timestamp"))
            .withWatermark("ts", "30 seconds")
            .groupBy(F.window("ts", "1 minute"), "key")
            .agg(F.count("*").alias("n"), F.sum(F.col("qty") * F.col("price")).alias("total"))
        )
        q = (
            df.writeStream.format("parquet")
            .outputMode("append")
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
    c0, s0, j0 = cpu_s(), tree_cpu(jvm), own_cpu(jvm)
    secs = run(src, out)
    cpu, spark_cpu, jvm_cpu = cpu_s() - c0, tree_cpu(jvm) - s0, own_cpu(jvm) - j0
    windows = spark.read.parquet(out).count()
    return measured(
        n,
        secs,
        cpu,
        spark_cpu_us=spark_cpu / n * 1e6,
        jvm_cpu_us=jvm_cpu / n * 1e6,
        windows_written=windows,
        note="append mode: windows still open at the end are not written",
    )


def phase_ackflow_windows(
    src: str, n: int, batch: int, inflight: int, out: str, window: bool
) -> dict[str, Any]:
    import ackflow
    from ackflow import windows as w
    from ackflow.engine import Engine
    from ackflow.sinks import Parquet
    from ackflow.sources import Files

    spark = ackflow.session("local[*]")
    fields = "id BIGINT, key STRING, ts DOUBLE, total DOUBLE"

    def flow(files: str, path: str) -> ackflow.Flow:
        f = ackflow.Flow(Files(files, "jsonl", done="record")).map(parse, name="parse", schema=fields)
        if not window:
            return f.to(Parquet(path))
        return f.window(
            w.tumbling("1 minute"),
            by="key",
            time="ts",
            lateness="30s",
            idle=600,  # windows close by the watermark, as Structured Streaming's do
            aggs=[w.count().alias("n"), w.sum_("total").alias("total")],
            name="per_minute",
        ).to(Parquet(path))

    def engine(files: str, path: str, **kw: Any) -> Any:
        return Engine(
            flow(files, path),
            spark=spark,
            batch_size=batch,
            max_inflight=inflight,
            handle_signals=False,
            state_dir=path + "-state",
            **kw,
        )

    warm = src + "-warmup"
    write_files(warm, batch)
    engine(warm, out + "-warmup", until_idle=0.2).run()
    peak = [0.0]

    def sample(report: Any, window_: Any) -> None:
        peak[0] = max(peak[0], rss_mb())

    jvm = jvm_pid()
    c0, s0, j0 = cpu_s(), tree_cpu(jvm), own_cpu(jvm)
    report = engine(src, out, until_idle=IDLE_S, progress=sample).run()
    cpu, spark_cpu, jvm_cpu = cpu_s() - c0, tree_cpu(jvm) - s0, own_cpu(jvm) - j0
    if report.acked != n:
        raise SystemExit(f"ackflow acked {report.acked} of {n} messages ({report.summary()})")
    state = os.path.join(out + "-state", "windows.db")
    state_bytes = sum(os.path.getsize(p) for p in (state, state + "-wal") if os.path.exists(p))
    extra: dict[str, Any] = {}
    if window:
        from ackflow.state.show import describe

        (op,) = describe(out + "-state", limit=0)
        extra = {
            "state_bytes": state_bytes,
            "open_windows": op["open_windows"],
            "windows_written": op["windows_written"],
            "applied_keys_remembered": op["applied_keys_remembered"],
        }
    return measured(
        report.acked,
        report.elapsed_s - IDLE_S,
        cpu,
        rss_peak_mb=peak[0],
        spark_cpu_us=spark_cpu / n * 1e6,
        jvm_cpu_us=jvm_cpu / n * 1e6,
        batch_p50_s=report.batch_p50_s,
        batch_p99_s=report.batch_p99_s,
        **extra,
    )


def one_phase(name: str, files: str, n: int, batch: int, inflight: int, out: str) -> dict[str, Any]:
    if name == "ss_windows":
        return phase_ss_windows(files, n, batch, out)
    return phase_ackflow_windows(files, n, batch, inflight, out, window=name == "ackflow_windows")
