"""What ackflow's RabbitMQ source costs on its own, beside raw pika on the same broker:
``.venv/bin/python -m benchmarks.rmq_source [--n 200000] [--kinds classic,quorum]
[--consumers process,inline] [--out X.json]``.

One throwaway broker; per queue kind, N persistent 100-byte messages are loaded (untimed)
into a queue for each measurement. Raw pika consumes them (prefetch 65 535, a
multiple-ack every 1 000: the benchmark's ``rmq_limit`` phase). The source (no engine, no
Spark) pulls batches of ``--batch`` with a window of ``--window`` and acks each batch
right after the next is pulled (one batch in flight, as if every write took no time).
CPU a message of this process (the driver) and of the broker (``/proc``); messages a
second. The difference between the two rows is the source's own cost: its Delivery per
message, delivery counting, settlement bookkeeping, and what the broker spends on the
source's larger window.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from typing import Any

import pika

from ackflow.servers import RabbitMQServer
from ackflow.sources import RabbitMQ
from benchmarks.phases import body, phase_rmq_limit, tree_cpu


def _cpu(who: int = resource.RUSAGE_SELF) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def _load(url: str, queue: str, kind: str, n: int) -> None:
    from ackflow.sinks.rabbitmq import publish_confirmed

    conn = pika.BlockingConnection(pika.URLParameters(url))
    conn.channel().queue_declare(queue, durable=True, arguments={"x-queue-type": kind})
    conn.close()
    for start in range(0, n, 50_000):
        msgs = [
            (queue, body(i), pika.BasicProperties(delivery_mode=2, message_id=f"m{i}"))
            for i in range(start, min(n, start + 50_000))
        ]
        failed = publish_confirmed(url, "", msgs)
        if failed:
            raise RuntimeError(f"{len(failed)} messages were not confirmed while loading")


def _source(
    url: str, queue: str, n: int, window: int, batch: int, broker: int, consumer: str
) -> dict[str, Any]:
    src = RabbitMQ(url, queue, reject_to_dlx=False, consumer=consumer)
    k0 = _cpu(resource.RUSAGE_CHILDREN)
    src.configure(max_inflight=window, error_sink=True)  # dead letters would go to a sink
    src.open()
    done, held = 0, []
    t0, c0, b0 = time.perf_counter(), _cpu(), tree_cpu(broker)
    deadline = time.monotonic() + 120
    while done < n and time.monotonic() < deadline:
        got = src.pull(batch, 0.2)
        if held:
            src.ack(held)
            done += len(held)
        held = got
    if held:
        src.ack(held)
        done += len(held)
    secs, cpu, broker_cpu = time.perf_counter() - t0, _cpu() - c0, tree_cpu(broker) - b0
    src.close()  # (the consumer process ends: its CPU is counted, start to end)
    return {
        "messages": done,
        "rate": done / secs,
        "driver_cpu_us": cpu / max(1, done) * 1e6,
        "consumer_cpu_us": (_cpu(resource.RUSAGE_CHILDREN) - k0) / max(1, done) * 1e6,
        "broker_cpu_us": broker_cpu / max(1, done) * 1e6,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=200_000)
    p.add_argument("--kinds", default="classic,quorum")
    p.add_argument("--window", type=int, default=75_000)
    p.add_argument("--batch", type=int, default=25_000)
    p.add_argument("--consumers", default="process,inline", help="the source's consumer= values to measure")
    p.add_argument("--out", help="write the results as JSON here")
    a = p.parse_args()
    results: dict[str, dict[str, Any]] = {}
    server = RabbitMQServer().start()
    try:
        assert server.proc is not None
        pid = server.proc.pid
        for kind in a.kinds.split(","):
            _load(server.url, f"raw-{kind}", kind, a.n)
            raw = phase_rmq_limit(server.url, f"raw-{kind}", a.n, a.window, pid)
            results[f"raw pika, {kind}"] = {
                k: raw[k] for k in ("messages", "rate", "driver_cpu_us", "broker_cpu_us")
            }
            for consumer in a.consumers.split(","):
                _load(server.url, f"src-{kind}-{consumer}", kind, a.n)
                results[f"source ({consumer}), {kind}"] = _source(
                    server.url, f"src-{kind}-{consumer}", a.n, a.window, a.batch, pid, consumer
                )
    finally:
        server.close()
    print(f"{'consumer':<28} {'msg/s':>8} {'driver µs/msg':>14} {'child µs/msg':>13} {'broker µs/msg':>14}")
    for name, r in results.items():
        child = r.get("consumer_cpu_us", 0.0)
        rate, driver, broker = r["rate"], r["driver_cpu_us"], r["broker_cpu_us"]
        print(f"{name:<28} {rate:>8.0f} {driver:>14.1f} {child:>13.1f} {broker:>14.1f}")
    out = {"messages": a.n, "window": a.window, "batch": a.batch, "results": results}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
