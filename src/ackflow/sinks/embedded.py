"""The embedded queue as a sink, so that pipelines can be chained."""

from __future__ import annotations

import json
import os
from typing import Any

from ackflow.core.errors import ConfigError
from ackflow.sinks.base import ROW_KEY, PartitionResult, Sink


class EmbeddedQueueSink(Sink):
    """Publish each row as a JSON message to ``queue`` in the embedded queue file.

    Each partition is published in one SQLite transaction from its Spark task: a
    row is written when that transaction committed. Each message's id is the row's
    key (its source message's identity and its position among that message's rows),
    or the value of ``id_column``; an id once published is never queued again, so a
    message delivered again after a crash does not reach the next stage twice
    (effectively-once; the queue file keeps every id, ~60 bytes each).
    """

    wants_keys = True

    def __init__(self, path: str | os.PathLike[str], queue: str, *,
                 id_column: str | None = None, name: str | None = None) -> None:
        super().__init__(name or f"embedded:{queue}")
        self.path = os.path.abspath(os.fspath(path))
        self.queue = queue
        self.id_column = id_column

    def open(self) -> None:
        from ackflow.embedded import EmbeddedQueue

        if not os.path.isdir(os.path.dirname(self.path)):
            raise ConfigError(f"sink {self.name!r}: directory of {self.path!r} does not exist")
        EmbeddedQueue(self.path).close()  # creates the file and the tables

    def write_partition(self, batch_id: str, partition: int, rows: Any) -> PartitionResult:
        from ackflow.embedded import EmbeddedQueue

        if rows.num_rows == 0:
            return PartitionResult()
        keys = rows.column(ROW_KEY).to_pylist()
        records = rows.drop_columns([ROW_KEY]).to_pylist()
        ids = keys
        if self.id_column is not None:
            ids = [k if r.get(self.id_column) is None else str(r[self.id_column])
                   for r, k in zip(records, keys, strict=True)]
        q = EmbeddedQueue(self.path)
        try:
            q.publish(
                self.queue,
                [json.dumps(r, default=str).encode() for r in records],
                msg_ids=ids,
                remember=True,
            )
        finally:
            q.close()
        return PartitionResult()
