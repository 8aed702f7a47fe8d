"""The RabbitMQ source in blocks (issue 32): the first deliveries of one pull are one
delivery on the driver (rabbitmq_blocks), one input row per message in the job. Against a
real broker: a failing message fails alone and counts add up (classic and quorum); a
connection lost with blocks in flight, or with a block's acks held, loses and doubles
nothing and counts each message once; a split block's deliveries come one by one on the
same channel, without spending a delivery; a stop gives every block's messages back."""

import json
import signal
import threading
import time

import pytest

import ackflow
from ackflow import faults
from ackflow.core.policy import RetryPolicy
from ackflow.core.settlement import Settlement
from ackflow.sinks import Memory
from ackflow.sources import RabbitMQ
from ackflow.testing import KeyedSink
from amqp import count, names, publish_many, setup
from helpers import CountingPulls, must_be_positive
from helpers import run_local as run

KINDS = {"classic": {"x-queue-type": "classic"}, "quorum": {"x-queue-type": "quorum", "x-delivery-limit": 5}}


#: set by slow_check's first row (the in-process executor runs it in this process)
STARTED = threading.Event()


def slow_check(row):
    STARTED.set()
    time.sleep(0.05)
    return must_be_positive(row)


class Counting(CountingPulls, RabbitMQ):
    pulls: list = []


def load(url, kind, n, bad=()):
    q = names(f"blk-{kind}")
    setup(url, queue=q, arguments={**KINDS[kind], "x-dead-letter-exchange": "ackflow-tests-dlx"})
    publish_many(url, q, [{"n": -i if i in bad else i} for i in range(n)], ids=[f"m{i}" for i in range(n)])
    return q


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_bad_message_fails_alone_and_counts_add_up(rabbitmq, kind):
    bad = {3, 500, 1999}
    q = load(rabbitmq.url, kind, 2000, bad)
    Counting.pulls = []
    sink, dead = KeyedSink(), Memory("dead")
    src = Counting(rabbitmq.url, q, policy=RetryPolicy(max_deliveries=2, backoff_s=0.01))
    flow = ackflow.Flow(src).map(must_be_positive, name="check").to(sink).on_error(dead)
    report = run(flow, until_idle=1.0)
    assert max(Counting.pulls) > 1, "blocks were used"
    assert report.acked == 1997 and report.dead_lettered == 3 and report.nacked == 3
    assert report.split >= 1
    assert report.pulled == report.acked + report.nacked + report.dead_lettered + report.split
    assert report.rows_written["keyed"] == 1997  # a split block's rows counted once
    assert sorted(r["n"] for r in sink.rows.values()) == [i for i in range(2000) if i not in bad]
    assert not sink.conflicts
    assert sorted(json.loads(r["body"])["n"] for r in dead.rows) == sorted(-i for i in bad)
    assert count(rabbitmq.url, q) == 0


def test_no_blocks_for_a_sink_that_appends(rabbitmq):
    q = load(rabbitmq.url, "classic", 300, {5})
    Counting.pulls = []
    src = Counting(rabbitmq.url, q, policy=RetryPolicy(max_deliveries=1))
    report = run(ackflow.Flow(src).map(must_be_positive).to(Memory()).on_error(Memory("dead")))
    assert set(Counting.pulls) == {1}
    assert report.acked == 299


@pytest.mark.parametrize("point", ["rabbitmq.ack", "source.reconnect"])
def test_a_connection_lost_while_blocks_are_acked_loses_and_doubles_nothing(rabbitmq, point):
    """The first ack of a block loses the connection (the fault point raises inside the
    broker call): the block and every block in flight come again from the broker; each
    message is written once (in place) and acked once in the report."""
    q = load(rabbitmq.url, "classic", 3000)
    Counting.pulls = []
    sink = KeyedSink()
    src = Counting(rabbitmq.url, q)
    flow = ackflow.Flow(src).map(must_be_positive, name="check").to(sink).on_error(Memory("dead"))
    faults.arm("rabbitmq.ack", "raise", nth=2)
    if point == "source.reconnect":  # and the first reconnection fails too
        faults.arm("source.reconnect", "raise")
    try:
        report = run(flow, until_idle=2.0)
    finally:
        faults.disarm()
    assert max(Counting.pulls) > 1
    assert report.redelivered >= 1  # the lost channel's messages came again
    assert report.acked == 3000 and report.dead_lettered == 0
    assert sorted(r["n"] for r in sink.rows.values()) == list(range(3000))
    assert not sink.conflicts
    assert count(rabbitmq.url, q) == 0


def opened(url, q, window=100):
    src = RabbitMQ(url, q, reject_to_dlx=True)
    src.configure(max_inflight=window, error_sink=False)
    assert src.use_blocks(True)
    src.open()
    return src


def pull_messages(src, n, timeout=15.0):
    import time

    got, deadline = [], time.monotonic() + timeout
    while sum(d.messages for d in got) < n and time.monotonic() < deadline:
        got += src.pull(n - sum(d.messages for d in got), 0.2)
    return got


def test_a_killed_consumer_with_a_block_in_flight_hands_back_the_block_and_counts_its_messages(rabbitmq):
    q = load(rabbitmq.url, "classic", 40)
    src = opened(rabbitmq.url, q)
    try:
        got = pull_messages(src, 40)
        blocks = [d for d in got if d.messages > 1]
        assert blocks and sum(d.messages for d in got) == 40
        src._conn._proc.send_signal(signal.SIGKILL)
        src._conn._proc.wait(timeout=10)
        first = got[0]
        first.settle(Settlement.ACKED)
        stale = src.ack([first])  # finds the channel gone
        assert stale == [first] and src.unacked(first) == first.messages
        lost = src.take_lost()
        assert {id(d) for d in lost} == {id(d) for d in got[1:]}  # the engine's deliveries
        again = pull_messages(src, 40)
        assert sorted(x.key for d in again for x in (d.handle if d.parts else [d])) == sorted(
            f"m{i}" for i in range(40)
        )
        assert all(d.delivery_count == 2 for d in again)  # redelivered: none in a block
        assert src.ack(again) == []
    finally:
        src.close()
    assert count(rabbitmq.url, q) == 0


def test_held_acks_of_a_block_that_never_reached_the_broker_are_counted_per_message(rabbitmq):
    q = load(rabbitmq.url, "classic", 30)
    src = opened(rabbitmq.url, q)
    src.block_size.now = 10
    try:
        got = pull_messages(src, 30)
        assert [d.messages for d in got] == [10, 10, 10]
        for d in got[1:]:
            d.settle(Settlement.ACKED)
        assert src.ack(got[1:]) == []  # younger than got[0]: held
        faults.arm("rabbitmq.nack", "raise")
        src.release([got[0]])  # the nack loses the connection: the held acks never went
        faults.disarm()
        unsent = src.take_unsent_acks()
        assert {id(d) for d in unsent} == {id(got[1]), id(got[2])}
        assert [src.unacked(d) for d in unsent] == [10, 10]
    finally:
        faults.disarm()
        src.close()
    assert count(rabbitmq.url, q) == 30  # all of them back in the queue


def test_a_split_block_comes_again_one_by_one_and_a_release_gives_back_every_message(rabbitmq):
    q = load(rabbitmq.url, "quorum", 20)
    src = opened(rabbitmq.url, q)
    src.block_size.now = 20
    try:
        (block,) = pull_messages(src, 20)
        assert block.messages == 20
        src.split([block])
        assert src.block_size.now == 10
        singles = pull_messages(src, 20)
        assert [d.messages for d in singles] == [1] * 20
        assert sorted(d.key for d in singles) == sorted(f"m{i}" for i in range(20))
        assert all(d.delivery_count == 1 for d in singles)  # no delivery spent by the split
        for d in singles:
            d.settle(Settlement.ACKED)
        assert src.ack(singles[:5]) == []
        src.release(singles[5:])
        src.pull(1, 0.2)  # the due nacks (give-backs) go out
    finally:
        src.close()
    assert count(rabbitmq.url, q) == 15  # given back, never lost


def test_a_stop_gives_back_every_message_of_the_blocks_in_flight(rabbitmq):
    q = load(rabbitmq.url, "quorum", 600)
    src = opened(rabbitmq.url, q, window=600)
    try:
        got = pull_messages(src, 600)
        assert max(d.messages for d in got) > 1
        left = src.stop_consuming()
        src.release([*got, *left])
        src.pull(1, 0.2)
    finally:
        src.close()
    assert count(rabbitmq.url, q) == 600


def test_acks_of_single_messages_grow_the_block_size_again():
    """After splits halved it to 1 (no blocks), acks of single deliveries earn it back."""
    from ackflow.core.settlement import Delivery

    src = RabbitMQ("amqp://127.0.0.1:1/", "q", reject_to_dlx=True)
    assert src.use_blocks(True)
    src.block_size.split(16)
    assert src.block_size.now == 1
    src.ack([Delivery(0, f"k{i}", b"", handle=(0, i)) for i in range(4)])
    assert src.block_size.now == 2


def test_no_blocks_where_a_give_back_could_spend_a_last_delivery_or_headers_are_carried():
    assert not RabbitMQ("amqp://127.0.0.1:1/", "q", reject_to_dlx=True, delivery_limit=0).use_blocks(True)
    assert not RabbitMQ("amqp://127.0.0.1:1/", "q", reject_to_dlx=True, headers_field="meta").use_blocks(True)
    assert not RabbitMQ("amqp://127.0.0.1:1/", "q", reject_to_dlx=True).use_blocks(False)


def test_no_blocks_on_a_queue_whose_delivery_limit_below_1_is_learned_at_the_start(rabbitmq):
    """The engine asks for blocks before open(), which learns the queue's x-delivery-limit:
    a block given back there would cost each message its last delivery (the broker drops
    it), where single messages are dead-lettered knowingly."""
    q = names("lim0")
    setup(rabbitmq.url, queue=q, arguments={"x-queue-type": "quorum", "x-delivery-limit": 0})
    publish_many(rabbitmq.url, q, [{"n": i} for i in range(20)], ids=[f"m{i}" for i in range(20)])
    src = RabbitMQ(rabbitmq.url, q)
    src.configure(max_inflight=100, error_sink=True)
    assert src.use_blocks(True) and src.delivery_limit is None  # not known yet
    src.open()
    try:
        assert src.delivery_limit == 0
        got = pull_messages(src, 20)
        assert [d.messages for d in got] == [1] * 20
        assert len(src.unreleasable(got)) == 20  # the engine dead-letters them knowingly
    finally:
        src.close()


def test_a_block_split_in_the_stops_drain_is_released_not_left_to_the_channels_close(rabbitmq):
    from ackflow.engine.loop import Engine

    q = load(rabbitmq.url, "quorum", 40, {7})
    STARTED.clear()

    src = RabbitMQ(rabbitmq.url, q)
    flow = ackflow.Flow(src).map(slow_check, name="check").to(KeyedSink()).on_error(Memory("dead"))
    engine = Engine(
        flow, handle_signals=False, executor="local", batch_size=500, max_inflight=2000, linger_s=0.3
    )
    threading.Thread(target=lambda: STARTED.wait(60) and engine.request_stop(), daemon=True).start()
    report = engine.run()
    assert report.split == 40 and report.acked == 0  # the block failed in the drain
    assert report.released == 40  # its messages given back at the stop, and counted
    assert (
        report.pulled == report.acked + report.nacked + report.dead_lettered + report.released + report.split
    )
    assert src.stats["nacks"] == 40
    assert count(rabbitmq.url, q) == 40
