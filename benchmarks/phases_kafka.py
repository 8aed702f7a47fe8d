"""The Kafka phases' own parts: the topic's publishing, the raw consumer's phase, and
ackflow's source noting when the group joined (both phases report the join apart)."""

from __future__ import annotations

import time
from typing import Any

from benchmarks.phases import body, cpu_s, rss_mb, tree_cpu

KAFKA_PARTITIONS = 4
#: the Kafka phases' consumer settings (ackflow's source uses the same defaults): short
#: session timeouts make the group join take seconds, not tens of seconds
KAFKA_GROUP = {
    "session.timeout.ms": 6000,
    "heartbeat.interval.ms": 500,
    "max.poll.interval.ms": 10000,
    "auto.offset.reset": "earliest",
}


def publish_kafka(bootstrap: str, topic: str, n: int) -> None:
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics(
        [NewTopic(topic, num_partitions=KAFKA_PARTITIONS, replication_factor=1)]
    ).values():
        try:
            future.result(30)
        except Exception as e:  # (the warm-up topic, on a phase's second run: appended to)
            if "TOPIC_ALREADY_EXISTS" not in str(e):
                raise
    p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all", "linger.ms": 20})
    for i in range(n):
        while True:
            try:
                p.produce(topic, value=body(i), partition=i % KAFKA_PARTITIONS)
                break
            except BufferError:
                p.poll(0.1)
    if p.flush(120):
        raise SystemExit("benchmark messages were not delivered to Kafka")


def phase_kafka_limit(bootstrap: str, topic: str, n: int, broker: int | None = None) -> dict[str, Any]:
    """Raw confluent-kafka: a group member consumes the topic and commits every 1 000
    messages (synchronously), the group join included, as ackflow's run includes it.
    ``broker``: the broker's pid, whose CPU is measured over the same span."""
    from confluent_kafka import Consumer

    c = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"limit-{topic}",
            "enable.auto.commit": False,
            **KAFKA_GROUP,
        }
    )
    t0 = time.perf_counter()
    c0, b0 = cpu_s(), tree_cpu(broker)
    joined: list[float] = []
    c.subscribe([topic], on_assign=lambda *_: joined.append(time.perf_counter()))
    done = 0
    idle_since = None
    while done < n:
        msgs = c.consume(1000, 1.0)
        got = sum(1 for m in msgs if m.error() is None)
        if not got:
            idle_since = idle_since or time.perf_counter()
            if time.perf_counter() - idle_since > 30:
                break
            continue
        idle_since = None
        done += got
        c.commit(asynchronous=False)
    secs = time.perf_counter() - t0
    cpu, broker_cpu = cpu_s() - c0, tree_cpu(broker) - b0
    c.close()
    join = joined[0] - t0 if joined else 0.0
    return {
        "messages": done,
        "seconds": secs,
        "rate": done / secs,
        "join_s": join,
        "rate_after_join": done / (secs - join),
        "rss_mb": rss_mb(),
        "driver_cpu_us": cpu / max(1, done) * 1e6,
        **({"broker_cpu_us": broker_cpu / max(1, done) * 1e6} if broker else {}),
    }


#: when the measured ackflow run's Kafka source was first assigned partitions
JOINED: list[float] = []


def _Joined(*args: Any, **kw: Any) -> Any:
    """ackflow's Kafka source, noting when the group first assigned it partitions."""
    from ackflow.sources import Kafka

    class Joined(Kafka):  # type: ignore[misc,valid-type]
        def _on_assign(self, consumer: Any, partitions: list[Any]) -> None:
            if not JOINED:
                JOINED.append(time.monotonic())
            super()._on_assign(consumer, partitions)

    return Joined(*args, **kw)
