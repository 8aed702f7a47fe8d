"""Small pika helpers for the RabbitMQ tests (declare, publish, drain)."""

from __future__ import annotations

import json
import uuid

import pika


def connect(url):
    return pika.BlockingConnection(pika.URLParameters(url))


def names(prefix):
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def setup(
    url, *, queue, arguments=None, out_exchange=None, out_queue=None, out_args=None, dlx=None, dead_queue=None
):
    """Declare the input queue, an output exchange bound to an output queue, and a
    dead-letter exchange bound to a dead-letter queue (each if named)."""
    conn = connect(url)
    ch = conn.channel()
    if dlx:
        ch.exchange_declare(dlx, "fanout", durable=True)
        ch.queue_declare(dead_queue, durable=True)
        ch.queue_bind(dead_queue, dlx)
    if out_exchange:
        ch.exchange_declare(out_exchange, "direct", durable=True)
        ch.queue_declare(out_queue, durable=True, arguments=out_args)
        ch.queue_bind(out_queue, out_exchange, routing_key=out_queue)
    ch.queue_declare(queue, durable=True, arguments=arguments)
    conn.close()


def publish(url, queue, rows, *, ids=None):
    """Publish JSON rows (persistent, with confirms in one go via a transaction-free
    blocking channel); ``ids`` become message_id properties."""
    conn = connect(url)
    ch = conn.channel()
    ch.confirm_delivery()
    for i, r in enumerate(rows):
        props = pika.BasicProperties(delivery_mode=2, message_id=ids[i] if ids is not None else None)
        ch.basic_publish("", queue, json.dumps(r).encode(), props)
    conn.close()


def publish_many(url, queue, rows, ids):
    """Fast: asynchronous confirms (the sink's own publisher)."""
    from ackflow.sinks.rabbitmq import publish_confirmed

    msgs = [
        (queue, json.dumps(r).encode(), pika.BasicProperties(delivery_mode=2, message_id=ids[i]))
        for i, r in enumerate(rows)
    ]
    failed = publish_confirmed(url, "", msgs)
    assert not failed, list(failed.items())[:3]


def drain(url, queue, limit=10**7):
    """Take every message of ``queue`` (acking them): list of (message_id, body dict,
    headers)."""
    conn = connect(url)
    ch = conn.channel()
    ch.basic_qos(prefetch_count=2000)
    out = []
    for method, props, body in ch.consume(queue, auto_ack=True, inactivity_timeout=0.5):
        if method is None or len(out) >= limit:
            break
        out.append((props.message_id, json.loads(body), props.headers or {}))
    ch.cancel()
    conn.close()
    return out


def count(url, queue):
    conn = connect(url)
    n = conn.channel().queue_declare(queue, passive=True).method.message_count
    conn.close()
    return n


def stream_publish(server, stream, bodies):
    """Create ``stream`` (if missing) and append ``bodies`` with publisher confirms."""
    import asyncio

    from rstream import Producer

    async def go():
        async with Producer("127.0.0.1", server.stream_port, username="guest", password="guest") as p:
            await p.create_stream(stream, exists_ok=True)
            for k in range(0, len(bodies), 500):
                await p.send_batch(stream, list(bodies[k : k + 500]))

    asyncio.run(go())


def fds():
    """This process's open file descriptors and what each one is (from /proc)."""
    import os

    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed between listdir and readlink
    return out


def connections_to(port):
    """The TCP sockets this process holds open to 127.0.0.1:``port`` (their inodes, read
    from /proc): compare two of them to see which connections a piece of code left
    open, whatever other threads of the process open or close meanwhile."""
    inodes = {link[8:-1] for link in fds().values() if link.startswith("socket:[")}
    found = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            remote_port, state, inode = int(cols[2].rsplit(":", 1)[1], 16), cols[3], cols[9]
            if remote_port == port and inode in inodes and state != "06":  # 06: TIME_WAIT
                found.add(inode)
    return found
