"""Parquet files whose batches appear atomically, each row once."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import uuid
from collections.abc import Sequence
from typing import Any

from ackflow.core.errors import ConfigError
from ackflow.sinks.base import ROW_KEY as KEY
from ackflow.sinks.base import PartitionResult, Sink


class ParquetSink(Sink):
    """Write each batch as a directory ``PATH/batch=<id>/`` of Parquet files.

    Tasks stage their files under ``PATH/_staging/<id>/`` (one file per partition,
    replaced atomically, so a retried task attempt overwrites rather than adds).
    When the job has succeeded, the driver commits the batch: one ``rename`` of the
    staging directory, so a batch is either wholly visible or not at all. Read the
    result with ``pyarrow.parquet.read_table(PATH)`` or ``spark.read.parquet(PATH)``;
    the ``batch`` column names the batch a row came in.

    Effectively-once (``dedupe=True``, the default): the sink keeps a manifest,
    ``PATH/_manifest.db`` (SQLite), of the committed batches and of every row key
    they hold (a row's key is its source message's identity and its position among
    the message's rows). A commit first drops the rows whose keys are already
    committed (a message delivered again after a crash, whose rows are already
    there), then records the batch and its keys in one transaction, then renames.
    A crash between the two leaves a recorded batch in ``_staging``: the next start
    finishes its rename (roll forward); staged batches that were never recorded are
    removed (their messages were not acked and come again). Cost: one SQLite insert
    per row at commit (~60 bytes per row in the manifest, kept for good), and a
    rewrite of a staged file only when it holds rows already written.

    ``batches.dropped`` in the manifest counts the rows a commit left out because
    they were written before.

    The driver and the executors must see the same ``PATH`` (local mode, or a
    shared file system on a cluster).
    """

    def __init__(self, path: str | os.PathLike[str], *, name: str = "parquet",
                 compression: str = "snappy", dedupe: bool = True) -> None:
        super().__init__(name)
        self.path = os.path.abspath(os.fspath(path))
        self.compression = compression
        self.dedupe = dedupe
        self.wants_keys = dedupe

    @property
    def staging(self) -> str:
        return os.path.join(self.path, "_staging")

    @property
    def manifest(self) -> str:
        return os.path.join(self.path, "_manifest.db")

    def _db(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.manifest, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.executescript(
            "CREATE TABLE IF NOT EXISTS batches (batch TEXT PRIMARY KEY, rows INTEGER NOT NULL,"
            " dropped INTEGER NOT NULL, committed_at REAL NOT NULL);"
            "CREATE TABLE IF NOT EXISTS row_keys (key TEXT PRIMARY KEY) WITHOUT ROWID;")
        return db

    def open(self) -> None:
        try:
            os.makedirs(self.staging, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"sink {self.name!r}: cannot create {self.path!r}: {e}") from None
        recorded: set[str] = set()
        if self.dedupe:
            db = self._db()
            try:
                recorded = {r[0] for r in db.execute("SELECT batch FROM batches")}
            finally:
                db.close()
        for batch_id in os.listdir(self.staging):
            staged = os.path.join(self.staging, batch_id)
            if batch_id in recorded:  # committed, then the process died before the rename
                os.rename(staged, os.path.join(self.path, f"batch={batch_id}"))
            else:  # never committed: its messages were not acked and will come again
                shutil.rmtree(staged, ignore_errors=True)
        _fsync_dir(self.path)

    def write_partition(self, batch_id: str, partition: int, rows: Any) -> PartitionResult:
        import pyarrow.parquet as pq

        if rows.num_rows == 0:
            return PartitionResult()
        keys = None
        if KEY in rows.column_names:
            keys = rows.column(KEY).to_pylist()
            rows = rows.drop_columns([KEY])
        folder = os.path.join(self.staging, batch_id)
        os.makedirs(folder, exist_ok=True)
        final = os.path.join(folder, f"part-{partition:05d}.parquet")
        _write_atomically(rows, final, self.compression, pq)
        return PartitionResult(token=json.dumps({"file": final, "keys": keys,
                                                 "rows": rows.num_rows}).encode())

    def commit(self, batch_id: str, tokens: Sequence[bytes]) -> None:
        if not tokens:
            return
        staged = os.path.join(self.staging, batch_id)
        parts = [json.loads(t) for t in tokens]
        for part in parts:  # rows written without keys cannot be de-duplicated
            part["keys"] = part["keys"] or []
        for part in parts:
            if not os.path.exists(part["file"]):
                raise OSError(f"staged file {part['file']!r} is missing; not committing")
        target = os.path.join(self.path, f"batch={batch_id}")
        if not self.dedupe:
            os.rename(staged, target)
            _fsync_dir(self.path)
            return
        db = self._db()
        try:
            staged_total = sum(part["rows"] for part in parts)
            fresh_total = self._drop_written_rows(db, parts)
            db.execute("BEGIN IMMEDIATE")
            try:
                db.executemany("INSERT OR IGNORE INTO row_keys (key) VALUES (?)",
                               ((k,) for part in parts for k in part["keys"]))
                db.execute("INSERT INTO batches (batch, rows, dropped, committed_at) VALUES "
                           "(?, ?, ?, julianday('now'))",
                           (batch_id, fresh_total, staged_total - fresh_total))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        finally:
            db.close()
        # Recorded: from here on the batch is committed; a crash before the rename is
        # finished by the next open().
        if fresh_total == 0:  # every row was written before (a redelivered batch)
            shutil.rmtree(staged, ignore_errors=True)
            return
        os.rename(staged, target)
        _fsync_dir(self.path)

    def _drop_written_rows(self, db: sqlite3.Connection, parts: list[dict[str, Any]]) -> int:
        """Remove rows whose keys are committed already from the staged files."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        keys = [k for part in parts for k in part["keys"]]
        db.execute("CREATE TEMP TABLE IF NOT EXISTS incoming (key TEXT PRIMARY KEY)")
        db.execute("DELETE FROM incoming")
        db.executemany("INSERT OR IGNORE INTO incoming (key) VALUES (?)", ((k,) for k in keys))
        seen = {r[0] for r in db.execute(
            "SELECT key FROM incoming JOIN row_keys USING (key)")}
        total = 0
        for part in parts:
            if not part["keys"]:
                total += part["rows"]
                continue
            mask = [k not in seen for k in part["keys"]]
            kept = sum(mask)
            total += kept
            if kept == len(mask):
                continue
            if kept == 0:
                os.remove(part["file"])
            else:
                table = pq.read_table(part["file"]).filter(pa.array(mask))
                _write_atomically(table, part["file"], self.compression, pq)
            part["keys"] = [k for k, m in zip(part["keys"], mask, strict=True) if m]
        return total

    def abort(self, batch_id: str, tokens: Sequence[bytes]) -> None:
        shutil.rmtree(os.path.join(self.staging, batch_id), ignore_errors=True)



def _write_atomically(table: Any, final: str, compression: str, pq: Any) -> None:
    tmp = os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.{uuid.uuid4().hex}.tmp")
    pq.write_table(table, tmp, compression=compression)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
