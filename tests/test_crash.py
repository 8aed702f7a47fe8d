"""Crash safety: the demo killed with SIGKILL mid-run, then resumed, converges."""

import json
import os
import random
import signal
import subprocess
import sys

import pytest

from ackflow.embedded import EmbeddedQueue
from helpers import wait_until

pytestmark = [pytest.mark.spark, pytest.mark.slow]

DEMO = [
    sys.executable,
    "-m",
    "ackflow.cli",
    "demo",
    "--master",
    "local[2]",
    "--json",
    "--batch-size",
    "500",
    "--max-inflight",
    "1500",
    "--until-idle",
    "2",
]


def acked_total(db):
    if not os.path.exists(db):
        return 0
    q = EmbeddedQueue(db)
    try:
        return q.stats("orders")["acked_total"]
    finally:
        q.close()


def test_sigkill_at_random_moments_then_resume_converges(tmp_path):
    work = str(tmp_path / "demo")
    db = os.path.join(work, "queue.db")
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    messages = 6000
    kills = 0
    resume = False
    for _ in range(2):  # two kills, each after a random share of the work
        threshold = acked_total(db) + rng.randint(300, 1500)
        proc = subprocess.Popen(
            [*DEMO, "--messages", str(messages), "--workdir", work, *(["--resume"] if resume else [])],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        try:
            reached = wait_until(
                lambda t=threshold, p=proc: acked_total(db) >= t or p.poll() is not None,
                timeout=180,
                every=0.05,
            )
            assert reached and proc.poll() is None, "the demo ended before it could be killed"
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(30)
            kills += 1
        finally:
            if proc.poll() is None:
                proc.kill()
        resume = True
    assert kills == 2
    done = subprocess.run([*DEMO, "--resume", "--workdir", work], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    check = summary["check"]
    assert check["ok"], check
    assert check["valid_orders_in_parquet"] == check["valid_orders_expected"]
    assert check["line_items_in_parquet"] == check["line_items_expected"]
    assert check["dead_lettered_wrongly"] == 0
    assert check["queue"]["ready"] + check["queue"]["leased"] + check["queue"]["delayed"] == 0
    assert check["queue"]["acked_total"] + check["queue"]["dead_lettered"] == messages
    # duplicates only from messages in flight at a kill (at most 3 line items each)
    assert check["duplicate_rows"] <= 3 * 1500 * kills
