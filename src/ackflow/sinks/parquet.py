"""Parquet files whose batches appear atomically, each row once."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sqlite3
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any, cast

from ackflow import faults
from ackflow.core import key_runs
from ackflow.core.durable import WriteTx, fsync_dir, keys_text, open_db, try_lock
from ackflow.core.errors import ColumnsRefused, ConfigError
from ackflow.sinks.base import ROW_KEY as KEY
from ackflow.sinks.base import PartitionResult, Sink

log = logging.getLogger("ackflow.sinks.parquet")


class ParquetSink(Sink):
    """Write each batch as a directory ``PATH/batch=<id>/`` of Parquet files.

    Tasks stage their files under ``PATH/_staging/<id>/`` (one file per partition,
    replaced atomically, so a retried task attempt overwrites rather than adds).
    When the job has succeeded, the driver commits the batch: one ``rename`` of the
    staging directory, so a batch is either wholly visible or not at all. Read the
    result with ``spark.read.parquet(PATH)``, or with pyarrow in the dataset's schema
    (``schema=pyarrow.parquet.read_schema(PATH + "/_common_metadata")``: without it a
    dataset whose schema grew is read in one file's schema); the ``batch`` column names
    the batch a row came in.

    Effectively-once (``dedupe=True``, the default): the sink keeps a manifest,
    ``PATH/_manifest.db`` (SQLite), of the committed batches and of every row key
    they hold (a row's key is its source message's identity and its position among
    the message's rows). A commit, in one write transaction of the manifest (so two
    batch threads or two processes holding the same key cannot both write it),
    drops the staged rows whose keys are committed already (a message delivered
    again, whose rows are already there), and records the batch and its keys; then
    it renames. Cost: one SQLite insert per row at commit (~60 bytes per row in the
    manifest, kept for good), and a rewrite of a staged file only when it holds rows
    already written.

    Durability order (each step durable before the next): a task writes its file
    to a temporary name, fsyncs it, renames it into ``_staging/<id>/`` and fsyncs
    that directory and ``_staging``; the driver removes the staged files no task's
    receipt names (a task that failed after writing, one that died mid-write) and
    records the batch (SQLite,
    ``synchronous=FULL``); renames ``_staging/<id>`` to ``batch=<id>`` and fsyncs
    ``PATH``. A crash (or power loss) before the record leaves an unrecorded staged
    batch, removed at the next start (its messages were not acked and come again);
    after the record, the next start finishes the rename (roll forward). A recorded
    batch is never deleted: if the rename fails (EIO, ENOSPC), the commit undoes the
    record in one transaction and fails (the messages are retried and written then);
    if even the undo fails, the staged batch stays for the next start to finish.

    One writer per ``PATH``: :meth:`open` takes an exclusive lock on
    ``PATH/_writer.lock`` (``flock``; a dead process holds none) and a second
    process gets a :class:`~ackflow.core.errors.ConfigError`.

    ``batches.dropped`` in the manifest counts the rows a commit left out because
    they were written before.

    The driver and the executors must see the same ``PATH`` (local mode, or a
    shared file system on a cluster).

    The dataset's schema is kept in ``PATH/_common_metadata`` (a Parquet footer without
    rows, written atomically by :meth:`prepare`: the first batch's columns; with
    ``evolve=True``, the default, grown by each batch that brings new columns, new
    struct fields, or a widening Spark reads in older files: int8/16/32 to int64 or
    float64, float32 to float64). Every file is written in that schema (a narrower type
    of a later batch is cast to the stored one); files of older batches keep theirs.
    int64 never becomes float64 (Spark cannot read an INT64 file column as double): the
    column stays int64 and a value that is not a whole number fails its message.
    ``evolve=False``: a column outside the stored schema is refused (the rows holding
    a value in it fail alone). How Spark, pyarrow and polars read such a dataset as
    one table: docs/sinks/parquet.md, "A schema that grows".
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        name: str = "parquet",
        compression: str = "snappy",
        dedupe: bool = True,
        dedupe_retention_s: float | None = None,
        evolve: bool = True,
    ) -> None:
        super().__init__(name)
        if dedupe_retention_s is not None and dedupe_retention_s <= 0:
            raise ConfigError(
                f"sink {name!r}: dedupe_retention_s must be positive (or None "
                f"to keep every key), got {dedupe_retention_s!r}"
            )
        self.path = os.path.abspath(os.fspath(path))
        self.compression = compression
        self.dedupe = dedupe
        self.wants_keys = self.replays_in_place = dedupe
        self.dedupe_retention_s = dedupe_retention_s
        self._last_sweep = 0.0
        self.evolve = evolve
        self.target: Any = None  # the dataset's schema, set by prepare
        self._lock_fd: int | None = None
        self._commit_lock = threading.Lock()
        self._schema_lock = threading.Lock()
        # the records' connection, kept between commits under _commit_lock: closing the
        # last connection to a WAL database checkpoints it, which cost as much as the
        # rest of a commit's SQLite work (py-spy of the files benchmark)
        self._commit_db: sqlite3.Connection | None = None

    def __getstate__(self) -> dict[str, Any]:  # tasks get the configuration only
        state = dict(self.__dict__)
        state["_lock_fd"] = None
        state["_commit_lock"] = None
        state["_commit_db"] = None
        state["_schema_lock"] = None
        return state

    @property
    def schema_file(self) -> str:
        return os.path.join(self.path, "_common_metadata")

    def stored_schema(self) -> Any:
        """The dataset's schema (``_common_metadata``), or None before the first batch."""
        import pyarrow.parquet as pq

        try:
            return pq.read_schema(self.schema_file)
        except FileNotFoundError:
            return None

    def _store_schema(self, schema: Any) -> None:
        import pyarrow.parquet as pq

        os.makedirs(self.path, exist_ok=True)
        tmp = os.path.join(self.path, f"._common_metadata.{uuid.uuid4().hex}.tmp")
        pq.write_metadata(schema, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self.schema_file)
        fsync_dir(self.path)

    def prepare(self, schema: Any) -> None:
        """Record the dataset's schema at the first batch; with ``evolve=True`` grow it
        to take ``schema`` (see the class docstring); refuse what it cannot take."""
        import pyarrow as pa

        from ackflow.sinks.conform import can_take
        from ackflow.sinks.evolution import evolved, promote_parquet

        incoming = pa.schema([f.with_nullable(True) for f in schema if f.name != KEY])
        assert self._schema_lock is not None
        with self._schema_lock:  # re-read each time: the file is the truth after a crash
            stored = self.stored_schema()
            if stored is None:
                self._store_schema(incoming)
                stored = incoming
            elif self.evolve:
                grown, changes = evolved(stored, incoming, promote_parquet)
                if changes:
                    self._store_schema(grown)
                    log.info(
                        "sink %r: evolved the schema of %s: %s", self.name, self.path, "; ".join(changes)
                    )
                    faults.point("parquet.evolved")
                    stored = grown
        where = f"the Parquet dataset {self.path!r}"
        lacking = [n for n in incoming.names if n not in stored.names]
        if lacking:
            raise ColumnsRefused(
                self.name,
                f"{where} has no column(s) {', '.join(lacking)} (evolve=False); "
                "write them to another path, or pass evolve=True",
                {c: f"{where} has no such column (evolve=False)" for c in lacking},
            )
        wrong = {
            f.name: f"{f.type} into {stored.field(f.name).type}"
            for f in incoming
            if not can_take(f.type, stored.field(f.name).type)
        }
        if wrong:
            raise ColumnsRefused(
                self.name,
                f"{where} cannot take column(s) "
                f"{', '.join(f'{c} ({t})' for c, t in wrong.items())}; cast them in the flow",
                {c: f"{where} cannot take {t}" for c, t in wrong.items()},
                retype={c: stored.field(c).type for c in wrong},
            )
        self.target = stored

    @property
    def staging(self) -> str:
        return os.path.join(self.path, "_staging")

    @property
    def manifest(self) -> str:
        return os.path.join(self.path, "_manifest.db")

    def _db(self, threads: bool = False) -> sqlite3.Connection:
        """A connection to the manifest (``threads``: usable from any thread, the
        caller serializing its use)."""
        db = open_db(
            self.manifest,
            "CREATE TABLE IF NOT EXISTS batches (batch TEXT PRIMARY KEY, rows INTEGER NOT NULL,"
            " dropped INTEGER NOT NULL, committed_at REAL NOT NULL);" + key_runs.SCHEMA,
            threads=threads,
        )
        return db

    def open(self) -> None:
        try:
            os.makedirs(self.staging, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"sink {self.name!r}: cannot create {self.path!r}: {e}") from None
        self._take_writer_lock()
        recorded: set[str] = set()
        if self.dedupe:
            db = self._db()
            try:
                key_runs.migrate(db, self.name)
                recorded = {r[0] for r in db.execute("SELECT batch FROM batches")}
            finally:
                db.close()
        for batch_id in os.listdir(self.staging):
            staged = os.path.join(self.staging, batch_id)
            if batch_id in recorded:  # recorded, then the rename did not happen: finish it
                os.rename(staged, os.path.join(self.path, f"batch={batch_id}"))
            else:  # never committed: its messages were not acked and will come again
                shutil.rmtree(staged, ignore_errors=True)
        fsync_dir(self.path)
        fsync_dir(self.staging)

    def _take_writer_lock(self) -> None:
        if self._lock_fd is not None:
            return
        path = os.path.join(self.path, "_writer.lock")
        fd = try_lock(path)
        if fd is None:
            raise ConfigError(
                f"sink {self.name!r}: another process is writing to {self.path!r} (it holds "
                f"{path}); one writer per Parquet path: stop it or choose another path"
            )
        self._lock_fd = fd

    def close(self) -> None:
        with self._commit_lock:  # checked under the lock: a failing commit drops it meanwhile
            db, self._commit_db = self._commit_db, None
        if db is not None:
            db.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def write_partition(self, batch_id: str, partition: int, rows: Any) -> PartitionResult:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if rows.num_rows == 0:
            return PartitionResult()
        keys = None
        if KEY in rows.column_names:
            keys = rows.column(KEY)
            rows = rows.drop_columns([KEY])
        failed: dict[int, str] = {}
        if self.target is not None and not rows.schema.equals(self.target):
            rows, failed = self._conform(rows)
            if failed:
                kept = pa.array([i not in failed for i in range(rows.num_rows)])
                rows = rows.filter(kept)
                keys = None if keys is None else keys.filter(kept)
                if rows.num_rows == 0:
                    return PartitionResult(failed=failed)
        folder = os.path.join(self.staging, batch_id)
        os.makedirs(folder, exist_ok=True)
        final = os.path.join(folder, f"part-{partition:05d}.parquet")
        _write_atomically(rows, final, self.compression, pq)  # the file and its folder
        fsync_dir(self.staging)  # the folder's entry in _staging
        # the keys go to the driver as runs (the text the manifest's insert takes), and as
        # one JSON array in the rows' order (parsed only when some were written before),
        # each on its own line after the part's: never escaped into it
        runs = None if keys is None else key_runs.runs_or_none(keys)
        head = {
            "file": final,
            "rows": rows.num_rows,
            "has_keys": keys is not None,
            "n_runs": -1 if runs is None else len(runs),
            "null_key": keys is not None and keys.null_count > 0,
        }
        lines = [json.dumps(head).encode(), b"" if runs is None else key_runs.text(runs).encode()]
        lines.append(b"" if keys is None else keys_text(keys.to_pylist()).encode())
        return PartitionResult(failed=failed, token=b"\n".join(lines))

    def _conform(self, rows: Any) -> tuple[Any, dict[int, str]]:
        """The rows in the dataset's schema (columns it has and the rows lack are null; a
        value that does not fit the stored type fails its row)."""
        from ackflow.sinks.conform import conform

        extra = [c for c in rows.column_names if c not in self.target.names]
        if extra:  # never dropped silently: the job fails, its messages are retried
            raise RuntimeError(
                f"sink {self.name!r}: column(s) {', '.join(extra)} are not in "
                f"the dataset's schema; prepare() was not given them"
            )
        return conform(rows, self.target)

    def commit(self, batch_id: str, tokens: Sequence[bytes]) -> None:
        if not tokens:
            return
        staged = os.path.join(self.staging, batch_id)
        parts = [_part(t) for t in tokens]
        for part in parts:
            if not os.path.exists(part["file"]):
                raise OSError(f"staged file {part['file']!r} is missing; not committing")
        _drop_unnamed(staged, {os.path.basename(part["file"]) for part in parts})
        target = os.path.join(self.path, f"batch={batch_id}")
        faults.point("parquet.before_record")
        if not self.dedupe:
            os.rename(staged, target)
            fsync_dir(self.path)
            return
        with self._commit_lock:  # one commit at a time in this process; BEGIN IMMEDIATE across
            fresh_total = self._record(batch_id, parts)
        # Recorded: the batch is committed; from here on only the rename (now, or at the
        # next start) or an undo of the record may follow, never a deletion.
        if fresh_total == 0:  # every row was written before (a redelivered batch)
            shutil.rmtree(staged, ignore_errors=True)
            return
        try:
            faults.point("parquet.after_record")
            os.rename(staged, target)
        except Exception as e:  # a dying process (KeyboardInterrupt, exit) leaves the record
            self._undo_record(batch_id, e)
            raise
        faults.point("parquet.after_rename")
        try:
            fsync_dir(self.path)
        except OSError as e:  # renamed and recorded: written; a lost rename rolls forward
            log.warning(
                "sink %r: fsync of %s after renaming batch %s failed: %s", self.name, self.path, batch_id, e
            )

    def _record(self, batch_id: str, parts: list[dict[str, Any]]) -> int:
        """In one write transaction: drop rows already written (and their keys from the
        parts), record the batch and its fresh keys. Returns the number of rows left to
        show. The caller holds ``_commit_lock``."""
        if self._commit_db is None:
            self._commit_db = self._db(threads=True)
        db = self._commit_db
        try:
            with WriteTx(db):
                staged_total = sum(part["rows"] for part in parts)
                if any(part["null_key"] for part in parts):  # (a transform nulled the key
                    # column) never recorded; checked here, before any staged file is touched
                    # (the temporary table's INSERT OR IGNORE would skip a null silently)
                    raise ValueError(
                        "a row has no row key (null); its rows cannot be told "
                        "apart from a redelivery's: not committing"
                    )
                now = time.time()
                keyed = [part for part in parts if part["keys_json"]]
                texts = [part["runs_json"] for part in keyed]
                count = sum(part["n_runs"] for part in keyed)
                if all(part["n_runs"] >= 0 for part in keyed) and key_runs.insert_if_all_new(
                    db, texts, count, now, batch_id
                ):
                    fresh_total = staged_total  # no row was written before (the common case)
                else:
                    fresh_total = self._drop_written_rows(db, parts, [k for p in parts for k in _keys(p)])
                    # the parts' keys are now those of the rows kept: none is in the manifest
                    key_runs.insert_new(db, [k for p in parts for k in _keys(p)], now, batch_id)
                for folder in {os.path.dirname(part["file"]) for part in parts}:
                    if os.path.isdir(folder):
                        fsync_dir(folder)
                self._sweep(db, now)
                db.execute(
                    "INSERT INTO batches (batch, rows, dropped, committed_at) VALUES "
                    "(?, ?, ?, julianday('now'))",
                    (batch_id, fresh_total, staged_total - fresh_total),
                )
        except BaseException:  # rolled back; the next commit opens a fresh connection
            self._commit_db = None
            db.close()
            raise
        return fresh_total

    def _sweep(self, db: sqlite3.Connection, now: float) -> None:
        """With ``dedupe_retention_s``: forget keys committed longer ago than that (at most
        every tenth of the retention, and at most hourly; a scan of the key table)."""
        if self.dedupe_retention_s is None:
            return
        if now - self._last_sweep < min(self.dedupe_retention_s / 10, 3600.0):
            return
        self._last_sweep = now
        gone = db.execute("DELETE FROM key_runs WHERE at < ?", (now - self.dedupe_retention_s,)).rowcount
        if gone:
            kept_s = self.dedupe_retention_s
            log.info("sink %r: forgot %d runs of row keys older than %g s", self.name, gone, kept_s)

    def _undo_record(self, batch_id: str, cause: BaseException) -> None:
        """The rename failed after the record: take the record back (then the batch may be
        aborted and its messages retried), or, if that fails too, keep the staged batch
        for the next start to finish."""
        try:
            db = self._db()
            try:
                with WriteTx(db):
                    # the runs this batch inserted (its fresh keys) carry its id
                    db.execute("DELETE FROM key_runs WHERE batch = ?", (batch_id,))
                    db.execute("DELETE FROM batches WHERE batch = ?", (batch_id,))
            finally:
                db.close()
            log.error(
                "sink %r: renaming batch %s failed (%s); its record was undone and its messages are retried",
                self.name,
                batch_id,
                cause,
            )
        except Exception as e:  # noqa: BLE001 - the record stands: roll forward later
            log.error(
                "sink %r: renaming batch %s failed (%s) and undoing its record failed "
                "(%s); the staged batch is kept and finished at the next start",
                self.name,
                batch_id,
                cause,
                e,
            )

    def _drop_written_rows(self, db: sqlite3.Connection, parts: list[dict[str, Any]], keys: list[str]) -> int:
        """Remove rows whose keys (``keys``: every part's) are committed already from the
        staged files, and their keys from the parts' ``keys`` (inside the caller's write
        transaction)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        seen = key_runs.written(db, keys)
        total = 0
        for part in parts:
            if not part["keys"] or not seen:  # nothing of it was written before
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

    def _recorded(self, batch_id: str) -> bool:
        db = self._db()
        try:
            return db.execute("SELECT 1 FROM batches WHERE batch = ?", (batch_id,)).fetchone() is not None
        finally:
            db.close()

    def abort(self, batch_id: str, tokens: Sequence[bytes]) -> None:
        """Remove a staged batch that was not recorded. A recorded one is never removed
        (its messages may be acked on redelivery): it stays for the next start."""
        staged = os.path.join(self.staging, batch_id)
        if not os.path.exists(staged):
            return
        if self.dedupe and self._recorded(batch_id):
            log.error(
                "sink %r: batch %s is recorded but not renamed; kept for the next start", self.name, batch_id
            )
            return
        shutil.rmtree(staged, ignore_errors=True)


def _write_atomically(table: Any, final: str, compression: str, pq: Any) -> None:
    tmp = os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.{uuid.uuid4().hex}.tmp")
    pq.write_table(table, tmp, compression=compression)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fsync_dir(os.path.dirname(final))


def _drop_unnamed(staged: str, named: set[str]) -> None:
    """Remove the files of ``staged`` no token names before the folder becomes the batch: a
    task that failed after writing its file (its rows failed, their messages come again)
    or died mid-write. Shown, such rows would be written a second time by the redelivery
    (their keys were never recorded)."""
    stray = [name for name in os.listdir(staged) if name not in named]
    for name in stray:
        log.warning("batch folder %s: removing %s, which no task's receipt names", staged, name)
        os.remove(os.path.join(staged, name))
    if stray:
        fsync_dir(staged)


def _part(token: bytes) -> dict[str, Any]:
    """A task's token: its part's line (JSON: file, rows, ...), then its keys' runs' JSON
    text, then its keys' JSON text."""
    head, runs, text = token.split(b"\n", 2)
    part = cast(dict[str, Any], json.loads(head))
    has_keys = part.pop("has_keys")
    part["runs_json"] = runs.decode() if has_keys else None
    part["keys_json"] = text.decode() if has_keys else None
    return part


def _keys(part: dict[str, Any]) -> list[str]:
    """A staged part's row keys (parsed once from its token's JSON text, then kept as
    ``part["keys"]``, which the slow path filters in place)."""
    if "keys" not in part:
        part["keys"] = json.loads(part["keys_json"]) if part["keys_json"] else []
    return cast(list[str], part["keys"])
