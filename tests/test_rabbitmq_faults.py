"""RabbitMQ with faults: the pipeline SIGKILLed and restarted, the broker stopped and
started mid-run. Nothing valid is missing downstream; nothing is acked before its
rows were confirmed by the broker."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import ackflow
from amqp import count, drain, names, publish_many, setup
from helpers import wait_until

pytestmark = [pytest.mark.spark, pytest.mark.slow]

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, "pipelines"))
import rmq_flow  # noqa: E402


def prepare(url, n):
    q, out_x, out_q, dlx, dead = (names(p) for p in ("in", "out-x", "out", "dlx", "dead"))
    setup(url, queue=q, out_exchange=out_x, out_queue=out_q, dlx=dlx, dead_queue=dead)
    rows = [{"order": i, "qty": i % 7, "poison": i % 100 == 3} for i in range(n)]
    publish_many(url, q, rows, [f"o{i}" for i in range(n)])
    valid = {f"o{i}" for i in range(n) if i % 100 != 3}
    poison = {f"o{i}" for i in range(n) if i % 100 == 3}
    return (q, out_x, out_q, dlx, dead), valid, poison


def test_pipeline_sigkilled_mid_run_then_restarted_loses_nothing(rabbitmq):
    url = rabbitmq.url
    (q, out_x, out_q, dlx, dead), valid, poison = prepare(url, 20_000)
    env = {
        **os.environ,
        "AF_URL": url,
        "AF_QUEUE": q,
        "AF_OUT_EXCHANGE": out_x,
        "AF_OUT_QUEUE": out_q,
        "AF_DLX": dlx,
    }
    cmd = [
        sys.executable,
        "-m",
        "ackflow.cli",
        "run",
        f"{os.path.join(HERE, 'pipelines', 'rmq_flow.py')}:flow",
        "--master",
        "local[2]",
        "--json",
        "--batch-size",
        "1000",
        "--max-inflight",
        "3000",
        "--until-idle",
        "2",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        reached = wait_until(
            lambda: count(url, out_q) >= 3000 or proc.poll() is not None, timeout=180, every=0.1
        )
        assert reached and proc.poll() is None, "the pipeline ended before the kill"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        proc.stderr.close()
    assert 0 < count(url, q)  # work was left (the killed run's unacked messages came back)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = [m for m, _, _ in drain(url, out_q)]
    assert set(out) == valid  # none missing; a message in flight at the kill may be twice
    assert {m for m, _, _ in drain(url, dead)} == poison
    assert count(url, q) == 0


def test_broker_restart_mid_run_reconnects_and_loses_nothing(spark, rabbitmq):
    url = rabbitmq.url
    (q, out_x, out_q, dlx, dead), valid, poison = prepare(url, 20_000)
    flow = rmq_flow.build(url, q, out_x, out_q, dlx)
    restarted = {}

    def restart_broker():
        if wait_until(lambda: _safe_count(url, out_q) >= 3000, timeout=120, every=0.05):
            restarted["at_out"] = _safe_count(url, out_q)
            rabbitmq.restart()
            restarted["done"] = time.monotonic()

    t = threading.Thread(target=restart_broker, daemon=True)
    t.start()
    report = ackflow.run(
        flow, spark=spark, batch_size=1000, max_inflight=3000, until_idle=6.0, batch_timeout_s=0.3
    )
    t.join(timeout=120)
    assert "done" in restarted, "the broker was not restarted mid-run"
    assert restarted["at_out"] < len(valid)
    src = flow.source
    assert src.stats["lost"] > 0 and report.redelivered > 0  # the dead channel's deliveries
    left = count(url, q)
    out = [m for m, _, _ in drain(url, out_q)]
    assert left == 0, f"{left} messages left in the input queue"
    # nothing acked unwritten: every message that left the input queue is downstream
    assert set(out) == valid
    assert {m for m, _, _ in drain(url, dead)} == poison
    assert count(url, q) == 0


def _safe_count(url, queue):
    try:
        return count(url, queue)
    except Exception:  # noqa: BLE001 - the broker is restarting
        return -1
