"""Sources: where messages come from. They run on the driver."""

from ackflow.sources.base import Source
from ackflow.sources.embedded import EmbeddedQueueSource
from ackflow.sources.files import FilesSource
from ackflow.sources.merge import MergedSource
from ackflow.sources.rabbitmq import RabbitMQSource
from ackflow.sources.stream import RabbitMQStreamSource

EmbeddedQueue = EmbeddedQueueSource
Files = FilesSource
RabbitMQ = RabbitMQSource
RabbitMQStream = RabbitMQStreamSource

__all__ = [
    "EmbeddedQueue",
    "EmbeddedQueueSource",
    "Files",
    "FilesSource",
    "MergedSource",
    "RabbitMQ",
    "RabbitMQSource",
    "RabbitMQStream",
    "RabbitMQStreamSource",
    "Source",
]
