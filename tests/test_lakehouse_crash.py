"""A real Spark pipeline writing one Delta table and one Iceberg table (broadcast),
killed with SIGKILL at a random moment and at a commit boundary, then run to the end:
each table holds every message's rows exactly once."""

import json
import os
import random
import signal
import subprocess
import sys

import pytest

from ackflow.embedded import EmbeddedQueue
from helpers import wait_until
from lake import (
    PIPELINE,
    assert_exactly_once,
    dead_ids,
    delta_rows,
    iceberg_rows,
    publish_orders,
    queue_left,
)

pytestmark = [pytest.mark.spark, pytest.mark.slow]


def acked_total(db):
    q = EmbeddedQueue(db)
    try:
        return q.stats("orders")["acked_total"]
    finally:
        q.close()


def test_sigkill_at_a_random_moment_and_at_a_commit_then_exactly_once(tmp_path):
    db = str(tmp_path / "queue.db")
    env = {
        **os.environ,
        "AF_QUEUE": db,
        "AF_SINKS": "delta,iceberg",
        "AF_DELTA": str(tmp_path / "delta"),
        "AF_CATALOG": f"sqlite:///{tmp_path / 'catalog.db'}",
        "AF_TABLE": "shop.items",
    }
    expected, poison = publish_orders(db, 600, seed=11)
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
        "120",
        "--max-inflight",
        "360",
        "--until-idle",
        "1",
    ]
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    # 1. SIGKILL from outside after a random amount of work
    threshold = rng.randint(60, 300)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        reached = wait_until(
            lambda: acked_total(db) >= threshold or proc.poll() is not None, timeout=180, every=0.05
        )
        assert reached and proc.poll() is None, "the run ended before the kill"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        proc.stderr.close()
    # 2. killed at once after a commit, before its keys are recorded: the Delta table
    # recorded, the Iceberg snapshot committed, nothing acked
    point = "iceberg.after_commit"
    crashed = subprocess.run(
        cmd,
        env={**env, "ACKFLOW_FAULTS": f"{point}=exit@{rng.randint(1, 2)}"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert crashed.returncode == 137, crashed.stderr[-3000:]
    # 3. to the end
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["recovered"] >= 0
    assert_exactly_once(delta_rows(env["AF_DELTA"]), expected)
    assert_exactly_once(iceberg_rows(env["AF_CATALOG"], env["AF_TABLE"]), expected)
    assert queue_left(db) == 0
    assert dead_ids(db) == poison
