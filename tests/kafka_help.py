"""What the Kafka tests ask the broker: a group's committed offsets and a topic's ends."""

from __future__ import annotations

from typing import Any


def committed(kafka: Any, name: str, group: str, partitions: int = 3) -> dict[int, int]:
    """The group's committed offset of each partition (-1001: none)."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": kafka.bootstrap, "group.id": group})
    try:
        got = c.committed([TopicPartition(name, p) for p in range(partitions)], 15)
        return {tp.partition: tp.offset for tp in got}
    finally:
        c.close()


def ends(kafka: Any, name: str, partitions: int) -> dict[int, int]:
    """Each partition's high watermark (tansu 0.6's can lag the real end: at least there)."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": kafka.bootstrap, "group.id": "ends"})
    try:
        return {p: c.get_watermark_offsets(TopicPartition(name, p), 10)[1] for p in range(partitions)}
    finally:
        c.close()
