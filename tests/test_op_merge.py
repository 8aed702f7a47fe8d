"""merge: one flow over several sources; each message settles at its own source."""

import json

import pytest

import ackflow
from ackflow.core import ConfigError
from ackflow.embedded import EmbeddedQueue
from ackflow.sinks import MemorySink
from ackflow.sources import EmbeddedQueueSource
from ackflow.testing import ListSource
from helpers import FAST

pytestmark = pytest.mark.spark


def test_merged_sources_keep_their_formats_and_settle_at_home(spark, tmp_path):
    a = ListSource([json.dumps({"v": i}) for i in range(10)] + ["oops"], name="a")
    db = str(tmp_path / "q.db")
    EmbeddedQueue(db).publish(
        "b", [f"text {i}".encode() for i in range(5)], msg_ids=[f"m{i}" for i in range(5)]
    )  # same keys as source a
    b = EmbeddedQueueSource(db, "b", format="text", name="b")

    def shape(r):
        return {"v": r["v"] if "v" in r else len(r["body"])}

    sink = MemorySink()
    report = ackflow.run(
        ackflow.merge(ackflow.Flow(a), ackflow.Flow(b)).map(shape, name="shape").to(sink), spark=spark, **FAST
    )
    assert report.acked == 15 and report.dead_lettered == 1
    assert sorted(r["v"] for r in sink.rows) == sorted([*range(10), *([6] * 5)])
    assert a.final()["m10"] == "dead_lettered" and len(a.final()) == 11
    stats = EmbeddedQueue(db).stats("b")
    assert stats["acked_total"] == 5 and stats["ready"] + stats["leased"] == 0


def test_merge_needs_bare_flows():
    a, b = ListSource([], name="a"), ListSource([], name="b")
    with pytest.raises(ConfigError, match="only a source"):
        ackflow.merge(ackflow.Flow(a).map(lambda r: r), ackflow.Flow(b))
    with pytest.raises(ConfigError, match="unique"):
        ackflow.merge(ackflow.Flow(a), ackflow.Flow(ListSource([], name="a")))


def _unacked(url, queues, published):
    """Deliveries the broker holds unacked per queue: published - ready (valid while
    nothing is acked yet)."""
    from amqp import connect

    conn = connect(url)
    try:
        ch = conn.channel()
        return [published - ch.queue_declare(q, passive=True).method.message_count for q in queues]
    finally:
        conn.close()


def test_merged_rabbitmq_sources_share_the_window_at_the_broker(rabbitmq, tmp_path):
    """Law 6 with merge: two RabbitMQ sources under max_inflight=100 may hold at most
    100 unacked deliveries at the broker together (before: each got a prefetch of 100,
    and the broker held 200 while the engine counted 100)."""
    import threading
    import time

    from ackflow.engine.loop import Engine
    from ackflow.sources import RabbitMQ
    from amqp import names, publish, setup

    url, release = rabbitmq.url, tmp_path / "release"
    queues, published = [names("ma"), names("mb")], 150
    for q in queues:
        setup(url, queue=q)
        publish(url, q, [{"v": i} for i in range(published)], ids=[f"{q}-{i}" for i in range(published)])

    def hold(r, release=str(release)):  # every batch waits until the test has looked
        import os
        import time

        deadline = time.monotonic() + 60
        while not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.02)
        return r

    sources = [ackflow.Flow(RabbitMQ(url, q, name=q, reject_to_dlx=True, dlx_by_policy=True)) for q in queues]
    sink = MemorySink()
    engine = Engine(
        ackflow.merge(*sources).map(hold, name="hold").to(sink),
        executor="local",
        batch_size=50,
        max_inflight=100,
        batch_timeout_s=0.05,
        until_idle=0.5,
        handle_signals=False,
    )
    outcome = {}
    runner = threading.Thread(target=lambda: outcome.update(report=engine.run()), daemon=True)
    runner.start()
    worst, seen = 0, []
    deadline = time.monotonic() + 20
    try:
        while time.monotonic() < deadline:
            seen = _unacked(url, queues, published)
            worst = max(worst, sum(seen))
            if worst > 100 or (engine.window.in_flight == 100 and sum(seen) == 100):
                break
            time.sleep(0.02)
    finally:
        release.touch()
        runner.join(60)
    assert worst <= 100, f"the broker held {seen} unacked deliveries (window 100)"
    assert seen == [50, 50]  # the window filled, split evenly
    assert outcome["report"].acked == 2 * published and len(sink.rows) == 2 * published


def test_a_window_smaller_than_the_number_of_sources_is_refused():
    flows = [ackflow.Flow(ListSource([], name=n)) for n in "abc"]
    with pytest.raises(ConfigError, match="max_inflight"):
        ackflow.run(
            ackflow.merge(*flows).to(MemorySink()),
            executor="local",
            batch_size=2,
            max_inflight=2,
            until_idle=0.1,
        )
