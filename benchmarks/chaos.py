"""Chaos soak: a real pipeline under SIGKILLs, broker restarts, database outages and
armed fault points, then checked message by message against what was published.

    .venv/bin/python -m benchmarks.chaos --minutes 3 [--seed S] [--json]

It starts its own RabbitMQ (with streams) and PostgreSQL on 127.0.0.1 (free ports) and
a temporary directory. A publisher thread feeds, at a steady bounded rate, a quorum
queue (``x-delivery-limit`` and a dead-letter exchange into a queue of its own), a
stream and a Files directory; each message has a unique ``id``, an optional nested
object, a list that is often empty and a field that is often null, and about 1% are
poison (invalid JSON, or ``qty`` 0 which the ``validate`` step refuses). The queue's
producer re-sends a batch it holds no confirm for with the same ``message_id``s: after
a connection reset the whole batch, and at random (``--resend``) a batch whose confirm
it pretends was lost. The pipeline (``benchmarks.chaos_pipeline``) runs in a child process. A fault schedule,
drawn from ``--seed`` and printed at the start, SIGKILLs the child's process group at
random moments and restarts it, restarts the broker twice, stops PostgreSQL twice, and
arms a random fault point (``ACKFLOW_FAULTS``) for some child starts.

At the end the publisher stops, a last child runs until idle without faults, and the
output is checked against what was published: every message accounted for exactly
once (a good one written once in PostgreSQL and once in Parquet with its values as
published, or a poison one dead-lettered once by ackflow; either may instead be in the
broker's dead-letter queue, never also elsewhere), no good message dead-lettered by
ackflow, the queue empty, the stream's stored offset at its end, every
file processed. It prints a table and, with ``--json``, one JSON object on the last
line. The exit status is 1 when anything was lost or duplicated (or a check failed).
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

QUEUE = "chaos-orders"
DLX = "chaos-dlx"  # the quorum queue's dead-letter exchange (fanout) ...
DLX_QUEUE = "chaos-dlx-q"  # ... and the queue it routes to
STREAM = "chaos-events"
TABLE = "chaos_rows"
DEAD_TABLE = "chaos_dead"
KINDS = ("book", "game", "tool", "food")
FAULT_SPECS = (
    "batch.after_job=exit@2",
    "batch.after_commit=exit@2",
    "engine.mid_ack=exit@1",
    "engine.dead_letter_written=exit@1",
    "parquet.before_record=exit@1",
    "parquet.after_record=exit@1",
    "parquet.after_rename=exit@2",
    "postgres.before_commit=exit@2",
    "postgres.after_commit=exit@3",
    "files.before_commit=exit@3",
    "rabbitmq.ack=exit@2",
)
ID_RE = re.compile(r'"id":\s*"([qsf]\d{7})"')


# ---------------------------------------------------------------------------- schedule

@dataclass
class Schedule:
    seed: int
    minutes: float
    kills: list[float]
    broker_restarts: list[float]
    db_outages: list[tuple[float, float]]  # (at, seconds)
    fault_rate: float = 0.4

    @classmethod
    def draw(cls, seed: int, minutes: float) -> Schedule:
        rng = random.Random(seed)
        d = minutes * 60.0
        n = max(6, math.ceil(minutes * 1.2))
        slot = d / (n + 1)
        kills = sorted(slot * (i + 1) + rng.uniform(-0.4, 0.4) * slot for i in range(n))
        brokers = [rng.uniform(0.2, 0.32) * d, rng.uniform(0.6, 0.72) * d]
        scale = min(1.0, max(0.25, minutes / 20.0))
        outages = [(rng.uniform(0.4, 0.5) * d, rng.uniform(10, 30) * scale),
                   (rng.uniform(0.8, 0.86) * d, rng.uniform(10, 30) * scale)]
        return cls(seed, minutes, kills, brokers, outages)

    def describe(self) -> str:
        return (f"seed {self.seed}, {self.minutes:g} min: "
                f"{len(self.kills)} SIGKILLs at {', '.join(f'{t:.0f}' for t in self.kills)} s; "
                f"broker restarts at {', '.join(f'{t:.0f}' for t in self.broker_restarts)} s; "
                f"PostgreSQL down at "
                + ", ".join(f"{t:.0f} s for {s:.1f} s" for t, s in self.db_outages)
                + f"; a fault point armed at ~{self.fault_rate:.0%} of child starts")

    def retry_policy(self) -> dict[str, float]:
        """Retries must outlast the longest outage (a good message must never be given
        up because the database was down): backoff sums to > 2x the longest outage."""
        longest = max(s for _, s in self.db_outages)
        max_backoff = 2.0 if longest < 10 else 5.0
        total, n, b = 0.0, 0, 0.25
        while total < 2 * longest + 10:
            total += min(b * 2 ** n, max_backoff)
            n += 1
        return {"max_deliveries": n + 1, "backoff_s": b, "max_backoff_s": max_backoff}


# ---------------------------------------------------------------------------- publisher

@dataclass
class Published:
    good: set[str] = field(default_factory=set)
    poison: set[str] = field(default_factory=set)
    per_source: Counter[str] = field(default_factory=Counter)
    copies: Counter[str] = field(default_factory=Counter)  # queue message -> publishes
    expect: dict[str, dict[str, Any]] = field(default_factory=dict)  # good id -> its row
    resent: int = 0  # queue messages published again with the same message_id
    stream_count: int = 0
    errors: int = 0
    error_log: list[str] = field(default_factory=list)


class Publisher(threading.Thread):
    """Publishes ``rate`` messages a second to each of the three sources, recording
    every message once the broker confirmed it (or the file was renamed in)."""

    def __init__(self, rmq: Any, files_dir: str, rate: float, seed: int,
                 resend: float = 0.05) -> None:
        super().__init__(name="publisher", daemon=True)
        self.rmq, self.files_dir, self.rate, self.resend = rmq, files_dir, rate, resend
        self.rng = random.Random(seed * 7919 + 1)
        self.out = Published()
        self.stop_event = threading.Event()
        self.paused = threading.Event()
        self.idle = threading.Event()  # set while no publish is under way
        self.idle.set()
        self._n = 0
        self._conn: Any = None
        self._pending_lines: list[tuple[str, str, bool]] = []
        self._files = 0
        self._carry: dict[str, list[tuple[str, bytes, bool]]] = {"q": [], "s": []}

    def message(self, src: str) -> tuple[str, str, bool]:
        self._n += 1
        mid = f"{src}{self._n:07d}"
        kind = self.rng.choice(KINDS)
        r = self.rng.random()
        if r < 0.005:  # invalid JSON
            return mid, f'{{"id": "{mid}", "kind": "{kind}", "qty": ', True
        qty = 0 if r < 0.01 else self.rng.randint(1, 9)  # qty 0 fails `validate`
        n = self.rng.randint(1, 3)
        body: dict[str, Any] = {"id": mid, "kind": kind, "qty": qty, "lines": n, "pad": "x" * 40}
        # null, empty and nested values: an optional object (present, null or absent)
        # with a nested object holding a null and a list that may be empty; a list that
        # is often empty; a field that is often null (or the empty string)
        shape = self.rng.random()
        if shape < 0.5:
            body["opt"] = {"code": self.rng.choice(["", "a1", "zz"]),
                           "dims": {"w": self.rng.randint(0, 5),
                                    "h": None if self.rng.random() < 0.5 else 7},
                           "marks": [] if self.rng.random() < 0.5 else [1, n]}
        elif shape < 0.75:
            body["opt"] = None
        body["tags"] = [] if self.rng.random() < 0.4 else ["x", kind]
        body["note"] = self.rng.choice([None, None, "", "ok"])
        if r >= 0.01:
            self.out.expect[mid] = {"total": qty * n, "n_lines": n, "members": list(range(n)),
                                    "opt": body.get("opt"), "tags": body["tags"],
                                    "note": body["note"]}
        return mid, json.dumps(body), r < 0.01

    def record(self, src: str, mid: str, poison: bool) -> None:
        if src == "queue":
            self.out.copies[mid] += 1
            if self.out.copies[mid] > 1:
                self.out.resent += 1
                return
        (self.out.poison if poison else self.out.good).add(mid)
        self.out.per_source[src] += 1

    def run(self) -> None:
        tick = 0.5
        per_tick = self.rate * tick
        owed = 0.0
        next_at = time.monotonic()
        last_file = time.monotonic()
        while not self.stop_event.is_set():
            next_at += tick
            time.sleep(max(0.0, next_at - time.monotonic()))
            if self.paused.is_set():
                next_at = time.monotonic()
                continue
            self.idle.clear()
            try:
                owed += per_tick
                n = int(owed)
                owed -= n
                self.publish_queue([*self._carry["q"], *(self._enc(self.message("q")) for _ in range(n))])
                self.publish_stream([*self._carry["s"], *(self._enc(self.message("s")) for _ in range(n))])
                self._pending_lines += [self.message("f") for _ in range(n)]
                if time.monotonic() - last_file >= 2.0:
                    self.write_file()
                    last_file = time.monotonic()
            finally:
                self.idle.set()
        self.write_file()
        self.close()

    @staticmethod
    def _enc(m: tuple[str, str, bool]) -> tuple[str, bytes, bool]:
        return m[0], m[1].encode(), m[2]

    def publish_queue(self, msgs: list[tuple[str, bytes, bool]]) -> None:
        """Publish a batch, as a producer that waits for the batch's confirms does: a
        batch not wholly confirmed (a connection reset) is published again whole, with
        the same ``message_id``s (the same identities: the copies that did arrive are
        repeats), at the next tick; and with probability ``resend`` a confirmed batch is
        published again at once, as after a confirm that timed out."""
        import pika

        self._carry["q"] = []
        k = 0
        try:
            if self._conn is None or self._conn.is_closed:
                self._conn = pika.BlockingConnection(pika.URLParameters(self.rmq.url))
                self._ch = self._conn.channel()
                self._ch.confirm_delivery()
            again = bool(msgs) and self.rng.random() < self.resend
            for mid, body, poison in [*msgs, *(msgs if again else [])]:
                self._ch.basic_publish("", QUEUE, body, pika.BasicProperties(
                    delivery_mode=2, message_id=mid), mandatory=True)
                self.record("queue", mid, poison)
                k += 1
        except (OSError, pika.exceptions.AMQPError) as e:
            # not all confirmed: the whole batch again, with the same message_ids
            self.out.errors += 1
            self.out.error_log.append(f"queue at {k}/{len(msgs)}: {type(e).__name__}: {e}"[:200])
            self._carry["q"] = msgs
            self._conn = None

    def publish_stream(self, msgs: list[tuple[str, bytes, bool]]) -> None:
        from rstream import Producer

        self._carry["s"] = []
        sent = [0]

        async def go() -> None:
            async with Producer("127.0.0.1", self.rmq.stream_port, username="guest",
                                password="guest") as p:
                for mid, body, poison in msgs:
                    await p.send_wait(STREAM, body)
                    self.record("stream", mid, poison)
                    self.out.stream_count += 1
                    sent[0] += 1

        try:
            asyncio.run(asyncio.wait_for(go(), 30))
        except Exception as e:  # noqa: BLE001 - rstream raises many kinds; counted, reported
            # a message not confirmed may still be in the stream: publishing it again
            # could duplicate it under a new offset, so it is not; verify() reads the
            # stream and counts such a message as published (the rest of the batch was
            # never sent). The publisher pauses around broker restarts, yet a stream
            # can still be unavailable for a moment after one.
            self.out.errors += 1
            self.out.error_log.append(
                f"stream at {sent[0]}/{len(msgs)}: {type(e).__name__}: {e}"[:200])

    def write_file(self) -> None:
        if not self._pending_lines:
            return
        self._files += 1
        name = f"chunk-{self._files:05d}.jsonl"
        tmp = os.path.join(self.files_dir, f".{name}.tmp")
        with open(tmp, "w") as f:
            for _, line, _ in self._pending_lines:
                f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, os.path.join(self.files_dir, name))
        for mid, _, poison in self._pending_lines:
            self.record("files", mid, poison)
        self._pending_lines = []

    def close(self) -> None:
        try:
            if self._conn is not None and self._conn.is_open:
                self._conn.close()
        except Exception:  # noqa: BLE001 - closing a connection the broker may have dropped
            pass


# ---------------------------------------------------------------------------- the child

def proc_rss(pgid: int) -> tuple[int, int]:
    """(RSS of the process ``pgid``, RSS of every process in its group), in bytes."""
    page = os.sysconf("SC_PAGE_SIZE")
    own = total = 0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) != pgid:  # field 5: pgrp
            continue
        rss = int(fields[21]) * page  # field 24: rss pages
        total += rss
        if int(d) == pgid:
            own = rss
    return own, total


class Child:
    """The pipeline process (its own process group: driver, JVM, Python workers)."""

    def __init__(self, cfg: dict[str, Any], workdir: str, faults: str, until_idle: float | None,
                 log: Any) -> None:
        from ackflow.servers import free_port

        self.port = free_port()
        self.faults = faults
        path = os.path.join(workdir, f"child-{time.monotonic_ns()}.json")
        with open(path, "w") as f:
            json.dump({**cfg, "metrics_port": self.port}, f)
        env = {k: v for k, v in os.environ.items() if k != "ACKFLOW_FAULTS"}
        if faults:
            env["ACKFLOW_FAULTS"] = faults
        cmd = [sys.executable, "-m", "benchmarks.chaos_pipeline", path]
        if until_idle is not None:
            cmd += ["--until-idle", str(until_idle)]
        self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=log,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.pid = self.proc.pid
        self.acked = 0.0
        self.started = time.monotonic()

    def poll_acked(self) -> float | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=0.5) as r:
                text = r.read().decode()
        except (OSError, ValueError):
            return None
        for line in text.splitlines():
            if line.startswith("ackflow_messages_acked_total "):
                return float(line.split()[1])
        return None

    def kill(self) -> None:
        """SIGKILL the whole group (only processes this soak started)."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)

    def reap_group(self) -> None:
        """After the driver exited: SIGKILL what is left of its group (JVM, workers)."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


# ---------------------------------------------------------------------------- the soak

@dataclass
class Stats:
    kills: int = 0
    fault_starts: Counter[str] = field(default_factory=Counter)
    fault_exits: int = 0
    other_exits: int = 0
    starts: int = 0
    broker_restarts: int = 0
    db_outages: int = 0
    outage_s: list[float] = field(default_factory=list)
    longest_stall_s: float = 0.0
    peak_rss_driver: int = 0
    peak_rss_tree: int = 0
    acked: float = 0.0
    first_ack_s: list[float] = field(default_factory=list)  # per child: start to first ack


def log_line(msg: str, t0: float) -> None:
    print(f"[{time.monotonic() - t0:7.1f} s] {msg}", flush=True)


class Soak:
    def __init__(self, a: argparse.Namespace, sched: Schedule, pg: Any, rmq: Any, work: str) -> None:
        self.a, self.sched, self.pg, self.rmq, self.work = a, sched, pg, rmq, work
        self.files_dir = os.path.join(work, "in")
        self.parquet_dir = os.path.join(work, "parquet")
        os.makedirs(self.files_dir)
        policy = sched.retry_policy()
        # the broker's limit is above ackflow's own (its last delivery dead-letters with
        # provenance first); a message past it (given back too often: crashes, stops) goes
        # to the dead-letter exchange, and is accounted there
        self.delivery_limit = a.delivery_limit or int(policy["max_deliveries"]) + 2
        self.cfg = {"amqp_url": rmq.url, "queue": QUEUE, "stream_port": rmq.stream_port,
                    "delivery_limit": self.delivery_limit, "dlx": DLX,
                    "stream": STREAM, "files_dir": self.files_dir, "dsn": pg.dsn,
                    "table": TABLE, "dead_table": DEAD_TABLE, "parquet_dir": self.parquet_dir,
                    "batch_size": 2000, "max_inflight": 6000, **policy}
        self.stats = Stats()
        self.fault_rng = random.Random(sched.seed * 31 + 7)
        self.log = open(os.path.join(work, "pipeline.log"), "ab")
        self.t0 = time.monotonic()
        self.child: Child | None = None

    def say(self, msg: str) -> None:
        if not self.a.quiet:
            log_line(msg, self.t0)

    def setup(self) -> None:
        import pika
        from rstream import Producer

        conn = pika.BlockingConnection(pika.URLParameters(self.rmq.url))
        ch = conn.channel()
        ch.exchange_declare(DLX, "fanout", durable=True)
        ch.queue_declare(DLX_QUEUE, durable=True)
        ch.queue_bind(DLX_QUEUE, DLX)
        ch.queue_declare(QUEUE, durable=True, arguments={
            "x-queue-type": "quorum", "x-delivery-limit": self.delivery_limit,
            "x-dead-letter-exchange": DLX})
        conn.close()

        async def go() -> None:
            async with Producer("127.0.0.1", self.rmq.stream_port, username="guest",
                                password="guest") as p:
                await p.create_stream(STREAM, exists_ok=True)

        asyncio.run(go())

    def start_child(self, until_idle: float | None = None, faults_ok: bool = True) -> None:
        faults = ""
        pick = self.fault_rng.random()
        spec = self.fault_rng.choice(FAULT_SPECS)
        if faults_ok and pick < self.sched.fault_rate:
            faults = spec
            self.stats.fault_starts[spec] += 1
        self.child = Child(self.cfg, self.work, faults, until_idle, self.log)
        self.stats.starts += 1
        self.say(f"pipeline started (pid {self.child.pid})" + (f", armed {faults}" if faults else ""))

    def chaos_thread(self, publisher: Publisher) -> threading.Thread:
        events: list[tuple[float, str, float]] = (
            [(t, "broker", 0.0) for t in self.sched.broker_restarts]
            + [(t, "db", s) for t, s in self.sched.db_outages])
        events.sort()

        def run() -> None:
            for at, kind, secs in events:
                while time.monotonic() - self.t0 < at:
                    time.sleep(0.2)
                if kind == "broker":
                    publisher.paused.set()
                    publisher.idle.wait()
                    self.say("RabbitMQ: restarting the broker")
                    self.rmq.restart()
                    self.stats.broker_restarts += 1
                    self.say("RabbitMQ: back")
                    publisher.paused.clear()
                else:
                    self.say(f"PostgreSQL: stopping for {secs:.1f} s")
                    self.pg.stop()
                    self.stats.db_outages += 1
                    self.stats.outage_s.append(round(secs, 1))
                    time.sleep(secs)
                    self.pg.start()
                    self.say("PostgreSQL: back")

        th = threading.Thread(target=run, name="chaos", daemon=True)
        th.start()
        return th

    def sample(self, now: float, last_progress: list[float], soak: bool) -> None:
        c = self.child
        if c is None:
            return
        own, tree = proc_rss(c.pid)
        self.stats.peak_rss_driver = max(self.stats.peak_rss_driver, own)
        self.stats.peak_rss_tree = max(self.stats.peak_rss_tree, tree)
        acked = c.poll_acked()
        if acked is not None and acked > c.acked:
            if c.acked == 0:
                self.stats.first_ack_s.append(round(now - c.started, 1))
            self.stats.acked += acked - c.acked
            c.acked = acked
            if soak:
                self.stats.longest_stall_s = max(self.stats.longest_stall_s, now - last_progress[0])
            last_progress[0] = now

    def run(self) -> Published:
        self.setup()
        publisher = Publisher(self.rmq, self.files_dir, self.a.rate, self.sched.seed,
                              self.a.resend)
        publisher.start()
        chaos = self.chaos_thread(publisher)
        kills = list(self.sched.kills)
        end = self.sched.minutes * 60.0
        self.start_child()
        last_progress = [time.monotonic()]
        while True:
            now = time.monotonic()
            t = now - self.t0
            if t >= end:
                break
            c = self.child
            assert c is not None
            if kills and t >= kills[0]:
                kills.pop(0)
                c.kill()
                self.stats.kills += 1
                self.say(f"SIGKILL pipeline (pid {c.pid}, kill {self.stats.kills}, it acked "
                         f"{c.acked:.0f}; {self.stats.acked:.0f} in all)")
                self.start_child()
            elif c.proc.poll() is not None:
                rc = c.proc.returncode
                c.reap_group()
                if rc == 137 and c.faults:
                    self.stats.fault_exits += 1
                    self.say(f"pipeline exited at fault point ({c.faults})")
                else:
                    self.stats.other_exits += 1
                    self.say(f"pipeline exited with status {rc}; restarting")
                    time.sleep(1.0)
                self.start_child()
            self.sample(now, last_progress, soak=True)
            time.sleep(0.5)
        self.say("stopping the publisher")
        publisher.stop_event.set()
        publisher.join(60)
        chaos.join(600)
        # the last stall: from the last progress to the end of the soak
        self.stats.longest_stall_s = max(self.stats.longest_stall_s,
                                         time.monotonic() - last_progress[0])
        self.drain()
        return publisher.out

    def drain(self) -> None:
        """Stop the running child (SIGTERM: a graceful stop), then run one without
        faults until idle; again while work is left."""
        c = self.child
        if c is not None and c.proc.poll() is None:
            os.killpg(c.pid, signal.SIGTERM)
            try:
                c.proc.wait(60)
            except subprocess.TimeoutExpired:
                c.kill()
        if c is not None:
            c.reap_group()
        for attempt in range(4):
            self.say(f"draining: a pipeline without faults until idle (run {attempt + 1})")
            self.start_child(until_idle=8.0, faults_ok=False)
            c = self.child
            assert c is not None
            deadline = time.monotonic() + 600
            while c.proc.poll() is None and time.monotonic() < deadline:
                self.sample(time.monotonic(), [time.monotonic()], soak=False)
                time.sleep(0.5)
            if c.proc.poll() is None:
                c.kill()
            c.reap_group()
            if not self.work_left():
                return

    def work_left(self) -> bool:
        return bool(queue_depth(self.rmq.url) or files_left(self.files_dir))


# ---------------------------------------------------------------------------- checks

def queue_depth(url: str) -> int:
    import pika

    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        return int(conn.channel().queue_declare(QUEUE, passive=True).method.message_count)
    finally:
        conn.close()


def dlx_messages(url: str) -> tuple[Counter[str], Counter[str], int]:
    """What the broker dead-lettered: (message id -> copies, x-death reasons, messages
    without a message id). Read with ``basic_get`` and left in the queue (not acked)."""
    import pika

    ids: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    nameless = 0
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        for _ in range(10**6):  # bounded: the queue holds far fewer
            method, props, _body = ch.basic_get(DLX_QUEUE, auto_ack=False)
            if method is None:
                break
            if props.message_id:
                ids[props.message_id] += 1
            else:
                nameless += 1
            for death in (props.headers or {}).get("x-death") or []:
                reason = death.get("reason")
                reasons[reason.decode() if isinstance(reason, bytes) else str(reason)] += 1
    finally:
        conn.close()
    return ids, reasons, nameless


def _as_py(v: Any) -> Any:
    """A value read back from a sink, comparable with the published JSON value."""
    if isinstance(v, str) and v[:1] in "[{":
        try:
            return json.loads(v)
        except ValueError:
            return v
    return v


def value_mismatches(rows: list[dict[str, Any]], expect: dict[str, dict[str, Any]],
                     sink: str) -> list[str]:
    """Rows whose values are not what was published (nulls, empty lists and nested
    values must land intact)."""
    bad = []
    for r in rows:
        want = expect.get(r["id"])
        if want is None:
            continue
        got = {k: _as_py(r.get(k)) for k in want}
        if got != want:
            bad.append(f"{sink} {r['id']}: {got} != {want}"[:300])
    return bad


def files_left(folder: str) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith(".jsonl") and not n.startswith("."))


def stream_committed(rmq: Any) -> int:
    from rstream import Consumer

    async def go() -> int:
        async with Consumer("127.0.0.1", rmq.stream_port, username="guest",
                            password="guest") as c:
            return int(await c.query_offset(STREAM, "chaos"))

    try:
        return asyncio.run(go())
    except Exception:  # noqa: BLE001 - no stored offset (or no broker): reported as -1
        return -1


def stream_tail(rmq: Any, start: int) -> list[tuple[int, str]]:
    """(offset, body) of every stream message from ``start``."""
    from rstream import Consumer, ConsumerOffsetSpecification, OffsetType

    got: list[tuple[int, str]] = []

    async def on_message(body: Any, ctx: Any) -> None:
        text = bytes(body).decode("utf-8", "replace")
        got.append((int(ctx.offset), text))

    async def go() -> None:
        async with Consumer("127.0.0.1", rmq.stream_port, username="guest",
                            password="guest") as c:
            await c.subscribe(STREAM, on_message, offset_specification=ConsumerOffsetSpecification(
                OffsetType.OFFSET, max(0, start)))
            n = -1
            while n != len(got):  # until nothing more comes for a second
                n = len(got)
                await asyncio.sleep(1.0)

    try:
        asyncio.run(go())
    except Exception as e:  # noqa: BLE001 - a diagnostic only
        got.append((-1, f"{type(e).__name__}: {e}"))
    return got


def is_poison(text: str) -> bool:
    try:
        return int(json.loads(text)["qty"]) <= 0
    except (ValueError, KeyError, TypeError):
        return True


def verify(pub: Published, pg: Any, rmq: Any, soak: Soak) -> dict[str, Any]:
    import psycopg
    import pyarrow.parquet as pq

    cols = ["id", "total", "n_lines", "members", "opt", "tags", "note"]
    with psycopg.connect(pg.dsn) as conn:
        pg_rows = [dict(zip(cols, r, strict=True)) for r in conn.execute(
            f"SELECT {', '.join(cols)} FROM {TABLE}")]
        dead_rows = conn.execute(  # the body: text, or its bytes where it is not text
            f"SELECT message, coalesce(convert_to(body, 'UTF8'), body_bytes) FROM {DEAD_TABLE}"
        ).fetchall()
    pg_ids = Counter(r["id"] for r in pg_rows)
    pq_ids: Counter[str] = Counter()
    pq_rows: list[dict[str, Any]] = []
    for path in glob.glob(os.path.join(soak.parquet_dir, "batch=*", "**", "*.parquet"),
                          recursive=True):
        rows = pq.read_table(path, columns=cols).to_pylist()
        pq_rows += rows
        pq_ids.update(r["id"] for r in rows)
    mismatched = (value_mismatches(pg_rows, pub.expect, "postgres")
                  + value_mismatches(pq_rows, pub.expect, "parquet"))
    dlx_ids, dlx_reasons, dlx_nameless = dlx_messages(rmq.url)
    dead_ids: Counter[str] = Counter()
    unknown_dead = 0
    for _, body in dead_rows:
        text = body.decode("utf-8", "replace") if isinstance(body, bytes | bytearray | memoryview) \
            else str(body)
        if isinstance(body, memoryview):
            text = bytes(body).decode("utf-8", "replace")
        m = ID_RE.search(text)
        if m:
            dead_ids[m.group(1)] += 1
        else:
            unknown_dead += 1
    # what the stream really holds: a message whose publish raised (no confirm) may be
    # in the stream all the same; it is published then, and must be processed
    in_stream = stream_tail(rmq, 0)
    extra_stream = []
    for off, text in in_stream:
        mid = ID_RE.search(text)
        if mid and mid.group(1) not in pub.good and mid.group(1) not in pub.poison:
            extra_stream.append((off, text[:120]))
            (pub.poison if is_poison(text) else pub.good).add(mid.group(1))
    stream_end = max((off for off, _ in in_stream), default=-1)
    good, poison = pub.good, pub.poison
    in_dlx = set(dlx_ids)  # the broker's dead letters: accounted there, and only there
    lost_pg = good - set(pg_ids) - in_dlx
    lost_pq = good - set(pq_ids) - in_dlx
    poison_missing = poison - set(dead_ids) - in_dlx
    dup_pg = {k for k, n in pg_ids.items() if n > 1}
    dup_pq = {k for k, n in pq_ids.items() if n > 1}
    dup_dead = {k for k, n in dead_ids.items() if n > 1}
    dup_dlx = {k for k, n in dlx_ids.items() if n > max(1, pub.copies[k])}
    # one message in two places (written or dead-lettered by ackflow, and dead-lettered
    # by the broker too): counted twice
    dlx_and_settled = in_dlx & (set(pg_ids) | set(pq_ids) | set(dead_ids))
    lost = lost_pg | lost_pq | poison_missing
    duplicated = dup_pg | dup_pq | dup_dead | dup_dlx | dlx_and_settled
    good_dead = good & set(dead_ids)
    poison_written = poison & (set(pg_ids) | set(pq_ids))
    unknown_rows = (set(pg_ids) | set(pq_ids)) - good - poison
    depth = queue_depth(rmq.url)
    committed = stream_committed(rmq)
    left = files_left(soak.files_dir)
    checks = {
        "lost_in_postgres": sorted(lost_pg)[:20], "lost_in_parquet": sorted(lost_pq)[:20],
        "poison_not_dead_lettered": sorted(poison_missing)[:20],
        "duplicated_in_postgres": sorted(dup_pg)[:20], "duplicated_in_parquet": sorted(dup_pq)[:20],
        "dead_lettered_twice": sorted(dup_dead)[:20],
        "broker_dead_lettered_more_than_published": sorted(dup_dlx)[:20],
        "broker_dead_lettered_and_settled_by_ackflow": sorted(dlx_and_settled)[:20],
        "values_not_as_published": mismatched[:10],
        "broker_dead_letters_without_id": dlx_nameless,
        "good_dead_lettered": sorted(good_dead)[:20],
        "poison_written": sorted(poison_written)[:20],
        "rows_not_published": sorted(unknown_rows)[:20],
        "dead_letters_without_id": unknown_dead,
        "queue_depth": depth,
        "stream_stored_offset": committed, "stream_last_offset": stream_end,
        "files_left": left[:20],
    }
    checks["stream_unconfirmed_in_stream"] = extra_stream
    # offsets the broker never delivers (seen after a restart): the source declares them gaps
    checks["stream_offsets_not_messages"] = stream_end + 1 - len(in_stream)
    ok = (not lost and not duplicated and not good_dead and not poison_written
          and not unknown_rows and unknown_dead == 0 and depth == 0
          and committed == stream_end and not left and not mismatched)
    return {"lost": len(lost), "duplicated": len(duplicated), "dead_lettered": len(dead_rows),
            "broker_dead_lettered": sum(dlx_ids.values()) + dlx_nameless,
            "broker_dead_letter_reasons": dict(dlx_reasons),
            "values_checked": len(pg_rows) + len(pq_rows), "values_wrong": len(mismatched),
            "good_dead_lettered": len(good_dead), "rows_postgres": sum(pg_ids.values()),
            "rows_parquet": sum(pq_ids.values()), "ok": ok, "checks": checks}


# ---------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--rate", type=float, default=20.0, help="messages/s to each source")
    p.add_argument("--resend", type=float, default=0.05,
                   help="chance per queue batch that the producer publishes it again at once")
    p.add_argument("--delivery-limit", type=int, default=None,
                   help="the quorum queue's x-delivery-limit (default: max_deliveries + 2)")
    p.add_argument("--json", action="store_true", help="end with one JSON object")
    p.add_argument("--quiet", action="store_true", help="no event log, only the summary")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    a = p.parse_args(argv)
    seed = a.seed if a.seed is not None else int.from_bytes(os.urandom(3), "little")
    sched = Schedule.draw(seed, a.minutes)
    print(f"chaos soak: {sched.describe()}", flush=True)
    print(f"retry policy: {sched.retry_policy()}", flush=True)

    from ackflow.servers import PostgresServer, RabbitMQServer

    work = tempfile.mkdtemp(prefix="ackflow-chaos-")
    started = time.monotonic()
    try:
        with PostgresServer() as pg, RabbitMQServer(streams=True) as rmq:
            soak = Soak(a, sched, pg, rmq, work)
            pub = soak.run()
            result = verify(pub, pg, rmq, soak)
            soak.log.close()
            with open(os.path.join(work, "pipeline.log"), "rb") as f:
                text = f.read()
            fired = Counter(m.decode() for m in re.findall(
                rb"ackflow: fault point '([a-z_.]+)' \(hit \d+\): exiting now", text))
            # the children that ended cleanly print their report: repeats they held back
            held = sum(int(n) for n in re.findall(rb'"duplicates": (\d+)', text))
    finally:
        if a.keep:
            print(f"work directory kept: {work}", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)
    st = soak.stats
    summary = {
        "minutes": a.minutes, "seed": seed, "messages": len(pub.good) + len(pub.poison),
        "poison": len(pub.poison), "per_source": dict(pub.per_source),
        "kills": st.kills, "fault_point_exits": st.fault_exits,
        "fault_points_armed": dict(st.fault_starts), "fault_points_fired": dict(fired),
        "other_exits": st.other_exits,
        "child_starts": st.starts, "broker_restarts": st.broker_restarts,
        "db_outages": st.db_outages, "db_outage_s": st.outage_s,
        "lost": result["lost"], "duplicated": result["duplicated"],
        "dead_lettered": result["dead_lettered"],
        "good_dead_lettered": result["good_dead_lettered"],
        "resent": pub.resent, "resent_ids": sum(1 for n in pub.copies.values() if n > 1),
        "repeats_held": held,
        "delivery_limit": soak.delivery_limit,
        "broker_dead_lettered": result["broker_dead_lettered"],
        "broker_dead_letter_reasons": result["broker_dead_letter_reasons"],
        "values_checked": result["values_checked"], "values_wrong": result["values_wrong"],
        "rows_postgres": result["rows_postgres"], "rows_parquet": result["rows_parquet"],
        "longest_stall_s": round(st.longest_stall_s, 1),
        "acked_seen": int(st.acked),
        "first_ack_s_max": max(st.first_ack_s, default=None),
        "first_ack_s_median": sorted(st.first_ack_s)[len(st.first_ack_s) // 2] if st.first_ack_s else None,
        "peak_rss_driver_mb": round(st.peak_rss_driver / 2**20, 1),
        "peak_rss_child_tree_mb": round(st.peak_rss_tree / 2**20, 1),
        "publish_errors": pub.errors, "publish_error_log": pub.error_log[:10],
        "elapsed_s": round(time.monotonic() - started, 1),
        "checks": result["checks"], "ok": result["ok"],
    }
    print_table(summary)
    if a.json:
        print(json.dumps(summary), flush=True)
    return 0 if summary["ok"] and not summary["lost"] and not summary["duplicated"] else 1


def print_table(s: dict[str, Any]) -> None:
    armed = ", ".join(f"{k} x{v}" for k, v in sorted(s["fault_points_armed"].items())) or "none"
    rows = [
        ("seed", s["seed"]), ("minutes", s["minutes"]),
        ("SIGKILLs of the pipeline", s["kills"]),
        ("fault points armed (starts)", armed),
        ("fault points fired (driver or worker)",
         ", ".join(f"{k} x{v}" for k, v in sorted(s["fault_points_fired"].items())) or "none"),
        ("pipeline exits at a fault point", s["fault_point_exits"]),
        ("other pipeline exits", s["other_exits"]),
        ("pipeline starts", s["child_starts"]),
        ("broker restarts", s["broker_restarts"]),
        ("PostgreSQL outages", f"{s['db_outages']} ({', '.join(f'{x} s' for x in s['db_outage_s'])})"),
        ("messages published", f"{s['messages']:,} ({s['poison']} poison; "
         + ", ".join(f"{k} {v:,}" for k, v in sorted(s["per_source"].items())) + ")"),
        ("lost", s["lost"]), ("duplicated", s["duplicated"]),
        ("dead-lettered (by ackflow / by the broker)",
         f"{s['dead_lettered']} / {s['broker_dead_lettered']} "
         f"{s['broker_dead_letter_reasons'] or ''} (x-delivery-limit {s['delivery_limit']})"),
        ("queue messages re-sent (ids)", f"{s['resent']} ({s['resent_ids']}); repeats held "
         f"back in the final runs: {s['repeats_held']}"),
        ("row values checked (wrong)", f"{s['values_checked']:,} ({s['values_wrong']})"),
        ("good messages dead-lettered", s["good_dead_lettered"]),
        ("rows in PostgreSQL / Parquet", f"{s['rows_postgres']:,} / {s['rows_parquet']:,}"),
        ("longest stall (no ack progress)", f"{s['longest_stall_s']} s"),
        ("pipeline start to first ack", f"median {s['first_ack_s_median']} s, "
         f"max {s['first_ack_s_max']} s"),
        ("peak RSS driver / child tree", f"{s['peak_rss_driver_mb']} / {s['peak_rss_child_tree_mb']} MB"),
        ("elapsed", f"{s['elapsed_s']} s"),
        ("checks", "ok" if s["ok"] else json.dumps(s["checks"])),
    ]
    width = max(len(k) for k, _ in rows)
    print("-" * (width + 40))
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print("-" * (width + 40), flush=True)


if __name__ == "__main__":
    sys.exit(main())
