"""Kafka as a sink: each row produced with ``acks=all`` by an idempotent producer, from
Spark tasks; a row counts as written only on its delivery report."""

from __future__ import annotations

import time
from typing import Any

from ackflow.core.errors import WHOLE_WRITE, ConfigError
from ackflow.core.secrets import redact
from ackflow.sinks.base import ROW_KEY, PartitionResult, Sink, require_columns
from ackflow.sinks.jsonrows import json_records

#: producer settings ackflow owns: a row is written only once every in-sync replica has
#: it, and librdkafka's own retries never duplicate or reorder within a partition
OWNED = {"enable.idempotence": True, "acks": "all"}


class KafkaSink(Sink):
    """Produce each row as a JSON message to ``topic``.

    The message key is the value of ``key`` (a column; null fails the row) or, without
    it, the row's key (its source message's identity and its place among the message's
    rows): a row written again after a crash goes to the same partition under the same
    key. Every message carries the header ``ackflow-row-key`` (the row's key), which a
    consumer can use to drop a copy.

    **At least once downstream.** Each partition task produces its rows and waits for
    every delivery report (``timeout_s`` without one fails the rest as a failure of the
    write as a whole). A batch written again after a crash, or a message retried after a
    neighbour failed, produces its rows again: Kafka then holds them twice, with the same
    key and ``ackflow-row-key``. (Transactions could make the batch atomic; the tests'
    broker does not prove them in a crash test yet.) A row Kafka refuses on its own (too
    large for ``message.max.bytes``, a null key) fails alone.
    """

    wants_keys = True

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        *,
        key: str | None = None,
        config: dict[str, Any] | None = None,
        timeout_s: float = 60.0,
        name: str | None = None,
    ) -> None:
        super().__init__(name or f"kafka:{topic}")
        if not bootstrap or not topic:
            raise ConfigError(f"sink {self.name!r}: bootstrap= and topic= must not be empty")
        clash = sorted(set(config or {}) & {*OWNED, "bootstrap.servers"})
        if clash:
            raise ConfigError(
                f"sink {self.name!r}: config= may not set {clash}: every row "
                "is produced idempotently with acks=all"
            )
        if not timeout_s > 0:
            raise ConfigError(f"sink {self.name!r}: timeout_s must be > 0, got {timeout_s!r}")
        self.bootstrap, self.topic, self.key = bootstrap, topic, key
        self.config = {"linger.ms": 5, **(config or {}), **OWNED, "bootstrap.servers": bootstrap}
        self.timeout_s = timeout_s

    def open(self) -> None:
        try:
            from confluent_kafka.admin import AdminClient
        except ImportError:
            raise ConfigError("the Kafka sink needs confluent-kafka: pip install 'ackflow[kafka]'") from None
        try:
            meta = AdminClient({"bootstrap.servers": self.bootstrap}).list_topics(timeout=15)
        except Exception as e:  # noqa: BLE001 - a clear message at start
            raise ConfigError(
                f"sink {self.name!r}: cannot reach Kafka at {redact(self.bootstrap)}: {type(e).__name__}: {e}"
            ) from None
        if self.topic not in meta.topics:
            raise ConfigError(f"sink {self.name!r}: topic {self.topic!r} does not exist; create it first")

    def prepare(self, schema: Any) -> None:
        if self.key is not None:
            require_columns(self.name, schema, key=self.key)

    def write_partition(self, batch_id: str, partition: int, rows: Any) -> PartitionResult:
        from confluent_kafka import KafkaException, Producer

        if rows.num_rows == 0:
            return PartitionResult()
        row_keys = rows.column(ROW_KEY).to_pylist()
        data = rows.drop_columns([ROW_KEY])
        keys = data.column(self.key).to_pylist() if self.key is not None else row_keys
        bodies = json_records(data)  # a row JSON cannot hold fails alone
        failed: dict[int, str] = {}
        delivered: set[int] = set()

        def report(i: int) -> Any:
            def done(err: Any, msg: Any) -> None:
                if err is None:
                    delivered.add(i)
                else:
                    failed[i] = f"Kafka refused the row: {err.str()}"

            return done

        producer = Producer(self.config)
        for i, body in enumerate(bodies):
            if isinstance(body, str):
                failed[i] = body
                continue
            key = keys[i]
            if key is None:
                failed[i] = f"its key column {self.key!r} is null"
                continue
            kb = key if isinstance(key, bytes) else str(key).encode()
            stuck_since = None
            while True:
                try:
                    producer.produce(
                        self.topic,
                        value=body,
                        key=kb,
                        on_delivery=report(i),
                        headers=[("ackflow-row-key", str(row_keys[i]).encode())],
                    )
                    break
                except BufferError:  # the local queue is full: let deliveries drain, for
                    # at most timeout_s without room (the brokers away): then the flush
                    # below fails what was not delivered
                    stuck_since = stuck_since or time.monotonic()
                    if time.monotonic() - stuck_since > self.timeout_s:
                        failed[i] = WHOLE_WRITE + (
                            f"the producer's queue stayed full for {self.timeout_s:g} s"
                        )
                        break
                    producer.poll(0.1)
                except KafkaException as e:  # this row (its size, say), not the others
                    failed[i] = f"Kafka refused the row: {e.args[0].str() if e.args else e}"
                    break
            producer.poll(0)
        left = producer.flush(self.timeout_s)
        if left:
            why = WHOLE_WRITE + f"no delivery report within {self.timeout_s:g} s"
            for i in range(len(bodies)):
                if i not in delivered:
                    failed.setdefault(i, why)
        return PartitionResult(failed=failed)
