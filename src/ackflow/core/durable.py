"""Small pieces of local durability shared by the embedded queue, the Parquet manifest
and the Files source: a SQLite write transaction, an exclusive lock a dead process does
not hold, and the fsync of a directory (so that a rename or a new file survives a power
loss)."""

from __future__ import annotations

import fcntl
import json
import os
import sqlite3
from typing import Any, cast


def open_db(path: str, schema: str, *, timeout: float = 600, threads: bool = False) -> sqlite3.Connection:
    """A SQLite file of durable bookkeeping (a key manifest): autocommit (transactions
    through :class:`WriteTx`), WAL, fsynced at every commit (``synchronous=FULL``),
    ``schema`` (a script of ``CREATE ... IF NOT EXISTS``) run. ``threads``: the connection
    may be used from any thread (its owner serializes the uses)."""
    db = sqlite3.connect(path, isolation_level=None, timeout=timeout, check_same_thread=not threads)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    apply_schema(db, schema)
    return db


def apply_schema(db: sqlite3.Connection, schema: str) -> None:
    """Run a script of ``CREATE ... IF NOT EXISTS`` statements in one write transaction:
    a process killed half way leaves the file as it was, never with part of its tables
    (``executescript`` would commit each statement on its own). The statements hold no
    ``;`` inside them."""
    with WriteTx(db):
        for statement in schema.split(";"):
            if statement.strip():
                db.execute(statement)


class WriteTx:
    """``BEGIN IMMEDIATE`` ... ``COMMIT`` (or ``ROLLBACK`` on any exception): the write
    lock is taken first, so checks made inside hold until the commit."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self._db.execute("COMMIT" if exc_type is None else "ROLLBACK")


def try_lock(path: str) -> int | None:
    """An exclusive ``flock`` on ``path`` (created 0600): its file descriptor, or None if
    a live process holds it. Closing the descriptor (or dying) releases it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def fsync_dir(path: str) -> None:
    """Make the entries of directory ``path`` (new files, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def keys_text(keys: list[str | None]) -> str:
    """``keys`` as a JSON array in their rows' order (a writer's tasks make it, so the
    driver does not): by msgspec where it can (an eighth of
    the time), else by ``json`` (a key holding a lone surrogate, no msgspec there)."""
    if _KEYS_WRITER is not None:
        try:
            return cast(str, _KEYS_WRITER.encode(keys).decode())
        except Exception:  # noqa: BLE001 - what msgspec cannot write, json writes
            pass
    return json.dumps(keys, ensure_ascii=False)


def _keys_writer() -> Any:
    try:
        import msgspec

        return msgspec.json.Encoder()
    except Exception:  # noqa: BLE001 - an executor's Python without msgspec: json writes
        return None


_KEYS_WRITER = _keys_writer()
