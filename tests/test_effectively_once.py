"""Effectively-once into PostgreSQL and Parquet, against a real server: every row
exactly once after poison messages, after SIGKILLs at random moments (and right
after a commit, before the acks), and after the database went away for a while."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import psycopg
import pyarrow.parquet as pq
import pytest
from psycopg import sql

import ackflow
from ackflow.core.policy import RetryPolicy
from ackflow.embedded import EmbeddedQueue
from helpers import Outage, wait_until

pytestmark = [pytest.mark.spark, pytest.mark.slow]

HERE = os.path.dirname(__file__)
PIPELINE = os.path.join(HERE, "pipelines", "orders_pg.py")
sys.path.insert(0, os.path.join(HERE, "pipelines"))
import orders_pg  # noqa: E402


def publish_orders(db, n, seed):
    """n orders with 1-3 line items each; 1% poison. Returns (expected rows, poison ids)."""
    rng = random.Random(seed)
    q = EmbeddedQueue(db)
    expected, poison, msgs, ids = set(), set(), [], []
    for i in range(n):
        order = {"order": i, "items": rng.randint(1, 3), "poison": i % 100 == 37}
        if order["poison"]:
            poison.add(f"o{i}")
        else:
            expected.update((i, j) for j in range(order["items"]))
        msgs.append(json.dumps(order).encode())
        ids.append(f"o{i}")
    for k in range(0, n, 10_000):
        q.publish("orders", msgs[k : k + 10_000], msg_ids=ids[k : k + 10_000])
    q.close()
    return expected, poison


def table_rows(dsn, table):
    with psycopg.connect(dsn) as c:
        return c.execute(sql.SQL('SELECT "order", line FROM {}').format(sql.Identifier(table))).fetchall()


def parquet_rows(path):
    t = pq.read_table(path, columns=["order", "line"])
    return list(zip(t.column("order").to_pylist(), t.column("line").to_pylist(), strict=True))


def assert_exactly_once(rows, expected):
    assert len(rows) == len(set(rows)), f"{len(rows) - len(set(rows))} duplicate rows"
    assert set(rows) == expected, (
        f"missing {len(expected - set(rows))}, unexpected {len(set(rows) - expected)}"
    )


def queue_state(db):
    q = EmbeddedQueue(db)
    try:
        return q.stats("orders"), {d.msg_id: d for d in q.dead_letters("orders")}
    finally:
        q.close()


def test_50k_messages_with_poison_into_postgres(spark, postgres, pg_table, tmp_path):
    db = str(tmp_path / "queue.db")
    expected, poison = publish_orders(db, 50_000, seed=1)
    flow = orders_pg.build(db, postgres.dsn, pg_table, str(tmp_path / "pq"))
    report = ackflow.run(flow, spark=spark, batch_size=5000, max_inflight=15_000, until_idle=1.0)
    assert report.acked == 50_000 - len(poison) and report.dead_lettered == len(poison)
    rows = table_rows(postgres.dsn, pg_table)
    # (a block with a poison message is split and its good rows written again, in place:
    # rows_written counts them once, engine/blocks.py)
    assert len(rows) == len(expected) == report.rows_written["pg"]
    assert_exactly_once(rows, expected)
    assert_exactly_once(parquet_rows(tmp_path / "pq"), expected)
    stats, dead = queue_state(db)
    assert set(dead) == poison
    assert all(d.step == "check" and "is poison" in d.error for d in dead.values()), next(iter(dead.values()))
    assert stats["ready"] + stats["leased"] + stats["delayed"] == 0


def acked_total(db):
    return queue_state(db)[0]["acked_total"]


def test_sigkill_at_random_moments_then_exactly_once(postgres, pg_table, tmp_path):
    """Six kills: three SIGKILLs from outside after a random amount of work, three
    from inside right after a batch's commit and before its acks (so that committed
    rows are certainly delivered again). Then a run to the end."""
    db, parquet = str(tmp_path / "queue.db"), str(tmp_path / "pq")
    expected, poison = publish_orders(db, 8000, seed=2)
    env = {**os.environ, "AF_QUEUE": db, "AF_DSN": postgres.dsn, "AF_TABLE": pg_table, "AF_PARQUET": parquet}
    cmd = [
        sys.executable,
        "-m",
        "ackflow.cli",
        "run",
        f"{PIPELINE}:flow",
        "--master",
        "local[2]",
        "--json",
        "--batch-size",
        "400",
        "--max-inflight",
        "1200",
        "--until-idle",
        "2",
    ]
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    kills = {"outside": 0, "after_commit": 0}
    deadline = time.monotonic() + 420
    for attempt in range(6):
        assert time.monotonic() < deadline, "the kill loop ran out of time"
        inside = attempt % 2 == 1
        run_env = {**env, "AF_CRASH_AFTER_COMMIT": str(rng.randint(1, 3)) if inside else "0"}
        before = acked_total(db)
        proc = subprocess.Popen(cmd, env=run_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            if inside:
                proc.wait(timeout=180)
                assert proc.returncode == -signal.SIGKILL, proc.stderr.read()[-2000:]
                kills["after_commit"] += 1
            else:
                threshold = before + rng.randint(200, 1200)
                reached = wait_until(
                    lambda t=threshold, p=proc: acked_total(db) >= t or p.poll() is not None,
                    timeout=180,
                    every=0.05,
                )
                assert reached and proc.poll() is None, "the run ended before the kill"
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(30)
                kills["outside"] += 1
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
            proc.stderr.close()
    assert kills == {"outside": 3, "after_commit": 3}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["recovered"] >= 0
    assert_exactly_once(table_rows(postgres.dsn, pg_table), expected)
    assert_exactly_once(parquet_rows(parquet), expected)
    stats, dead = queue_state(db)
    assert set(dead) == poison
    assert stats["ready"] + stats["leased"] + stats["delayed"] == 0
    # the kills after a commit made the next run deliver committed rows again: the
    # Parquet manifest left them out (and Postgres wrote them in place)
    import sqlite3

    with sqlite3.connect(os.path.join(parquet, "_manifest.db")) as m:
        dropped = m.execute("SELECT sum(dropped) FROM batches").fetchone()[0]
    assert dropped > 0


def test_database_away_mid_run_nacks_retries_and_ends_exact(spark, postgres, pg_table, tmp_path):
    db = str(tmp_path / "queue.db")
    expected, poison = publish_orders(db, 4000, seed=3)
    flow = orders_pg.build(
        db,
        postgres.dsn,
        pg_table,
        str(tmp_path / "pq"),
        policy=RetryPolicy(max_deliveries=60, backoff_s=0.2, max_backoff_s=1.0),
    )
    with Outage(postgres, f'SELECT count(*) FROM "{pg_table}"', at_least=1, seconds=5, wait_s=120) as outage:
        report = ackflow.run(flow, spark=spark, batch_size=300, max_inflight=900, until_idle=4.0)
    assert outage.happened, "the database was never stopped"
    # rows failed while it was away: a systemic failure (every write failed alike), so
    # given back (never dead-lettered), or nacked while fewer than three had shown it
    assert report.nacked + report.given_back_systemic > 0
    assert report.acked == 4000 - len(poison) and report.dead_lettered == len(poison)
    assert_exactly_once(table_rows(postgres.dsn, pg_table), expected)
    assert_exactly_once(parquet_rows(tmp_path / "pq"), expected)
    assert set(queue_state(db)[1]) == poison
