"""The chaos soak's publisher (``benchmarks.chaos``): the names it publishes into, and
a thread feeding the quorum queue, the stream, the Files directory and the Kafka topic
at a steady rate, recording each message once it is confirmed."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

QUEUE = "chaos-orders"
DLX = "chaos-dlx"  # the quorum queue's dead-letter exchange (fanout) ...
DLX_QUEUE = "chaos-dlx-q"  # ... and the queue it routes to
STREAM = "chaos-events"
KAFKA_TOPIC = "chaos-kafka"
KAFKA_PARTITIONS = 3
TABLE = "chaos_rows"
DEAD_TABLE = "chaos_dead"
WINDOW_TABLE = "chaos_windows"
WINDOW = "per_500"  # the soak's count window: every 500 rows, their count and total
KINDS = ("book", "game", "tool", "food")
ID_RE = re.compile(r'"id":\s*"([qsfk]\d{7})"')


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
    """Publishes ``rate`` messages a second to each of the sources, recording every
    message once the broker confirmed it (or the file was renamed in)."""

    def __init__(
        self,
        rmq: Any,
        files_dir: str,
        rate: float,
        seed: int,
        resend: float = 0.05,
        kafka: str | None = None,
    ) -> None:
        super().__init__(name="publisher", daemon=True)
        self.rmq, self.files_dir, self.rate, self.resend = rmq, files_dir, rate, resend
        self.kafka = kafka  # the bootstrap address, or None: no Kafka source
        self._producer: Any = None
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
            body["opt"] = {
                "code": self.rng.choice(["", "a1", "zz"]),
                "dims": {"w": self.rng.randint(0, 5), "h": None if self.rng.random() < 0.5 else 7},
                "marks": [] if self.rng.random() < 0.5 else [1, n],
            }
        elif shape < 0.75:
            body["opt"] = None
        body["tags"] = [] if self.rng.random() < 0.4 else ["x", kind]
        body["note"] = self.rng.choice([None, None, "", "ok"])
        if r >= 0.01:
            self.out.expect[mid] = {
                "total": qty * n,
                "n_lines": n,
                "members": list(range(n)),
                "opt": body.get("opt"),
                "tags": body["tags"],
                "note": body["note"],
            }
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
                if self.kafka is not None:
                    self.publish_kafka([self._enc(self.message("k")) for _ in range(n)])
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
                self._ch.basic_publish(
                    "", QUEUE, body, pika.BasicProperties(delivery_mode=2, message_id=mid), mandatory=True
                )
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
            async with Producer("127.0.0.1", self.rmq.stream_port, username="guest", password="guest") as p:
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
            self.out.error_log.append(f"stream at {sent[0]}/{len(msgs)}: {type(e).__name__}: {e}"[:200])

    def publish_kafka(self, msgs: list[tuple[str, bytes, bool]]) -> None:
        """Produce to the topic (idempotent, ``acks=all``), a message recorded on its
        delivery report. One without a report is not produced again (it may be in the
        topic: a second copy would be a second message); verify() reads the topic and
        counts what it holds as published."""
        from confluent_kafka import Producer

        if self._producer is None:
            self._producer = Producer(
                {"bootstrap.servers": self.kafka, "enable.idempotence": True, "acks": "all", "linger.ms": 5}
            )

        def report(mid: str, poison: bool) -> Any:
            def on(err: Any, _m: Any) -> None:
                if err is None:
                    self.record("kafka", mid, poison)
                else:
                    self.out.errors += 1
                    self.out.error_log.append(f"kafka {mid}: {err}"[:200])

            return on

        for i, (mid, body, poison) in enumerate(msgs):
            self._producer.produce(
                KAFKA_TOPIC, value=body, partition=i % KAFKA_PARTITIONS, on_delivery=report(mid, poison)
            )
        left = self._producer.flush(30)
        if left:
            self.out.errors += 1
            self.out.error_log.append(f"kafka: {left} messages without a delivery report")

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
        if self._producer is not None:
            self._producer.flush(30)
        try:
            if self._conn is not None and self._conn.is_open:
                self._conn.close()
        except Exception:  # noqa: BLE001 - closing a connection the broker may have dropped
            pass
