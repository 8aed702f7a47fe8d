"""Sinks that hand rows back to the driver: memory (for tests) and console."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from ackflow.sinks.base import PartitionResult, Sink


def _to_ipc(rows: Any) -> bytes:
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, rows.schema) as w:
        w.write_table(rows)
    return bytes(sink.getvalue().to_pybytes())


def _from_ipc(token: bytes) -> list[dict[str, Any]]:
    import pyarrow as pa

    return pa.ipc.open_stream(token).read_all().to_pylist()  # type: ignore[no-any-return]


class MemorySink(Sink):
    """Keep written rows in ``self.rows`` on the driver (tests and notebooks).

    Rows travel back from the tasks in the job's result and are appended at
    commit, so they appear only for batches whose job succeeded.
    """

    def __init__(self, name: str = "memory") -> None:
        super().__init__(name)
        self.rows: list[dict[str, Any]] = []

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "rows": []}  # rows stay on the driver

    def write_partition(self, batch_id: str, partition: int, rows: Any) -> PartitionResult:
        return PartitionResult(token=_to_ipc(rows) if rows.num_rows else None)

    def commit(self, batch_id: str, tokens: Sequence[bytes]) -> None:
        for t in tokens:
            self.rows.extend(_from_ipc(t))


class ConsoleSink(Sink):
    """Print written rows on the driver's standard output (at most ``limit`` per batch)."""

    def __init__(self, name: str = "console", limit: int = 20) -> None:
        super().__init__(name)
        self.limit = limit

    def write_partition(self, batch_id: str, partition: int, rows: Any) -> PartitionResult:
        return PartitionResult(token=_to_ipc(rows.slice(0, self.limit)) if rows.num_rows else None)

    def commit(self, batch_id: str, tokens: Sequence[bytes]) -> None:
        shown = 0
        for t in tokens:
            for row in _from_ipc(t):
                if shown >= self.limit:
                    return
                print(f"[{self.name} {batch_id}] {row}", file=sys.stdout)
                shown += 1
