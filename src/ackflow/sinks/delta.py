"""Delta Lake tables, one transaction per batch, each row once (``deltalake``, delta-rs)."""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Sequence
from typing import Any

from ackflow import faults
from ackflow.core.durable import fsync_dir
from ackflow.core.errors import ColumnsRefused, ConfigError, FlowError
from ackflow.sinks.lakehouse import TableSink

log = logging.getLogger("ackflow.sinks.delta")

#: how often a commit is retried when another writer committed first (delta-rs re-checks
#: the conflict and rebases an append on top of the winner)
COMMIT_RETRIES = 15

#: a log file's name: its version (20 digits), then ``.json``, ``.checkpoint[...].parquet``,
#: ``.crc`` or ``.<version>.compacted.json``
_LOG_NAME = re.compile(r"^(\d{20})\.(?:(\d{20})\.compacted\.json|json|crc|checkpoint\..*parquet)$")


class DeltaSink(TableSink):
    """Append each batch to the Delta table at ``path`` as one transaction.

    Spark tasks write Parquet data files (new unique names, the table's columns, one file
    per partition value) into the table's folder; the driver commits the batch as one
    Delta transaction adding exactly those files, so a batch is visible whole or not at
    all, and each batch is one table version (``DeltaTable(path).history()``, time
    travel with ``load_as_version``). A row is written when that commit succeeded.

    Effectively-once: the commit carries an application transaction ``(app id, sequence
    number)`` (``DeltaTable.transaction_version``), and the key manifest
    ``PATH/_ackflow/keys.db`` (SQLite) records every committed row key; rows whose keys
    are recorded are left out of a commit, and a commit made just before a crash is found
    by its sequence number and recorded at the next start (see
    :mod:`ackflow.sinks.lakehouse`). A batch whose rows were all written before makes no
    version. The row key is stored in the column ``key_column`` (``ackflow_key``); with
    ``key=[...]`` those columns identify a row instead (first write wins).

    Files of a batch that never committed (a crash, a failed job) are in no version:
    readers never see them. ``DeltaTable(path).vacuum(retention_hours=H, dry_run=False,
    full=True)`` deletes files no version references that are older than ``H`` hours (the
    ``_ackflow`` folder starts with ``_`` and is kept); choose ``H`` longer than a batch
    can take, never 0 while a pipeline writes.

    Schema: with ``create=True`` a missing table is created from the flow's columns
    (and ``partition_by``). ``evolve=True`` (the default): before a batch with new
    columns is written, the table's schema is merged with them in one metadata-only
    Delta version (``DeltaTable.alter.add_columns``): new nullable columns, new fields
    inside structs (also inside lists and map values).
    Types never widen (delta-rs has no ``typeWidening`` table feature): a wider value
    is written value by value in the table's type and fails its message only if it
    does not fit. ``evolve=False``: the table is never changed; a column it lacks, or a
    type it cannot take (a string into a number), is refused, naming the columns. A
    value that does not fit (an integer too large for the column, a null in a NOT NULL
    column) fails only its message.

    Several processes may write one table: commits of processes that share the manifest
    take turns; other writers' commits are retried over by delta-rs's optimistic
    concurrency (``COMMIT_RETRIES``). The driver and the executors must see the same
    ``path`` (local mode, or a shared file system).

    The log is bounded (``keep_versions``, 100): delta-rs lists the whole ``_delta_log``
    folder to find new versions (several times per commit), and the format keeps one
    JSON per version for ``delta.logRetentionDuration`` (30 days), so left alone a
    commit's cost grows with the number of batches (26 -> 75 ms over 5 000). After a
    batch's keys are recorded, once ``keep_versions / 2`` versions were committed since
    the last trim, the sink deletes the log entries (commit JSON, checkpoints, CRC and
    compacted files) older than the newest checkpoint that is at least ``keep_versions``
    versions old (creating a checkpoint when the table has none recent enough). Readers
    need only the newest checkpoint and the entries after it, so the table is unchanged;
    time travel (``load_as_version``, ``history()``) reaches ``keep_versions`` versions
    back and at most one checkpoint interval (``delta.checkpointInterval``, 100) more.
    ``keep_versions=None`` leaves the log to the format's own retention.
    """

    POINTS = ("delta.before_commit", "delta.after_commit", "delta.after_record")
    EVOLVED_POINT = "delta.evolved"

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        key: Sequence[str] | str | None = None,
        partition_by: Sequence[str] | str | None = None,
        create: bool = True,
        key_column: str = "ackflow_key",
        compression: str = "snappy",
        keep_versions: int | None = 100,
        evolve: bool = True,
        name: str = "delta",
    ) -> None:
        super().__init__(
            name, key=key, key_column=key_column, create=create, compression=compression, evolve=evolve
        )
        if keep_versions is not None and (
            not isinstance(keep_versions, int) or isinstance(keep_versions, bool) or keep_versions < 2
        ):
            raise ConfigError(
                f"sink {name!r}: keep_versions must be an integer of at least 2 "
                f"(or None to keep the whole log), got {keep_versions!r}"
            )
        self.keep_versions = keep_versions
        self._trimmed = -1  # the table version at this sink's last trim of the log
        self.path = os.path.abspath(os.fspath(path))
        if isinstance(partition_by, str):
            partition_by = [partition_by]
        self.wanted_partitions = list(partition_by or [])
        self.empty_partition_is_null = True  # Delta reads an empty partition value as null
        self._table: Any = None

    def _driver_only(self) -> Sequence[str]:
        return ("_table",)

    def describe(self) -> str:
        return f"Delta table {self.path!r}"

    @property
    def manifest_path(self) -> str:
        return os.path.join(self.path, "_ackflow", "keys.db")

    def data_dir(self) -> str:
        return self.path

    def open(self) -> None:
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise ConfigError(f"sink {self.name!r}: {self.path!r} is a file, not a Delta table folder")
        found = self.table_schema()
        if found is None and not self.create:
            raise ConfigError(
                f"sink {self.name!r}: no Delta table at {self.path!r}; create "
                "it, or pass create=True to create it from the flow's columns"
            )
        if found is not None and self.wanted_partitions and found[1] != self.wanted_partitions:
            raise ConfigError(
                f"sink {self.name!r}: the Delta table at {self.path!r} is "
                f"partitioned by {found[1]}, not {self.wanted_partitions}"
            )
        super().open()

    def _dt(self) -> Any:
        from deltalake import DeltaTable

        if self._table is None:
            self._table = DeltaTable(self.path)
        else:
            self._table.update_incremental()
        return self._table

    def table_schema(self) -> tuple[Any, list[str]] | None:
        import pyarrow as pa
        from deltalake import DeltaTable

        if not DeltaTable.is_deltatable(self.path):
            return None
        dt = DeltaTable(self.path)  # its own: prepare may run beside a commit
        return pa.schema(dt.schema().to_arrow()), list(dt.metadata().partition_columns)

    def create_table(self, schema: Any) -> None:
        import pyarrow as pa
        from deltalake import DeltaTable
        from deltalake import Schema as DeltaSchema

        missing = [c for c in self.wanted_partitions if c not in schema.names]
        if missing:
            raise FlowError(
                self.name,
                f"partition_by column(s) {', '.join(missing)} are not "
                f"among the flow's columns {', '.join(schema.names)}",
            )
        odd = [
            f"{c} ({schema.field(c).type})"
            for c in self.wanted_partitions
            if not _partition_type(schema.field(c).type)
        ]
        if odd:
            raise FlowError(
                self.name,
                f"partition_by column(s) {', '.join(odd)} must be strings, integers, dates or booleans",
            )
        bad = {}
        for f in schema:
            try:
                DeltaSchema.from_arrow(pa.schema([f]))
            except Exception as e:  # noqa: BLE001 - reported as what to fix
                bad[f.name] = f"{f.type} ({str(e).splitlines()[0][:80]})"
        if bad:
            raise ColumnsRefused(
                self.name,
                f"Delta cannot hold column(s) "
                f"{', '.join(f'{c} ({why})' for c, why in bad.items())}; "
                "cast them in the flow",
                {c: f"Delta cannot hold {why}" for c, why in bad.items()},
            )
        try:
            DeltaTable.create(self.path, schema, mode="ignore", partition_by=self.wanted_partitions or None)
        except Exception as e:  # noqa: BLE001 - a path the library refuses
            raise FlowError(
                self.name, f"cannot create a Delta table at {self.path!r}: {str(e).splitlines()[0]}"
            ) from None
        log.info("sink %r: created the Delta table %s (%s)", self.name, self.path, ", ".join(schema.names))

    def holds(self, field: Any) -> bool:
        import pyarrow as pa
        from deltalake import Schema as DeltaSchema

        try:
            DeltaSchema.from_arrow(pa.schema([field]))
        except Exception:  # noqa: BLE001 - a type Delta cannot hold: refused, named
            return False
        return True

    def evolve_table(self, schema: Any) -> None:
        """Add the columns of ``schema`` that are new or grew (new struct fields) in one
        Delta version that adds no rows (``DeltaTable.alter.add_columns``); fsynced like
        a batch's commit (a later batch's version must never outlive it). A commit that
        lost the race to another writer is made again on the newest version.
        (``write_deltalake(..., schema_mode="merge")`` of no rows merges as well; this
        commits only the metadata and leaves the columns it does not name alone.)"""
        import pyarrow as pa
        from deltalake import DeltaTable
        from deltalake import Schema as DeltaSchema
        from deltalake.exceptions import CommitFailedError
        from deltalake.transaction import CommitProperties

        before = int(DeltaTable(self.path).version())
        for attempt in range(COMMIT_RETRIES + 1):
            dt = DeltaTable(self.path)
            live = pa.schema(dt.schema().to_arrow())
            grown = [
                f for f in schema if f.name not in live.names or not live.field(f.name).type.equals(f.type)
            ]
            if not grown:  # another writer did it first
                break
            try:
                dt.alter.add_columns(
                    DeltaSchema.from_arrow(pa.schema(grown)).fields,
                    commit_properties=CommitProperties(custom_metadata={"ackflow.evolve": self.name}),
                )
                break
            except CommitFailedError as e:  # "Metadata changed since last commit"
                if attempt == COMMIT_RETRIES:
                    raise FlowError(
                        self.name,
                        f"evolving the Delta table at {self.path!r} "
                        f"lost the race {attempt + 1} times: "
                        f"{str(e).splitlines()[0]}",
                    ) from None
                time.sleep(min(1.0, 0.02 * 2**attempt))
            except OSError:
                raise
            except Exception as e:  # noqa: BLE001 - the table stays: its columns are refused
                log.warning(
                    "sink %r: cannot evolve the Delta table at %s (%s); it is left as it is",
                    self.name,
                    self.path,
                    str(e).splitlines()[0],
                )
                return
        self._sync_log(before, int(DeltaTable(self.path).version()))

    def table_state(self, app: str) -> tuple[str, int | None] | None:
        from deltalake import DeltaTable

        if not DeltaTable.is_deltatable(self.path):
            return None
        dt = self._dt()
        version = dt.transaction_version(app)
        return str(dt.metadata().id), None if version is None else int(version)

    def other_apps(self, app: str) -> set[str]:
        return {
            str(c["ackflow.app"]) for c in self._dt().history() if c.get("ackflow.app") not in (None, app)
        }

    def files_of(self, app: str, seq: int) -> list[str]:
        dt = self._dt()
        limit = 16
        while True:
            history = dt.history(limit)
            for commit in history:
                if commit.get("ackflow.app") == app and commit.get("ackflow.seq") == str(seq):
                    return [os.path.join(self.path, p) for p in commit.get("ackflow.files", [])]
            if len(history) < limit:
                raise RuntimeError(
                    f"sink {self.name!r}: the Delta log has a transaction "
                    f"{app}/{seq} but no commit naming it; cannot record its "
                    "keys"
                )
            limit *= 8

    def commit_files(self, files: list[dict[str, Any]], app: str, seq: int, batch_id: str) -> int | None:
        from deltalake.transaction import AddAction, CommitProperties, Transaction

        dt = self._dt()
        before = int(dt.version())
        paths = [f["path"] for f in files]  # as on disk: delta-rs does not decode them
        actions = [
            AddAction(p, f["size"], f["partition"], f["mtime"], True, f["stats"])
            for p, f in zip(paths, files, strict=True)
        ]
        properties = CommitProperties(
            custom_metadata={
                "ackflow.app": app,
                "ackflow.seq": str(seq),
                "ackflow.batch": batch_id,
                "ackflow.files": paths,
            },
            app_transactions=[Transaction(app, seq)],
            max_commit_retries=COMMIT_RETRIES,
        )
        dt.create_write_transaction(
            actions,
            "append",
            dt.schema(),
            partition_by=self.partition_by or None,
            commit_properties=properties,
        )
        dt.update_incremental()
        version = int(dt.version())
        self._sync_log(before, version)
        return version

    def maintain(self) -> None:
        """Trim the log to about ``keep_versions`` versions (see the class docstring),
        every ``keep_versions / 2`` versions. A failure is logged; the batch is written."""
        keep = self.keep_versions
        if keep is None or self._table is None:
            return
        version = int(self._table.version())
        if version - self._trimmed < max(1, keep // 2):
            return
        assert self._lock is not None
        try:
            with self._lock:  # not beside this process's own commits
                self._trim_log(version, keep)
            self._trimmed = version
        except Exception as e:  # noqa: BLE001 - maintenance: tried again after the next batch
            log.warning(
                "sink %r: could not trim the log of %s: %s",
                self.name,
                self.path,
                str(e).splitlines()[0] if str(e) else type(e).__name__,
            )

    def _trim_log(self, version: int, keep: int) -> None:
        """Delete the log entries older than the newest checkpoint at or below
        ``version - keep`` (only entries a reader of any newer version never opens)."""
        log_dir = os.path.join(self.path, "_delta_log")
        entries = [
            (int(m.group(2) or m.group(1)), name)
            for name in os.listdir(log_dir)
            if (m := _LOG_NAME.match(name))
        ]
        checkpoints = {v for v, name in entries if ".checkpoint." in name}
        if not any(version - keep < v <= version for v in checkpoints):
            self._table.create_checkpoint()  # a table whose checkpoint interval is longer
            faults.point("delta.after_checkpoint")
            return  # used once ``keep`` more versions exist
        usable = [v for v in checkpoints if v <= version - keep]
        if not usable:
            return
        floor = max(usable)
        for v, name in entries:  # delta-rs writes checkpoints without fsync
            if v == floor and ".checkpoint." in name:
                _fsync(os.path.join(log_dir, name))
        gone = 0
        for v, name in sorted(entries):
            if v < floor:
                try:
                    os.remove(os.path.join(log_dir, name))
                    gone += 1
                except FileNotFoundError:  # another writer trimmed it
                    pass
        if gone:
            fsync_dir(log_dir)
            faults.point("delta.after_trim")
            log.info(
                "sink %r: deleted %d log entries of %s older than the checkpoint of "
                "version %d (the table is at version %d)",
                self.name,
                gone,
                self.path,
                floor,
                version,
            )

    def _sync_log(self, after: int, upto: int) -> None:
        """fsync the log entries written since version ``after`` and the log folder:
        delta-rs writes them without fsync, and the keys recorded next (fsynced) must
        never outlive the commit they stand for (a power cut would lose the rows)."""
        log_dir = os.path.join(self.path, "_delta_log")
        for v in range(after + 1, upto + 1):
            try:
                _fsync(os.path.join(log_dir, f"{v:020d}.json"))
            except FileNotFoundError:  # another writer's checkpoint-only version
                continue
        fsync_dir(log_dir)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _partition_type(t: Any) -> bool:
    import pyarrow.types as pt

    return bool(
        pt.is_string(t)
        or pt.is_large_string(t)
        or pt.is_string_view(t)
        or pt.is_integer(t)
        or pt.is_date32(t)
        or pt.is_boolean(t)
    )
