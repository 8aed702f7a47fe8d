"""A consumer the broker cancels (``basic.cancel``: the queue deleted under it), against
a real broker (issue 27 #9). Before, the source ignored the notification: it stopped
receiving, said nothing, stayed "connected", and an ``until_idle`` run ended as idle.
Now it consumes again when the queue is back, or stops the run with one line naming the
queue after ``gone_timeout_s``; nothing is acked unwritten either way."""

import threading
import time

import pytest

from ackflow import Flow
from ackflow.core.errors import SourceGone
from ackflow.engine.loop import Engine
from ackflow.sinks import Memory
from ackflow.sources import RabbitMQ
from amqp import connect, names, publish, setup
from helpers import wait_until


def hold(r, gate=""):
    """Message 30 waits (bounded) until the test has deleted the queue."""
    import os
    import time

    if r["n"] == 30:
        open(gate + ".reached", "w").close()
        deadline = time.monotonic() + 60
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.02)
    return r


def start(url, q, tmp_path, **kw):
    gate = str(tmp_path / "deleted")
    src = RabbitMQ(url, q, name=q, reject_to_dlx=True, dlx_by_policy=True, **kw)
    sink = Memory()
    engine = Engine(
        Flow(src).map(lambda r, g=gate: hold(r, g), name="hold").to(sink),
        executor="local",
        batch_size=20,
        max_inflight=60,
        batch_timeout_s=0.05,
        until_idle=1.0,
        handle_signals=False,
    )
    outcome = {}

    def run():
        try:
            outcome["report"] = engine.run()
        except Exception as e:  # noqa: BLE001 - the test looks at it
            outcome["error"] = e

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    assert wait_until(lambda: (tmp_path / "deleted.reached").exists(), timeout=60)
    return src, sink, engine, runner, outcome, tmp_path / "deleted"


def delete(url, q):
    conn = connect(url)
    conn.channel().queue_delete(q)
    conn.close()


def gauge(engine):
    return engine.metrics.registry.get_sample_value("ackflow_source_connected")


@pytest.mark.parametrize("kind", ["classic", "quorum"])
def test_queue_deleted_while_consuming_stops_the_run_with_one_line(rabbitmq, tmp_path, kind):
    url, q = rabbitmq.url, names(f"gone-{kind}")
    setup(url, queue=q, arguments={"x-queue-type": kind})
    publish(url, q, [{"n": i} for i in range(200)], ids=[f"m{i}" for i in range(200)])
    src, sink, engine, runner, outcome, gate = start(
        url, q, tmp_path, gone_timeout_s=1.0, reconnect_max_s=0.2
    )
    try:
        delete(url, q)
        deleted = time.monotonic()
        gate.touch()  # the engine pulls again (its window was full): it hears the cancel
        assert wait_until(lambda: not src.connected, timeout=10), "basic.cancel went unnoticed"
        assert wait_until(lambda: gauge(engine) == 0, timeout=10)
    finally:
        gate.touch()
        runner.join(60)
    stopped = time.monotonic() - deleted
    assert not runner.is_alive() and "report" not in outcome
    e = outcome["error"]
    assert isinstance(e, SourceGone) and f"queue {q!r} does not exist" in str(e)
    assert "\n" not in str(e)
    assert stopped < 20
    written = {r["n"] for r in sink.rows}
    assert 30 in written  # the batch held across the cancel was written and settled
    assert engine.report.acked <= len(written)  # nothing acked unwritten


def test_queue_deleted_then_declared_again_is_consumed_again(rabbitmq, tmp_path):
    url, q = rabbitmq.url, names("back")
    setup(url, queue=q)
    publish(url, q, [{"n": i} for i in range(100)], ids=[f"m{i}" for i in range(100)])
    src, sink, engine, runner, outcome, gate = start(url, q, tmp_path, gone_timeout_s=60, reconnect_max_s=0.2)
    try:
        delete(url, q)
        gate.touch()
        assert wait_until(lambda: not src.connected, timeout=10), "basic.cancel went unnoticed"
        assert wait_until(lambda: gauge(engine) == 0, timeout=10)
        setup(url, queue=q)  # the queue comes back, with new messages
        publish(url, q, [{"n": i} for i in range(1000, 1050)], ids=[f"m{i}" for i in range(1000, 1050)])
        assert wait_until(lambda: src.connected, timeout=30), "not consuming again"
    finally:
        gate.touch()
        runner.join(60)
    assert not runner.is_alive() and "error" not in outcome, outcome.get("error")
    written = [r["n"] for r in sink.rows]
    assert set(range(1000, 1050)) <= set(written)  # the new queue's messages were read
    assert 30 in written
    assert src.stats["cancelled_by_broker"] == 1 and src.stats["reconsumed"] == 1
    assert gauge(engine) == 1
    assert outcome["report"].acked <= len(written)
