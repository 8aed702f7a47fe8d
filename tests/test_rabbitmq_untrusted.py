"""RabbitMQ source: producers' headers are untrusted, identity is never the body, and a
connection lost at any broker call is a lost connection (deliveries come back), never a
crash. Driver-side against a real broker (no Spark)."""

import datetime
import decimal
import json
import time

import pika
import pytest

from ackflow import faults
from ackflow.core.ledger import Failure
from ackflow.core.policy import RetryPolicy
from ackflow.core.settlement import Settlement
from ackflow.sources import RabbitMQ
from amqp import connect, count, drain, names, publish, setup

DLX = {"x-dead-letter-exchange": "ackflow-tests-dlx"}  # reject_to_dlx needs one


def pull_all(src, n, timeout=10.0):
    import time

    got, deadline = [], time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got += src.pull(n - len(got), 0.2)
    return got


def publish_raw(url, queue, messages):
    conn = connect(url)
    ch = conn.channel()
    ch.confirm_delivery()
    for body, props in messages:
        ch.basic_publish("", queue, body, props)
    conn.close()


@pytest.fixture(params=["process", "inline"])
def opened(rabbitmq, request):
    """Open a source, with pika in its consumer process and in the driver (both paths)."""
    made = []

    def make(q, **kw):
        src = RabbitMQ(rabbitmq.url, q, consumer=request.param, **kw)
        src.configure(max_inflight=100, error_sink=False)
        src.open()
        made.append(src)
        return src

    yield make
    faults.disarm()
    for s in made:
        s.close()


def test_hostile_header_values_never_raise_and_rows_get_text(rabbitmq, opened):
    q = names("hdr")
    setup(rabbitmq.url, queue=q, arguments=DLX)
    hostile = [
        {"x-delivery-count": "n/a"},
        {"x-delivery-count": b"\xff\xfe"},
        {"x-delivery-count": -5, "x-death": "not a list"},
        {"x-delivery-count": 10**12},
        {"x-delivery-count": True},
        {"nested": {"a": [1, b"\x00", {"b": None}]}, "dec": decimal.Decimal("1.5")},
        {"when": datetime.datetime(2026, 1, 1), "bin": b"\xc3\x28", "big": "x" * 100_000},
    ]
    publish_raw(
        rabbitmq.url,
        q,
        [(b'{"n": 1}', pika.BasicProperties(headers=h, message_id=f"m{i}")) for i, h in enumerate(hostile)],
    )
    src = opened(q, reject_to_dlx=True)
    got = pull_all(src, len(hostile))  # before: ValueError out of pull()
    assert len(got) == len(hostile)
    for d in got:
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in d.headers.items())
        json.dumps(d.headers)  # JSON-safe for headers_field
        assert d.delivery_count == 1  # bad counts are ignored, not trusted
    src.ack(got)
    assert count(rabbitmq.url, q) == 0


def test_identical_bodies_without_message_id_are_distinct_messages(rabbitmq, opened):
    q = names("same")
    setup(rabbitmq.url, queue=q, arguments=DLX)
    publish(rabbitmq.url, q, [{"n": 1}, {"n": 1}])
    src = opened(q, reject_to_dlx=True)
    got = pull_all(src, 2)
    assert len({d.key for d in got}) == 2  # before: both "sha256:<same digest>"
    assert all(d.key.startswith("delivery:") for d in got)
    src.ack(got)


def test_identical_bodies_still_share_a_retry_count_on_a_classic_queue(rabbitmq, opened):
    """Without a message id the identity is per delivery, but a poison body must still
    reach max_deliveries (counted by a digest of the body)."""
    q = names("cnt")
    setup(rabbitmq.url, queue=q, arguments=DLX)
    publish(rabbitmq.url, q, [{"poison": True}])
    src = opened(q, reject_to_dlx=True, policy=RetryPolicy(max_deliveries=3, backoff_s=0.0))
    counts = []
    for _ in range(3):
        (d,) = pull_all(src, 1)
        counts.append(d.delivery_count)
        src.fail([(d, Failure("parse", "bad"))])
    assert counts == [1, 2, 3]


@pytest.mark.parametrize("point", ["rabbitmq.nack", "rabbitmq.dead_letter", "rabbitmq.ack"])
def test_a_connection_lost_at_each_broker_call_is_a_lost_connection(rabbitmq, opened, point):
    """fail() with one retry and one give-up: before, a nack losing the connection made the
    dead-letter publish raise AttributeError. Now: no exception; what the dead channel
    held is RELEASED (or handed back by take_lost) and comes again from the broker."""
    q, dlx, dead_q = names("loss"), names("dlx"), names("dead")
    setup(rabbitmq.url, queue=q, dlx=dlx, dead_queue=dead_q)
    publish(rabbitmq.url, q, [{"n": i} for i in range(4)], ids=[f"k{i}" for i in range(4)])
    src = opened(q, dead_letter_exchange=dlx, policy=RetryPolicy(max_deliveries=2, backoff_s=0.0))
    got = sorted(pull_all(src, 4), key=lambda d: d.key)
    got[1].delivery_count = 2  # given up if it fails now
    faults.arm(point, "raise")
    if point == "rabbitmq.ack":
        # younger than k0 and k1: held until they are settled, so the broker call that
        # loses the connection is the ack sent when fail() settles them, not this one
        assert src.ack(got[2:]) == [] and faults.hits(point) == 0
    states = src.fail([(got[0], Failure("s", "e")), (got[1], Failure("s", "e"))])
    if point == "rabbitmq.ack":
        src.pull(1, 0.1)  # the due nack of k0 frees the held acks: they go now
    assert faults.hits(point) >= 1
    if point != "rabbitmq.ack":
        assert Settlement.RELEASED in states  # the dead channel's deliveries come back
    lost = {d.key for d in src.take_lost()}
    settled = {d.key for d, s in zip(got[:2], states, strict=True) if s is not Settlement.RELEASED}
    assert settled.isdisjoint(lost) or point == "rabbitmq.nack"
    # the source reconnects and the broker delivers again everything not settled
    again = pull_all(src, 4, timeout=15)
    assert {d.key for d in again} >= {"k2", "k3"} if point == "rabbitmq.ack" else again
    src.ack(again)


def test_delayed_nacks_settle_nothing_on_a_dead_channel(rabbitmq, opened):
    q = names("delay")
    setup(rabbitmq.url, queue=q, arguments=DLX)
    publish(rabbitmq.url, q, [{"n": 1}], ids=["d1"])
    src = opened(q, reject_to_dlx=True, policy=RetryPolicy(max_deliveries=5, backoff_s=0.2))
    (d,) = pull_all(src, 1)
    assert src.fail([(d, Failure("s", "e"))]) == [Settlement.NACKED]
    src._lose_connection(OSError("cut"))  # the channel dies while the nack waits
    (again,) = pull_all(src, 1, timeout=15)  # no crash in the due nack; the broker redelivers
    assert again.key == "d1"
    src.ack([again])


def test_the_sink_timeout_is_on_confirm_progress_not_one_deadline(rabbitmq):
    """A partition that takes longer than timeout_s in all, while confirms keep coming, is
    written whole (before: its tail failed at the absolute deadline). The timeout is 1 s
    (CI once saw a 0.3 s gap between two confirms on two busy cores) and the partition
    takes about 3.6 s on an idle machine."""
    import time

    from ackflow.sinks.rabbitmq import publish_confirmed

    q = names("slow")
    setup(rabbitmq.url, queue=q, arguments=DLX)
    msgs = [(q, b"x" * 200, pika.BasicProperties(delivery_mode=2, message_id=f"s{i}")) for i in range(30_000)]
    started = time.monotonic()
    failed = publish_confirmed(rabbitmq.url, "", msgs, window=200, timeout_s=1.0)
    took = time.monotonic() - started
    assert took > 1.0, f"the partition was too fast to show anything ({took:.2f} s); raise its size"
    assert failed == {}
    assert count(rabbitmq.url, q) == 30_000


def test_reject_to_dlx_on_a_queue_without_a_dead_letter_exchange_is_refused(rabbitmq):
    from ackflow.core.errors import ConfigError

    plain, with_dlx = names("plain"), names("withdlx")
    setup(rabbitmq.url, queue=plain)
    setup(rabbitmq.url, queue=with_dlx, arguments=DLX)
    src = RabbitMQ(rabbitmq.url, plain, reject_to_dlx=True)
    src.configure(max_inflight=10, error_sink=False)
    with pytest.raises(ConfigError, match="has no x-dead-letter-exchange"):
        src.open()  # before: opened, and poison messages were dropped on reject
    ok = RabbitMQ(rabbitmq.url, with_dlx, reject_to_dlx=True)
    ok.configure(max_inflight=10, error_sink=False)
    ok.open()
    ok.close()
    trusted = RabbitMQ(rabbitmq.url, plain, reject_to_dlx=True, dlx_by_policy=True)
    trusted.configure(max_inflight=10, error_sink=False)
    trusted.open()
    trusted.close()
    assert count(rabbitmq.url, plain) == 0  # the probe declared nothing new


def open_source(url, q, **kw):
    src = RabbitMQ(url, q, **kw)
    src.configure(max_inflight=10, error_sink=False)
    src.open()
    return src


def test_a_dead_letter_route_is_proven_at_start_or_the_run_stops(rabbitmq):
    """Issue 27 #2: the probe read any refusal not naming x-dead-letter-exchange as "it
    has one" (a queue with x-message-ttl, a non-durable queue), and never checked that
    the exchange exists or routes anywhere: poison was rejected into nothing."""
    from ackflow.core.errors import ConfigError

    url = rabbitmq.url
    conn = connect(url)
    ch = conn.channel()
    ttl, transient = names("ttl"), names("transient")
    ch.queue_declare(ttl, durable=True, arguments={"x-message-ttl": 60_000})
    ch.queue_declare(transient, durable=False, auto_delete=False)
    missing, unbound, unbound_q = names("missing"), names("unbound"), names("unboundq")
    ch.exchange_declare(unbound, "direct", durable=True)
    ch.queue_declare(missing, durable=True, arguments={"x-dead-letter-exchange": names("gone")})
    ch.queue_declare(
        unbound_q, durable=True, arguments={"x-message-ttl": 60_000, "x-dead-letter-exchange": unbound}
    )
    conn.close()
    for q, why in [
        (ttl, "has no x-dead-letter-exchange"),
        (transient, "has no x-dead-letter-exchange"),
        (missing, r"dead letters would be lost: .*gone-.* does not exist"),
        (unbound_q, "routes routing key .* to no queue"),
    ]:
        with pytest.raises(ConfigError, match=why):
            open_source(url, q, reject_to_dlx=True).close()
    with pytest.raises(ConfigError, match="does not exist"):  # ackflow's own copies too
        open_source(url, ttl, dead_letter_exchange=names("nowhere")).close()
    with pytest.raises(ConfigError, match="to no queue"):
        open_source(url, ttl, dead_letter_exchange=unbound).close()

    # present and bound (with arguments ackflow was not told about): a poison message
    # rejected after its last delivery reaches the dead-letter queue
    q, dlx, dlq = names("bound"), names("dlx"), names("dlq")
    setup(
        url,
        queue=q,
        arguments={"x-message-ttl": 60_000, "x-max-length": 1000, "x-dead-letter-exchange": dlx},
        dlx=dlx,
        dead_queue=dlq,
    )
    publish(url, q, [{"poison": 1}], ids=["p1"])
    src = open_source(url, q, reject_to_dlx=True, policy=RetryPolicy(max_deliveries=1))
    try:
        (d,) = pull_all(src, 1)
        assert src.fail([(d, Failure("parse", "bad"))]) == [Settlement.DEAD_LETTERED]
        deadline = time.monotonic() + 10
        while count(url, dlq) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [m[0] for m in drain(url, dlq)] == ["p1"]  # the probe expired, unseen
    finally:
        src.close()


def pulled_in_order(rabbitmq, opened, prefix, n):
    """A fresh queue of ``n`` messages k0..k(n-1), all pulled by a new source, in order."""
    q = names(prefix)
    setup(rabbitmq.url, queue=q, arguments=DLX)
    publish(rabbitmq.url, q, [{"n": i} for i in range(n)], ids=[f"k{i}" for i in range(n)])
    src = opened(q, reject_to_dlx=True)
    return q, src, sorted(pull_all(src, n), key=lambda d: d.key)


def test_acks_of_younger_messages_wait_for_the_older_then_go_in_one_frame(rabbitmq, opened):
    """A younger batch finished first: before, each of its acks went as a frame of its
    own (10 000 frames for a batch of 10 000). Now they wait for the older messages and
    all go in one ``multiple=True`` frame."""
    q, src, got = pulled_in_order(rabbitmq, opened, "hold", 6)
    assert src.ack(got[2:]) == []
    src.pull(1, 0.1)
    assert src.stats["acks"] + src.stats["multiple_acks"] == 0  # held: k0 and k1 are not done
    assert src.ack(got[:2]) == []
    assert (src.stats["multiple_acks"], src.stats["acks"]) == (1, 0)
    src.close()
    assert count(rabbitmq.url, q) == 0


def test_held_acks_go_one_by_one_once_the_hold_is_over(rabbitmq, opened, monkeypatch):
    from ackflow.sources import rabbitmq as rmq

    monkeypatch.setattr(rmq, "ACK_HOLD_S", 0.2)
    q, src, got = pulled_in_order(rabbitmq, opened, "hold1", 4)
    src.ack(got[2:])
    time.sleep(0.3)
    src.pull(1, 0.1)  # the owner's service sends them
    assert src.stats["acks"] == 2 and src.stats["multiple_acks"] == 0
    src.close()  # k0 and k1 were never acked: the broker has them again
    assert count(rabbitmq.url, q) == 2


def test_held_acks_of_a_dead_channel_are_delivered_again(rabbitmq, opened):
    q, src, got = pulled_in_order(rabbitmq, opened, "hold2", 3)
    src.ack(got[1:])
    src._lose_connection(OSError("cut"))  # before k0 settles
    assert src.stats["unsent_acks"] == 2
    assert [d.key for d in src.take_unsent_acks()] == ["k1", "k2"]  # the engine uncounts
    assert src.take_unsent_acks() == []
    again = pull_all(src, 3, timeout=15)  # written, but the broker never heard: again
    assert {d.key for d in again} == {"k0", "k1", "k2"}
    src.ack(again)
    src.close()
    assert count(rabbitmq.url, q) == 0


def test_held_acks_are_sent_at_close(rabbitmq, opened):
    """A run that stops while acks are held (their older messages never settled) sends
    them before the connection closes: the written messages do not come again."""
    q, src, got = pulled_in_order(rabbitmq, opened, "hold3", 4)
    src.ack(got[2:])
    assert src.stats["acks"] + src.stats["multiple_acks"] == 0
    src.close()
    assert src.stats["acks"] == 2
    assert count(rabbitmq.url, q) == 2  # only k0 and k1, never acked, are back in the queue


def test_a_dead_letter_carries_the_producers_message_id(rabbitmq, opened):
    """Keys escape producer ids that look like ackflow's ("id:7" is keyed "id:id:7");
    the dead letter must carry the id the producer gave, or a replay is a new message."""
    q, dlx, dead = names("ids"), names("dlx"), names("dead")
    setup(rabbitmq.url, queue=q, dlx=dlx, dead_queue=dead)
    publish(rabbitmq.url, q, [{"n": 1}, {"n": 2}, {"n": 3}], ids=["id:7", "delivery:x", "o-1"])
    src = opened(q, dead_letter_exchange=dlx, policy=RetryPolicy(max_deliveries=1))
    got = pull_all(src, 3)
    assert sorted(d.key for d in got) == ["id:delivery:x", "id:id:7", "o-1"]
    src.fail([(d, Failure("check", "no")) for d in got])
    assert sorted(m for m, _, _ in drain(rabbitmq.url, dead)) == ["delivery:x", "id:7", "o-1"]


def test_the_sink_fails_a_row_without_its_message_id(rabbitmq):
    """A null message_id_column value was published as the id "None", shared by every
    such row (a consumer dropping repeated ids kept one)."""
    import pyarrow as pa

    from ackflow.sinks import RabbitMQ as RabbitMQSink
    from ackflow.sinks.base import ROW_KEY

    q = names("out")
    setup(rabbitmq.url, queue=q, arguments=DLX)
    sink = RabbitMQSink(rabbitmq.url, "", routing_key=q, message_id_column="order_id")
    rows = pa.table({"order_id": ["a", None, "", "b"], ROW_KEY: ["k0", "k1", "k2", "k3"]})
    result = sink.write_partition("b1", 0, rows)
    assert sorted(result.failed) == [1, 2]
    assert "message_id_column 'order_id' is empty" in result.failed[1]
    assert sorted(m for m, _, _ in drain(rabbitmq.url, q)) == ["a", "b"]


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_a_window_past_the_prefetch_cap_is_all_in_flight_and_no_more(rabbitmq, queue_type):
    """AMQP's prefetch count stops at 65 535: with one consumer a window of 70 000 was
    filled to 65 535 (and batches were cut smaller). The source splits it over two
    consumers of 35 000: all 70 000 arrive unacked, the 10 past the window do not."""
    from ackflow.sources.rabbitmq_keys import consumer_prefetch
    from amqp import publish_many

    assert consumer_prefetch(65_535) == (1, 65_535)
    assert consumer_prefetch(70_000) == (2, 35_000)
    assert consumer_prefetch(200_001) == (4, 50_000)
    assert consumer_prefetch(10**9)[0] == 16
    window, q = 70_000, names(f"wide-{queue_type}")
    args = {**DLX, "x-queue-type": queue_type}
    setup(rabbitmq.url, queue=q, arguments=args)
    publish_many(
        rabbitmq.url, q, [{"n": i} for i in range(window + 10)], [f"m{i}" for i in range(window + 10)]
    )
    src = RabbitMQ(rabbitmq.url, q, reject_to_dlx=True)
    src.configure(max_inflight=window, error_sink=False)
    src.open()
    try:
        got = pull_all(src, window, timeout=30)  # one consumer stopped at 65 535
        assert len(got) == window
        assert len({d.key for d in got}) == window
        time.sleep(0.5)
        assert src.pull(10, 0.5) == []  # the broker holds the rest: the window is full
        assert src.ack(got) == []
        rest = pull_all(src, 10)  # acks made room
        assert {d.key for d in got + rest} == {f"m{i}" for i in range(window + 10)}
        assert src.ack(rest) == []
    finally:
        src.close()
    assert count(rabbitmq.url, q) == 0


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_a_producers_delivery_count_header_is_never_trusted(rabbitmq, opened, queue_type):
    """Issue 27 #8: a producer's x-delivery-count header of 0 on a classic queue kept a
    poison message alive forever; on a quorum queue a first delivery carries the
    producer's header too (the broker writes it on redeliveries only)."""
    q, dlx, dlq = names("hostile"), names("dlx"), names("dlq")
    args = {"x-queue-type": "quorum"} if queue_type == "quorum" else None
    setup(rabbitmq.url, queue=q, arguments=args, dlx=dlx, dead_queue=dlq)
    header = 0 if queue_type == "classic" else 7
    publish_raw(
        rabbitmq.url,
        q,
        [(b'{"poison": 1}', pika.BasicProperties(headers={"x-delivery-count": header}, message_id="poison"))],
    )
    src = opened(q, dead_letter_exchange=dlx, policy=RetryPolicy(max_deliveries=3, backoff_s=0.0))
    assert src.queue_type == queue_type and src.broker_counts == (queue_type == "quorum")
    counts, outcomes = [], []
    for _ in range(3):
        (d,) = pull_all(src, 1)
        counts.append(d.delivery_count)
        outcomes += src.fail([(d, Failure("parse", "bad"))])
    assert counts == [1, 2, 3]
    assert outcomes == [Settlement.NACKED, Settlement.NACKED, Settlement.DEAD_LETTERED]
    deadline = time.monotonic() + 10
    while count(rabbitmq.url, dlq) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    ((mid, _, headers),) = drain(rabbitmq.url, dlq)
    assert mid == "poison" and headers["x-ackflow-deliveries"] == 3


def test_a_refused_dead_letter_fails_that_message_not_the_connection(rabbitmq, opened):
    """Issue 27 #7: a dead letter the broker refused (basic.nack from a full dead-letter
    queue with x-overflow=reject-publish) was read as a lost connection: the channel was
    rebuilt every ~0.5 s forever and held acks died with it."""
    url = rabbitmq.url
    q, dlx, dlq = names("full"), names("dlx"), names("dlq")
    conn = connect(url)
    ch = conn.channel()
    ch.exchange_declare(dlx, "fanout", durable=True)
    ch.queue_declare(dlq, durable=True, arguments={"x-max-length": 1, "x-overflow": "reject-publish"})
    ch.queue_bind(dlq, dlx)
    ch.queue_declare(q, durable=True)
    conn.close()
    publish(url, dlq, [{"older": "dead letter"}], ids=["old"])  # the DLQ is full
    publish(url, q, [{"poison": 1}, {"ok": 1}], ids=["p1", "g1"])
    src = opened(
        q, dead_letter_exchange=dlx, policy=RetryPolicy(max_deliveries=1, backoff_s=0.2, max_backoff_s=0.2)
    )
    got = sorted(pull_all(src, 2), key=lambda d: d.key)
    good, poison = got
    assert src.ack([good]) == []  # younger than the poison: held until it is settled
    gen = src._gen
    assert src.fail([(poison, Failure("parse", "bad"))]) == [Settlement.NACKED]
    assert src.connected and src._gen == gen  # the same channel: nothing was lost
    assert src.stats["dead_letters_refused"] == 1 and src.stats["lost"] == 0
    assert src.status()["dead_letters_refused"] == 1
    deadline = time.monotonic() + 10
    drain(url, dlq)  # room again: the poison's next try is dead-lettered
    (again,) = pull_all(src, 1)
    assert again.key == "p1"
    assert src.fail([(again, Failure("parse", "bad"))]) == [Settlement.DEAD_LETTERED]
    while count(url, dlq) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [m[0] for m in drain(url, dlq)] == ["p1"]
    assert src.stats["lost"] == 0
    src.close()
    assert count(url, q) == 0  # the held ack of g1 was sent, on the channel it came on
