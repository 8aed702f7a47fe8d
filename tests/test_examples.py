"""The scripts in examples/ run as written, against the real servers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import psycopg
import pytest
from psycopg import sql

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}


def example(name, *args, env=None, timeout=600):
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or ENV,
    )


@pytest.mark.parametrize("name", ["rabbitmq_to_postgres.py", "files_to_delta.py", "clicks_per_minute.py"])
def test_help(name):
    r = example(name, "--help")
    assert r.returncode == 0 and "usage:" in r.stdout and "--until-idle" in r.stdout


@pytest.mark.slow
@pytest.mark.spark
def test_rabbitmq_to_postgres(rabbitmq, postgres):
    tag = uuid.uuid4().hex[:8]
    queue, table, dead = f"orders-{tag}", f"orders_{tag}", f"orders_dead_{tag}"
    env = {**ENV, "ACKFLOW_AMQP_URL": rabbitmq.url}  # the URL through the environment
    r = example(
        "rabbitmq_to_postgres.py",
        "--dsn",
        postgres.dsn,
        "--queue",
        queue,
        "--table",
        table,
        "--dead-table",
        dead,
        "--publish",
        "50",
        "--until-idle",
        "2",
        "--master",
        "local[2]",
        env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "acked              45" in r.stdout and "validate: 5" in r.stdout, r.stdout
    assert "guest:guest" not in r.stdout + r.stderr
    with psycopg.connect(postgres.dsn) as c:
        n, total = c.execute(
            sql.SQL("SELECT count(*), sum(qty) FROM {}").format(sql.Identifier(table))
        ).fetchone()
        rows = c.execute(
            sql.SQL(
                "SELECT message, step, error, left(body, 80), deliveries FROM {} ORDER BY message"
            ).format(sql.Identifier(dead))
        ).fetchall()
    assert n == 45 and total > 0
    assert [m for m, *_ in rows] == sorted(f"o-{i}" for i in range(9, 50, 10))
    assert all(
        step == "validate"
        and "qty must be a positive integer" in error
        and json.loads(body)["qty"] == 0
        and deliveries == 3
        for _, step, error, body, deliveries in rows
    ), rows
    import pika

    conn = pika.BlockingConnection(pika.URLParameters(rabbitmq.url))
    left = conn.channel().queue_declare(queue, passive=True).method.message_count
    conn.close()
    assert left == 0


@pytest.mark.slow
@pytest.mark.spark
def test_files_to_delta(tmp_path):
    from deltalake import DeltaTable

    src, table = tmp_path / "in", tmp_path / "table"
    r = example(
        "files_to_delta.py",
        str(src),
        str(table),
        "--sample",
        "2",
        "--until-idle",
        "2",
        "--master",
        "local[2]",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "acked             392" in r.stdout and "check: 8" in r.stdout, r.stdout
    rows = DeltaTable(str(table)).to_pyarrow_table().to_pylist()
    assert len(rows) == 392 and all(row["kind"] in ("view", "click", "buy") for row in rows)
    done = sorted(os.listdir(src / "done"))
    assert len(done) == 4 and [d for d in done if d.endswith(".dead.jsonl")] == [
        "events-0.jsonl.dead.jsonl",
        "events-1.jsonl.dead.jsonl",
    ], done
    dead = [
        json.loads(line) for line in (src / "done" / "events-0.jsonl.dead.jsonl").read_text().splitlines()
    ]
    assert len(dead) == 4 and all("teleport" in json.dumps(d) for d in dead), dead[:1]


@pytest.mark.slow
@pytest.mark.spark
def test_clicks_per_minute(tmp_path, postgres):
    """Windows into PostgreSQL: every valid click counted once, in a window row or in the
    late dataset; one row per page and minute; the state inspectable afterwards."""
    import pyarrow.dataset as ds

    src, table = tmp_path / "in", f"clicks_{uuid.uuid4().hex[:8]}"
    args = [str(src), "--dsn", postgres.dsn, "--table", table, "--master", "local[2]"]
    r = example("clicks_per_minute.py", *args, "--sample", "3", "--until-idle", "5")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "acked             891" in r.stdout and "check: 9" in r.stdout, r.stdout
    with psycopg.connect(postgres.dsn) as c:
        rows = c.execute(
            sql.SQL("SELECT page, window_start, clicks, users FROM {}").format(sql.Identifier(table))
        ).fetchall()
    late = ds.dataset(str(src / "late")).to_table().num_rows if (src / "late").exists() else 0
    assert sum(n for _, _, n, _ in rows) + late == 891
    assert len({(p, t) for p, t, _, _ in rows}) == len(rows) and all(0 < u <= 40 for *_, u in rows)
    assert {p for p, *_ in rows} == {"/", "/cart", "/search"}
    shown = subprocess.run(
        [sys.executable, "-m", "ackflow.cli", "state", "show", str(tmp_path / "in-state"), "--json"],
        capture_output=True,
        text=True,
        env=ENV,
    )
    (op,) = json.loads(shown.stdout)
    assert op["window"] == "per_minute" and op["open_windows"] == 0 and op["rows_applied"] == 891 - late
