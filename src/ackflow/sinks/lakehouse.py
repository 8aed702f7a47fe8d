"""What the Delta Lake and Iceberg sinks share: files written by tasks, one table commit
per batch on the driver, and a key manifest that makes redelivered rows effectively-once.

The protocol (:class:`TableSink`), per batch:

1. **Tasks** cast their rows to the table's columns (a row that does not fit fails its
   message only), write them as Parquet data files with new unique names into the
   table's location (fsynced, with their folder), and return each file's name, size,
   row count, statistics and row keys in their token. A file no commit names is not
   part of the table: a batch whose tasks wrote files and that never committed leaves
   only unreferenced files behind (see the sinks' ``vacuum`` notes).
2. **The driver** commits, inside one write transaction of the key manifest (SQLite,
   ``BEGIN IMMEDIATE``: one committer at a time across threads and processes that share
   the manifest):

   a. *catch up*: if the table holds a commit of ours the manifest does not (the process
      died between the table commit and the manifest's COMMIT), record its keys now,
      read from its files;
   b. drop rows whose keys are recorded (a message delivered again): files holding such
      rows are rewritten without them (new names), files left empty are not committed;
   c. commit the files to the table in one transaction carrying this manifest's
      application id and the batch's sequence number (Delta: an application
      transaction; Iceberg: snapshot properties);
   d. record the keys, the batch and its sequence number; COMMIT.

   A crash before (c) leaves unreferenced files and no record; the messages come again.
   A crash between (c) and (d) is repaired by (a) at the next commit or start: the
   batch is recognised by its sequence number and never committed twice, and its keys
   make the redelivered rows drop out. A crash after (d) is an ordinary redelivery of
   committed rows: dropped by (b).

Keys: by default ackflow's row key, stored in the table in column ``key_column``
(``ackflow_key``) as well as in the manifest; with ``key=[...]`` the values of those
columns (first write wins: a later row with the same values is not added).
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
import uuid
from abc import abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from ackflow import faults
from ackflow.core import key_runs
from ackflow.core.durable import WriteTx, fsync_dir, open_db
from ackflow.core.errors import ColumnsRefused, ConfigError, FlowError
from ackflow.sinks.base import ROW_KEY as KEY
from ackflow.sinks.base import PartitionResult, Sink, null_key_failures
from ackflow.sinks.conform import can_take, conform
from ackflow.sinks.datafiles import file_stats, hive_escape, partition_value, split_partitions, too_long

log = logging.getLogger("ackflow.sinks.lakehouse")


class KeyManifest:
    """The row keys committed to one table, the batches and the last sequence number.

    SQLite (WAL, ``synchronous=FULL``) at ``path``; the keys kept for good as runs
    (core/key_runs.py: a batch of a file's lines or a queue's row ids is one row).
    ``meta`` holds the application id (made once, the id the table's commits carry),
    ``seq``, the sequence number of the last batch whose keys are recorded, and
    ``dropped``, the rows left out so far because their keys were recorded."""

    def __init__(self, path: str) -> None:
        self.path = path

    def connect(self) -> sqlite3.Connection:
        db = open_db(
            self.path,
            "CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL);"
            f"{key_runs.SCHEMA};"
            "CREATE TABLE IF NOT EXISTS batches (seq INTEGER PRIMARY KEY, batch TEXT,"
            " version INTEGER, rows INTEGER NOT NULL, dropped INTEGER NOT NULL,"
            " recovered INTEGER NOT NULL DEFAULT 0, committed_at REAL NOT NULL);",
        )
        db.execute("INSERT OR IGNORE INTO meta (k, v) VALUES ('app', ?)", (f"ackflow-{uuid.uuid4().hex}",))
        db.execute("INSERT OR IGNORE INTO meta (k, v) VALUES ('seq', '0')")
        db.execute("INSERT OR IGNORE INTO meta (k, v) VALUES ('dropped', '0')")
        key_runs.migrate(db, self.path)
        return db

    @staticmethod
    def get(db: sqlite3.Connection, k: str) -> str:
        return str(db.execute("SELECT v FROM meta WHERE k = ?", (k,)).fetchone()[0])

    @staticmethod
    def written(db: sqlite3.Connection, keys: Sequence[str]) -> set[str]:
        """Which of ``keys`` are recorded (a primary-key search per key: flat in the
        manifest's size)."""
        return key_runs.written(db, list(keys))

    @staticmethod
    def record(
        db: sqlite3.Connection,
        seq: int,
        batch: str,
        version: int | None,
        runs: list[list[Any]],
        rows: int,
        dropped: int,
        recovered: bool = False,
    ) -> None:
        """Record a committed batch: its keys' ``runs`` (none recorded yet), its rows."""
        now = time.time()
        key_runs.insert(db, runs, now, batch or None)
        db.execute(
            "INSERT OR REPLACE INTO batches (seq, batch, version, rows, dropped, recovered,"
            " committed_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (seq, batch, version, rows, dropped, int(recovered), now),
        )
        db.execute("UPDATE meta SET v = ? WHERE k = 'seq'", (str(seq),))


class TableSink(Sink):
    """Base of the table sinks (see the module docstring). Subclasses say where files
    go, how the table's schema is read or created, and how a batch is committed and
    found again by its sequence number."""

    wants_keys = True
    replays_in_place = True  # the manifest of written keys: a key is written once
    #: fault point names, in order: before the table commit, after it (keys not yet
    #: recorded), after the record (nothing acked yet)
    POINTS: tuple[str, str, str] = ("", "", "")
    #: fault point after the table's schema was evolved, before prepare returns
    EVOLVED_POINT = ""

    def __init__(
        self,
        name: str,
        *,
        key: Sequence[str] | str | None,
        key_column: str,
        create: bool,
        compression: str,
        evolve: bool = True,
    ) -> None:
        super().__init__(name)
        if isinstance(key, str):
            key = [key]
        if key is not None and not key:
            raise ConfigError(
                f"sink {name!r}: key= needs at least one column (or None for ackflow's row key)"
            )
        self.key = list(key) if key is not None else None
        self.key_column = key_column
        self.create = create
        self.evolve = evolve
        self.compression = compression
        self.target: Any = None  # the data files' pyarrow schema, set by prepare
        self.partition_by: list[str] = []
        #: True where the table format keeps an empty partition value as null (Delta)
        self.empty_partition_is_null = False
        self._prepared: set[tuple[str, ...]] = set()
        self._lock = threading.Lock()
        self._state: dict[str, str] = {}  # batch id -> "committing" | "committed"

    def __getstate__(self) -> dict[str, Any]:  # tasks get the configuration only
        state = dict(self.__dict__)
        state["_lock"] = None
        state["_state"] = {}
        state["_prepared"] = set()
        for k in self._driver_only():
            state[k] = None
        return state

    def _driver_only(self) -> Sequence[str]:
        return ()

    # -- what subclasses provide --------------------------------------------------------

    @property
    @abstractmethod
    def manifest_path(self) -> str:
        """Where the key manifest lives (every writer of the table must use the same)."""

    @abstractmethod
    def data_dir(self) -> str:
        """The local folder tasks write data files into (driver side, after prepare)."""

    @abstractmethod
    def table_schema(self) -> tuple[Any, list[str]] | None:
        """The table's columns (``pyarrow.Schema``) and partition columns, or None if the
        table does not exist."""

    @abstractmethod
    def create_table(self, schema: Any) -> None:
        """Create the table with these columns (``create=True``)."""

    @abstractmethod
    def table_state(self, app: str) -> tuple[str, int | None] | None:
        """The table's unique id and the sequence number of this application's last
        commit in it (None: no commit yet); None if the table does not exist."""

    @abstractmethod
    def other_apps(self, app: str) -> set[str]:
        """Application ids other than ``app`` that committed to the table."""

    @abstractmethod
    def files_of(self, app: str, seq: int) -> list[str]:
        """Local paths of the data files the commit ``seq`` of ``app`` added."""

    @abstractmethod
    def commit_files(self, files: list[dict[str, Any]], app: str, seq: int, batch_id: str) -> int | None:
        """Commit ``files`` as one table transaction carrying ``(app, seq)``; returns the
        table version (or snapshot) made, if known."""

    def fmt_type(self, t: Any) -> str:
        return str(t)

    def promote(self, have: Any, want: Any) -> bool:
        """Whether the table format widens a column of type ``have`` to ``want``."""
        return False

    def holds(self, field: Any) -> bool:
        """Whether the table format can hold a column like ``field`` (``pyarrow.Field``)."""
        return True

    def evolve_table(self, schema: Any) -> None:
        """Change the table's schema to ``schema`` (:func:`~ackflow.sinks.evolution.evolved`
        of the live table's: only additions and widenings; idempotent)."""
        raise NotImplementedError

    # -- driver side: start and schema --------------------------------------------------

    def open(self) -> None:
        try:
            os.makedirs(os.path.dirname(self.manifest_path), exist_ok=True)
        except OSError as e:
            raise ConfigError(f"sink {self.name!r}: cannot create {self.manifest_path!r}: {e}") from None
        if self.table_schema() is not None:
            with self._manifest() as db:
                self._catch_up(db)

    @contextmanager
    def _manifest(self) -> Iterator[sqlite3.Connection]:
        """The manifest, write-locked (this process's threads and other processes wait)."""
        assert self._lock is not None
        with self._lock:
            db = KeyManifest(self.manifest_path).connect()
            try:
                with WriteTx(db):
                    yield db
            finally:
                db.close()

    def columns(self, schema: Any) -> Any:
        """The table columns the flow writes: its own plus the key column (by default)."""
        import pyarrow as pa

        fields = [f for f in schema if f.name != KEY]
        twin = [n for n in schema.names if n != KEY and n.lower() == self.key_column.lower()]
        if self.key is None and twin:  # Delta does not tell column names apart by case
            raise ColumnsRefused(
                self.name,
                f"the flow writes a column {self.key_column!r}, the sink's own key "
                "column: rename the flow's column, or give the sink another key_column=",
                {n: "the sink's own key column (key_column=) has this name" for n in twin},
            )
        if self.key is None:
            fields.append(pa.field(self.key_column, pa.string()))
        return pa.schema(fields)

    def prepare(self, schema: Any) -> None:
        """Create the table (``create=True``) or check that it takes the flow's columns;
        with ``evolve=True`` first grow it to take them (new columns, new struct fields,
        the format's widenings: :mod:`ackflow.sinks.evolution`); what it still cannot
        take is refused naming the columns (:class:`ColumnsRefused`)."""
        signature = tuple(f"{f.name}:{f.type}" for f in schema)
        if signature in self._prepared:
            return
        incoming = self.columns(schema)
        missing_key = [k for k in self.key or [] if k not in incoming.names]
        if missing_key:
            raise FlowError(
                self.name,
                f"the key column(s) {', '.join(missing_key)} are not "
                f"among the flow's columns {', '.join(incoming.names)}",
            )
        found = self.table_schema()
        if found is None:
            if not self.create:
                raise FlowError(
                    self.name,
                    f"{self.describe()} does not exist; create it, or "
                    "pass create=True to create it from the flow's columns",
                )
            self.create_table(incoming)
            found = self.table_schema()
            assert found is not None
        table, partitions = found
        if self.evolve:
            from ackflow.sinks.evolution import evolved

            grown, changes = evolved(table, incoming, self.promote, self.holds)
            if changes:
                assert self._lock is not None
                with self._lock:  # never beside this process's own commit of a batch
                    found = self.table_schema()  # live: another process may have done it
                    assert found is not None
                    grown, changes = evolved(found[0], incoming, self.promote, self.holds)
                    if changes:
                        self.evolve_table(grown)
                        log.info("sink %r: evolved %s: %s", self.name, self.describe(), "; ".join(changes))
                faults.point(self.EVOLVED_POINT)
                found = self.table_schema()
                assert found is not None
                table, partitions = found
        lacking = [f.name for f in incoming if f.name not in table.names]
        if lacking:
            raise ColumnsRefused(
                self.name,
                f"{self.describe()} has no column(s) {', '.join(lacking)} (the flow "
                f"writes {', '.join(incoming.names)}); add them to the table, or write to a "
                "new table",
                {c: f"{self.describe()} has no such column" for c in lacking},
            )
        wrong = {
            f.name: f"{self.fmt_type(f.type)} into {self.fmt_type(table.field(f.name).type)}"
            for f in incoming
            if not can_take(f.type, table.field(f.name).type)
        }
        if wrong:
            raise ColumnsRefused(
                self.name,
                f"{self.describe()} cannot take column(s) "
                f"{', '.join(f'{c} ({t})' for c, t in wrong.items())}; cast them in the flow, "
                "or write to a new table",
                {c: f"{self.describe()} cannot take {t}" for c, t in wrong.items()},
                retype={c: table.field(c).type for c in wrong},
            )
        required = [f.name for f in table if not f.nullable and f.name not in incoming.names]
        if required:
            raise FlowError(
                self.name,
                f"{self.describe()} requires column(s) "
                f"{', '.join(required)} (NOT NULL) that the flow does not write",
            )
        self.target = table
        self.partition_by = partitions
        self._prepared.add(signature)

    def describe(self) -> str:
        return f"table {self.name!r}"

    # -- task side ----------------------------------------------------------------------

    def write_partition(self, batch_id: str, partition: int, rows: Any) -> PartitionResult:
        import pyarrow as pa

        if rows.num_rows == 0:
            return PartitionResult()
        if self.target is None:
            raise RuntimeError(f"sink {self.name!r} was not prepared")
        keys = rows.column(KEY) if KEY in rows.column_names else None
        data = rows.drop_columns([KEY]) if keys is not None else rows
        if self.key is None:
            data = data.append_column(
                self.key_column, keys if keys is not None else pa.array([None] * rows.num_rows, pa.string())
            )
        data, failed = conform(data, self.target)
        for i, why in null_key_failures(data, self.key).items():
            failed.setdefault(i, why)  # a null key would make every later null-keyed row "written"
        if self.empty_partition_is_null:
            for c in self.partition_by:
                for i, v in enumerate(data.column(c).to_pylist()):
                    if v == "":  # the table format would read it back as null: never silently
                        failed.setdefault(
                            i,
                            f"partition column {c!r} is an empty string, which "
                            f"{self.name!r} would store as null; map it to a "
                            "value or to null in the flow",
                        )
        if self.partition_by:
            for i, why in too_long(data, self.partition_by).items():
                failed.setdefault(i, why)
        if failed:
            kept = pa.array([i not in failed for i in range(rows.num_rows)])
            data = data.filter(kept)
        files = []
        if data.num_rows:
            groups: list[tuple[dict[str, str | None], Any]] = [({}, data)]
            if self.partition_by:
                groups = split_partitions(data, self.partition_by)
            for values, part in groups:
                files.append(
                    self._write_file(part.drop_columns(self.partition_by), values, self.row_keys(part))
                )
        return PartitionResult(failed=dict(failed), token=json.dumps({"files": files}).encode())

    def row_keys(self, data: Any) -> list[str]:
        """The manifest's keys of these rows (ackflow's row key, or the ``key=`` values)."""
        if self.key is None:
            return [str(k) for k in data.column(self.key_column).to_pylist()]
        cols = [data.column(k).to_pylist() for k in self.key]
        return [json.dumps(v, default=str, separators=(",", ":")) for v in zip(*cols, strict=True)]

    def _write_file(self, data: Any, values: dict[str, str | None], keys: list[str]) -> dict[str, Any]:
        """Write one data file (without the partition columns), fsynced with its folder."""
        import pyarrow.parquet as pq

        rel = "/".join(
            [
                *(f"{c}={hive_escape(values[c])}" for c in self.partition_by),
                f"part-ackflow-{uuid.uuid4().hex}.{self.compression}.parquet",
            ]
        )
        path = os.path.join(self.data_dir(), rel)
        folder = os.path.dirname(path)
        made = not os.path.isdir(folder)
        os.makedirs(folder, exist_ok=True)
        pq.write_table(data, path, compression=self.compression)
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        fsync_dir(folder)
        if made:  # a new folder (a partition value, Iceberg's data/): its entry too
            fsync_dir(os.path.dirname(folder))
        runs = key_runs.runs_or_none(keys)  # the driver's quick check; None: key by key
        return {
            "path": rel,
            "size": os.path.getsize(path),
            "rows": data.num_rows,
            "keys": keys,
            "runs": runs,
            "partition": values,
            "stats": file_stats(data),
            "mtime": int(os.path.getmtime(path) * 1000),
        }

    # -- driver side: commit ------------------------------------------------------------

    def commit(self, batch_id: str, tokens: Sequence[bytes]) -> None:
        files = [f for t in tokens for f in json.loads(t)["files"]]
        if not files:
            return
        before, after, recorded = self.POINTS
        with self._manifest() as db:
            seq = self._catch_up(db) + 1
            files, fresh, dropped = self._drop_written(db, files)
            if dropped:  # rows of messages delivered again, left out (the total, for checks)
                db.execute("UPDATE meta SET v = CAST(v AS INTEGER) + ? WHERE k = 'dropped'", (dropped,))
            if not files:  # every row was written before (a redelivered batch): no commit
                log.info(
                    "sink %r: batch %s holds only rows written before (%d); nothing to commit",
                    self.name,
                    batch_id,
                    dropped,
                )
                return
            faults.point(before)
            self._state[batch_id] = "committing"
            version = self.commit_files(files, KeyManifest.get(db, "app"), seq, batch_id)
            self._state[batch_id] = "committed"
            faults.point(after)
            KeyManifest.record(db, seq, batch_id, version, fresh, sum(f["rows"] for f in files), dropped)
        faults.point(recorded)
        self._state.pop(batch_id, None)
        self.maintain()

    def maintain(self) -> None:
        """Called after each recorded commit (the keys are durable): bound what the table
        keeps of its history (Iceberg). A failure here never fails the batch."""

    def _catch_up(self, db: sqlite3.Connection) -> int:
        """Record the keys of commits of ours the manifest missed (a crash between the
        table commit and the record). Returns the last sequence number."""
        app, seq = KeyManifest.get(db, "app"), int(KeyManifest.get(db, "seq"))
        state = self.table_state(app)
        if state is None:
            return seq
        table_id, last = state
        known = db.execute("SELECT v FROM meta WHERE k = 'table'").fetchone()
        if known is None:  # a manifest new to this table: no other manifest's rows in it
            others = sorted(self.other_apps(app))
            if others:
                raise FlowError(
                    self.name,
                    f"{self.describe()} holds rows committed through "
                    f"another key manifest (application {others[0]}), but "
                    f"{self.manifest_path} is new to it: their keys are unknown, "
                    "so redelivered rows would be written twice. Restore that "
                    "manifest (or point manifest= at it)",
                )
            db.execute("INSERT INTO meta (k, v) VALUES ('table', ?)", (table_id,))
        elif known[0] != table_id:  # its keys would leave out rows this table never had
            raise FlowError(
                self.name,
                f"the key manifest {self.manifest_path} belongs to "
                f"another table (id {known[0]}, this one is {table_id}; was the "
                "table made again?): move it away, or give this table its own",
            )
        if last is None or last <= seq:
            return seq
        for s in range(seq + 1, last + 1):
            keys: list[str] = []
            for path in self.files_of(app, s):
                keys.extend(self._keys_in_file(path))
            # its keys were new at its commit; runs of those the manifest lacks, all the same
            seen = KeyManifest.written(db, keys)
            runs = key_runs.unique_runs([k for k in keys if k not in seen])
            KeyManifest.record(db, s, "", None, runs, len(keys), 0, recovered=True)
            log.warning(
                "sink %r: batch %d was committed to the table before a crash but not "
                "recorded; recorded its %d keys now (its rows are not written again)",
                self.name,
                s,
                len(keys),
            )
        return last

    def _keys_in_file(self, path: str) -> list[str]:
        import pyarrow.parquet as pq

        cols = [self.key_column] if self.key is None else list(self.key)
        present = [c for c in cols if c not in self.partition_by]
        data = pq.ParquetFile(path).read(columns=present)
        if len(present) != len(cols):  # a key column is a partition column: from the path
            import pyarrow as pa

            rel = os.path.relpath(path, self.data_dir())
            for c in cols:
                if c not in present:
                    value = partition_value(rel, c)
                    column = pa.array([value] * data.num_rows, pa.string())
                    kind = self.target.field(c).type if self.target is not None else None
                    if kind is not None and pa.types.is_boolean(kind):
                        column = pa.array(
                            [None if v is None else v == "true" for v in column.to_pylist()], pa.bool_()
                        )
                    elif kind is not None:  # typed as at write time, so the keys match
                        column = column.cast(kind)
                    data = data.append_column(c, column)
        return self.row_keys(data)

    def _drop_written(
        self, db: sqlite3.Connection, files: list[dict[str, Any]]
    ) -> tuple[list[dict[str, Any]], list[list[Any]], int]:
        """Leave out rows whose keys are recorded (and repeats within the batch): rewrite
        files that hold some, skip files that hold only those. Returns the files to
        commit, their keys' runs and the number of rows left out. The common case, no
        key recorded or repeated, is one search per run, not per key."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        if all(f.get("runs") is not None for f in files):
            runs = [r for f in files for r in f["runs"]]
            if key_runs.disjoint(runs) and not key_runs.any_written(db, runs):
                return files, runs, 0
        seen = KeyManifest.written(db, [k for f in files for k in f["keys"]])
        out, fresh, dropped = [], [], 0
        for f in files:
            mask = []
            for k in f["keys"]:
                mask.append(k not in seen)
                seen.add(k)
            kept = sum(mask)
            dropped += len(mask) - kept
            path = os.path.join(self.data_dir(), f["path"])
            if kept == len(mask):
                out.append(f)
                fresh.extend(f["keys"])
                continue
            if kept:
                table = pq.ParquetFile(path).read().filter(pa.array(mask))
                rewritten = self._write_file(
                    table, f["partition"], [k for k, m in zip(f["keys"], mask, strict=True) if m]
                )
                out.append(rewritten)
                fresh.extend(rewritten["keys"])
            _remove(path)
        return out, key_runs.unique_runs(fresh), dropped

    def _committed(self, batch_id: str) -> bool:
        with self._manifest() as db:
            return db.execute("SELECT 1 FROM batches WHERE batch = ?", (batch_id,)).fetchone() is not None

    def abort(self, batch_id: str, tokens: Sequence[bytes]) -> None:
        """Remove the files of a batch that certainly did not commit. Files of a batch
        whose table commit was attempted stay (they may be in the table; unreferenced
        ones are removed by ``vacuum``)."""
        if self._state.pop(batch_id, None) is not None or self._committed(batch_id):
            return  # a later sink of the batch failed after this one committed: keep them
        for t in tokens:
            for f in json.loads(t)["files"]:
                _remove(os.path.join(self.data_dir(), f["path"]))


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
