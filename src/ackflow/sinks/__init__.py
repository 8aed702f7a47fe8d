"""Sinks: where rows go. Their writers run inside Spark tasks. Imported on first use
(ackflow/_lazy.py): a Python worker imports only the sink it writes to."""

from typing import TYPE_CHECKING

from ackflow._lazy import lazy

if TYPE_CHECKING:
    from ackflow.sinks.base import PartitionResult, Sink
    from ackflow.sinks.broadcast import Broadcast
    from ackflow.sinks.delta import DeltaSink
    from ackflow.sinks.delta import DeltaSink as Delta
    from ackflow.sinks.embedded import EmbeddedQueueSink
    from ackflow.sinks.embedded import EmbeddedQueueSink as EmbeddedQueue
    from ackflow.sinks.iceberg import IcebergSink
    from ackflow.sinks.iceberg import IcebergSink as Iceberg
    from ackflow.sinks.kafka import KafkaSink
    from ackflow.sinks.kafka import KafkaSink as Kafka
    from ackflow.sinks.memory import ConsoleSink, MemorySink
    from ackflow.sinks.memory import ConsoleSink as Console
    from ackflow.sinks.memory import MemorySink as Memory
    from ackflow.sinks.parquet import ParquetSink
    from ackflow.sinks.parquet import ParquetSink as Parquet
    from ackflow.sinks.postgres import PostgresSink
    from ackflow.sinks.postgres import PostgresSink as Postgres
    from ackflow.sinks.rabbitmq import RabbitMQSink
    from ackflow.sinks.rabbitmq import RabbitMQSink as RabbitMQ

__getattr__, __dir__ = lazy(
    __name__,
    {
        "PartitionResult": "ackflow.sinks.base:PartitionResult",
        "Sink": "ackflow.sinks.base:Sink",
        "Broadcast": "ackflow.sinks.broadcast:Broadcast",
        "Delta": "ackflow.sinks.delta:DeltaSink",
        "DeltaSink": "ackflow.sinks.delta:DeltaSink",
        "EmbeddedQueue": "ackflow.sinks.embedded:EmbeddedQueueSink",
        "EmbeddedQueueSink": "ackflow.sinks.embedded:EmbeddedQueueSink",
        "Iceberg": "ackflow.sinks.iceberg:IcebergSink",
        "IcebergSink": "ackflow.sinks.iceberg:IcebergSink",
        "Console": "ackflow.sinks.memory:ConsoleSink",
        "ConsoleSink": "ackflow.sinks.memory:ConsoleSink",
        "Memory": "ackflow.sinks.memory:MemorySink",
        "MemorySink": "ackflow.sinks.memory:MemorySink",
        "Parquet": "ackflow.sinks.parquet:ParquetSink",
        "ParquetSink": "ackflow.sinks.parquet:ParquetSink",
        "Postgres": "ackflow.sinks.postgres:PostgresSink",
        "PostgresSink": "ackflow.sinks.postgres:PostgresSink",
        "Kafka": "ackflow.sinks.kafka:KafkaSink",
        "KafkaSink": "ackflow.sinks.kafka:KafkaSink",
        "RabbitMQ": "ackflow.sinks.rabbitmq:RabbitMQSink",
        "RabbitMQSink": "ackflow.sinks.rabbitmq:RabbitMQSink",
    },
)

__all__ = [
    "Broadcast",
    "Console",
    "ConsoleSink",
    "Delta",
    "DeltaSink",
    "EmbeddedQueue",
    "EmbeddedQueueSink",
    "Iceberg",
    "IcebergSink",
    "Kafka",
    "KafkaSink",
    "Memory",
    "MemorySink",
    "Parquet",
    "ParquetSink",
    "PartitionResult",
    "Postgres",
    "PostgresSink",
    "RabbitMQ",
    "RabbitMQSink",
    "Sink",
]
