"""Sources: where messages come from. They run on the driver. Imported on first use
(ackflow/_lazy.py)."""

from typing import TYPE_CHECKING

from ackflow._lazy import lazy

if TYPE_CHECKING:
    from ackflow.sources.base import Source
    from ackflow.sources.embedded import EmbeddedQueueSource
    from ackflow.sources.embedded import EmbeddedQueueSource as EmbeddedQueue
    from ackflow.sources.files import FilesSource
    from ackflow.sources.files import FilesSource as Files
    from ackflow.sources.kafka import KafkaSource
    from ackflow.sources.kafka import KafkaSource as Kafka
    from ackflow.sources.merge import MergedSource
    from ackflow.sources.rabbitmq import RabbitMQSource
    from ackflow.sources.rabbitmq import RabbitMQSource as RabbitMQ
    from ackflow.sources.stream import RabbitMQStreamSource
    from ackflow.sources.stream import RabbitMQStreamSource as RabbitMQStream

__getattr__, __dir__ = lazy(
    __name__,
    {
        "Source": "ackflow.sources.base:Source",
        "EmbeddedQueue": "ackflow.sources.embedded:EmbeddedQueueSource",
        "EmbeddedQueueSource": "ackflow.sources.embedded:EmbeddedQueueSource",
        "Files": "ackflow.sources.files:FilesSource",
        "FilesSource": "ackflow.sources.files:FilesSource",
        "Kafka": "ackflow.sources.kafka:KafkaSource",
        "KafkaSource": "ackflow.sources.kafka:KafkaSource",
        "MergedSource": "ackflow.sources.merge:MergedSource",
        "RabbitMQ": "ackflow.sources.rabbitmq:RabbitMQSource",
        "RabbitMQSource": "ackflow.sources.rabbitmq:RabbitMQSource",
        "RabbitMQStream": "ackflow.sources.stream:RabbitMQStreamSource",
        "RabbitMQStreamSource": "ackflow.sources.stream:RabbitMQStreamSource",
    },
)

__all__ = [
    "EmbeddedQueue",
    "EmbeddedQueueSource",
    "Files",
    "FilesSource",
    "Kafka",
    "KafkaSource",
    "MergedSource",
    "RabbitMQ",
    "RabbitMQSource",
    "RabbitMQStream",
    "RabbitMQStreamSource",
    "Source",
]
