"""The Kafka source's delivery counts that survive a restart: one small SQLite file
(fsynced) per consumer group and machine, or (``attempts_dsn=``) two PostgreSQL tables
shared by every process of the group, wherever it runs.

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
from typing import Any, cast

from ackflow import faults
from ackflow.core.errors import ConfigError, SourceGone
from ackflow.core.secrets import redact

Partition = tuple[str, int]


class Attempts:
    """Deliveries of failed messages so far. Used under the source's lock (one thread
    at a time); rows below a partition's committed offset are deleted at each commit.
    :class:`PgAttempts` is the same for several processes."""

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


class PgAttempts(Attempts):
    """The delivery counts in PostgreSQL, shared by the group's processes: a partition
    that moves to another process (a rebalance, a crash, a restart on an empty disk)
    keeps its counts, so a message that kills every process it reaches is given up after
    ``max_deliveries`` in all. Rows are the group's (``grp``); each write is one
    committed transaction, before the deliveries it counts are handed out."""

    def __init__(self, dsn: str, group: str) -> None:

        self.group, self.dsn = group, dsn
        self.conn = _connect(dsn)
        with self.conn.transaction():
            self.conn.execute("SELECT pg_advisory_xact_lock(hashtext('ackflow_kafka_attempts'))")
            self.conn.execute(
                "CREATE TABLE IF NOT EXISTS ackflow_kafka_attempts (grp TEXT, topic TEXT, "
                "part INTEGER, off BIGINT, n INTEGER, PRIMARY KEY (grp, topic, part, off))"
            )
            self.conn.execute(
                "CREATE TABLE IF NOT EXISTS ackflow_kafka_handed (grp TEXT, topic TEXT, "
                "part INTEGER, high BIGINT, committed BIGINT, PRIMARY KEY (grp, topic, part))"
            )

    def _again(self, what: str, fn: Any) -> Any:
        """``fn()``; after a lost connection (a database restart), once more on a new
        one; still failing, the run stops with one line (nothing is lost: what was not
        committed is read again)."""
        import psycopg

        try:
            return fn()
        except psycopg.OperationalError:
            try:
                self.conn.close()
                self.conn = _connect(self.dsn)
                return fn()
            except psycopg.OperationalError as e:
                raise SourceGone(
                    f"Kafka source: the delivery counts database at {redact(self.dsn)} "
                    f"cannot be reached ({what}): {redact(str(e)).strip()}"
                ) from None

    def handed(self, tp: Partition) -> tuple[int, int]:
        return cast(tuple[int, int], self._again("read", lambda: self._handed(tp)))

    def _handed(self, tp: Partition) -> tuple[int, int]:
        with self.conn.transaction():
            row = self.conn.execute(
                "SELECT committed, high FROM ackflow_kafka_handed WHERE grp=%s AND topic=%s AND part=%s",
                (self.group, *tp),
            ).fetchone()
        return (int(row[0]), int(row[1])) if row else (0, -1)

    def get(self, tp: Partition, offset: int) -> int:
        return int(self._again("read", lambda: self._get(tp, offset)))

    def _get(self, tp: Partition, offset: int) -> int:
        with self.conn.transaction():
            row = self.conn.execute(
                "SELECT n FROM ackflow_kafka_attempts WHERE grp=%s AND topic=%s AND part=%s AND off=%s",
                (self.group, *tp, offset),
            ).fetchone()
        return int(row[0]) if row else 0

    def record(self, tp: Partition, offset: int, n: int) -> None:
        self.record_pull([(tp, offset, n)], {})

    def record_pull(self, counts: list[tuple[Partition, int, int]], highs: dict[Partition, int]) -> None:
        self._again("record", lambda: self._record_pull(counts, highs))
        faults.point("kafka.attempt_recorded")

    def _record_pull(self, counts: list[tuple[Partition, int, int]], highs: dict[Partition, int]) -> None:
        with self.conn.transaction(), self.conn.cursor() as cur:
            cur.executemany(
                "INSERT INTO ackflow_kafka_attempts VALUES (%s, %s, %s, %s, %s) "
                "ON CONFLICT (grp, topic, part, off) DO UPDATE "
                "SET n = greatest(ackflow_kafka_attempts.n, excluded.n)",
                [(self.group, tp[0], tp[1], off, n) for tp, off, n in counts],
            )
            cur.executemany(
                "INSERT INTO ackflow_kafka_handed VALUES (%s, %s, %s, %s, 0) "
                "ON CONFLICT (grp, topic, part) DO UPDATE "
                "SET high = greatest(ackflow_kafka_handed.high, excluded.high)",
                [(self.group, tp[0], tp[1], high) for tp, high in highs.items()],
            )

    def forget(self, tp: Partition, below: int) -> None:
        self._again("trim", lambda: self._forget(tp, below))

    def _forget(self, tp: Partition, below: int) -> None:
        with self.conn.transaction():
            self.conn.execute(
                "DELETE FROM ackflow_kafka_attempts WHERE grp=%s AND topic=%s AND part=%s AND off<%s",
                (self.group, *tp, below),
            )
            self.conn.execute(
                "INSERT INTO ackflow_kafka_handed VALUES (%s, %s, %s, -1, %s) "
                "ON CONFLICT (grp, topic, part) DO UPDATE "
                "SET committed = greatest(ackflow_kafka_handed.committed, excluded.committed)",
                (self.group, *tp, below),
            )

    def close(self) -> None:
        self.conn.close()


def _connect(dsn: str) -> Any:
    """A connection whose queries cannot hang on a dead peer (they run under the
    source's lock: a stuck one would stop the consumer thread's polling)."""
    import psycopg

    return psycopg.connect(
        dsn,
        connect_timeout=10,
        autocommit=True,
        keepalives=1,
        keepalives_idle=5,
        keepalives_interval=2,
        keepalives_count=3,
        tcp_user_timeout=15000,
    )


def open_attempts(source: str, group: str, path: str, dsn: str | None) -> Attempts:
    """The source's delivery counts: shared in PostgreSQL when ``dsn`` is given, else
    in the SQLite file at ``path``; a database that cannot be reached stops the run at
    start with one line (the password redacted)."""
    if dsn is None:
        return Attempts(path)
    try:
        return PgAttempts(dsn, group)
    except Exception as e:  # noqa: BLE001 - a clear message at start
        raise ConfigError(
            f"source {source!r}: cannot open the delivery counts in PostgreSQL at "
            f"{redact(dsn)}: {type(e).__name__}: {redact(str(e))}"
        ) from None
