"""Which Python RabbitMQ client consumes cheapest? pika against the others, one broker:
``.venv/bin/python -m benchmarks.rmq_clients [--clients pika,librabbitmq] [--n 50000]``.

Each client consumes N persistent 100-byte messages preloaded (untimed, by pika) on a
durable classic queue: manual acks, prefetch 5000, a multiple-ack every 1000; timed from
connect to close; CPU per message of the client (user+sys) and of the broker (/proc).
"batch": lists of up to 25 000 bodies go over a queue.Queue to the main thread, which
acks each with one multiple-ack (sent by the consumer thread within 10 ms: most clients
are not thread-safe); prefetch 50 000 there (25 000 never fills under 5000).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import queue
import signal
import sys
import threading
import time
from importlib import metadata

import pika

from ackflow.servers import RabbitMQServer

QUEUE = "bench.rmq_clients"
BODY = b"x" * 100
LIMIT_S = 60.0  # at most per measurement
CLIENTS = ["pika", "amqpstorm", "aio-pika", "aiormq", "rabbitpy", "py-amqp", "kombu", "librabbitmq"]


class Sink:
    """Counts deliveries, queues acks (sent by the consumer thread's ``flush``), hands batches."""

    def __init__(self, n: int, batch: int, deadline: float) -> None:
        self.n, self.batch, self.deadline = n, batch, deadline
        self.count = self.last_acked = 0
        self.pending, self.bodies, self.handoff = collections.deque(), [], queue.Queue()

    def on(self, body: bytes, tag: int) -> None:
        self.count += 1
        if self.batch:
            self.bodies.append(body)
            if len(self.bodies) >= self.batch or self.count >= self.n:
                self.handoff.put((self.bodies, tag))
                self.bodies = []
        elif self.count % 1000 == 0 or self.count >= self.n:
            self.pending.append(tag)

    def flush(self, ack) -> None:
        while self.pending:
            tag = self.pending.popleft()
            ack(tag)
            self.last_acked = tag

    def handler(self, ack):  # the consumer thread's delivery callback: count, then send the acks
        return lambda body, tag: (self.on(body, tag), self.flush(ack))

    @property
    def finished(self) -> bool:
        return self.last_acked >= self.n or time.monotonic() > self.deadline


def run_pika(url: str, sink: Sink, prefetch: int) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.basic_qos(prefetch_count=prefetch)
    ack = lambda tag: ch.basic_ack(tag, multiple=True)  # noqa: E731
    on = sink.handler(ack)
    ch.basic_consume(QUEUE, lambda _ch, method, _props, body: on(body, method.delivery_tag))
    while not sink.finished:
        conn.process_data_events(time_limit=0.01)
        sink.flush(ack)
    conn.close()


def run_amqpstorm(url: str, sink: Sink, prefetch: int) -> None:
    import amqpstorm

    conn = amqpstorm.UriConnection(url)
    ch = conn.channel()
    ch.basic.qos(prefetch_count=prefetch)
    ack = lambda tag: ch.basic.ack(tag, multiple=True)  # noqa: E731
    on = sink.handler(ack)
    ch.basic.consume(lambda body, _ch, method, _props: on(body, method["delivery_tag"]), QUEUE)
    while not sink.finished:
        ch.process_data_events(to_tuple=True, auto_decode=False)  # sleeps 10 ms when idle
        sink.flush(ack)
    conn.close()


def _run_async(sink: Sink, setup) -> None:  # an event loop; setup(on) returns (async ack, close)

    async def main() -> None:
        async def flush() -> None:
            while sink.pending:
                tag = sink.pending.popleft()
                await ack(tag)
                sink.last_acked = tag

        async def on(body: bytes, tag: int) -> None:
            sink.on(body, tag)
            await flush()

        ack, close = await setup(on)
        while not sink.finished:
            await asyncio.sleep(0.01)
            await flush()
        await close()

    asyncio.run(main())


def run_aiormq(url: str, sink: Sink, prefetch: int) -> None:
    import aiormq

    async def setup(on):
        conn = await aiormq.connect(url)
        ch = await conn.channel()
        await ch.basic_qos(prefetch_count=prefetch)
        await ch.basic_consume(QUEUE, lambda msg: on(msg.body, msg.delivery_tag), no_ack=False)
        return (lambda tag: ch.basic_ack(tag, multiple=True)), conn.close

    _run_async(sink, setup)


def run_aio_pika(url: str, sink: Sink, prefetch: int) -> None:
    import aio_pika

    async def setup(on):
        conn = await aio_pika.connect(url)
        ch = await conn.channel()
        await ch.set_qos(prefetch_count=prefetch)
        raw = await ch.get_underlay_channel()
        q = await ch.get_queue(QUEUE, ensure=False)
        await q.consume(lambda msg: on(msg.body, msg.delivery_tag), no_ack=False)
        return (lambda tag: raw.basic_ack(tag, multiple=True)), conn.close

    _run_async(sink, setup)


def run_rabbitpy(url: str, sink: Sink, prefetch: int) -> None:
    import rabbitpy
    from pamqp import commands  # Basic.Ack(multiple=True): what Message.ack(all_previous=True) sends

    with rabbitpy.Connection(url) as conn, conn.channel() as ch:
        q = rabbitpy.Queue(ch, QUEUE)
        on = sink.handler(lambda tag: ch.write_frame(commands.Basic.Ack(delivery_tag=tag, multiple=True)))
        for msg in q.consume(prefetch=prefetch):
            on(msg.body, msg.delivery_tag)
            if sink.finished:
                break
        if q.consuming:
            q.stop_consuming()


def _drain(conn, ch, sink: Sink) -> None:
    ack = lambda tag: ch.basic_ack(tag, multiple=True)  # noqa: E731
    while not sink.finished:
        with contextlib.suppress(TimeoutError):  # batch mode: look at the acks every 10 ms
            conn.drain_events(timeout=0.01 if sink.batch else 1.0)
        sink.flush(ack)


def run_py_amqp(url: str, sink: Sink, prefetch: int) -> None:
    import amqp

    with amqp.Connection(host=f"127.0.0.1:{url.split(':')[3].split('/')[0]}") as conn:
        ch = conn.channel()
        ch.basic_qos(0, prefetch, False)
        on = sink.handler(lambda tag: ch.basic_ack(tag, multiple=True))
        ch.basic_consume(QUEUE, callback=lambda msg: on(msg.body, msg.delivery_tag))
        _drain(conn, ch, sink)


def run_kombu(url: str, sink: Sink, prefetch: int) -> None:
    import kombu

    with kombu.Connection(url.replace("amqp://", "pyamqp://")) as conn:
        ch = conn.channel()
        on = sink.handler(lambda tag: ch.basic_ack(tag, multiple=True))
        q = kombu.Queue(QUEUE, no_declare=True)
        cb = lambda msg: on(msg.body, msg.delivery_tag)  # noqa: E731
        with kombu.Consumer(ch, queues=[q], on_message=cb, prefetch_count=prefetch):
            _drain(conn, ch, sink)


def run_librabbitmq(url: str, sink: Sink, prefetch: int) -> None:
    import librabbitmq

    conn = librabbitmq.Connection(host=f"127.0.0.1:{url.split(':')[3].split('/')[0]}")
    ch = conn.channel()
    ch.basic_qos(prefetch_count=prefetch)
    on = sink.handler(lambda tag: ch.basic_ack(tag, multiple=True))
    ch.basic_consume(QUEUE, callback=lambda msg: on(msg.body, msg.delivery_info["delivery_tag"]))
    _drain(conn, ch, sink)
    conn.close()


def tree_cpu_s(root: int) -> float:  # utime+stime of root and its live descendants, in seconds
    stats: dict[int, tuple[int, int]] = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
            stats[int(d)] = (int(rest[1]), int(rest[11]) + int(rest[12]))
        except OSError:
            continue
    tree, new = set(), {root}
    while new:
        tree |= new
        new = {pid for pid, (ppid, _) in stats.items() if ppid in new} - tree
    return sum(stats[pid][1] for pid in tree if pid in stats) / os.sysconf("SC_CLK_TCK")


def preload(url: str, n: int) -> None:
    with pika.BlockingConnection(pika.URLParameters(url)) as conn:
        ch = conn.channel()
        ch.queue_delete(QUEUE)
        ch.queue_declare(QUEUE, durable=True)
        props = pika.BasicProperties(delivery_mode=2)
        for _ in range(n):
            ch.basic_publish("", QUEUE, BODY, props)
        while ch.queue_declare(QUEUE, passive=True).method.message_count < n:
            time.sleep(0.1)


def measure(server: RabbitMQServer, client: str, variant: str, n: int, limit: float) -> dict:
    preload(server.url, n)
    batch, prefetch = (25_000, 50_000) if variant == "batch" else (0, 5000)
    cpu0, broker0, t0 = time.process_time(), tree_cpu_s(server.proc.pid), time.monotonic()
    sink = Sink(n, batch, t0 + limit)
    error: list[Exception] = []

    def consume() -> None:
        try:
            globals()["run_" + client.replace("-", "_")](server.url, sink, prefetch)
        except Exception as e:  # noqa: BLE001 (reported: one client must not stop the rest)
            error.append(e)
            sink.deadline = 0

    (thread := threading.Thread(target=consume)).start()
    while batch and not sink.finished and thread.is_alive():
        with contextlib.suppress(queue.Empty):
            sink.pending.append(sink.handoff.get(timeout=0.1)[1])  # one multiple-ack per list
    thread.join()
    wall = time.monotonic() - t0
    cpu, broker = time.process_time() - cpu0, tree_cpu_s(server.proc.pid) - broker0
    us = 1e6 / (sink.count or 1)
    row = {"client": client, "variant": variant, "messages": sink.count, "acked": sink.last_acked}
    row |= {"wall_s": round(wall, 3), "msg_per_s": round(sink.count / wall)}
    row |= {"client_cpu_us_per_msg": round(cpu * us, 2), "broker_cpu_us_per_msg": round(broker * us, 2)}
    return row | {"error": repr(error[0]) if error else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", default=",".join(CLIENTS))
    ap.add_argument("--n", type=int, default=100_000, help="messages (at most 200 000)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/measured/rmq-clients-2026-11-26.json")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the broker is stopped too
    n = min(args.n, 200_000)
    dists = {d.metadata["Name"].lower(): d.version for d in metadata.distributions()}
    dist = {"py-amqp": "amqp", "librabbitmq": "librabbitmq-fork"}
    versions = {c: dists.get(dist.get(c, c)) for c in CLIENTS}
    clients = [c for c in args.clients.split(",") if versions.get(c)]
    rows: list[dict] = []
    with RabbitMQServer() as server:
        for variant in ("plain", "batch"):
            if variant == "batch":  # rows sorted slowest first: a client's fastest run wins
                ok = sorted((r for r in rows if r["acked"] >= n), key=lambda r: r["msg_per_s"])
                speed = {r["client"]: r["msg_per_s"] for r in ok if r["client"] not in ("pika", "rabbitpy")}
                top = sorted(speed, key=lambda c: -speed[c])[:2]  # and pika (rabbitpy's loop cannot poll)
                clients = [c for c in CLIENTS if c in top or c == "pika"]
            for rnd in range(1, args.rounds + 1):
                for client in clients:
                    rows.append({"round": rnd, **measure(server, client, variant, n, LIMIT_S)})
                    print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'client':<12}{'variant':<8}{'round':>6}{'msg/s':>9}{'client µs':>11}{'broker µs':>11}  note")
    for r in rows:
        note = r["error"] or ("" if r["acked"] >= n else f"stopped at {r['messages']} (time limit)")
        print(
            f"{r['client']:<12}{r['variant']:<8}{r['round']:>6}{r['msg_per_s']:>9}"
            f"{r['client_cpu_us_per_msg']:>11}{r['broker_cpu_us_per_msg']:>11}  {note}"
        )
    workload = {"messages": n, "body_bytes": len(BODY), "prefetch": 5000, "ack_every": 1000, "batch": 25_000}
    with open(args.out, "w") as f:
        json.dump({"workload": workload, "versions": versions, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
