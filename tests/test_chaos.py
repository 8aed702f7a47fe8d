"""The chaos soak, short: 3 minutes of SIGKILLs, broker restarts, database outages and
armed fault points against a real RabbitMQ (a quorum queue with a delivery limit and a
dead-letter exchange, fed by a producer that re-sends batches with the same message
ids; a stream), a Files directory, a Kafka topic read as a consumer group (tansu),
PostgreSQL and Parquet, through grouped_within,
group_by, join and transform, with null, empty and nested values, and a count window in
durable state; nothing may be lost or duplicated, every value lands as published, and
the window counts each row once."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_three_minute_chaos_soak_loses_and_duplicates_nothing():
    seed = int.from_bytes(os.urandom(3), "little")
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.chaos", "--minutes", "3", "--seed", str(seed), "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=480,  # 3 minutes, the final drain and the checks (about 330 s on two busy cores)
    )
    out = done.stdout.strip().splitlines()
    assert out, done.stderr[-3000:]
    summary = json.loads(out[-1])
    context = f"seed {seed}:\n" + "\n".join(out[-40:])
    assert summary["seed"] == seed
    assert summary["kills"] >= 5, context
    assert summary["broker_restarts"] >= 1, context
    assert summary["db_outages"] >= 1, context
    assert summary["messages"] > 1000, context
    assert summary["per_source"].get("kafka", 0) > 200, context  # and committed to its end (ok)
    assert summary["lost"] == 0, context
    assert summary["duplicated"] == 0, context
    assert summary["good_dead_lettered"] == 0, context
    assert summary["dead_lettered"] > 0, context
    assert summary["resent"] > 0, context  # repeats of one identity were in the run
    assert summary["values_checked"] > 0, context
    assert summary["values_wrong"] == 0, context
    # the count window counted each written row once (open windows included)
    assert summary["window_rows_counted"] == summary["rows_postgres"], context
    assert summary["ok"], context
    assert done.returncode == 0, context


def test_the_window_check_sees_a_row_counted_twice_or_not_at_all(tmp_path):
    """The soak's window check is not a formality: a window with one row too many, or an
    open window missing a row, shows as a difference; a window written twice shows."""
    import pickle
    import sqlite3

    from benchmarks.chaos_checks import window_counts
    from benchmarks.chaos_publisher import WINDOW

    from ackflow.state.store import SCHEMA

    rows = [{"id": f"q{i}", "total": 2} for i in range(7)]
    db = sqlite3.connect(tmp_path / "windows.db")
    db.executescript(SCHEMA)
    db.execute(
        "INSERT INTO windows (op, gk, start, \"end\", nrows, state) VALUES (?, '[]', 1, 1, 2, ?)",
        (WINDOW, pickle.dumps(((), [2, 4]))),
    )
    db.commit()
    db.close()
    good = window_counts([(0, 5, 10)], str(tmp_path), rows)
    assert (good["rows"], good["rows_off"], good["total_off"], good["twice"]) == (7, 0, 0, [])
    assert window_counts([(0, 6, 12)], str(tmp_path), rows)["rows_off"] == 1
    assert window_counts([(0, 5, 10)], str(tmp_path), rows[:6])["rows_off"] == 1
    assert window_counts([(0, 5, 10), (0, 5, 10)], str(tmp_path), rows)["twice"] == [0]
