"""An internal sink that brings rows, with their lineage, back to the driver."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from ackflow.sinks.base import PartitionResult, Sink
from ackflow.sinks.memory import _to_ipc


class CollectSink(Sink):
    """Hands rows to the engine (``grouped_within``); they are not written anywhere.

    The writer gives this sink the lineage column too (``wants_lineage``). A row
    counts as "written" once it reached the driver; its message is then held, not
    acked, until the groups it went into are written downstream.
    """

    wants_lineage = True
    wants_keys = True  # a group's key derives from its rows' keys

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._tables: dict[str, list[Any]] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"name": self.name}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.name = state["name"]
        self._tables = {}
        self._lock = threading.Lock()

    def write_partition(self, batch_id: str, partition: int, rows: Any) -> PartitionResult:
        return PartitionResult(token=_to_ipc(rows) if rows.num_rows else None)

    def commit(self, batch_id: str, tokens: Sequence[bytes]) -> None:
        import pyarrow as pa

        tables = [pa.ipc.open_stream(t).read_all() for t in tokens]
        with self._lock:
            self._tables.setdefault(batch_id, []).extend(tables)

    def take(self, batch_id: str) -> list[Any]:
        with self._lock:
            return self._tables.pop(batch_id, [])
