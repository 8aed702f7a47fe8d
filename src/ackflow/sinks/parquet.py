"""Parquet files whose batches appear atomically."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Sequence
from typing import Any

from ackflow.core.errors import ConfigError
from ackflow.sinks.base import PartitionResult, Sink


class ParquetSink(Sink):
    """Write each batch as a directory ``PATH/batch=<id>/`` of Parquet files.

    Tasks stage their files under ``PATH/_staging/<id>/`` (one file per partition,
    replaced atomically, so a retried task attempt overwrites rather than adds).
    When the job has succeeded, the driver renames the staging directory into
    place: one ``rename``, so a batch is either wholly visible or not at all. A
    crash leaves only ``_staging`` behind, which readers ignore (the leading
    underscore) and the next run clears. Read the result with
    ``pyarrow.parquet.read_table(PATH)`` or ``spark.read.parquet(PATH)``; the
    ``batch`` column names the batch a row came in.

    The driver and the executors must see the same ``PATH`` (local mode, or a
    shared file system on a cluster).
    """

    def __init__(self, path: str | os.PathLike[str], *, name: str = "parquet",
                 compression: str = "snappy") -> None:
        super().__init__(name)
        self.path = os.path.abspath(os.fspath(path))
        self.compression = compression

    @property
    def staging(self) -> str:
        return os.path.join(self.path, "_staging")

    def open(self) -> None:
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"sink {self.name!r}: cannot create {self.path!r}: {e}") from e
        # Staged files of a crashed run were never committed: their messages were not
        # acked and will be delivered again. Remove them.
        shutil.rmtree(self.staging, ignore_errors=True)
        os.makedirs(self.staging, exist_ok=True)

    def write_partition(self, batch_id: str, partition: int, rows: Any) -> PartitionResult:
        import pyarrow.parquet as pq

        if rows.num_rows == 0:
            return PartitionResult()
        folder = os.path.join(self.staging, batch_id)
        os.makedirs(folder, exist_ok=True)
        final = os.path.join(folder, f"part-{partition:05d}.parquet")
        tmp = os.path.join(folder, f".part-{partition:05d}.{uuid.uuid4().hex}.tmp")
        pq.write_table(rows, tmp, compression=self.compression)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
        return PartitionResult(token=final.encode())

    def commit(self, batch_id: str, tokens: Sequence[bytes]) -> None:
        if not tokens:
            return
        staged = os.path.join(self.staging, batch_id)
        for t in tokens:
            if not os.path.exists(t.decode()):
                raise OSError(f"staged file {t.decode()!r} is missing; not committing")
        target = os.path.join(self.path, f"batch={batch_id}")
        os.rename(staged, target)
        _fsync_dir(self.path)

    def abort(self, batch_id: str, tokens: Sequence[bytes]) -> None:
        shutil.rmtree(os.path.join(self.staging, batch_id), ignore_errors=True)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
