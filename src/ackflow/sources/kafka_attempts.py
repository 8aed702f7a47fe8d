"""The Kafka source's delivery counts that survive a restart: one small SQLite file
(fsynced) per consumer group and machine.

Two tables: per partition, the highest offset ever handed out and the offset last
committed through this file (``handed``: every offset from the committed one up to the
high one was delivered at least once; one below the committed one that comes again is
a replay, after the group's offsets were reset or expired, and counts from 1), and per
message delivered more than once, its count (``attempts``). A first delivery costs
no row of its own, only the partition's high mark (one upsert per pull and partition,
in the pull's one transaction), so counting stays off the per-message path."""

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
        with self.db:
            self.db.execute("BEGIN")
            made = self.db.execute(
                "SELECT 1 FROM sqlite_master WHERE type='table' AND name='handed'"
            ).fetchone()
            self.db.execute(
                "CREATE TABLE IF NOT EXISTS handed (topic TEXT, part INTEGER, high INTEGER, "
                "committed INTEGER, PRIMARY KEY (topic, part))"
            )
            if not made:  # a file of a version that kept a row per delivery: its marks
                self.db.execute(
                    "INSERT OR IGNORE INTO handed SELECT topic, part, max(off), min(off) "
                    "FROM attempts GROUP BY topic, part"
                )

    def handed(self, tp: Partition) -> tuple[int, int]:
        """``(committed, high)`` of ``tp``: the offsets from ``committed`` to ``high`` were
        handed out before, by any run using this file (``(0, -1)``: none)."""
        row = self.db.execute("SELECT committed, high FROM handed WHERE topic=? AND part=?", tp).fetchone()
        return (int(row[0]), int(row[1])) if row else (0, -1)

    def get(self, tp: Partition, offset: int) -> int:
        """Deliveries of the message so far, as recorded (0: none recorded)."""
        row = self.db.execute(
            "SELECT n FROM attempts WHERE topic=? AND part=? AND off=?", (tp[0], tp[1], offset)
        ).fetchone()
        return int(row[0]) if row else 0

    def record(self, tp: Partition, offset: int, n: int) -> None:
        self.db.execute("INSERT OR REPLACE INTO attempts VALUES (?, ?, ?, ?)", (tp[0], tp[1], offset, n))
        faults.point("kafka.attempt_recorded")

    def record_pull(self, counts: list[tuple[Partition, int, int]], highs: dict[Partition, int]) -> None:
        """Before a pull's deliveries are handed out, in one transaction (one fsync): the
        count of each one that is not a first delivery (partition, offset, deliveries so
        far) and each partition's highest offset handed out."""
        with self.db:
            self.db.execute("BEGIN")
            self.db.executemany(
                "INSERT OR REPLACE INTO attempts VALUES (?, ?, ?, ?)",
                [(tp[0], tp[1], off, n) for tp, off, n in counts],
            )
            self.db.executemany(
                "INSERT INTO handed VALUES (?, ?, ?, 0) ON CONFLICT (topic, part) "
                "DO UPDATE SET high = max(high, excluded.high)",
                [(tp[0], tp[1], high) for tp, high in highs.items()],
            )
        faults.point("kafka.attempt_recorded")

    def forget(self, tp: Partition, below: int) -> None:
        """``tp`` was committed up to ``below``: the counts below it go, and the mark
        moves (an offset below it that comes again is a replay)."""
        with self.db:
            self.db.execute("BEGIN")
            self.db.execute("DELETE FROM attempts WHERE topic=? AND part=? AND off<?", (tp[0], tp[1], below))
            self.db.execute(
                "INSERT INTO handed VALUES (?, ?, -1, ?) ON CONFLICT (topic, part) "
                "DO UPDATE SET committed = max(committed, excluded.committed)",
                (tp[0], tp[1], below),
            )

    def close(self) -> None:
        self.db.close()
