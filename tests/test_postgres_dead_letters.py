"""A PostgreSQL error sink's table is one a person can query (docs/tools.md): ``body``
text where it decodes (else null, the bytes in ``body_bytes``), ``failed_at``
timestamptz; a table of an older ackflow is upgraded in place."""

from __future__ import annotations

import datetime as dt
import subprocess

import psycopg
import pytest
from psycopg import sql

import ackflow
from ackflow.core.errors import FlowError
from ackflow.core.ledger import Failure
from ackflow.core.settlement import Delivery
from ackflow.engine.loop import write_dead_letters
from ackflow.sinks import MemorySink, Postgres
from ackflow.testing import ListSource
from helpers import FAST

BINARY = b"\xff\xfe\x00 not text"
NUL = b'{"a": "x\x00y"}'  # UTF-8, but text cannot hold NUL


def check(r):
    if r["n"] < 0:
        raise ValueError(f"n is negative: {r['n']}")
    return r


def run(dsn, table, bodies):
    src = ListSource(bodies)
    flow = (
        ackflow.Flow(src)
        .map(check, name="check")
        .to(MemorySink("ok"))
        .on_error(Postgres(dsn, table, create=True, name="dead"))
    )
    return ackflow.run(flow, executor="local", **FAST), src


def psql(dsn, query):
    out = subprocess.run(["psql", dsn, "-AtF", "|", "-c", query], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()


def test_dead_letters_are_text_and_timestamps(postgres, pg_table):
    before = dt.datetime.now(dt.UTC)
    report, _ = run(postgres.dsn, pg_table, ['{"n": 1}', '{"n": -2, "note": "caf\u00e9"}', BINARY, NUL])
    assert (report.acked, report.dead_lettered) == (1, 3), report.failures
    lines = psql(
        postgres.dsn,
        f"SELECT message, step, left(body, 80), body_bytes IS NULL, "
        f"pg_typeof(failed_at) FROM {pg_table} ORDER BY message",
    )
    assert lines == [
        'm1|check|{"n": -2, "note": "caf\u00e9"}|t|timestamp with time zone',
        "m2|decode||f|timestamp with time zone",
        "m3|decode||f|timestamp with time zone",
    ]
    with psycopg.connect(postgres.dsn) as c:
        rows = c.execute(
            sql.SQL(
                "SELECT message, body, body_bytes, failed_at, headers::jsonb FROM {} ORDER BY message"
            ).format(sql.Identifier(pg_table))
        ).fetchall()
        types = dict(
            c.execute(
                "SELECT column_name, data_type FROM information_schema.columns WHERE table_name = %s",
                [pg_table],
            ).fetchall()
        )
    assert [bytes(r[2]) if r[2] is not None else None for r in rows] == [None, BINARY, NUL]
    assert all(before - dt.timedelta(seconds=5) <= r[3] <= dt.datetime.now(dt.UTC) for r in rows)
    assert rows[0][4] == {}
    assert types["body"] == "text" and types["body_bytes"] == "bytea"
    assert types["failed_at"] == "timestamp with time zone"


OLD_TABLE = """CREATE TABLE {} (message text, body bytea, headers text, step text,
    error text, deliveries bigint, failed_at double precision, ackflow_key text PRIMARY KEY)"""


def old_table(dsn, table):
    """A dead-letter table as ackflow 0.1 created it, with two dead letters in it."""
    with psycopg.connect(dsn) as c:
        c.execute(sql.SQL(OLD_TABLE).format(sql.Identifier(table)))
        c.execute(
            sql.SQL(
                "INSERT INTO {} VALUES (%s, %s, '{{}}', 's', 'e', 1, %s, %s), "
                "(%s, %s, '{{}}', 's', 'e', 2, %s, %s)"
            ).format(sql.Identifier(table)),
            ["old1", b'{"old": true}', 1_700_000_000.25, "old1", "old2", BINARY, 1_700_000_001.0, "old2"],
        )


def test_an_older_dead_letter_table_is_upgraded_in_place(postgres, pg_table):
    old_table(postgres.dsn, pg_table)
    report, _ = run(postgres.dsn, pg_table, ['{"n": -1}', BINARY])
    assert report.dead_lettered == 2, report.failures
    with psycopg.connect(postgres.dsn) as c:
        rows = c.execute(
            sql.SQL("SELECT message, left(body, 80), body_bytes, failed_at FROM {} ORDER BY message").format(
                sql.Identifier(pg_table)
            )
        ).fetchall()
    got = {m: (b, bytes(x) if x is not None else None, at) for m, b, x, at in rows}
    assert got["old1"] == (
        '{"old": true}',
        None,
        dt.datetime(2023, 11, 14, 22, 13, 20, 250000, tzinfo=dt.UTC),
    )
    assert got["old2"][:2] == (None, BINARY)
    assert got["m0"][:2] == ('{"n": -1}', None) and got["m1"][:2] == (None, BINARY)
    # a second start finds it upgraded and changes nothing
    report, _ = run(postgres.dsn, pg_table, ['{"n": -3}'])
    assert report.dead_lettered == 1


def test_an_older_table_that_cannot_be_upgraded_says_how(postgres, pg_table):
    """A writer that does not own the table cannot ALTER it: the error names the table
    and gives the SQL to run as its owner (the rows are never written into bytea)."""
    old_table(postgres.dsn, pg_table)
    with psycopg.connect(postgres.dsn, autocommit=True) as c:
        c.execute("DROP ROLE IF EXISTS dl_writer")
        c.execute("CREATE ROLE dl_writer LOGIN")
        c.execute(sql.SQL("GRANT SELECT, INSERT, UPDATE ON {} TO dl_writer").format(sql.Identifier(pg_table)))
    dsn = postgres.dsn.replace("postgres@", "dl_writer@")
    sink = Postgres(dsn, pg_table, create=True, name="dead")
    try:
        with pytest.raises(FlowError, match=r"cannot be upgraded.*ALTER TABLE"):
            write_dead_letters(sink, "b1", [(Delivery(1, "m1", b"{}"), Failure("s", "e"))])
    finally:
        with psycopg.connect(postgres.dsn, autocommit=True) as c:
            c.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(pg_table)))
            c.execute("DROP ROLE dl_writer")
