"""Sinks: where rows go. Their writers run inside Spark tasks."""

from ackflow.sinks.base import PartitionResult, Sink
from ackflow.sinks.broadcast import Broadcast
from ackflow.sinks.delta import DeltaSink
from ackflow.sinks.embedded import EmbeddedQueueSink
from ackflow.sinks.iceberg import IcebergSink
from ackflow.sinks.memory import ConsoleSink, MemorySink
from ackflow.sinks.parquet import ParquetSink
from ackflow.sinks.postgres import PostgresSink
from ackflow.sinks.rabbitmq import RabbitMQSink

Parquet = ParquetSink
Memory = MemorySink
Console = ConsoleSink
EmbeddedQueue = EmbeddedQueueSink
Postgres = PostgresSink
RabbitMQ = RabbitMQSink
Delta = DeltaSink
Iceberg = IcebergSink

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
