"""Sources at scale: the cost per operation must stay flat as the numbers grow ten-fold.

    .venv/bin/python -m benchmarks.scale_sources                 # the defaults below
    .venv/bin/python -m benchmarks.scale_sources --files 2000,20000 --rows 0,200000

Six phases (``--phases``), each bounded in size (and so in time: a minute or two on two
busy cores):

* **files**: N small files (2 lines each) dropped in a folder, read by the Files source
  driven directly (no Spark: what is timed is the source's own work, the scan, the state
  store and the settlement), for ``done="record"`` and ``done="move"``. Reported: the
  cost per file from ``open()`` to the last settlement, and the longest single ``pull``
  or ``ack`` call (a scan is done in bounded steps, so it never blocks settling long).
* **state**: the Files source's state store holding R recorded instances; timed: the
  record of a new instance and one settlement's progress update (each one transaction,
  fsynced), and a lookup by name. For scale, the JSON state file that d2a9abf rewrote
  whole at each of those, at the same R.
* **offsets**: an :class:`~ackflow.core.offsets.OffsetTracker` with one declared gap of
  length L (a stream resuming below its first kept offset), then a settle past it: time
  and peak memory.
* **embedded**: an embedded queue file whose history is N messages (N remembered ids,
  N / 10 dead letters) with N waiting: publishing with ``remember=True``, refusing a
  remembered id, and consuming (pull, ack) per message.
* **rabbitmq**: N messages on a classic queue consumed by the source (a throwaway
  broker): cost per message and what the source remembers at the end.
* **stream**: N offsets in a RabbitMQ stream consumed by the source (each ack stores
  the committed offset), then a restart at the stored offset.

Prints a table per phase and one JSON object (also written to ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import tracemalloc
from typing import Any

from ackflow.core.offsets import OffsetTracker
from ackflow.sources import Files
from ackflow.sources.files_state import FileStates, new_id

LINES = 2


def _fill(folder: str, n: int) -> None:
    for i in range(n):
        tmp = os.path.join(folder, f".f{i}.tmp")
        with open(tmp, "w") as f:
            f.write("".join(json.dumps({"f": i, "n": k}) + "\n" for k in range(LINES)))
        os.rename(tmp, os.path.join(folder, f"f{i:06d}.jsonl"))


def files_phase(n: int, done: str) -> dict[str, Any]:
    folder = tempfile.mkdtemp(prefix="af-scale-files-")
    try:
        _fill(folder, n)
        src = Files(folder, done=done, scan_interval_s=0.05)
        src.configure(max_inflight=2000, error_sink=False)
        began = time.perf_counter()
        src.open()
        opened = time.perf_counter() - began
        got, longest, calls = 0, 0.0, 0
        while got < n * LINES:
            t = time.perf_counter()
            batch = src.pull(1000, 0.05)
            t2 = time.perf_counter()
            src.ack(batch)
            t3 = time.perf_counter()
            longest = max(longest, t2 - t, t3 - t2)
            calls += 1
            got += len(batch)
            if time.perf_counter() - began > 300:
                raise RuntimeError(f"files phase: {got} of {n * LINES} lines after 300 s")
        took = time.perf_counter() - began
        src.close()
        return {
            "files": n,
            "done": done,
            "open_s": round(opened, 3),
            "total_s": round(took, 2),
            "us_per_file": round(took / n * 1e6),
            "longest_call_ms": round(longest * 1e3, 1),
            "pull_ack_calls": calls,
        }
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _median_ms(fn: Any, rounds: int) -> float:
    for i in range(min(5, rounds)):  # warm-up
        fn(-1 - i)
    times = []
    for i in range(rounds):
        t = time.perf_counter()
        fn(i)
        times.append((time.perf_counter() - t) * 1e3)
    return round(statistics.median(times), 3)


def state_phase(rows: int, rounds: int, json_too: bool) -> dict[str, Any]:
    folder = tempfile.mkdtemp(prefix="af-scale-state-")
    try:
        states = FileStates(os.path.join(folder, "state.db"))
        ids = []
        for lo in range(0, rows, 50_000):  # recorded in large transactions (fill only)
            with states.tx():
                for i in range(lo, min(rows, lo + 50_000)):
                    fid = new_id()
                    ids.append(fid)
                    states.insert(fid, f"f{i:07d}.jsonl", (1, i, 100, 1_700_000_000 + i), i)
                    states.set_status(fid, "done")

        if not ids:  # one row, so that a settlement updates something
            with states.tx():
                ids.append(new_id())
                states.insert(ids[0], "f.jsonl", (1, 0, 100, 1), 1)
        states.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # the fill's WAL is not timed

        def insert(i: int) -> None:
            with states.tx():
                states.insert(new_id(), f"new-{i}.jsonl", (1, 10**9 + i, 100, 1), 1)

        def progress(i: int) -> None:
            with states.tx():
                states.progress([(ids[i * 7919 % len(ids)], i, 0)])

        out: dict[str, Any] = {
            "rows": rows,
            "insert_ms": _median_ms(insert, rounds),
            "settle_ms": _median_ms(progress, rounds),
            "lookup_ms": _median_ms(
                lambda i: states.by_name(f"f{i * 7919 % max(rows, 1):07d}.jsonl"), rounds
            ),
        }
        states.close()
        size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
        out["store_mb"] = round(size / 1e6, 1)
        if json_too:  # d2a9abf: the whole state.json rewritten and fsynced per change
            entries = {
                new_id(): {
                    "name": f"f{i:07d}.jsonl",
                    "fingerprint": [1, i, 100, i],
                    "committed": 2,
                    "dead": 0,
                    "done": True,
                }
                for i in range(rows)
            }
            path = os.path.join(folder, "state.json")

            def rewrite(_: int) -> None:
                with open(path + ".tmp", "w") as f:
                    json.dump({"version": 2, "files": entries}, f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(path + ".tmp", path)

            out["old_json_write_ms"] = _median_ms(rewrite, 3)
            out["old_json_mb"] = round(os.path.getsize(path) / 1e6, 1)
        return out
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def offsets_phase(length: int) -> dict[str, Any]:
    tracemalloc.start()
    t = time.perf_counter()
    tracker = OffsetTracker(start=0)
    tracker.pulled(0)
    tracker.gap(1, length + 1)
    tracker.pulled(length + 1)
    tracker.settled_many([0, length + 1])
    took = time.perf_counter() - t
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert tracker.committed == length + 2
    return {"gap": length, "us": round(took * 1e6, 1), "peak_kb": round(peak / 1024, 1)}


def _consume(src: Any, n: int, chunk: int, limit_s: float) -> tuple[float, float]:
    """Pull and ack ``n`` deliveries; (seconds, longest pull or ack in seconds)."""
    began = time.perf_counter()
    got, longest = 0, 0.0
    while got < n:
        t = time.perf_counter()
        batch = src.pull(chunk, 0.2)
        t2 = time.perf_counter()
        src.ack(batch)
        longest = max(longest, t2 - t, time.perf_counter() - t2)
        got += len(batch)
        if time.perf_counter() - began > limit_s:
            raise RuntimeError(f"{got} of {n} after {limit_s:g} s")
    return time.perf_counter() - began, longest


def embedded_phase(n: int) -> dict[str, Any]:
    """A queue file whose history is ``n`` messages: ``n`` remembered ids and ``n / 10``
    dead letters already there, ``n`` messages waiting. Timed: publishing with
    ``remember=True`` (1 000 new messages, the id check against ``n`` remembered), one
    re-publish of 1 000 remembered ids (all refused), and consuming the ``n`` messages
    (pull 500, ack) per message."""
    from ackflow.core.policy import RetryPolicy
    from ackflow.embedded import EmbeddedQueue
    from ackflow.sources import EmbeddedQueueSource

    folder = tempfile.mkdtemp(prefix="af-scale-embedded-")
    try:
        db = os.path.join(folder, "q.db")
        q = EmbeddedQueue(db)
        dead = n // 10
        for lo in range(0, n + dead, 10_000):
            hi = min(lo + 10_000, n + dead)
            q.publish(
                "in",
                [json.dumps({"n": i}).encode() for i in range(lo, hi)],
                msg_ids=[f"m{i}" for i in range(lo, hi)],
                remember=True,
            )
        rows = q.lease_rows("in", dead, visibility_timeout=300)  # the oldest: dead letters
        q.dead_letter("in", [(r[0], r[4], "check", "poison") for r in rows])
        publish, refuse = [], []
        for r in range(7):  # the median of 7 rounds of 1 000
            t = time.perf_counter()
            q.publish("new", [b"{}"] * 1000, msg_ids=[f"x{r}-{i}" for i in range(1000)], remember=True)
            publish.append(time.perf_counter() - t)
            t = time.perf_counter()
            old = [f"m{(r * 7919 + i * 104729) % n}" for i in range(1000)]  # spread out
            assert q.publish("in", [b"{}"] * 1000, msg_ids=old, remember=True) == 0
            refuse.append(time.perf_counter() - t)
        publish_us = statistics.median(publish) / 1000 * 1e6
        refuse_us = statistics.median(refuse) / 1000 * 1e6
        q.close()
        src = EmbeddedQueueSource(db, "in", policy=RetryPolicy(max_deliveries=2))
        src.configure(max_inflight=2000, error_sink=False)
        src.open()
        took, longest = _consume(src, n, 500, 300)
        stats = src.q.stats("in")
        src.close()
        assert stats["dead_lettered"] == dead and stats["ready"] == 0
        return {
            "messages": n,
            "dead_letters": dead,
            "remembered_ids": n + dead + 7000,
            "publish_remembered_us": round(publish_us, 1),
            "refuse_remembered_us": round(refuse_us, 1),
            "consume_us": round(took / n * 1e6, 1),
            "longest_call_ms": round(longest * 1e3, 1),
            "file_mb": round(os.path.getsize(db) / 1e6, 1),
        }
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def rabbitmq_phase(url: str, n: int) -> dict[str, Any]:
    """``n`` messages (with message ids) on a classic queue, consumed by the source
    (window 2 000, pull 500, ack): cost per message, and what the source remembers at
    the end (delivery counts per id, capped; retry keys of unsettled deliveries)."""
    import uuid

    import pika

    from ackflow.sinks.rabbitmq import publish_confirmed
    from ackflow.sources import RabbitMQ

    queue = f"scale-{uuid.uuid4().hex[:8]}"
    conn = pika.BlockingConnection(pika.URLParameters(url))
    conn.channel().queue_declare(queue, durable=True)
    conn.close()
    for lo in range(0, n, 20_000):
        msgs = [
            (queue, json.dumps({"n": i}).encode(), pika.BasicProperties(delivery_mode=2, message_id=f"k{i}"))
            for i in range(lo, min(lo + 20_000, n))
        ]
        assert not publish_confirmed(url, "", msgs)
    src = RabbitMQ(url, queue)  # dead letters would go to the flow's error sink
    src.configure(max_inflight=2000, error_sink=True)
    src.open()
    try:
        took, longest = _consume(src, n, 500, 300)
        remembered = {"seen_ids": len(src._seen), "retry_keys": len(src._retry_keys)}
    finally:
        src.close()
    conn = pika.BlockingConnection(pika.URLParameters(url))
    conn.channel().queue_delete(queue)
    conn.close()
    return {
        "messages": n,
        "consume_us": round(took / n * 1e6, 1),
        "longest_call_ms": round(longest * 1e3, 1),
        **remembered,
    }


def stream_phase(server: Any, n: int) -> dict[str, Any]:
    """``n`` offsets in a stream, consumed by the source (window 2 000, pull 500, ack:
    each ack stores the committed offset on the broker): cost per offset, then a restart
    of the same consumer at the stored offset (open to the first delivery)."""
    import asyncio
    import uuid

    from rstream import Producer

    from ackflow.sources import RabbitMQStream

    stream = f"scale-{uuid.uuid4().hex[:8]}"

    async def fill(lo: int, hi: int) -> None:
        async with Producer("127.0.0.1", server.stream_port, username="guest", password="guest") as p:
            await p.create_stream(stream, exists_ok=True)
            for k in range(lo, hi, 500):
                await p.send_batch(
                    stream, [json.dumps({"n": i}).encode() for i in range(k, min(k + 500, hi))]
                )

    asyncio.run(fill(0, n))

    def start() -> Any:
        src = RabbitMQStream("127.0.0.1", server.stream_port, stream, "c1")
        src.configure(max_inflight=2000, error_sink=True)
        src.open()
        return src

    src = start()
    try:
        took, longest = _consume(src, n, 500, 300)
        assert src.committed == n
    finally:
        src.close()
    asyncio.run(fill(n, n + 1))  # one more, for the restart to read
    t = time.perf_counter()
    src = start()
    try:
        got = []
        while not got and time.perf_counter() - t < 30:
            got = src.pull(1, 0.2)
        restart = time.perf_counter() - t
        # (offsets are not message numbers: the broker's offset-tracking entries take
        # offsets too) a restart reads again what was not stored, never skips a message
        first = json.loads(got[0].body)["n"] if got else None
        assert first is not None and first <= n, first
        reread = n - first
    finally:
        src.close()
    return {
        "offsets": n,
        "consume_us": round(took / n * 1e6, 1),
        "longest_call_ms": round(longest * 1e3, 1),
        "restart_ms": round(restart * 1e3, 1),
        "reread_at_restart": reread,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--phases",
        default="files,state,offsets,embedded,rabbitmq,stream",
        help="which phases (rabbitmq and stream start a throwaway broker)",
    )
    p.add_argument("--files", default="2000,20000", help="folder sizes (default 2000,20000)")
    p.add_argument(
        "--rows",
        default="0,20000,200000",
        help="recorded instances in the state store (default 0,20000,200000)",
    )
    p.add_argument("--gaps", default="1000,1000000,1000000000")
    p.add_argument("--rounds", type=int, default=100, help="timed writes per store size")
    p.add_argument("--queue", default="10000,100000", help="embedded queue history sizes")
    p.add_argument("--amqp", default="5000,50000", help="RabbitMQ queue messages")
    p.add_argument("--offsets", default="5000,50000", help="RabbitMQ stream offsets")
    p.add_argument("--out", default="benchmarks/results/scale_sources.json")
    args = p.parse_args()
    phases = {x.strip() for x in args.phases.split(",") if x.strip()}
    result: dict[str, Any] = {}

    if "files" in phases:
        files = [files_phase(int(n), done) for n in args.files.split(",") for done in ("record", "move")]
        print(f"{'files':>8} {'done':>7} {'open s':>7} {'total s':>8} {'µs/file':>8} {'longest call ms':>16}")
        for r in files:
            print(
                f"{r['files']:>8,} {r['done']:>7} {r['open_s']:>7} {r['total_s']:>8} "
                f"{r['us_per_file']:>8} {r['longest_call_ms']:>16}"
            )
        result["files"] = files

    if "state" in phases:
        state = [state_phase(int(n), args.rounds, json_too=int(n) > 0) for n in args.rows.split(",")]
        print(
            f"\n{'rows':>8} {'insert ms':>10} {'settle ms':>10} {'lookup ms':>10} "
            f"{'store MB':>9} {'old json ms':>12} {'old json MB':>12}"
        )
        for r in state:
            print(
                f"{r['rows']:>8,} {r['insert_ms']:>10} {r['settle_ms']:>10} "
                f"{r['lookup_ms']:>10} {r['store_mb']:>9} "
                f"{r.get('old_json_write_ms', '-'):>12} {r.get('old_json_mb', '-'):>12}"
            )
        result["state"] = state

    if "offsets" in phases:
        offsets = [offsets_phase(int(n)) for n in args.gaps.split(",")]
        print(f"\n{'gap':>14} {'µs':>8} {'peak KiB':>9}")
        for r in offsets:
            print(f"{r['gap']:>14,} {r['us']:>8} {r['peak_kb']:>9}")
        result["offsets"] = offsets

    if "embedded" in phases:
        emb = [embedded_phase(int(n)) for n in args.queue.split(",")]
        print(
            f"\n{'messages':>9} {'dead':>7} {'remembered':>11} {'publish µs':>11} "
            f"{'refuse µs':>10} {'consume µs':>11} {'longest ms':>11} {'file MB':>8}"
        )
        for r in emb:
            print(
                f"{r['messages']:>9,} {r['dead_letters']:>7,} {r['remembered_ids']:>11,} "
                f"{r['publish_remembered_us']:>11} {r['refuse_remembered_us']:>10} "
                f"{r['consume_us']:>11} {r['longest_call_ms']:>11} {r['file_mb']:>8}"
            )
        result["embedded"] = emb

    if phases & {"rabbitmq", "stream"}:
        from ackflow.servers import RabbitMQServer

        server = RabbitMQServer(streams=True).start()
        try:
            if "rabbitmq" in phases:
                amqp = [rabbitmq_phase(server.url, int(n)) for n in args.amqp.split(",")]
                print(
                    f"\n{'messages':>9} {'consume µs':>11} {'longest ms':>11} "
                    f"{'seen ids':>9} {'retry keys':>11}"
                )
                for r in amqp:
                    print(
                        f"{r['messages']:>9,} {r['consume_us']:>11} {r['longest_call_ms']:>11} "
                        f"{r['seen_ids']:>9,} {r['retry_keys']:>11,}"
                    )
                result["rabbitmq"] = amqp
            if "stream" in phases:
                streams = [stream_phase(server, int(n)) for n in args.offsets.split(",")]
                print(
                    f"\n{'offsets':>9} {'consume µs':>11} {'longest ms':>11} "
                    f"{'restart ms':>11} {'re-read':>8}"
                )
                for r in streams:
                    print(
                        f"{r['offsets']:>9,} {r['consume_us']:>11} {r['longest_call_ms']:>11} "
                        f"{r['restart_ms']:>11} {r['reread_at_restart']:>8}"
                    )
                result["stream"] = streams
        finally:
            server.close()

    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
