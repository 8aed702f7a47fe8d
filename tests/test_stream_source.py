"""The RabbitMQ stream source against a real broker (stream plugin on loopback): the
stored offset follows the contiguous commit, poison goes to the error sink, a
restart resumes after the stored offset and re-reads what was in flight."""

import json
import os

import pytest

import ackflow
from ackflow.core.errors import ConfigError
from ackflow.core.policy import RetryPolicy
from ackflow.sinks import Memory
from ackflow.sources import RabbitMQStream
from amqp import names, stream_publish
from helpers import FAST

pytestmark = pytest.mark.spark


def source(server, stream, consumer="c1", **kw):
    return RabbitMQStream(
        "127.0.0.1",
        server.stream_port,
        stream,
        consumer,
        policy=RetryPolicy(max_deliveries=2, backoff_s=0.05),
        **kw,
    )


def open_and_pull(server, stream, n):
    """Open a source by hand (no engine) and pull ``n`` deliveries."""
    src = source(server, stream)
    src.configure(max_inflight=100, error_sink=True)
    src.open()
    got = []
    while len(got) < n:
        got += src.pull(n - len(got), 2.0)
    return src, got


def check(row):
    if row.get("poison"):
        raise ValueError(f"row {row['n']} is poison")
    return row


def test_consumes_commits_and_resumes_after_the_stored_offset(spark, rabbitmq):
    stream = names("s")
    stream_publish(rabbitmq, stream, [json.dumps({"n": i, "poison": i == 7}).encode() for i in range(300)])
    sink, dead = Memory(), Memory("dead")
    src = source(rabbitmq, stream)
    flow = ackflow.Flow(src).map(check, name="check").to(sink).on_error(dead)
    report = ackflow.run(flow, spark=spark, **FAST)
    assert report.acked == 299 and report.dead_lettered == 1
    assert sorted(r["n"] for r in sink.rows) == [i for i in range(300) if i != 7]
    assert [r["message"] for r in dead.rows] == [f"{stream}@7"]
    assert src.committed == 300
    # the same consumer again: nothing new; then only the new messages
    stream_publish(rabbitmq, stream, [json.dumps({"n": i}).encode() for i in range(300, 320)])
    sink2 = Memory()
    again = ackflow.run(
        ackflow.Flow(source(rabbitmq, stream)).to(sink2).on_error(Memory("dead")), spark=spark, **FAST
    )
    assert again.acked == 20 and sorted(r["n"] for r in sink2.rows) == list(range(300, 320))


def test_in_flight_messages_hold_the_stored_offset_and_are_read_again(rabbitmq):
    """By hand, no Spark: 10 pulled, 1-9 acked, 0 still in flight: nothing is stored;
    a new consumer with the same name starts at 0 again (the recovery race)."""
    stream = names("s")
    stream_publish(rabbitmq, stream, [json.dumps({"n": i}).encode() for i in range(10)])
    src, got = open_and_pull(rabbitmq, stream, 10)
    src.ack(got[1:])
    assert src.committed == 0
    src.close()
    again, got = open_and_pull(rabbitmq, stream, 10)
    assert [d.key for d in got] == [f"{stream}@{i}" for i in range(10)]
    again.ack(got)
    assert again.committed == 10
    again.close()


def test_needs_an_error_sink_and_an_existing_stream(rabbitmq):
    with pytest.raises(ConfigError, match="on_error"):
        s = source(rabbitmq, "x")
        s.configure(max_inflight=10, error_sink=False)
        s.open()
    with pytest.raises(ConfigError, match="does not exist"):
        s = source(rabbitmq, names("missing"))
        s.configure(max_inflight=10, error_sink=True)
        s.open()


def test_messages_waiting_for_a_retry_count_against_the_window(rabbitmq):
    """A sink failing everything: failed messages wait for their retry with their bodies.
    Before, their credit returned at once and new messages kept coming: memory grew with
    throughput x backoff. Now bodies held stay within the window."""
    import time

    from ackflow.core.ledger import Failure

    stream = names("s")
    stream_publish(rabbitmq, stream, [json.dumps({"n": i}).encode() for i in range(300)])
    src = RabbitMQStream(
        "127.0.0.1", rabbitmq.stream_port, stream, "c1", policy=RetryPolicy(max_deliveries=50, backoff_s=30)
    )
    src.configure(max_inflight=20, error_sink=True)
    src.open()
    try:
        deadline = time.monotonic() + 5
        pulled = 0
        while time.monotonic() < deadline:
            got = src.pull(20, 0.05)
            pulled += len(got)
            src.fail([(d, Failure("sink", "down")) for d in got])
            assert len(src._bodies) <= 20
        assert pulled == 20  # the window was filled once, then nothing new while they wait
    finally:
        src.close()


def _publish_once(server, stream, ns):
    """Publish after a broker start: the stream takes a moment to come back."""
    from rstream.exceptions import ServerError

    try:
        stream_publish(server, stream, [json.dumps({"n": i}).encode() for i in ns])
        return True
    except (ServerError, OSError):
        return False


def gauge(engine):
    return engine.metrics.registry.get_sample_value("ackflow_source_connected")


def _stored_offset(server, stream, consumer):
    import asyncio

    from rstream import Consumer

    async def go():
        async with Consumer("127.0.0.1", server.stream_port, username="guest", password="guest") as c:
            return await c.query_offset(stream, consumer)

    return asyncio.run(go())


def test_a_broker_restart_with_messages_in_flight_loses_and_repeats_nothing(rabbitmq, tmp_path):
    """Issue 27 #9: the stream source had no recovery: after a broker restart new messages
    sat unread, nothing was logged, ``connected`` stayed True and the run ended "idle".
    Now it reconnects with backoff from the committed offset: a batch held across the
    restart settles, the messages published during and after it are read, each message
    is written once, and the stored offset is the contiguous committed one."""
    import collections
    import threading

    from ackflow.engine.loop import Engine
    from helpers import wait_until

    stream, gate = names("s"), tmp_path / "restarted"
    first, total = 600, 900
    stream_publish(rabbitmq, stream, [json.dumps({"n": i}).encode() for i in range(first)])

    def hold(r, gate=str(gate)):  # the batch holding message 250 waits for the restart
        import os
        import time

        if r["n"] == 250:
            deadline = time.monotonic() + 90
            while not os.path.exists(gate) and time.monotonic() < deadline:
                time.sleep(0.02)
        return r

    src = RabbitMQStream(
        "127.0.0.1",
        rabbitmq.stream_port,
        stream,
        "c1",
        policy=RetryPolicy(max_deliveries=3, backoff_s=0.05),
        reconnect_max_s=1.0,
    )
    sink = Memory()
    engine = Engine(
        ackflow.Flow(src).map(hold, name="hold").to(sink).on_error(Memory("dead")),
        executor="local",
        batch_size=50,
        max_inflight=200,
        batch_timeout_s=0.05,
        until_idle=1.0,
        handle_signals=False,
    )
    outcome, seen = {}, {}
    runner = threading.Thread(target=lambda: outcome.update(report=engine.run()), daemon=True)
    runner.start()
    try:
        assert wait_until(lambda: src.committed >= 200 and engine.window.in_flight > 0, timeout=60), (
            "the run did not reach message 250"
        )
        rabbitmq.stop()
        assert wait_until(lambda: not src.connected, timeout=30), "the loss went unnoticed"
        seen["down"] = wait_until(lambda: gauge(engine) == 0, timeout=10)
        rabbitmq.start()
        assert wait_until(
            lambda: _publish_once(rabbitmq, stream, range(first, total)), timeout=60, every=0.5
        ), "the stream did not come back"
        gate.touch()
        assert wait_until(lambda: src.connected, timeout=60), "no reconnection"
    finally:
        gate.touch()
        runner.join(120)
    assert not runner.is_alive()
    report = outcome["report"]
    counts = collections.Counter(r["n"] for r in sink.rows)
    assert sorted(counts) == list(range(total)), "messages missing"
    assert max(counts.values()) == 1, [n for n, c in counts.items() if c > 1][:10]
    assert report.acked == total and report.dead_lettered == 0
    # offsets are the log's (a restart can leave some that no message holds: gaps)
    committed = src.committed
    assert committed >= total and committed == src.status()["last_offset_received"] + 1
    assert src.reconnects >= 1
    assert seen["down"], "ackflow_source_connected stayed 1 while the broker was down"
    assert gauge(engine) == 1
    assert _stored_offset(rabbitmq, stream, "c1") == committed - 1


def test_a_deleted_stream_stops_the_run_with_one_line(rabbitmq):
    """Issue 27 #9: a stream deleted under the consumer: the source reconnects, finds it
    missing, and after gone_timeout_s stops with SourceGone naming the stream."""
    import asyncio
    import time

    from rstream import Producer

    from ackflow.core.errors import SourceGone

    stream = names("s")
    stream_publish(rabbitmq, stream, [json.dumps({"n": i}).encode() for i in range(5)])
    src = RabbitMQStream(
        "127.0.0.1", rabbitmq.stream_port, stream, "c1", reconnect_max_s=0.2, gone_timeout_s=1.0
    )
    src.configure(max_inflight=10, error_sink=True)
    src.open()
    try:
        got = []
        while len(got) < 5:
            got += src.pull(5, 2.0)
        src.ack(got)

        async def delete():
            async with Producer("127.0.0.1", rabbitmq.stream_port, username="guest", password="guest") as p:
                await p.delete_stream(stream)

        asyncio.run(delete())
        deadline = time.monotonic() + 30
        with pytest.raises(SourceGone, match=f"stream '{stream}' does not exist"):
            while time.monotonic() < deadline:
                src.pull(5, 0.1)
        assert not src.connected
    finally:
        src.close()


PULLED = {}


class CountingStream(RabbitMQStream):
    def pull(self, max_messages, timeout):
        got = super().pull(max_messages, timeout)
        for d in got:
            PULLED[d.key] = PULLED.get(d.key, 0) + 1
        return got


def fails_on_first_delivery(row):
    if PULLED[row["key"]] == 1:
        raise ConnectionError("a transient failure")
    return row


def test_an_idle_run_waits_for_the_retries_the_stream_holds(rabbitmq):
    """A retry's backoff (1 s) longer than until_idle (0.3 s): before, the run ended as
    idle with the failed message waiting in memory (never retried in that run, its offset
    left uncommitted); now it is retried and acked, and the offset committed."""
    from ackflow.engine.loop import Engine

    stream = names("s")
    stream_publish(rabbitmq, stream, [json.dumps({"key": f"{stream}@{i}"}).encode() for i in range(3)])
    src = CountingStream(
        "127.0.0.1", rabbitmq.stream_port, stream, "c1", policy=RetryPolicy(max_deliveries=3, backoff_s=1.0)
    )
    sink = Memory()
    report = Engine(
        ackflow.Flow(src).map(fails_on_first_delivery, name="flaky").to(sink).on_error(Memory("dead")),
        executor="local",
        until_idle=0.3,
        batch_timeout_s=0.05,
        handle_signals=False,
    ).run()
    assert report.nacked == 3 and report.acked == 3 and len(sink.rows) == 3
    assert src.committed == 3 and _stored_offset(rabbitmq, stream, "c1") == 2


def test_a_frozen_broker_is_a_lost_connection(rabbitmq):
    """A broker that stops answering without closing the socket (SIGSTOP: what a frozen
    host or a half-open TCP connection looks like): rstream only logs missing heartbeats
    and waits for ever; the source counts three silent heartbeat intervals as a lost
    connection, reconnects once the broker answers, and reads on."""
    import signal
    import time

    from helpers import wait_until

    stream = names("s")
    stream_publish(rabbitmq, stream, [json.dumps({"n": i}).encode() for i in range(5)])
    src = RabbitMQStream("127.0.0.1", rabbitmq.stream_port, stream, "c1", heartbeat_s=1, reconnect_max_s=0.5)
    src.configure(max_inflight=50, error_sink=True)
    src.open()
    got = []
    try:
        deadline = time.monotonic() + 20
        while len(got) < 5 and time.monotonic() < deadline:
            got += src.pull(5, 0.5)
        src.ack(got)
        os.killpg(rabbitmq.proc.pid, signal.SIGSTOP)
        try:
            assert wait_until(lambda: src.pull(5, 0.1) == [] and not src.connected, timeout=30, every=0.1), (
                "a silent broker went unnoticed"
            )
        finally:
            os.killpg(rabbitmq.proc.pid, signal.SIGCONT)
        assert wait_until(lambda: src.pull(5, 0.1) == [] and src.connected, timeout=60, every=0.1), (
            "no reconnection"
        )
        stream_publish(rabbitmq, stream, [json.dumps({"n": i}).encode() for i in range(5, 8)])
        more = []
        deadline = time.monotonic() + 20
        while len(more) < 3 and time.monotonic() < deadline:
            more += src.pull(3, 0.5)
        assert [json.loads(d.body)["n"] for d in more] == [5, 6, 7]
        assert src.reconnects >= 1
    finally:
        src.close()
