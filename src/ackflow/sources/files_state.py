"""The Files source's durable state: one row per file instance, in SQLite.

Each row is one instance of a file (a name is not an identity): its random id, its name,
its fingerprint (device, inode, size, mtime and ctime in ns), its committed line, its
dead-letter count and its status (``reading``, ``done``, ``unmovable``). Every change is
a per-row update in a WAL transaction fsynced at commit (``synchronous=FULL``), so the
cost of recording a new file or a settlement does not grow with the number of files
(the JSON state file it replaces was rewritten and fsynced whole each time).

Retention: rows of instances that are done and no longer in the folder are deleted by
the scan that notices their absence; so a file re-created later under the same name, even
with the same inode, size and mtime, finds no row and is a new arrival.

A scan pass records which rows it saw in a TEMP table (not fsynced, dropped with the
connection), so that noticing absences costs one query at the end of the pass.
"""

from __future__ import annotations

import json
import os
import sqlite3
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ackflow import faults
from ackflow.core.durable import WriteTx, open_db

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    dev INTEGER, ino INTEGER, size INTEGER, mtime_ns INTEGER, ctime_ns INTEGER,
    committed INTEGER NOT NULL DEFAULT 0,
    dead INTEGER NOT NULL DEFAULT 0,
    status TEXT NOT NULL DEFAULT 'reading',
    cause TEXT
);
CREATE INDEX IF NOT EXISTS files_by_name ON files(name);
CREATE INDEX IF NOT EXISTS files_by_status ON files(status) WHERE status != 'reading';
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
"""

_COLS = "id, name, dev, ino, size, mtime_ns, ctime_ns, committed, dead, status, cause"


@dataclass
class Row:
    """One file instance as stored."""

    id: str
    name: str
    fingerprint: tuple[int, int, int, int] | None  # dev, ino, size, mtime_ns
    ctime_ns: int | None
    committed: int
    dead: int
    status: str  # reading | done | unmovable
    cause: str | None

    @classmethod
    def of(cls, r: tuple[Any, ...]) -> Row:
        fp = None if r[2] is None else (r[2], r[3], r[4], r[5])
        return cls(r[0], r[1], fp, r[6], r[7], r[8], r[9], r[10])


def new_id() -> str:
    return uuid.uuid4().hex[:16]


class FileStates:
    """The rows of one folder's file instances (``PATH/_ackflow/state.db``)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.db: sqlite3.Connection = open_db(path, SCHEMA)
        self.db.execute("CREATE TEMP TABLE IF NOT EXISTS seen (id TEXT PRIMARY KEY)")

    def close(self) -> None:
        self.db.close()

    def tx(self) -> WriteTx:
        return WriteTx(self.db)

    # -- reading ---------------------------------------------------------------------------

    def by_name(self, name: str) -> list[Row]:
        return [Row.of(r) for r in self.db.execute(f"SELECT {_COLS} FROM files WHERE name = ?", (name,))]

    def get(self, fid: str) -> Row | None:
        r = self.db.execute(f"SELECT {_COLS} FROM files WHERE id = ?", (fid,)).fetchone()
        return None if r is None else Row.of(r)

    def with_status(self, status: str, limit: int = 5) -> list[Row]:
        return [
            Row.of(r)
            for r in self.db.execute(f"SELECT {_COLS} FROM files WHERE status = ? LIMIT ?", (status, limit))
        ]

    def count(self, status: str | None = None) -> int:
        if status is None:
            return int(self.db.execute("SELECT count(*) FROM files").fetchone()[0])
        return int(self.db.execute("SELECT count(*) FROM files WHERE status = ?", (status,)).fetchone()[0])

    def rows(self) -> Iterator[Row]:
        for r in self.db.execute(f"SELECT {_COLS} FROM files ORDER BY rowid"):
            yield Row.of(r)

    # -- writing (inside a transaction: ``with states.tx(): ...``) --------------------------

    def insert(self, fid: str, name: str, fingerprint: Iterable[int], ctime_ns: int) -> None:
        self.db.execute(
            "INSERT INTO files (id, name, dev, ino, size, mtime_ns, ctime_ns) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (fid, name, *fingerprint, ctime_ns),
        )

    def adopt(self, fid: str, fingerprint: Iterable[int], ctime_ns: int) -> None:
        """Give a row written without a fingerprint (or ctime) the file's."""
        self.db.execute(
            "UPDATE files SET dev = ?, ino = ?, size = ?, mtime_ns = ?, ctime_ns = ? WHERE id = ?",
            (*fingerprint, ctime_ns, fid),
        )

    def progress(self, updates: Iterable[tuple[str, int, int]]) -> None:
        """(id, committed line, dead letters) of each instance that settled lines."""
        self.db.executemany(
            "UPDATE files SET committed = ?, dead = ? WHERE id = ?", [(c, d, fid) for fid, c, d in updates]
        )

    def set_status(self, fid: str, status: str, cause: str | None = None) -> None:
        self.db.execute("UPDATE files SET status = ?, cause = ? WHERE id = ?", (status, cause, fid))

    def delete(self, fids: Iterable[str]) -> None:
        self.db.executemany("DELETE FROM files WHERE id = ?", [(f,) for f in fids])

    @staticmethod
    def commit_point() -> None:
        faults.point("files.before_commit")

    # -- a scan pass -------------------------------------------------------------------------

    def saw(self, fids: Iterable[str]) -> None:
        self.db.executemany("INSERT OR IGNORE INTO temp.seen VALUES (?)", [(f,) for f in fids])

    def unseen(self) -> list[Row]:
        """Rows no scan of this pass saw (their file is gone or replaced)."""
        return [
            Row.of(r)
            for r in self.db.execute(f"SELECT {_COLS} FROM files WHERE id NOT IN (SELECT id FROM temp.seen)")
        ]

    def end_pass(self) -> None:
        self.db.execute("DELETE FROM temp.seen")

    # -- migration -------------------------------------------------------------------------

    def migrate_json(self, json_path: str) -> int:
        """Take over a ``state.json`` of an earlier version (rows kept: progress, done,
        dead-letter counts), then rename it ``state.json.migrated``. Idempotent: a crash
        between the commit and the rename is finished at the next open. Returns the
        number of rows taken over."""
        migrated = self.db.execute("SELECT value FROM meta WHERE key = 'migrated_json'").fetchone()
        n = 0
        if migrated is None:
            with open(json_path) as f:
                files = _old_entries(json.load(f)["files"])
            with self.tx():
                for fid, e in files.items():
                    fp = e.get("fingerprint") or [None] * 4
                    status = "done" if e.get("done") else "reading"
                    self.db.execute(
                        "INSERT OR REPLACE INTO files (id, name, dev, ino, size, mtime_ns, "
                        "committed, dead, status) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        (
                            fid,
                            str(e["name"]),
                            *[None if v is None else int(v) for v in fp[:4]],
                            int(e.get("committed", 0)),
                            int(e.get("dead", 0)),
                            status,
                        ),
                    )
                    n += 1
                self.db.execute("INSERT INTO meta VALUES ('migrated_json', ?)", (str(n),))
        os.replace(json_path, json_path + ".migrated")
        return n


def _old_entries(files: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """State files written before instance ids were keyed by file name."""
    out = {}
    for key, entry in files.items():
        if "name" in entry:
            out[key] = entry
        else:  # old: the key is the name; the fingerprint is taken when it is next seen
            out[new_id()] = {**entry, "name": key}
    return out


def read_state(folder: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """The stored state of a Files source's folder, by instance id (for inspection and
    tests): name, fingerprint, committed, dead, status, cause, done."""
    path = os.path.join(os.fspath(folder), "_ackflow", "state.db")
    if not os.path.exists(path):
        return {}
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        rows = [Row.of(r) for r in db.execute(f"SELECT {_COLS} FROM files")]
    finally:
        db.close()
    return {
        r.id: {
            "name": r.name,
            "fingerprint": list(r.fingerprint or ()),
            "committed": r.committed,
            "dead": r.dead,
            "status": r.status,
            "cause": r.cause,
            "done": r.status != "reading",
        }
        for r in rows
    }
