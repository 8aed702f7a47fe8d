"""The report and the CLI say only what happened (issue 28, item 3): the failures list
says when it is cut, the rate leaves out the closing until_idle wait, the status page
counts jobs and bisections while a bisection runs, and `ackflow queue` given a broker
URL says it is for the embedded queue without echoing the password."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

import ackflow
from ackflow.engine.loop import Engine
from ackflow.sinks import MemorySink
from ackflow.testing import ListSource
from helpers import FAST, bodies, wait_until


def test_queue_commands_refuse_a_broker_url_without_echoing_its_password():
    url = "amqp://alice:s3cr3t-pw@127.0.0.1:5672/%2F"
    out = subprocess.run(
        [sys.executable, "-m", "ackflow.cli", "queue", "dead-letters", "--db", url, "--queue", "orders"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert "s3cr3t-pw" not in text, text
    assert "embedded queue" in text and "alice:***@" in text, text
    dsn = "host=db user=app password=hunter22 dbname=x"
    out = subprocess.run(
        [sys.executable, "-m", "ackflow.cli", "queue", "stats", "--db", dsn, "--queue", "q"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and "hunter22" not in out.stdout + out.stderr


def test_the_failures_list_says_it_is_cut_and_counts_them_all():
    def boom(row):
        raise ValueError(f"bad {row['n']}")  # a different error each: poison, not systemic

    src = ListSource(bodies([{"n": i} for i in range(25)]), policy=ackflow.RetryPolicy(max_deliveries=1))
    report = ackflow.run(ackflow.Flow(src).map(boom, name="boom").to(MemorySink()), executor="local", **FAST)
    assert report.dead_lettered == 25 and len(report.failures) == 20
    d = report.as_dict()
    assert d["failures_total"] == 25
    assert d["failures_cut"] == "the first 20 of 25 failures are listed"


def test_the_rate_leaves_out_the_until_idle_wait():
    src = ListSource(bodies([{"n": i} for i in range(40)]))
    report = ackflow.run(ackflow.Flow(src).to(MemorySink()), executor="local", **{**FAST, "until_idle": 2.0})
    assert report.acked == 40
    assert report.elapsed_s >= 2.0 and report.active_s < report.elapsed_s - 1.5
    assert report.messages_per_s == pytest.approx(40 / report.active_s)


@pytest.mark.spark
def test_the_page_counts_jobs_and_bisections_while_a_bisection_runs(spark):
    from pyspark.sql import functions as F

    rows = [{"v": "1"} for _ in range(32)]
    rows[7] = {"v": "abc"}
    src = ListSource(bodies(rows), policy=ackflow.RetryPolicy(max_deliveries=1))
    flow = ackflow.Flow(src).with_columns(n=F.col("v").cast("int")).to(MemorySink())
    engine = Engine(flow, spark=spark, handle_signals=False, ui_port=0, **{**FAST, "batch_size": 32})
    seen = []

    def watch():
        def busy():
            if engine.board is None:
                return False
            totals = engine.board.current()[1].get("totals") or {}
            if totals.get("batches") == 0 and totals.get("bisections", 0) > 0:
                seen.append((totals["jobs"], totals["bisections"]))
            return engine.report.batches > 0

        wait_until(busy, timeout=120, every=0.05)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    report = engine.run()
    t.join(5)
    assert report.dead_lettered == 1 and report.acked == 31
    assert seen and max(j for j, _ in seen) > 1, seen  # live, before the batch settled
    assert report.jobs >= 1 + 2 * 5 and report.bisections >= 5
