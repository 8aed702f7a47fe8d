"""Sources: where messages come from. They run on the driver."""

from ackflow.sources.base import Source
from ackflow.sources.embedded import EmbeddedQueueSource
from ackflow.sources.merge import MergedSource
from ackflow.sources.rabbitmq import RabbitMQSource

EmbeddedQueue = EmbeddedQueueSource
RabbitMQ = RabbitMQSource

__all__ = ["EmbeddedQueue", "EmbeddedQueueSource", "MergedSource", "RabbitMQ", "RabbitMQSource",
           "Source"]
