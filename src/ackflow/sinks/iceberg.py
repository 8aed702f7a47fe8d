"""Apache Iceberg tables, one snapshot per batch, each row once (``pyiceberg``).

Durability of a commit (law 11). pyiceberg writes every file without fsync; only the
catalog's own commit (a SQL transaction) is durable. The keys a commit records in the
key manifest make the redelivered rows "already written", so every file the snapshot
references must be durable before they are recorded, or a power cut could keep the
keys and lose the rows. The order, with the fault point after each step:

1. tasks write the data files, fsynced with their folder (``lakehouse``);
   ``iceberg.before_commit``: nothing of the batch is in the table;
2. pyiceberg writes the manifests, the manifest list and the metadata JSON, and the
   catalog points at it: ``iceberg.committed``;
3. from the committed snapshot itself (the transaction's metadata, never a re-load that
   could be another writer's newer metadata), fsync: its data files
   (``iceberg.synced_data``), the manifests it wrote (``iceberg.synced_manifests``), its
   manifest list (``iceberg.synced_manifest_list``), the metadata JSON; each file's
   folder after its files;
4. ``iceberg.after_commit``: all durable, keys not yet recorded; the key manifest
   records the keys and the batch (SQLite, synchronous): ``iceberg.after_record``.

A crash before 4 leaves a snapshot whose keys are not recorded: the next commit or
start finds it by its ``ackflow.seq`` and records them (``lakehouse``). What stays out of
ackflow's hands: between 2 and 3 the catalog points at files not yet durable; a power
cut there can leave the table unreadable (pyiceberg's, as for any of its writers), but
never keys recorded for rows that are not there.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ackflow import faults
from ackflow.core.durable import fsync_dir
from ackflow.core.errors import ColumnsRefused, ConfigError, FlowError
from ackflow.core.secrets import hide, redact
from ackflow.sinks.lakehouse import TableSink

log = logging.getLogger("ackflow.sinks.iceberg")

#: how often a commit is tried again when another writer committed first
COMMIT_RETRIES = 10

#: Table properties that bound the table's metadata (set unless the table has them; a
#: value you set wins): pyiceberg deletes metadata JSON files past the newest ten after
#: each commit, and merges manifests (at 100, the format's default) so that the manifest
#: list does not grow by one per batch; merged manifests of 1 MiB (about 4 000 data files)
#: are left alone, so a merge never rewrites more than that (with the default 8 MiB a
#: merge at 10 000 batches rewrote every entry: 1.1 s at the 99th percentile).
RETENTION = {
    "write.metadata.delete-after-commit.enabled": "true",
    "write.metadata.previous-versions-max": "10",
    "commit.manifest-merge.enabled": "true",
    "commit.manifest.target-size-bytes": str(1 << 20),
}


class IcebergSink(TableSink):
    """Append each batch to the Iceberg table ``table`` (``"namespace.name"``) as one
    snapshot.

    ``catalog``: a SQLAlchemy URL of pyiceberg's SQL catalog (``"sqlite:///cat.db"``, the
    default kind, no server; or ``"postgresql+psycopg://user:pw@host/db"``), or a mapping
    of pyiceberg catalog properties (``{"type": "sql", "uri": ..., "warehouse": ...}``).
    ``warehouse``: where new tables go (default: ``warehouse/`` beside a SQLite catalog
    file). The table's data location must be a local (or shared) file system path.

    Spark tasks write Parquet data files (new unique names, the table's columns) under
    the table's ``data/`` folder; the driver adds them in one snapshot per batch
    (``Transaction.add_files``), so a batch is visible whole or not at all. A row is
    written when that snapshot is committed. The snapshot's properties
    ``ackflow.app`` and ``ackflow.seq`` name the batch, so a batch committed just before
    a crash is found at the next start and never committed twice; the key manifest
    (``manifest=``, by default ``<table location>/_ackflow/keys.db``, SQLite) leaves out
    the rows of redelivered messages (see :mod:`ackflow.sinks.lakehouse`). The row key is
    stored in the column ``key_column`` (``ackflow_key``); ``key=[...]`` uses those
    columns instead (first write wins).

    Schema: with ``create=True`` a missing table (and namespace) is created from the
    flow's columns. ``evolve=True`` (the default): before a batch with new columns is
    written, ``table.update_schema().union_by_name(...)`` adds them (nullable), adds new
    fields inside structs (also inside lists and map values) and makes Iceberg's
    promotions (int -> long, float -> double; long -> double is not one: such a column
    keeps its type and a value that is not a whole number fails its message).
    ``evolve=False``: the table is never changed, and a column it lacks or a type it
    cannot take is refused naming the columns. A value that does not fit fails only its
    message. A commit that loses the race to another writer is tried again
    on the refreshed table (``COMMIT_RETRIES``). Files of a batch that never committed
    are in no snapshot (remove them with an orphan-file clean-up that spares files
    younger than a batch). Passwords in the catalog URL never appear in errors or logs.

    History is bounded (``keep_snapshots``, 20): the sink sets the table properties of
    :data:`RETENTION` unless the table has them, and once the table holds twice
    ``keep_snapshots`` snapshots it expires all but the newest ``keep_snapshots`` (after
    the batch's keys are recorded: the key manifest, not old snapshots, is what dedupes;
    recovery needs only the newest snapshot of this sink) and deletes the manifest lists
    and manifests that only expired snapshots referenced (never data files). So each
    commit's metadata JSON, manifest list and the number of metadata files stay bounded
    and a commit's cost stays flat. ``keep_snapshots=None`` leaves the table's
    properties and history alone (they then grow by one snapshot per batch).
    """

    POINTS = ("iceberg.before_commit", "iceberg.after_commit", "iceberg.after_record")
    EVOLVED_POINT = "iceberg.evolved"
    #: inside the commit, between the catalog's commit and ``after_commit``
    SYNC_POINTS = (
        "iceberg.committed",
        "iceberg.synced_data",
        "iceberg.synced_manifests",
        "iceberg.synced_manifest_list",
    )

    def __init__(
        self,
        catalog: str | Mapping[str, str],
        table: str,
        *,
        key: Sequence[str] | str | None = None,
        create: bool = True,
        warehouse: str | None = None,
        manifest: str | None = None,
        key_column: str = "ackflow_key",
        compression: str = "snappy",
        keep_snapshots: int | None = 20,
        evolve: bool = True,
        name: str = "iceberg",
    ) -> None:
        super().__init__(
            name, key=key, key_column=key_column, create=create, compression=compression, evolve=evolve
        )
        if keep_snapshots is not None and (not isinstance(keep_snapshots, int) or keep_snapshots < 1):
            raise ConfigError(
                f"sink {name!r}: keep_snapshots must be a positive integer (or "
                f"None to keep every snapshot), got {keep_snapshots!r}"
            )
        self.keep_snapshots = keep_snapshots
        self._snapshots = 0  # in the table after this sink's last commit
        if not isinstance(table, str) or "." not in table.strip("."):
            raise ConfigError(f"sink {name!r}: table must be 'namespace.name', got {table!r}")
        props = {"uri": catalog} if isinstance(catalog, str) else dict(catalog)
        props.setdefault("type", "sql")
        uri = str(props.get("uri", ""))
        if warehouse is None and "warehouse" not in props and uri.startswith("sqlite:///"):
            warehouse = os.path.join(os.path.dirname(os.path.abspath(uri[len("sqlite:///") :])), "warehouse")
        if warehouse is not None:
            if "://" not in warehouse:
                os.makedirs(warehouse, exist_ok=True)
                warehouse = "file://" + os.path.abspath(warehouse)
            props["warehouse"] = warehouse
        self._props = props
        self.table = table
        self._manifest_arg = os.path.abspath(manifest) if manifest else None
        self.location: str | None = None  # local folder of the table, known after open
        self._catalog: Any = None

    def _driver_only(self) -> Sequence[str]:
        return ("_catalog", "_props")

    def __repr__(self) -> str:
        return f"IcebergSink({self.name!r}, table={self.table!r})"

    def describe(self) -> str:
        return f"Iceberg table {self.table!r}"

    def _secret(self) -> str | None:
        from urllib.parse import urlsplit

        try:
            return urlsplit(str(self._props.get("uri", ""))).password
        except ValueError:
            return None

    def _hide(self, text: str) -> str:
        return hide(redact(text), self._secret())

    def _cat(self) -> Any:
        if self._catalog is None:
            from pyiceberg.catalog import load_catalog

            props = dict(self._props)
            try:
                self._catalog = load_catalog("ackflow", **props)
            except Exception as e:  # noqa: BLE001 - a bad URL or an unreachable server
                raise ConfigError(
                    f"sink {self.name!r}: cannot open the Iceberg catalog "
                    f"{self._hide(str(props.get('uri')))}: "
                    f"{self._hide(_first(e))}"
                ) from None
        return self._catalog

    def _load(self) -> Any:
        """The table, read afresh (``NoSuchTableError`` if it does not exist; any other
        failure as a ``ConnectionError`` whose text hides the password)."""
        from pyiceberg.exceptions import NoSuchTableError

        try:
            return self._cat().load_table(self.table)
        except (NoSuchTableError, ConfigError):
            raise
        except Exception as e:  # noqa: BLE001 - the catalog's database went away, ...
            raise ConnectionError(
                self._hide(f"cannot load Iceberg table {self.table!r}: {_first(e)}")
            ) from None

    def commit(self, batch_id: str, tokens: Sequence[bytes]) -> None:
        """See :meth:`TableSink.commit`; a failure's text never shows the password."""
        from ackflow.faults import InjectedFault

        try:
            super().commit(batch_id, tokens)
        except (InjectedFault, ConfigError, FlowError, ConnectionError):
            raise
        except Exception as e:  # noqa: BLE001 - re-raised with the password hidden
            raise RuntimeError(self._hide(_first(e))) from None

    @property
    def manifest_path(self) -> str:
        if self._manifest_arg:
            return self._manifest_arg
        if self.location is None:
            raise ConfigError(f"sink {self.name!r}: the table's location is not known yet")
        return os.path.join(self.location, "_ackflow", "keys.db")

    def data_dir(self) -> str:
        assert self.location is not None
        return os.path.join(self.location, "data")

    def _set_location(self, table: Any) -> None:
        loc = str(table.location())
        if loc.startswith("file://"):
            loc = loc[len("file://") :]
        if "://" in loc:
            raise ConfigError(
                f"sink {self.name!r}: the table's location {loc!r} is not a "
                "local path; ackflow's tasks write data files with the local "
                "(or a shared) file system"
            )
        self.location = loc

    def open(self) -> None:
        from pyiceberg.exceptions import NoSuchTableError

        try:
            table = self._load()
        except NoSuchTableError:
            if not self.create:
                raise ConfigError(
                    f"sink {self.name!r}: Iceberg table {self.table!r} does not "
                    "exist; create it, or pass create=True"
                ) from None
            return  # created at the first batch, from the flow's columns
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001
            raise ConfigError(
                f"sink {self.name!r}: cannot load Iceberg table {self.table!r}: {self._hide(_first(e))}"
            ) from None
        self._set_location(table)
        super().open()

    def table_schema(self) -> tuple[Any, list[str]] | None:
        from pyiceberg.exceptions import NoSuchTableError
        from pyiceberg.io.pyarrow import schema_to_pyarrow

        try:
            table = self._load()
        except NoSuchTableError:
            return None
        self._set_location(table)
        if table.spec().fields:
            raise FlowError(
                self.name,
                f"{self.describe()} is partitioned; ackflow's Iceberg sink writes unpartitioned tables only",
            )
        return schema_to_pyarrow(table.schema(), include_field_ids=False), []

    def promote(self, have: Any, want: Any) -> bool:
        from ackflow.sinks.evolution import promote_ints

        return promote_ints(have, want)

    def holds(self, field: Any) -> bool:
        import pyarrow as pa
        from pyiceberg.io.pyarrow import _ConvertToIcebergWithoutIDs, visit_pyarrow

        try:
            visit_pyarrow(pa.schema([field]), _ConvertToIcebergWithoutIDs())
        except Exception:  # noqa: BLE001 - a type Iceberg cannot hold: refused, named
            return False
        return True

    def evolve_table(self, schema: Any) -> None:
        """``update_schema().union_by_name(schema)`` on the freshly loaded table; a commit
        that lost the race to another writer is made again on the refreshed table (where
        the union may have nothing left to do)."""
        from pyiceberg.exceptions import CommitFailedException

        for attempt in range(COMMIT_RETRIES + 1):
            table = self._load()
            try:
                with table.update_schema() as update:
                    update.union_by_name(schema)
                return
            except CommitFailedException as e:
                if attempt == COMMIT_RETRIES:
                    raise FlowError(
                        self.name,
                        self._hide(
                            f"evolving {self.describe()} lost the race {attempt + 1} times: {_first(e)}"
                        ),
                    ) from None
                time.sleep(min(1.0, 0.02 * 2**attempt))
            except OSError:
                raise
            except Exception as e:  # noqa: BLE001 - the table stays: its columns are refused
                log.warning(
                    "sink %r: cannot evolve %s (%s); it is left as it is",
                    self.name,
                    self.describe(),
                    self._hide(_first(e)),
                )
                return

    def create_table(self, schema: Any) -> None:
        import pyarrow as pa

        catalog = self._cat()
        namespace = self.table.rsplit(".", 1)[0]
        bad = {}
        for f in schema:
            try:
                from pyiceberg.io.pyarrow import _ConvertToIcebergWithoutIDs, visit_pyarrow

                visit_pyarrow(pa.schema([f]), _ConvertToIcebergWithoutIDs())
            except Exception as e:  # noqa: BLE001 - reported as what to fix
                bad[f.name] = f"{f.type} ({_first(e)[:80]})"
        if bad:
            raise ColumnsRefused(
                self.name,
                f"Iceberg cannot hold column(s) "
                f"{', '.join(f'{c} ({why})' for c, why in bad.items())}; "
                "cast them in the flow",
                {c: f"Iceberg cannot hold {why}" for c, why in bad.items()},
            )
        # Two processes may create the same table at once: the catalog checks, then
        # inserts, and the slower one's insert fails on the faster one's row. The
        # "if not exists" calls are idempotent, so a second try sees the winner's work.
        for attempt in range(3):
            try:
                catalog.create_namespace_if_not_exists(namespace)
                table = catalog.create_table_if_not_exists(
                    self.table, schema=schema, properties=RETENTION if self.keep_snapshots is not None else {}
                )
                break
            except Exception as e:  # noqa: BLE001
                if attempt == 2:
                    raise FlowError(
                        self.name, f"cannot create Iceberg table {self.table!r}: {self._hide(_first(e))}"
                    ) from None
                log.info(
                    "sink %r: creating %s raced another writer (%s); trying again",
                    self.name,
                    self.table,
                    _first(e),
                )
        self._set_location(table)
        os.makedirs(os.path.dirname(self.manifest_path), exist_ok=True)
        log.info("sink %r: created Iceberg table %s (%s)", self.name, self.table, ", ".join(schema.names))

    def _ours(self, table: Any, app: str) -> Iterator[tuple[int, Any]]:
        """This application's snapshots, newest first, on the main branch's lineage."""
        snapshot = table.current_snapshot()
        while snapshot is not None:
            props = snapshot.summary.additional_properties if snapshot.summary else {}
            if props.get("ackflow.app") == app:
                yield int(props["ackflow.seq"]), snapshot
            parent = snapshot.parent_snapshot_id
            snapshot = table.snapshot_by_id(parent) if parent is not None else None

    def table_state(self, app: str) -> tuple[str, int | None] | None:
        from pyiceberg.exceptions import NoSuchTableError

        try:
            table = self._load()
        except NoSuchTableError:
            return None
        return str(table.metadata.table_uuid), next((seq for seq, _ in self._ours(table, app)), None)

    def other_apps(self, app: str) -> set[str]:
        apps = set()
        for snapshot in self._load().snapshots():
            props = snapshot.summary.additional_properties if snapshot.summary else {}
            if props.get("ackflow.app") not in (None, app):
                apps.add(str(props["ackflow.app"]))
        return apps

    def files_of(self, app: str, seq: int) -> list[str]:
        for s, snapshot in self._ours(self._load(), app):
            if s == seq:
                names = json.loads(snapshot.summary.additional_properties["ackflow.files"])
                return [os.path.join(self.data_dir(), n) for n in names]
            if s < seq:
                break
        raise RuntimeError(
            f"sink {self.name!r}: no snapshot of {app}/{seq} in {self.table!r}; cannot record its keys"
        )

    def commit_files(self, files: list[dict[str, Any]], app: str, seq: int, batch_id: str) -> int | None:
        from pyiceberg.exceptions import CommitFailedException

        paths = ["file://" + os.path.join(self.data_dir(), f["path"]) for f in files]
        props = {
            "ackflow.app": app,
            "ackflow.seq": str(seq),
            "ackflow.batch": batch_id,
            "ackflow.files": json.dumps([f["path"] for f in files]),
        }
        for attempt in range(COMMIT_RETRIES + 1):
            table = self._load()
            missing = (
                {k: v for k, v in RETENTION.items() if k not in table.properties}
                if self.keep_snapshots is not None
                else {}
            )
            try:
                with table.transaction() as tx:
                    if missing:  # a table made elsewhere: bound its history from now on
                        tx.set_properties(missing)
                    tx.add_files(paths, snapshot_properties=props, check_duplicate_files=False)
            except CommitFailedException as e:  # another writer won: nothing of ours landed
                if attempt == COMMIT_RETRIES:
                    raise RuntimeError(
                        self._hide(f"Iceberg commit lost the race {attempt + 1} times: {_first(e)}")
                    ) from None
                time.sleep(min(1.0, 0.02 * 2**attempt))
                continue
            faults.point("iceberg.committed")
            # ``table`` is the transaction's own: its metadata is what this commit wrote
            # (never a re-load, which may be another writer's newer metadata)
            snapshot = self._snapshot_of(table, app, seq)
            sync_snapshot(table.io, snapshot, table.metadata_location)
            self._snapshots = len(table.metadata.snapshots)
            return int(snapshot.snapshot_id)
        return None

    def maintain(self) -> None:
        """Expire all but the newest ``keep_snapshots`` snapshots once the table holds
        twice as many, then delete the manifest lists and manifests only they referenced
        (see the class docstring). A failure is logged; the batch is written already."""
        keep = self.keep_snapshots
        if keep is None or self._snapshots <= 2 * keep:
            return
        assert self._lock is not None
        try:
            with self._lock:  # not beside this process's own commits
                self._expire(keep)
        except Exception as e:  # noqa: BLE001 - maintenance: tried again after the next batch
            log.warning(
                "sink %r: could not expire old snapshots of %s: %s",
                self.name,
                self.table,
                self._hide(_first(e)),
            )

    def _expire(self, keep: int) -> None:
        table = self._load()
        io, meta = table.io, table.metadata
        protected = {ref.snapshot_id for ref in meta.refs.values()}
        ordered = sorted(meta.snapshots, key=lambda s: (s.sequence_number or 0, s.timestamp_ms))
        old = [s for s in ordered[:-keep] if s.snapshot_id not in protected]
        self._snapshots = len(meta.snapshots)
        if not old:
            return
        candidates = {s.manifest_list for s in old}
        candidates |= {m.manifest_path for s in old for m in s.manifests(io)}
        table.maintenance.expire_snapshots().by_ids([s.snapshot_id for s in old]).commit()
        faults.point("iceberg.after_expire")
        kept = table.metadata.snapshots  # the expiry's own metadata (updated in place)
        referenced = {s.manifest_list for s in kept}
        referenced |= {m.manifest_path for s in kept for m in s.manifests(io)}
        gone = 0
        for location in candidates - referenced:
            path = _local(location)
            if path is not None:
                try:
                    os.remove(path)
                    gone += 1
                except FileNotFoundError:
                    pass
        self._snapshots = len(kept)
        log.info(
            "sink %r: expired %d old snapshots of %s (kept %d), deleted %d metadata "
            "files only they referenced",
            self.name,
            len(old),
            self.table,
            len(kept),
            gone,
        )

    def _snapshot_of(self, table: Any, app: str, seq: int) -> Any:
        """This commit's snapshot in the committed table's metadata."""
        for s, snapshot in self._ours(table, app):
            if s == seq:
                return snapshot
            if s < seq:
                break
        raise RuntimeError(
            f"sink {self.name!r}: the commit of {app}/{seq} is not in the "
            f"metadata it returned ({table.metadata_location})"
        )


def sync_snapshot(io: Any, snapshot: Any, metadata_location: str) -> None:
    """Make every file the committed ``snapshot`` references durable, with the folders
    that name them, in the order of the module's docstring: its data files, the manifests
    it wrote, its manifest list, then the metadata JSON (pyiceberg writes them all without
    fsync; the catalog's own commit is durable). A fault point follows each step."""
    from pyiceberg.manifest import ManifestEntryStatus

    sid = snapshot.snapshot_id
    written = [m for m in snapshot.manifests(io) if m.added_snapshot_id == sid]
    data = [
        e.data_file.file_path
        for m in written
        for e in m.fetch_manifest_entry(io)
        if e.status == ManifestEntryStatus.ADDED and e.snapshot_id == sid
    ]
    _sync(data)
    faults.point("iceberg.synced_data")
    _sync([m.manifest_path for m in written])
    faults.point("iceberg.synced_manifests")
    _sync([snapshot.manifest_list])
    faults.point("iceberg.synced_manifest_list")
    _sync([metadata_location])


def _local(location: str) -> str | None:
    from urllib.parse import unquote, urlparse

    if location.startswith("file:"):
        return unquote(urlparse(location).path)
    return location if location.startswith("/") else None


def _sync(locations: Sequence[str]) -> None:
    """fsync each local file, then each folder holding them (once)."""
    folders: dict[str, None] = {}
    for location in locations:
        path = _local(location)
        if path is None:  # an object store: durable when written
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        folders[os.path.dirname(path)] = None
    for folder in folders:
        fsync_dir(folder)


def _first(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"
