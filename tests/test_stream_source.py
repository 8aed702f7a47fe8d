"""The RabbitMQ stream source against a real broker (stream plugin on loopback): the
stored offset follows the contiguous commit, poison goes to the error sink, a
restart resumes after the stored offset and re-reads what was in flight."""

import json

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
    return RabbitMQStream("127.0.0.1", server.stream_port, stream, consumer,
                          policy=RetryPolicy(max_deliveries=2, backoff_s=0.05), **kw)


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
    stream_publish(rabbitmq, stream, [json.dumps({"n": i, "poison": i == 7}).encode()
                                      for i in range(300)])
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
    again = ackflow.run(ackflow.Flow(source(rabbitmq, stream)).to(sink2).on_error(Memory("dead")),
                        spark=spark, **FAST)
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
    src = RabbitMQStream("127.0.0.1", rabbitmq.stream_port, stream, "c1",
                         policy=RetryPolicy(max_deliveries=50, backoff_s=30))
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
