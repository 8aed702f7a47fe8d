"""Sources: where messages come from. They run on the driver."""

from ackflow.sources.base import Source
from ackflow.sources.embedded import EmbeddedQueueSource

EmbeddedQueue = EmbeddedQueueSource

__all__ = ["EmbeddedQueue", "EmbeddedQueueSource", "Source"]
