"""A window's state in PostgreSQL: ``flow.window(..., state=PostgresState(dsn))``.

For Spark executors that cannot see the driver's file (a cluster across machines): the
tasks read the watermark and the applied row keys over the network, the driver merges
each batch in one PostgreSQL transaction, exactly as the SQLite store does (the same
statements, :class:`~ackflow.state.store.WindowStore`). The tables live in their own
schema (``ackflow_state`` by default). One process drives a window's state at a time: a
second one is refused at start (a session advisory lock per schema and window); several
processes sharing windows (a Kafka consumer group) need a watermark per source
partition, which is not built.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ackflow.core.errors import ConfigError, FlowError, StoreAway, describe
from ackflow.core.secrets import redact
from ackflow.state.store import SCHEMA


def _pg_types(ddl: str) -> str:
    """The SQLite store's tables in PostgreSQL's types (one schema, written once)."""
    for lite, pg in ((" INTEGER", " BIGINT"), (" BLOB", " BYTEA"), (" REAL", " DOUBLE PRECISION")):
        ddl = ddl.replace(lite, pg)
    return ddl


_DDL = _pg_types(SCHEMA)
_KEYS = {"windows": ("op", "gk", "start"), "begun": ("op", "batch"), "count_next": ("op", "gk")}
_REPLACE = re.compile(r"INSERT OR REPLACE INTO (\w+) \(([^)]*)\) VALUES \(([^)]*)\)")


def translate(query: str) -> str:
    """The SQLite store's statement for PostgreSQL: ``%s`` placeholders, ``INSERT OR
    REPLACE`` as an upsert on the table's key, ``BEGIN IMMEDIATE`` as ``BEGIN``.

    >>> q = translate("INSERT OR REPLACE INTO begun (op, batch, watermark) VALUES (?, ?, ?)")
    >>> for part in q.split(" ON CONFLICT "):
    ...     print(part)
    INSERT INTO begun (op, batch, watermark) VALUES (%s, %s, %s)
    (op, batch) DO UPDATE SET watermark = EXCLUDED.watermark
    """
    m = _REPLACE.search(query)
    if m is not None:
        table, cols = m.group(1), [c.strip() for c in m.group(2).split(",")]
        keys = _KEYS[table]
        sets = ", ".join(f"{c} = EXCLUDED.{c}" for c in cols if c not in keys)
        query = (
            f"INSERT INTO {table} ({m.group(2)}) VALUES ({m.group(3)}) "
            f"ON CONFLICT ({', '.join(keys)}) DO UPDATE SET {sets}"
        )
    return query.replace("BEGIN IMMEDIATE", "BEGIN").replace("?", "%s")


class _Conn:
    """A psycopg connection that takes the SQLite store's statements. ``reopen``: after
    the server went away (a restart), the next statement outside a transaction opens a
    new connection with it; statements while it is away raise :class:`StoreAway` (a
    transaction cut short is rolled back by the server: its ``ROLLBACK`` is a no-op).
    Thread-safe (the ticker reads sizes while a batch commits)."""

    def __init__(self, conn: Any, reopen: Any = None) -> None:
        self.conn = conn
        self._reopen = reopen
        self._in_tx = False
        self._lock = threading.RLock()

    def _ready(self) -> Any:
        conn = self.conn
        if (conn.closed or conn.broken) and self._reopen is not None and not self._in_tx:
            conn.close()
            self.conn = conn = self._reopen()
        return conn

    def execute(self, query: str, params: Sequence[Any] = ()) -> Any:
        query = translate(query)
        verb = query.lstrip()[:8].upper()
        with self._lock:
            if verb.startswith("ROLLBACK") and (self.conn.closed or self.conn.broken):
                self._in_tx = False  # the server ended the transaction with the connection
                return None
            if verb.startswith("BEGIN"):
                self._in_tx = False  # a BEGIN starts afresh (on a new connection if need be)
            try:
                with _away():
                    cur = self._ready().execute(query, params)
            finally:
                if verb.startswith(("COMMIT", "ROLLBACK")):
                    self._in_tx = False
            if verb.startswith("BEGIN"):
                self._in_tx = True
            return cur

    def executemany(self, query: str, rows: Sequence[Sequence[Any]]) -> Any:
        with self._lock, _away():
            cur = self._ready().cursor()
            cur.executemany(translate(query), rows)
            return cur

    def close(self) -> None:
        with self._lock:
            self._reopen = None  # closed on purpose: never opened again
            self.conn.close()


@contextlib.contextmanager
def _away() -> Iterator[None]:
    """A lost or refused connection as :class:`StoreAway` (other errors pass as they are)."""
    import psycopg

    try:
        yield
    except (psycopg.OperationalError, psycopg.InterfaceError) as e:
        sqlstate = getattr(e, "sqlstate", None)
        if sqlstate is not None and not sqlstate.startswith(("08", "57")):
            raise  # a statement's own trouble (a timeout, a limit), not the server away
        raise StoreAway("window state", f"PostgreSQL did not answer: {redact(describe(e))}") from None


@dataclass(frozen=True)
class PostgresState:
    """Keep a window's state in PostgreSQL at ``dsn`` (schema ``schema``, created if missing)."""

    dsn: str
    schema: str = "ackflow_state"
    connect_timeout: float = 10

    def __post_init__(self) -> None:
        if not isinstance(self.dsn, str) or not self.dsn:
            raise ConfigError("PostgresState: give a DSN (postgresql://user:pass@host/db)")
        if not isinstance(self.schema, str) or not self.schema:
            raise ConfigError("PostgresState: schema must be a name")
        if len(self.schema.encode()) > 63 or "\x00" in self.schema:  # (PostgreSQL would cut it)
            raise ConfigError(
                f"PostgresState: schema {self.schema[:70]!r} is longer than PostgreSQL's 63 bytes "
                "or holds a NUL; choose a shorter name"
            )

    def connect(self, create: bool = False) -> Any:
        """A connection (autocommit) whose search path is the schema; ``create``: the
        schema made first if missing (under an advisory lock: two processes creating
        it at once would otherwise collide on PostgreSQL's catalog)."""
        import psycopg
        from psycopg import sql

        try:
            conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=int(self.connect_timeout))
        except psycopg.Error as e:
            why = f"cannot connect to PostgreSQL at {redact(self.dsn)}: {redact(str(e))}"
            if create:  # at start: the run cannot begin (one line, what to fix)
                raise FlowError("window state", why) from None
            # mid-run: an outage fails the batch as a whole (given back, never a dead
            # letter) and the run goes on once the database answers
            raise StoreAway("window state", why) from None
        if create:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"ackflow-ddl:{self.schema}",))
                conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(self.schema)))
        conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(self.schema)))
        return conn


def connect_store(state: PostgresState, create: bool = True) -> _Conn:
    """A connection to the state's schema that takes the SQLite store's statements
    (``create``: the tables created if missing; the driver's, once: DDL takes locks
    that would queue the tasks' transactions). Several processes may create them at
    once: the statements run in one transaction under the schema's DDL lock."""
    conn = state.connect(create=create)
    if create:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"ackflow-ddl:{state.schema}",))
            for stmt in _DDL.split(";"):
                if stmt.strip():
                    conn.execute(stmt)
    return _Conn(conn)


def open_store(state: PostgresState, op: str) -> Any:
    """The driver's store in PostgreSQL (a :class:`WindowStore` on a psycopg connection),
    holding the window's advisory lock for the run (taken again on a new connection
    after the server went away: if another process took it meanwhile, the run stops)."""
    from ackflow.state.store import WindowStore

    before: list[int] = []  # the backend that held the lock (this process's)

    def locked(conn: Any) -> Any:
        def take() -> bool:
            return bool(
                conn.execute(
                    "SELECT pg_try_advisory_lock(hashtext(%s))", (f"ackflow-window:{state.schema}:{op}",)
                ).fetchone()[0]
            )

        got = take()
        if not got and before:
            stale = conn.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (before[-1],)).fetchone()
            if stale is not None:  # our old session, cut off, not yet ended by the server
                conn.close()
                raise StoreAway(op, "the previous session still holds the window's lock; tried again later")
            got = take()  # (it may have ended between the two statements)
        if not got:
            conn.close()
            raise FlowError(
                op,
                f"another process drives this window's state in PostgreSQL (schema {state.schema!r}); "
                "stop it first",
            )
        before.append(conn.info.backend_pid)
        return conn

    wrapped = _Conn(locked(connect_store(state).conn), reopen=lambda: locked(state.connect()))

    def size() -> int:
        return int(
            wrapped.execute(
                "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c "
                "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relkind = 'r'",
                (state.schema,),
            ).fetchone()[0]
        )

    return WindowStore(f"postgresql:{state.schema}", conn=wrapped, size=size)


def read_view(
    state: PostgresState, op: str, keys: Sequence[str], batch: str | None
) -> tuple[int | None, set[str]]:
    """A task's view (as :func:`ackflow.state.store.read_view`), over the network."""
    from ackflow.state.store import view_of

    conn = state.connect()
    try:
        return view_of(conn, op, keys, batch, lite=False)
    finally:
        conn.close()
