"""The RabbitMQ source and publishing sink against a real broker (a throwaway node
on 127.0.0.1): queue to queue with poison, quorum delivery limits, refused and
unroutable publishes, clear errors at start."""

import json
import threading

import pytest

import ackflow
from ackflow.core.errors import ConfigError
from ackflow.core.policy import RetryPolicy
from ackflow.sinks import Memory
from ackflow.sinks import RabbitMQ as RabbitMQSink
from ackflow.sources import RabbitMQ
from amqp import count, drain, names, publish, publish_many, setup

pytestmark = pytest.mark.spark

RUN = {"batch_size": 2000, "max_inflight": 6000, "until_idle": 1.5, "batch_timeout_s": 0.3}
FAST_RETRY = RetryPolicy(max_deliveries=3, backoff_s=0.05, max_backoff_s=0.2)


def check(row):
    if row.get("poison"):
        raise ValueError(f"order {row['order']} is poison")
    return {"order": row["order"], "total": row["qty"] * 2}


def test_queue_to_queue_20k_with_poison(spark, rabbitmq):
    url = rabbitmq.url
    q, out_x, out_q, dlx, dead = (names(p) for p in ("in", "out-x", "out", "dlx", "dead"))
    setup(url, queue=q, out_exchange=out_x, out_queue=out_q, dlx=dlx, dead_queue=dead)
    rows = [{"order": i, "qty": i % 7, "poison": i % 100 == 3} for i in range(20_000)]
    publish_many(url, q, rows, [f"o{i}" for i in range(20_000)])
    src = RabbitMQ(url, q, policy=FAST_RETRY, dead_letter_exchange=dlx)
    sink = RabbitMQSink(url, out_x, routing_key=out_q)
    report = ackflow.run(ackflow.Flow(src).map(check, name="check").to(sink), spark=spark, **RUN)
    valid = {f"o{i}" for i in range(20_000) if i % 100 != 3}
    poison = {f"o{i}" for i in range(20_000) if i % 100 == 3}
    assert report.acked == len(valid) and report.dead_lettered == len(poison)
    got = drain(url, out_q)
    assert {m for m, _, _ in got} == valid  # the row key of a 1:1 flow is the message id
    assert len(got) == len(valid)
    assert all(b["total"] == int(m[1:]) % 7 * 2 for m, b, _ in got)
    dead_letters = drain(url, dead)
    assert {m for m, _, _ in dead_letters} == poison
    h = dead_letters[0][2]
    assert h["x-ackflow-step"] == "check" and "is poison" in h["x-ackflow-error"]
    assert h["x-ackflow-deliveries"] == 3 and h["x-ackflow-queue"] == q
    assert count(url, q) == 0
    assert src.stats["multiple_acks"] > 0  # contiguous runs of tags acked in one frame


def test_quorum_queue_delivery_limit_rejects_into_its_dead_letter_exchange(spark, rabbitmq):
    url = rabbitmq.url
    q, dlx, dead = names("qq"), names("qdlx"), names("qdead")
    setup(url, queue=names("unused"), dlx=dlx, dead_queue=dead)
    args = {"x-queue-type": "quorum", "x-delivery-limit": 1, "x-dead-letter-exchange": dlx}
    src = RabbitMQ(
        url,
        q,
        declare=True,
        arguments=args,
        reject_to_dlx=True,
        policy=RetryPolicy(max_deliveries=10, backoff_s=0.05),
    )
    # declare=True declares the quorum queue; publish after it exists
    src.configure(max_inflight=100, error_sink=False)
    src.open()
    src.close()
    publish(
        url, q, [{"order": i, "qty": 1, "poison": i == 2} for i in range(5)], ids=[f"q{i}" for i in range(5)]
    )
    sink = Memory()
    report = ackflow.run(
        ackflow.Flow(src).map(check, name="check").to(sink), spark=spark, **{**RUN, "batch_size": 10}
    )
    assert report.acked == 4 and report.dead_lettered == 1
    # x-delivery-limit 1: the second delivery (x-delivery-count 1) is the last one
    dead_letters = drain(url, dead)
    assert [m for m, _, _ in dead_letters] == ["q2"]
    death = dead_letters[0][2]["x-death"][0]
    assert death["reason"] == "rejected" and death["queue"] == q
    assert count(url, q) == 0


def test_unroutable_rows_are_nacked_not_acked(spark, rabbitmq):
    url = rabbitmq.url
    q, out_x, out_q, dlx, dead = (names(p) for p in ("in", "out-x", "out", "dlx", "dead"))
    setup(url, queue=q, out_exchange=out_x, out_queue=out_q, dlx=dlx, dead_queue=dead)
    publish(url, q, [{"order": i, "qty": 1} for i in range(30)], ids=[f"u{i}" for i in range(30)])
    src = RabbitMQ(url, q, policy=RetryPolicy(max_deliveries=2, backoff_s=0.05), dead_letter_exchange=dlx)
    sink = RabbitMQSink(url, out_x, routing_key="nowhere", name="out")
    report = ackflow.run(ackflow.Flow(src).map(check).to(sink), spark=spark, **RUN)
    assert report.acked == 0 and report.nacked == 30 and report.dead_lettered == 30
    dead_letters = drain(url, dead)
    assert len(dead_letters) == 30
    assert all(
        "unroutable" in h["x-ackflow-error"] and h["x-ackflow-step"] == "out" for _, _, h in dead_letters
    )
    assert count(url, out_q) == 0


def test_a_queue_refusing_publishes_fails_only_the_refused_rows(spark, rabbitmq):
    url = rabbitmq.url
    q, out_x, out_q, dlx, dead = (names(p) for p in ("in", "out-x", "out", "dlx", "dead"))
    setup(
        url,
        queue=q,
        out_exchange=out_x,
        out_queue=out_q,
        dlx=dlx,
        dead_queue=dead,
        out_args={"x-max-length": 5, "x-overflow": "reject-publish"},
    )
    publish(url, q, [{"order": i, "qty": 1} for i in range(20)], ids=[f"r{i}" for i in range(20)])
    src = RabbitMQ(url, q, policy=RetryPolicy(max_deliveries=1), dead_letter_exchange=dlx)
    sink = RabbitMQSink(url, out_x, routing_key=out_q, name="out")
    report = ackflow.run(ackflow.Flow(src).map(check).to(sink), spark=spark, **{**RUN, "batch_size": 20})
    assert report.acked == 5 and report.dead_lettered == 15
    assert count(url, out_q) == 5
    dead_letters = drain(url, dead)
    assert all("refused" in h["x-ackflow-error"] for _, _, h in dead_letters)
    # what was refused is exactly what is missing downstream
    assert {m for m, _, _ in dead_letters} | {m for m, _, _ in drain(url, out_q)} == {
        f"r{i}" for i in range(20)
    }


def test_clear_errors_at_start_and_no_password_in_them(rabbitmq):
    with pytest.raises(ConfigError, match="does not exist"):
        src = RabbitMQ(rabbitmq.url, "no-such-queue", reject_to_dlx=True)
        src.open()
    with pytest.raises(ConfigError, match="dead letters"):
        RabbitMQ(rabbitmq.url, "q").open()
    bad = f"amqp://guest:sup3rsecret@127.0.0.1:{rabbitmq.port + 1 if rabbitmq.port < 65535 else 1}/%2F"
    with pytest.raises(ConfigError) as e:
        RabbitMQ(bad, "q", reject_to_dlx=True).open()
    assert "sup3rsecret" not in str(e.value) and "***" in str(e.value)
    with pytest.raises(ConfigError, match="exchange"):
        RabbitMQSink(rabbitmq.url, "no-such-exchange", routing_key="x").open()
    with pytest.raises(ConfigError, match="routing_key"):
        RabbitMQSink(rabbitmq.url, "x")


def test_settlements_from_another_thread_run_on_the_owner(rabbitmq):
    url = rabbitmq.url
    q = names("own")
    setup(url, queue=q, arguments={"x-dead-letter-exchange": "ackflow-tests-dlx"})
    publish(url, q, [{"n": i} for i in range(10)])
    src = RabbitMQ(url, q, reject_to_dlx=True)
    src.configure(max_inflight=100, error_sink=False)
    src.open()
    try:
        got = []
        while len(got) < 10:
            got += src.pull(10 - len(got), 1.0)
        t = threading.Thread(target=src.ack, args=(got,))
        t.start()
        t.join()
        assert src.stats["acks"] + src.stats["multiple_acks"] == 0  # not on that thread
        src.pull(1, 0.2)  # the owner carries it out
        assert src.stats["multiple_acks"] == 1
    finally:
        src.close()
    assert count(url, q) == 0


def test_headers_and_message_ids_are_carried_from_the_source(spark, rabbitmq):
    import pika

    from amqp import connect

    url = rabbitmq.url
    q, out_x, out_q, dlx, dead = (names(p) for p in ("in", "out-x", "out", "dlx", "dead"))
    setup(url, queue=q, out_exchange=out_x, out_queue=out_q, dlx=dlx, dead_queue=dead)
    conn = connect(url)
    ch = conn.channel()
    for i in range(5):
        ch.basic_publish(
            "",
            q,
            b'{"order": %d, "qty": 1}' % i,
            pika.BasicProperties(delivery_mode=2, message_id=f"h{i}", headers={"tenant": f"t{i % 2}"}),
        )
    conn.close()
    src = RabbitMQ(url, q, dead_letter_exchange=dlx, headers_field="meta")
    sink = RabbitMQSink(url, out_x, routing_key=out_q, headers_column="meta")
    report = ackflow.run(ackflow.Flow(src).to(sink), spark=spark, **RUN)
    assert report.acked == 5
    got = {m: (b, h) for m, b, h in drain(url, out_q)}
    assert set(got) == {f"h{i}" for i in range(5)}
    assert all(h == {"tenant": f"t{int(m[1:]) % 2}"} for m, (_, h) in got.items())
    assert all("meta" not in b for b, _ in got.values())


class Stalling(Memory):
    """Its commit (on the driver) waits while the file ``gate`` exists (bounded)."""

    def __init__(self, gate):
        super().__init__("stalling")
        self.gate = gate

    def commit(self, batch_id, tokens):
        import os
        import time

        super().commit(batch_id, tokens)
        deadline = time.monotonic() + 120
        while os.path.exists(self.gate) and time.monotonic() < deadline:
            time.sleep(0.02)


def test_a_release_never_spends_a_quorum_queues_last_delivery(spark, rabbitmq):
    """Issue 27 #1: on a quorum queue a give-back counts as a delivery (RabbitMQ 3.10:
    basic.nack or reject with requeue, a closed channel and a cancelled consumer alike).
    With x-delivery-limit 1 and ackflow's own dead-letter exchange, a message at its
    last delivery that was released (here: a flow error gives its batch back) was then
    in neither the queue nor the dead-letter queue. Now it is dead-lettered knowingly
    (step 'release'), and a message with deliveries left is released as before."""
    import pika

    url = rabbitmq.url
    q, dlx, dead = names("qrel"), names("qreldlx"), names("qreldead")
    setup(url, queue=q, arguments={"x-queue-type": "quorum", "x-delivery-limit": 1}, dlx=dlx, dead_queue=dead)
    publish(url, q, [{"a": 1}], ids=["tired"])
    conn = pika.BlockingConnection(pika.URLParameters(url))  # one failed delivery: the
    ch = conn.channel()  # next one is its last
    method, _, _ = ch.basic_get(q)
    ch.basic_nack(method.delivery_tag, requeue=True)
    conn.close()
    publish(url, q, [{"a": 2}], ids=["fresh"])
    src = RabbitMQ(url, q, dead_letter_exchange=dlx)
    flow = ackflow.Flow(src).transform(lambda df: df.select("a"), name="narrow").to(Memory())
    with pytest.raises(ackflow.FlowError, match="narrow"):
        ackflow.run(flow, spark=spark, **{**RUN, "batch_size": 2, "batch_timeout_s": 1.0})
    assert src.queue_type == "quorum" and src.delivery_limit == 1  # learned from the queue
    letters = drain(url, dead)
    assert [(m, h["x-ackflow-step"]) for m, _, h in letters] == [("tired", "release")]
    assert [m for m, _, _ in drain(url, q)] == ["fresh"]  # released, one delivery left


def test_a_stop_never_spends_a_quorum_queues_last_delivery(spark, rabbitmq, tmp_path):
    """Issue 27 #1, as reported: messages waiting when the stop comes (a SIGTERM does
    request_stop), in the batcher or still in the source's prefetch buffer. Those at
    their last delivery (x-delivery-limit 1, failed once) are dead-lettered knowingly;
    the one with a delivery left is given back once, never twice."""
    import pika

    from ackflow.engine.loop import Engine
    from helpers import wait_until

    url = rabbitmq.url
    q, dlx, dead = names("qstop"), names("qstopdlx"), names("qstopdead")
    setup(url, queue=q, arguments={"x-queue-type": "quorum", "x-delivery-limit": 1}, dlx=dlx, dead_queue=dead)
    publish(url, q, [{"a": 0}, {"a": 1}, {"a": 2}], ids=["blocker", "tired", "weary"])
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    tags = [ch.basic_get(q)[0].delivery_tag for _ in range(3)]
    for tag in tags:  # each failed once: the next delivery of each is its last
        ch.basic_nack(tag, requeue=True)
    conn.close()
    publish(url, q, [{"a": 3}], ids=["young"])
    gate = tmp_path / "stall"
    gate.write_text("stalled")
    engine = Engine(
        ackflow.Flow(RabbitMQ(url, q, dead_letter_exchange=dlx)).to(Stalling(str(gate))),
        spark=spark,
        batch_size=1,
        max_inflight=10,
        max_concurrent_batches=1,
        handle_signals=False,
    )
    result = {}
    runner = threading.Thread(target=lambda: result.setdefault("report", engine.run()))
    runner.start()
    try:  # blocker's batch runs; tired waits in the batcher, the rest in the prefetch
        assert wait_until(lambda: engine.report.pulled == 2, 60)
        assert wait_until(lambda: len(engine.flow.source._buffer) == 2, 30)
    finally:
        engine.request_stop()
        gate.unlink()
        runner.join(120)
    report = result["report"]
    assert (report.acked, report.released, report.dead_lettered) == (1, 1, 2)
    assert sorted((m, h["x-ackflow-step"]) for m, _, h in drain(url, dead)) == [
        ("tired", "release"),
        ("weary", "release"),
    ]
    ((mid, _, headers),) = drain(url, q)
    assert mid == "young" and headers.get("x-delivery-count") == 1  # one give-back, not two


def test_a_give_back_spends_no_delivery_on_a_classic_queue(spark, rabbitmq, tmp_path):
    """A sink down for a while gives every message back (a systemic failure) several
    times; once it is up, a message that fails its own step is retried (nacked), not
    dead-lettered at its first real failure: give-backs did not count as deliveries."""
    url = rabbitmq.url
    q, dlx, dead = names("gb"), names("gb-dlx"), names("gb-dead")
    setup(url, queue=q, dlx=dlx, dead_queue=dead)
    publish(url, q, [{"n": i} for i in range(6)], ids=[f"g{i}" for i in range(6)])
    up = tmp_path / "up"

    def step(row, _up=str(up)):
        import os

        if row["n"] == 0 and os.path.exists(_up):
            raise ValueError("g0 is poison once the sink is up")
        return row

    sink = Memory(name="mem")
    real = sink.write_partition

    def write(batch_id, partition, rows, _up=str(up), _real=real):
        import os

        if not os.path.exists(_up):
            raise ConnectionError("connection refused")
        return _real(batch_id, partition, rows)

    sink.write_partition = write
    from ackflow.engine.loop import Engine

    src = RabbitMQ(url, q, policy=RetryPolicy(max_deliveries=2, backoff_s=0.05), dead_letter_exchange=dlx)
    engine = Engine(
        ackflow.Flow(src).map(step, name="step").to(sink),
        spark=spark,
        handle_signals=False,
        systemic_backoff_s=0.05,
        systemic_max_backoff_s=0.1,
        **RUN,
    )

    def heal():
        from helpers import wait_until

        wait_until(lambda: engine.report.given_back_systemic >= 18, timeout=120)
        up.write_text("1")

    threading.Thread(target=heal, daemon=True).start()
    report = engine.run()
    assert report.given_back_systemic >= 18 and report.acked == 5
    outcomes = [f["outcome"] for f in report.failures if f["message"] == "g0"]
    assert outcomes == ["nacked", "dead_lettered"], report.failures
    assert {m for m, _, _ in drain(url, dead)} == {"g0"}


def test_a_row_pika_cannot_encode_fails_alone(spark, rabbitmq):
    """A routing key, message id or header key over 255 bytes, or a header value AMQP
    (pika) cannot encode: that row fails alone, naming the field; its valid neighbours
    in the same partition are published once and acked (before: the encoding error
    escaped the publisher and failed the partition)."""
    from ackflow.testing import ListSource

    url = rabbitmq.url
    q, out_x, out_q = names("in"), names("out-x"), names("out")
    setup(url, queue=q, out_exchange=out_x, out_queue=out_q)
    ok = {"tenant": "t", "score": None, "long_name": None}
    rows = [{"n": i, "rk": out_q, "mid": f"v{i}", "h": ok} for i in range(9)]
    rows[1]["rk"] = "r" * 256
    rows[3]["mid"] = "m" * 300
    rows[5]["h"] = {**ok, "score": 1.5}  # pika has no encoding for a float header
    rows[6]["h"] = {**ok, "long_name": {"k" * 256: 1}}  # a table key is a short string
    rows[8]["rk"] = None  # never published as "None"
    src = ListSource([json.dumps(r) for r in rows])
    sink = RabbitMQSink(
        url, out_x, routing_key_column="rk", message_id_column="mid", headers_column="h", name="out"
    )
    report = ackflow.run(
        ackflow.Flow(src).to(sink), spark=spark, **{**RUN, "batch_size": 9, "until_idle": 0.5}
    )
    bad = {
        "m1": "routing key",
        "m3": "message id",
        "m5": "header 'score'",
        "m6": "header 'long_name'",
        "m8": "routing_key_column 'rk' is null",
    }
    assert {k: v for k, v in src.final().items() if v != "acked"} == dict.fromkeys(bad, "dead_lettered")
    for key, field in bad.items():
        assert field in src.failures[key].error and src.failures[key].step == "out", src.failures[key]
    assert report.acked == 4 and report.jobs == 1  # no bisection: the job did not fail
    got = drain(url, out_q)
    assert sorted(m for m, _, _ in got) == ["v0", "v2", "v4", "v7"]  # each once
    assert all(h == ok for _, _, h in got)


def test_an_exchange_gone_after_the_start_is_systemic_not_poison(spark, rabbitmq):
    """The sink's exchange disappears (deleted by an operator) after the start: every
    publish closes the channel (404). That is the write's failure, not the rows': the
    messages are given back, none dead-lettered, and the run stops naming the sink."""
    from ackflow.core.errors import SystemicFailure
    from ackflow.engine.loop import Engine
    from ackflow.testing import ListSource

    class Gone(RabbitMQSink):  # as if deleted after its check at start
        def open(self):
            pass

    src = ListSource([json.dumps({"n": i}) for i in range(12)], policy=RetryPolicy(max_deliveries=1))
    sink = Gone(rabbitmq.url, names("no-such-exchange"), routing_key="x", name="out")
    engine = Engine(
        ackflow.Flow(src).to(sink),
        spark=spark,
        handle_signals=False,
        systemic_stop_after_s=1,
        systemic_backoff_s=0.05,
        **{**RUN, "batch_size": 12, "until_idle": 0.5},
    )
    with pytest.raises(SystemicFailure, match="channel closed") as e:
        engine.run()
    assert e.value.step == "out" and engine.report.dead_lettered == 0
    assert not src.dead_letters and set(src.final().values()) == {"released"}


def test_each_publish_closes_its_connection_without_waiting_for_a_collection(rabbitmq):
    """A confirmed publish (the sink's, one per partition) closes its socket before it
    returns. It once stopped its loop while the close was under way, and the socket
    stayed open until Python's cycle collector ran: with collections off, three publishes
    left three connections open, and each loop two wake-up sockets."""
    import gc

    import pika

    from ackflow.sinks.rabbitmq import publish_confirmed
    from amqp import connections_to, fds

    q = names("closes")
    setup(rabbitmq.url, queue=q)

    def sockets():
        return {fd: link for fd, link in fds().items() if link.startswith("socket:")}

    gc.disable()
    try:
        before, all_before = connections_to(rabbitmq.port), sockets()
        for i in range(3):
            props = pika.BasicProperties(message_id=f"m{i}")
            assert publish_confirmed(rabbitmq.url, "", [(q, b"{}", props)]) == {}
        left = connections_to(rabbitmq.port) - before
        new = {fd: link for fd, link in sockets().items() if all_before.get(fd) != link}
    finally:
        gc.enable()
    assert left == set()
    assert new == {}  # nor its event loop's wake-up sockets (two a publish, before)
    assert count(rabbitmq.url, q) == 3
