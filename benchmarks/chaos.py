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
The publisher is in ``benchmarks.chaos_publisher``, the final checks in
``benchmarks.chaos_checks``.
"""

from __future__ import annotations

import argparse
import asyncio
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

from benchmarks.chaos_checks import (
    files_left,
    kafka_lag,
    queue_depth,
    verify,
)
from benchmarks.chaos_publisher import (
    DEAD_TABLE,
    DLX,
    DLX_QUEUE,
    KAFKA_PARTITIONS,
    KAFKA_TOPIC,
    QUEUE,
    STREAM,
    TABLE,
    WINDOW,
    WINDOW_TABLE,
    Published,
    Publisher,
)

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
    "kafka.before_commit=exit@2",
    "kafka.after_commit=exit@3",
    "kafka.attempt_recorded=exit@1",
)


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
        outages = [
            (rng.uniform(0.4, 0.5) * d, rng.uniform(10, 30) * scale),
            (rng.uniform(0.8, 0.86) * d, rng.uniform(10, 30) * scale),
        ]
        return cls(seed, minutes, kills, brokers, outages)

    def describe(self) -> str:
        return (
            f"seed {self.seed}, {self.minutes:g} min: "
            f"{len(self.kills)} SIGKILLs at {', '.join(f'{t:.0f}' for t in self.kills)} s; "
            f"broker restarts at {', '.join(f'{t:.0f}' for t in self.broker_restarts)} s; "
            f"PostgreSQL down at "
            + ", ".join(f"{t:.0f} s for {s:.1f} s" for t, s in self.db_outages)
            + f"; a fault point armed at ~{self.fault_rate:.0%} of child starts"
        )

    def retry_policy(self) -> dict[str, float]:
        """Retries must outlast the longest outage (a good message must never be given
        up because the database was down): backoff sums to > 2x the longest outage."""
        longest = max(s for _, s in self.db_outages)
        max_backoff = 2.0 if longest < 10 else 5.0
        total, n, b = 0.0, 0, 0.25
        while total < 2 * longest + 10:
            total += min(b * 2**n, max_backoff)
            n += 1
        return {"max_deliveries": n + 1, "backoff_s": b, "max_backoff_s": max_backoff}


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

    def __init__(
        self, cfg: dict[str, Any], workdir: str, faults: str, until_idle: float | None, log: Any
    ) -> None:
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
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True
        )
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
    def __init__(
        self, a: argparse.Namespace, sched: Schedule, pg: Any, rmq: Any, work: str, kafka: Any = None
    ) -> None:
        self.a, self.sched, self.pg, self.rmq, self.work = a, sched, pg, rmq, work
        self.kafka = kafka  # the Kafka server, or None: a soak without the Kafka source
        self.files_dir = os.path.join(work, "in")
        self.parquet_dir = os.path.join(work, "parquet")
        self.state_dir = os.path.join(work, "state")  # the schema store and the window's state
        os.makedirs(self.files_dir)
        policy = sched.retry_policy()
        # the broker's limit is above ackflow's own (its last delivery dead-letters with
        # provenance first) and above what the schedule can spend: a quorum queue counts
        # every delivery, and each crash (a kill, a fault-point exit) while a message is in
        # flight spends one, as does each give-back while PostgreSQL is down. Seed 7 ran
        # with max_deliveries + 2 (19) through 31 process deaths: a message whose rows were
        # written was dead-lettered by the broker too. A message past this limit still goes
        # to the dead-letter exchange, and is accounted there
        spent = 2 * len(sched.kills) + 20
        self.delivery_limit = a.delivery_limit or int(policy["max_deliveries"]) + 2 + spent
        self.cfg = {
            "amqp_url": rmq.url,
            "queue": QUEUE,
            "stream_port": rmq.stream_port,
            "delivery_limit": self.delivery_limit,
            "dlx": DLX,
            "stream": STREAM,
            "files_dir": self.files_dir,
            "dsn": pg.dsn,
            "table": TABLE,
            "dead_table": DEAD_TABLE,
            "window_table": WINDOW_TABLE,
            "window": WINDOW,
            "state_dir": self.state_dir,
            "parquet_dir": self.parquet_dir,
            "kafka": kafka.bootstrap if kafka is not None else None,
            "kafka_topic": KAFKA_TOPIC,
            "batch_size": 2000,
            "max_inflight": 6000,
            **policy,
        }
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
        ch.queue_declare(
            QUEUE,
            durable=True,
            arguments={
                "x-queue-type": "quorum",
                "x-delivery-limit": self.delivery_limit,
                "x-dead-letter-exchange": DLX,
            },
        )
        conn.close()

        async def go() -> None:
            async with Producer("127.0.0.1", self.rmq.stream_port, username="guest", password="guest") as p:
                await p.create_stream(STREAM, exists_ok=True)

        asyncio.run(go())
        if self.kafka is not None:
            self.kafka.create_topic(KAFKA_TOPIC, KAFKA_PARTITIONS)

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
        events: list[tuple[float, str, float]] = [(t, "broker", 0.0) for t in self.sched.broker_restarts] + [
            (t, "db", s) for t, s in self.sched.db_outages
        ]
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
        publisher = Publisher(
            self.rmq,
            self.files_dir,
            self.a.rate,
            self.sched.seed,
            self.a.resend,
            kafka=self.kafka.bootstrap if self.kafka is not None else None,
        )
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
                self.say(
                    f"SIGKILL pipeline (pid {c.pid}, kill {self.stats.kills}, it acked "
                    f"{c.acked:.0f}; {self.stats.acked:.0f} in all)"
                )
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
        self.stats.longest_stall_s = max(self.stats.longest_stall_s, time.monotonic() - last_progress[0])
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
        return bool(
            queue_depth(self.rmq.url)
            or files_left(self.files_dir)
            or (self.kafka is not None and kafka_lag(self.kafka.bootstrap))
        )


# ---------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--rate", type=float, default=20.0, help="messages/s to each source")
    p.add_argument(
        "--resend",
        type=float,
        default=0.05,
        help="chance per queue batch that the producer publishes it again at once",
    )
    p.add_argument(
        "--delivery-limit",
        type=int,
        default=None,
        help="the quorum queue's x-delivery-limit (default: max_deliveries + 2, plus twice "
        "the scheduled SIGKILLs and 20 for the outages' give-backs)",
    )
    p.add_argument("--json", action="store_true", help="end with one JSON object")
    p.add_argument("--quiet", action="store_true", help="no event log, only the summary")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--no-kafka", action="store_true", help="leave the Kafka source out")
    a = p.parse_args(argv)
    seed = a.seed if a.seed is not None else int.from_bytes(os.urandom(3), "little")
    sched = Schedule.draw(seed, a.minutes)
    print(f"chaos soak: {sched.describe()}", flush=True)
    print(f"retry policy: {sched.retry_policy()}", flush=True)

    from contextlib import nullcontext

    from ackflow.servers import KafkaServer, PostgresServer, RabbitMQServer

    work = tempfile.mkdtemp(prefix="ackflow-chaos-")
    started = time.monotonic()
    try:
        with (
            PostgresServer() as pg,
            RabbitMQServer(streams=True) as rmq,
            nullcontext() if a.no_kafka else KafkaServer() as kafka,
        ):
            soak = Soak(a, sched, pg, rmq, work, kafka)
            pub = soak.run()
            result = verify(pub, pg, rmq, soak)
            soak.log.close()
            with open(os.path.join(work, "pipeline.log"), "rb") as f:
                text = f.read()
            fired = Counter(
                m.decode()
                for m in re.findall(rb"ackflow: fault point '([a-z_.]+)' \(hit \d+\): exiting now", text)
            )
            # the children that ended cleanly print their report: repeats they held back
            held = sum(int(n) for n in re.findall(rb'"duplicates": (\d+)', text))
    finally:
        if a.keep:
            print(f"work directory kept: {work}", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)
    st = soak.stats
    summary = {
        "minutes": a.minutes,
        "seed": seed,
        "messages": len(pub.good) + len(pub.poison),
        "poison": len(pub.poison),
        "per_source": dict(pub.per_source),
        "kills": st.kills,
        "fault_point_exits": st.fault_exits,
        "fault_points_armed": dict(st.fault_starts),
        "fault_points_fired": dict(fired),
        "other_exits": st.other_exits,
        "child_starts": st.starts,
        "broker_restarts": st.broker_restarts,
        "db_outages": st.db_outages,
        "db_outage_s": st.outage_s,
        "lost": result["lost"],
        "duplicated": result["duplicated"],
        "dead_lettered": result["dead_lettered"],
        "good_dead_lettered": result["good_dead_lettered"],
        "resent": pub.resent,
        "resent_ids": sum(1 for n in pub.copies.values() if n > 1),
        "repeats_held": held,
        "delivery_limit": soak.delivery_limit,
        "broker_dead_lettered": result["broker_dead_lettered"],
        "broker_dead_letter_reasons": result["broker_dead_letter_reasons"],
        "values_checked": result["values_checked"],
        "values_wrong": result["values_wrong"],
        "rows_postgres": result["rows_postgres"],
        "rows_parquet": result["rows_parquet"],
        "windows_written": result["windows_written"],
        "window_rows_counted": result["window_rows_counted"],
        "longest_stall_s": round(st.longest_stall_s, 1),
        "acked_seen": int(st.acked),
        "first_ack_s_max": max(st.first_ack_s, default=None),
        "first_ack_s_median": sorted(st.first_ack_s)[len(st.first_ack_s) // 2] if st.first_ack_s else None,
        "peak_rss_driver_mb": round(st.peak_rss_driver / 2**20, 1),
        "peak_rss_child_tree_mb": round(st.peak_rss_tree / 2**20, 1),
        "publish_errors": pub.errors,
        "publish_error_log": pub.error_log[:10],
        "elapsed_s": round(time.monotonic() - started, 1),
        "checks": result["checks"],
        "ok": result["ok"],
    }
    print_table(summary)
    if a.json:
        print(json.dumps(summary), flush=True)
    return 0 if summary["ok"] and not summary["lost"] and not summary["duplicated"] else 1


def print_table(s: dict[str, Any]) -> None:
    armed = ", ".join(f"{k} x{v}" for k, v in sorted(s["fault_points_armed"].items())) or "none"
    rows = [
        ("seed", s["seed"]),
        ("minutes", s["minutes"]),
        ("SIGKILLs of the pipeline", s["kills"]),
        ("fault points armed (starts)", armed),
        (
            "fault points fired (driver or worker)",
            ", ".join(f"{k} x{v}" for k, v in sorted(s["fault_points_fired"].items())) or "none",
        ),
        ("pipeline exits at a fault point", s["fault_point_exits"]),
        ("other pipeline exits", s["other_exits"]),
        ("pipeline starts", s["child_starts"]),
        ("broker restarts", s["broker_restarts"]),
        ("PostgreSQL outages", f"{s['db_outages']} ({', '.join(f'{x} s' for x in s['db_outage_s'])})"),
        (
            "messages published",
            f"{s['messages']:,} ({s['poison']} poison; "
            + ", ".join(f"{k} {v:,}" for k, v in sorted(s["per_source"].items()))
            + ")",
        ),
        ("lost", s["lost"]),
        ("duplicated", s["duplicated"]),
        (
            "dead-lettered (by ackflow / by the broker)",
            f"{s['dead_lettered']} / {s['broker_dead_lettered']} "
            f"{s['broker_dead_letter_reasons'] or ''} (x-delivery-limit {s['delivery_limit']})",
        ),
        (
            "queue messages re-sent (ids)",
            f"{s['resent']} ({s['resent_ids']}); repeats held back in the final runs: {s['repeats_held']}",
        ),
        ("row values checked (wrong)", f"{s['values_checked']:,} ({s['values_wrong']})"),
        ("good messages dead-lettered", s["good_dead_lettered"]),
        ("rows in PostgreSQL / Parquet", f"{s['rows_postgres']:,} / {s['rows_parquet']:,}"),
        (
            "rows the window counted (windows written)",
            f"{s['window_rows_counted']:,} ({s['windows_written']})",
        ),
        ("longest stall (no ack progress)", f"{s['longest_stall_s']} s"),
        ("pipeline start to first ack", f"median {s['first_ack_s_median']} s, max {s['first_ack_s_max']} s"),
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
