"""The chaos soak, short: 3 minutes of SIGKILLs, broker restarts, database outages and
armed fault points against a real RabbitMQ (a quorum queue with a delivery limit and a
dead-letter exchange, fed by a producer that re-sends batches with the same message
ids; a stream), a Files directory, PostgreSQL and Parquet, through grouped_within,
group_by, join and transform, with null, empty and nested values; nothing may be lost
or duplicated, and every value lands as published."""

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
        timeout=330,
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
    assert summary["lost"] == 0, context
    assert summary["duplicated"] == 0, context
    assert summary["good_dead_lettered"] == 0, context
    assert summary["dead_lettered"] > 0, context
    assert summary["resent"] > 0, context  # repeats of one identity were in the run
    assert summary["values_checked"] > 0, context
    assert summary["values_wrong"] == 0, context
    assert summary["ok"], context
    assert done.returncode == 0, context
