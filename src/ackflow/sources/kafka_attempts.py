"""The Kafka source's delivery counts that survive a restart: one small SQLite file
(fsynced) per consumer group and machine, keyed by topic, partition and offset."""

from __future__ import annotations

import os
import sqlite3

from ackflow import faults

Partition = tuple[str, int]


class Attempts:
    """Deliveries of failed messages so far. Used under the source's lock (one thread
    at a time); rows below a partition's committed offset are deleted at each commit."""

    def __init__(self, path: str) -> None:
        folder = os.path.dirname(path)
        if folder:
            os.makedirs(folder, exist_ok=True)
        self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute(
            "CREATE TABLE IF NOT EXISTS attempts (topic TEXT, part INTEGER, "
            "off INTEGER, n INTEGER, PRIMARY KEY (topic, part, off))"
        )

    def get(self, tp: Partition, offset: int) -> int:
        """Deliveries of the message so far, as recorded (0: none recorded)."""
        row = self.db.execute(
            "SELECT n FROM attempts WHERE topic=? AND part=? AND off=?", (tp[0], tp[1], offset)
        ).fetchone()
        return int(row[0]) if row else 0

    def record(self, tp: Partition, offset: int, n: int) -> None:
        self.db.execute("INSERT OR REPLACE INTO attempts VALUES (?, ?, ?, ?)", (tp[0], tp[1], offset, n))
        faults.point("kafka.attempt_recorded")

    def record_many(self, counts: list[tuple[Partition, int, int]]) -> None:
        """Record (partition, offset, deliveries so far) in one transaction (one fsync):
        the deliveries a pull hands out, before they are handed out."""
        with self.db:
            self.db.execute("BEGIN")
            self.db.executemany(
                "INSERT OR REPLACE INTO attempts VALUES (?, ?, ?, ?)",
                [(tp[0], tp[1], off, n) for tp, off, n in counts],
            )
        faults.point("kafka.attempt_recorded")

    def forget(self, tp: Partition, below: int) -> None:
        self.db.execute("DELETE FROM attempts WHERE topic=? AND part=? AND off<?", (tp[0], tp[1], below))

    def close(self) -> None:
        self.db.close()
