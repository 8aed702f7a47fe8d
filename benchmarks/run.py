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
* ackflow_columns -- the same flow in Column steps only (``filter("qty > 0")`` for the
             map's check; its columns inferred, ``pad`` written too). With
             ``--conf spark.ackflow.jvmjson=true`` in ``PYSPARK_SUBMIT_ARGS``, JSON is
             decoded in the JVM (``spark/jvm_decode.py``, off by default);
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
* ss_windows, ackflow_windows, ackflow_windows_base -- windows (``benchmarks.windows``):
                Structured Streaming's watermark and ``groupBy(window(...))`` in append
                mode against ackflow's tumbling window in its state store, and ackflow
                without the window, on the same files with event times (10 000 keys);
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
The phases themselves are in ``benchmarks.phases``.
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
import uuid
from typing import Any

from benchmarks import phases as shapes
from benchmarks import windows
from benchmarks.chart import workers_cpu
from benchmarks.phases import (
    QUEUE,
    body,
    phase_ackflow,
    phase_latency,
    phase_limit,
    phase_peer,
    phase_pg_limit,
    phase_rmq_limit,
    phase_ss_files,
    publish,
    publish_rmq,
    rmq_queue,
    shaped,
    tree_cpu,
    write_files,
)
from benchmarks.phases_kafka import phase_kafka_limit, publish_kafka

PHASES = (
    "limit",
    "peer",
    "ackflow",
    "ackflow_columns",
    "pg_limit",
    "ackflow_pg",
    "rmq_limit",
    "ackflow_rmq",
    "rmq_limit_quorum",
    "ackflow_rmq_quorum",
    "ss_files",
    "ackflow_files",
    "latency",
    "ackflow_delta",
    "ackflow_iceberg",
    "shape_fixed",
    "shape_evolving",
    "kafka_limit",
    "ackflow_kafka",
    *windows.PHASES,
)
RATIOS = (
    ("shape_evolving", "shape_fixed"),
    ("ackflow_kafka", "kafka_limit"),
    ("ackflow", "limit"),
    ("ackflow", "peer"),
    ("ackflow_columns", "peer"),
    ("ackflow_pg", "pg_limit"),
    ("ackflow_rmq", "rmq_limit"),
    ("ackflow_rmq_quorum", "rmq_limit_quorum"),
    ("ackflow_files", "ss_files"),
    ("ackflow_delta", "ackflow"),
    ("ackflow_iceberg", "ackflow"),
    *windows.RATIOS,
)


def run_phase(name: str, args: list[str], broker: int | None = None) -> dict[str, Any]:
    """Run one phase in a fresh process; ``broker``: the broker's pid. The phase reports
    the broker's CPU over its measured section (``broker_cpu_us``, per message); the CPU
    over the whole process (Spark's start, the warm-up batch, the idle wait at the end
    included) is ``broker_total_cpu_us``."""
    b0 = tree_cpu(broker)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.run",
            "--phase",
            name,
            *args,
            *(["--broker-pid", str(broker)] if broker else []),
        ],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        raise SystemExit(f"phase {name} failed:\n{r.stderr[-3000:]}")
    res: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    if broker is not None:
        res["broker_total_cpu_us"] = (tree_cpu(broker) - b0) / max(1, res["messages"]) * 1e6
    return res


def one_phase(a: argparse.Namespace) -> dict[str, Any]:
    """Run the phase ``a.phase`` in this process."""
    name, out = a.phase, os.path.join(a.dir, a.phase)
    if name in windows.PHASES:
        return windows.one_phase(name, a.files, a.messages, a.batch_size, a.max_inflight, out)
    if name == "limit":
        return phase_limit(a.db, a.messages, a.batch_size)
    if name == "peer":
        return phase_peer(a.db, a.messages, a.batch_size, out)
    if name == "pg_limit":
        return phase_pg_limit(a.db, a.messages, a.batch_size, a.dsn)
    if name.startswith("rmq_limit"):
        return phase_rmq_limit(a.url, rmq_queue(name), a.messages, a.max_inflight, a.broker_pid)
    if name == "kafka_limit":
        return phase_kafka_limit(a.kafka, a.topic, a.messages, a.broker_pid)
    if name == "ackflow_kafka":
        publish_kafka(a.kafka, "warmup", a.batch_size)
        return phase_ackflow(
            a.db,
            a.messages,
            a.batch_size,
            a.max_inflight,
            out,
            queue=a.topic,
            kafka=a.kafka,
            broker=a.broker_pid,
        )
    if name == "ss_files":
        return phase_ss_files(a.files, a.messages, a.batch_size, out)
    if name == "latency":
        return phase_latency(a.url, a.latency_rate, a.latency_seconds, out)
    if name == "ackflow_files":
        return phase_ackflow(a.db, a.messages, a.batch_size, a.max_inflight, out, files=a.files)
    if name.startswith("shape_"):
        publish(a.db, a.batch_size, "warmup")
        return phase_ackflow(a.db, a.messages, a.batch_size, a.max_inflight, out, shape=True)
    if name == "ackflow_columns":
        publish(a.db, a.batch_size, "warmup")
        return phase_ackflow(a.db, a.messages, a.batch_size, a.max_inflight, out, columns=True)
    if a.url:
        publish_rmq(a.url, "warmup", a.batch_size)
    else:
        publish(a.db, a.batch_size, "warmup")
    table = name.removeprefix("ackflow_") if name in ("ackflow_delta", "ackflow_iceberg") else "parquet"
    return phase_ackflow(
        a.db,
        a.messages,
        a.batch_size,
        a.max_inflight,
        out,
        dsn=a.dsn,
        url=a.url,
        queue=rmq_queue(name) if a.url else QUEUE,
        table=table,
        broker=a.broker_pid,
    )


def prepare(name: str, n: int, tmp: str, url: str | None, kafka: str | None = None) -> list[str]:
    """Load the phase's input; the arguments that point the phase at it."""
    db = os.path.join(tmp, f"{name}.db")
    if "kafka" in name:
        topic = f"bench-{name}-{uuid.uuid4().hex[:6]}"
        publish_kafka(kafka or "", topic, n)
        return ["--db", db, "--kafka", kafka or "", "--topic", topic]
    if "rmq" in name:
        publish_rmq(url or "", rmq_queue(name), n, "quorum" if name.endswith("quorum") else "classic")
        return ["--db", db, "--url", url or ""]
    if name == "latency":
        return ["--db", db, "--url", url or ""]
    if name in windows.PHASES:
        files = os.path.join(tmp, f"{name}-in")
        shutil.rmtree(files, ignore_errors=True)
        windows.write_files(files, n)
        return ["--db", db, "--files", files]
    if "files" in name:
        files = os.path.join(tmp, f"{name}-in")
        shutil.rmtree(files, ignore_errors=True)
        write_files(files, n)
        return ["--db", db, "--files", files]
    publish(db, n, make=shaped(name == "shape_evolving", n) if name.startswith("shape_") else None)
    return ["--db", db]


def clean(tmp: str, name: str) -> None:
    """Remove what a run of phase ``name`` left (output, warm-up output, checkpoints,
    input), so that the next run starts from nothing (a Structured Streaming checkpoint
    left behind would make it read nothing)."""
    import glob

    for path in glob.glob(os.path.join(glob.escape(tmp), glob.escape(name) + "*")):
        rest = os.path.basename(path)[len(name) :]
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
    p.add_argument(
        "--sweep", default=None, help="comma-separated batch sizes: ackflow_rmq at each (and one rmq_limit)"
    )
    p.add_argument(
        "--queue-type", default="classic", choices=("classic", "quorum"), help="the queue --sweep runs on"
    )
    p.add_argument("--repeat", type=int, default=1, help="runs per phase; the median is shown")
    p.add_argument(
        "--shape-every",
        type=int,
        default=shapes.SHAPE_EVERY,
        help="shape phases: messages per optional field (columns = messages / this + 5)",
    )
    p.add_argument("--latency-rate", type=float, default=200.0)
    p.add_argument("--latency-seconds", type=float, default=60.0)
    p.add_argument(
        "--ack-hold",
        type=float,
        default=None,
        help="RabbitMQ source: seconds acks of a younger batch are held (1.0)",
    )
    p.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    p.add_argument("--db", default=None, help=argparse.SUPPRESS)
    p.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--dsn", default=None, help=argparse.SUPPRESS)
    p.add_argument("--url", default=None, help=argparse.SUPPRESS)
    p.add_argument("--files", default=None, help=argparse.SUPPRESS)
    p.add_argument("--kafka", default=None, help=argparse.SUPPRESS)
    p.add_argument("--topic", default=None, help=argparse.SUPPRESS)
    p.add_argument("--broker-pid", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--phases", default=",".join(PHASES), help="comma-separated phases to run")
    a = p.parse_args()
    shapes.SHAPE_EVERY = a.shape_every  # read by shaped() when the input is published

    if a.phase:
        if a.ack_hold is not None:
            from ackflow.sources import rabbitmq

            rabbitmq.ACK_HOLD_S = a.ack_hold
        res = one_phase(a)
        res["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(res))
        return

    common = [
        "--batch-size",
        str(a.batch_size),
        "--max-inflight",
        str(a.max_inflight),
        "--latency-rate",
        str(a.latency_rate),
        "--latency-seconds",
        str(a.latency_seconds),
        *(["--ack-hold", str(a.ack_hold)] if a.ack_hold is not None else []),
    ]
    results: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        },
        "settings": {
            "messages": a.messages,
            "batch_size": a.batch_size,
            "max_inflight": a.max_inflight,
            "message_bytes": len(body(0)),
            "repeat": a.repeat,
        },
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
                print(
                    f"{r['messages']:>10,} {r['rate']:>9,.0f} {r['max_rss_mb']:>19.0f} "
                    f"{r['max_rss_mb'] / base - 1:>+9.1%}"
                )
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
                kafka = kafka_pid = None
                if any("kafka" in x for x in phases):
                    from ackflow.servers import KafkaServer

                    tansu = stack.enter_context(KafkaServer())
                    kafka, kafka_pid = tansu.bootstrap, tansu.proc.pid if tansu.proc else None
                if any("rmq" in x or x == "latency" for x in phases):
                    from ackflow.servers import RabbitMQServer

                    server = stack.enter_context(RabbitMQServer())
                    url, broker = server.url, server.proc.pid if server.proc else None
                for name in phases:
                    runs = []
                    for _ in range(a.repeat):
                        extra = prepare(name, a.messages, tmp, url, kafka)
                        if "pg" in name:
                            extra += ["--dsn", dsn or ""]
                        runs.append(
                            run_phase(
                                name,
                                ["--dir", tmp, "--messages", str(a.messages), *common, *extra],
                                broker if "rmq" in name else kafka_pid if "kafka" in name else None,
                            )
                        )
                        clean(tmp, name)
                    results[name] = median_run(runs)
                    print(f"  {name}: {results[name]['rate']:,.0f} msg/s", file=sys.stderr)
            ratios = {}
            for a_name, b_name in RATIOS:
                if a_name in results and b_name in results:
                    ratios[f"{a_name}_vs_{b_name}"] = results[a_name]["rate"] / results[b_name]["rate"]
                    if "rate_after_join" in results[a_name] and "rate_after_join" in results[b_name]:
                        ratios[f"{a_name}_vs_{b_name}_after_join"] = (
                            results[a_name]["rate_after_join"] / results[b_name]["rate_after_join"]
                        )
            results["ratios"] = ratios
            print_table(phases, results)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {a.out}")
    if not a.rss and not a.sweep:  # the run's picture beside it
        from benchmarks import chart

        picture = os.path.splitext(a.out)[0] + ".svg"
        if chart.draw(a.out, picture):
            print(f"wrote {picture}")


def print_table(phases: list[str], results: dict[str, Any]) -> None:
    print(
        f"{'phase':<19} {'msg/s':>9} {'batch p50/p99 s':>16} {'CPU µs/msg: driver':>19} "
        f"{'consumer':>8} {'Spark':>6} {'(JVM':>6} {'Python)':>7} {'broker':>7} {'driver RSS':>11}  runs"
    )

    def us(v: float | None) -> str:
        return f"{v:.1f}" if v is not None else "-"

    for name in phases:
        r = results[name]
        lat = f"{r.get('batch_p50_s', 0):.2f}/{r.get('batch_p99_s', 0):.2f}" if r.get("batch_p50_s") else "-"
        print(
            f"{name:<19} {r['rate']:>9,.0f} {lat:>16} {us(r['driver_cpu_us']):>19} "
            f"{us(r.get('consumer_cpu_us')):>8} {us(r.get('spark_cpu_us')):>6} {us(r.get('jvm_cpu_us')):>6} "
            f"{us(workers_cpu(r)):>7} {us(r.get('broker_cpu_us')):>7} "
            f"{r['max_rss_mb']:>8.0f} MB  {r.get('runs', '')}"
        )
    if "latency" in results:
        r = results["latency"]
        print(
            f"latency at {r['messages'] / r['seconds']:.0f} msg/s: publish-to-ack p50 "
            f"{r['latency_p50_s']:.2f} s, p99 {r['latency_p99_s']:.2f} s, max "
            f"{r['latency_max_s']:.2f} s ({r['timed']} timed messages)"
        )
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
        rows["limit"] = run_phase(
            limit, ["--dir", tmp, "--messages", str(a.messages), "--max-inflight", "65535", *extra], broker
        )
        for size in [int(x) for x in a.sweep.split(",")]:
            runs = []
            for _ in range(a.repeat):
                extra = prepare(name, a.messages, tmp, server.url)
                hold = ["--ack-hold", str(a.ack_hold)] if a.ack_hold is not None else []
                runs.append(
                    run_phase(
                        name,
                        [
                            "--dir",
                            tmp,
                            "--messages",
                            str(a.messages),
                            *hold,
                            "--batch-size",
                            str(size),
                            "--max-inflight",
                            str(3 * size),
                            *extra,
                        ],
                        broker,
                    )
                )
                shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
            rows[str(size)] = median_run(runs)
            print(f"  batch {size}: {rows[str(size)]['rate']:,.0f} msg/s", file=sys.stderr)
    results["sweep"] = rows
    best = max(r["rate"] for k, r in rows.items() if k != "limit")
    print(
        f"{'batch':>8} {'msg/s':>9} {'vs best':>8} {'vs limit':>9} "
        f"{'CPU µs/msg: driver':>19} {'Spark':>6} {'broker':>7}"
    )
    for k, r in rows.items():
        size = "limit" if k == "limit" else f"{int(k):,}"
        vs = (
            ("", "")
            if k == "limit"
            else (f"{r['rate'] / best:.2f}", f"{r['rate'] / rows['limit']['rate']:.2f}")
        )
        print(
            f"{size:>8} {r['rate']:>9,.0f} {vs[0]:>8} {vs[1]:>9} {r['driver_cpu_us']:>19.1f} "
            f"{r.get('spark_cpu_us', 0):>6.1f} {r.get('broker_cpu_us', 0):>7.1f}"
        )
    results["sweep_spread"] = min(r["rate"] for k, r in rows.items() if k != "limit") / best


if __name__ == "__main__":
    main()
