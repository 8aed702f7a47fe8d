"""The embedded queue as a sink, so that pipelines can be chained."""

from __future__ import annotations

import os
from typing import Any

from ackflow.core.errors import ConfigError
from ackflow.sinks.base import ROW_KEY, PartitionResult, Sink, missing_id, require_columns
from ackflow.sinks.jsonrows import json_records


class EmbeddedQueueSink(Sink):
    """Publish each row as a JSON message to ``queue`` in the embedded queue file.

    Each partition is published in one SQLite transaction from its Spark task: a
    row is written when that transaction committed. Each message's id is the row's
    key (its source message's identity and its position among that message's rows),
    or the value of ``id_column``; an id once published is never queued again, so a
    message delivered again after a crash does not reach the next stage twice
    (effectively-once; the queue file keeps every id, ~60 bytes each). With
    ``remember_for_s`` ids older than that are forgotten (checked at most every tenth
    of it, after a batch's commit): the file stops growing, and a message redelivered
    after its ids were forgotten is queued again (at-least-once beyond that horizon).
    """

    wants_keys = True
    replays_in_place = True  # an id once published is never queued again

    def __init__(
        self,
        path: str | os.PathLike[str],
        queue: str,
        *,
        id_column: str | None = None,
        remember_for_s: float | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(name or f"embedded:{queue}")
        if remember_for_s is not None and remember_for_s <= 0:
            raise ConfigError(
                f"sink {self.name!r}: remember_for_s must be positive (or None "
                f"to remember every id), got {remember_for_s!r}"
            )
        self.path = os.path.abspath(os.fspath(path))
        self.queue = queue
        self.id_column = id_column
        self.remember_for_s = remember_for_s
        self._last_sweep = 0.0

    def commit(self, batch_id: str, tokens: Any) -> None:
        """Driver side: apply the retention of remembered ids, now and then."""
        import time

        from ackflow.embedded import EmbeddedQueue

        if self.remember_for_s is None:
            return
        now = time.monotonic()
        if now - self._last_sweep < self.remember_for_s / 10:
            return
        self._last_sweep = now
        q = EmbeddedQueue(self.path)
        try:
            q.forget_published(self.queue, self.remember_for_s)
        finally:
            q.close()

    def open(self) -> None:
        from ackflow.embedded import EmbeddedQueue

        if not os.path.isdir(os.path.dirname(self.path)):
            raise ConfigError(f"sink {self.name!r}: directory of {self.path!r} does not exist")
        EmbeddedQueue(self.path).close()  # creates the file and the tables

    def prepare(self, schema: Any) -> None:
        require_columns(self.name, schema, id_column=self.id_column)

    def write_partition(self, batch_id: str, partition: int, rows: Any) -> PartitionResult:
        from ackflow.embedded import EmbeddedQueue

        if rows.num_rows == 0:
            return PartitionResult()
        keys = rows.column(ROW_KEY).to_pylist()
        data = rows.drop_columns([ROW_KEY])
        bodies = json_records(data)  # a row JSON cannot hold fails alone
        failed: dict[int, str] = {i: b for i, b in enumerate(bodies) if isinstance(b, str)}
        ids = keys
        if self.id_column is not None:  # a row without one fails (see missing_id)
            ids = []
            for i, v in enumerate(data.column(self.id_column).to_pylist()):
                why = missing_id(v, "id_column", self.id_column)
                if why is not None:
                    failed.setdefault(i, why)
                ids.append(str(v) if why is None else "")
        q = EmbeddedQueue(self.path)
        try:
            q.publish(
                self.queue,
                [b for i, b in enumerate(bodies) if i not in failed],  # type: ignore[misc]
                msg_ids=[mid for i, mid in enumerate(ids) if i not in failed],
                remember=True,
            )
        finally:
            q.close()
        return PartitionResult(failed=failed)
