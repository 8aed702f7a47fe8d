"""The embedded queue: leases, expiry, stale settlements, backoff, the delivery limit."""

import multiprocessing
import os
import sqlite3
import subprocess
import sys
import time

import pytest

from ackflow.core import ConfigError, Delivery, RetryPolicy, Settlement
from ackflow.core.ledger import Failure
from ackflow.embedded import EmbeddedQueue
from ackflow.sources import EmbeddedQueueSource
from helpers import wait_until


@pytest.fixture
def db(tmp_path):
    return str(tmp_path / "q.db")


def test_publish_lease_ack(db):
    q = EmbeddedQueue(db)
    assert q.publish("a", [b"1", b"2", b"3"], msg_ids=["x", "y", "z"]) == 3
    assert q.publish("a", [b"1"], msg_ids=["x"]) == 0  # already queued: not twice
    leased = q.lease("a", 2, visibility_timeout=30)
    assert [m.key for m in leased] == ["x", "y"] and all(m.deliveries == 1 for m in leased)
    assert q.stats("a")["leased"] == 2 and q.stats("a")["ready"] == 1
    assert q.ack("a", [(m.row_id, m.deliveries) for m in leased]) == 2
    s = q.stats("a")
    assert (s["ready"], s["leased"], s["acked_total"], s["delivered_total"]) == (1, 0, 2, 2)


def test_expired_lease_is_delivered_again_and_the_stale_ack_is_refused(db):
    q = EmbeddedQueue(db)
    q.publish("a", [b"m"])
    (first,) = q.lease("a", 10, visibility_timeout=0.05)
    assert q.lease("a", 10, visibility_timeout=30) == []  # invisible while leased
    assert wait_until(lambda: q.stats("a")["ready"] == 1, timeout=5)
    (second,) = q.lease("a", 10, visibility_timeout=30)
    assert second.deliveries == 2
    assert q.ack("a", [(first.row_id, first.deliveries)]) == 0  # stale: not acked
    assert q.stats("a")["leased"] == 1
    assert q.ack("a", [(second.row_id, second.deliveries)]) == 1


def _deliveries(src, n=10):
    return src.pull(n, timeout=0.5)


def test_source_retries_with_backoff_then_dead_letters_with_provenance(db):
    EmbeddedQueue(db).publish("a", [b'{"n": 1}'], msg_ids=["order-1"], headers=[{"h": "v"}])
    src = EmbeddedQueueSource(db, "a", policy=RetryPolicy(max_deliveries=3, backoff_s=0.1))
    src.open()
    boom = Failure("validate", "ValueError: no")
    seen_at = []
    for attempt in (1, 2):
        got = []
        assert wait_until(lambda got=got: bool(got.extend(_deliveries(src)) or got), timeout=5)
        seen_at.append(time.monotonic())
        (d,) = got
        assert d.delivery_count == attempt and d.headers == {"h": "v"}
        assert src.fail([(d, boom)]) == [Settlement.NACKED]
        assert src.q.stats("a")["delayed"] == 1
    got = []
    assert wait_until(lambda got=got: bool(got.extend(_deliveries(src)) or got), timeout=5)
    assert time.monotonic() - seen_at[-1] >= 0.19  # second backoff is 0.2 s
    (d,) = got
    assert src.fail([(d, boom)]) == [Settlement.DEAD_LETTERED]
    (dl,) = src.q.dead_letters("a")
    assert (dl.msg_id, dl.body, dl.headers, dl.step, dl.error, dl.deliveries) == (
        "order-1",
        b'{"n": 1}',
        {"h": "v"},
        "validate",
        "ValueError: no",
        3,
    )
    assert dl.dead_at >= dl.published_at
    s = src.q.stats("a")
    assert (s["ready"], s["delayed"], s["dead_lettered"]) == (0, 0, 1)
    assert src.q.replay("a") == 1 and src.q.stats("a")["ready"] == 1
    src.close()


def test_a_failure_on_an_expired_lease_is_no_dead_letter(db):
    """Issue 27 #11: a message given up after its lease expired was reported
    dead-lettered though nothing was stored: it is the queue's again (released)."""
    EmbeddedQueue(db).publish("a", [b'{"n": 1}'], msg_ids=["late"])
    src = EmbeddedQueueSource(db, "a", policy=RetryPolicy(max_deliveries=1))
    src.open()
    (d,) = _deliveries(src)
    other = EmbeddedQueue(db)
    other.release([d.handle])  # the lease ended (as when it expires): not held any more
    other.close()
    assert src.fail([(d, Failure("validate", "ValueError: no"))]) == [Settlement.RELEASED]
    assert src.q.dead_letters("a") == [] and src.q.stats("a")["ready"] == 1
    (again,) = _deliveries(src)
    assert src.fail([(again, Failure("validate", "ValueError: no"))]) == [Settlement.DEAD_LETTERED]
    assert [x.msg_id for x in src.q.dead_letters("a")] == ["late"]
    src.close()


def test_replay_keeps_each_dead_letter_it_cannot_move(db):
    """Issue 27 #3: replay moves a dead letter only together with its re-queue; two dead
    letters of one msg_id, or one whose msg_id is queued, stay, with the reason."""
    q = EmbeddedQueue(db)
    for body in (b"first", b"second"):
        q.publish("a", [body], msg_ids=["m1"])
        (m,) = q.lease("a", 1, visibility_timeout=60)
        q.dead_letter("a", [(m.row_id, m.deliveries, "parse", f"bad {body!r}")])
    q.publish("a", [b"other"], msg_ids=["m2"])
    q.publish("a", [b"x"], msg_ids=["m2"])  # already queued: ignored
    first, second = q.dead_letters("a")
    done = q.replay_each("a")
    assert done.moved == [first.row_id] and list(done.kept) == [second.row_id]
    assert "'m1' is queued" in done.kept[second.row_id]
    assert q.dead_letters("a") == [second]  # untouched: body, headers, error
    assert sorted(p["body"] for p in q.peek("a")) == ["first", "other"]
    assert q.replay("a") == 0 and q.dead_letters("a") == [second]
    q.close()


def test_release_gives_back_without_counting_a_delivery(db):
    EmbeddedQueue(db).publish("a", [b"{}"])
    src = EmbeddedQueueSource(db, "a")
    src.open()
    (d,) = src.pull(1, 1)
    src.release([d])
    (again,) = src.pull(1, 1)
    assert again.delivery_count == 1
    src.close()


def test_one_consumer_per_queue_and_orphans_are_reclaimed(db):
    q = EmbeddedQueue(db)
    q.publish("a", [b"{}", b"{}"])
    q.lease("a", 2, visibility_timeout=300)  # a consumer that then "died"
    first = EmbeddedQueueSource(db, "a")
    assert first.open() == 2  # given back at once, not after 300 s
    with pytest.raises(ConfigError, match="already has a live consumer"):
        EmbeddedQueueSource(db, "a").open()
    assert len(first.pull(10, 0.5)) == 2
    first.close()
    assert EmbeddedQueueSource(db, "a").open() == 2


def test_missing_queue_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        EmbeddedQueueSource(str(tmp_path / "nope.db")).open()


def _produce(db, start, n):
    q = EmbeddedQueue(db)
    for i in range(start, start + n, 50):
        q.publish("a", [b"{}"] * 50, msg_ids=[f"p{j}" for j in range(i, i + 50)])
    q.close()


def test_concurrent_producers_and_one_consumer(db):
    EmbeddedQueue(db).close()
    procs = [
        multiprocessing.get_context("spawn").Process(target=_produce, args=(db, k * 2000, 2000))
        for k in range(3)
    ]
    for p in procs:
        p.start()
    src = EmbeddedQueueSource(db, "a")
    src.open()
    seen: set[str] = set()
    deadline = time.monotonic() + 60
    while len(seen) < 6000 and time.monotonic() < deadline:
        got = src.pull(500, 0.1)
        keys = [d.key for d in got]
        assert not seen & set(keys)  # never delivered twice while acked
        seen.update(keys)
        src.ack(got)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert len(seen) == 6000
    s = src.q.stats("a")
    assert (s["ready"], s["leased"], s["published_total"], s["acked_total"]) == (0, 0, 6000, 6000)
    src.close()


def test_source_settles_delivery_objects_it_made(db):
    EmbeddedQueue(db).publish("a", [b"{}"])
    src = EmbeddedQueueSource(db, "a")
    src.open()
    (d,) = src.pull(1, 1)
    assert isinstance(d, Delivery) and d.handle[1] == 1
    src.ack([d])
    assert src.q.stats("a")["acked_total"] == 1
    assert os.path.exists(db)
    src.close()


@pytest.mark.spark
@pytest.mark.parametrize("keepalive_s, extended", [(0.25, True), (1000.0, False)])
def test_leases_are_extended_while_a_slow_batch_runs(spark, db, keepalive_s, extended):
    import json

    import ackflow
    from ackflow.engine import Engine
    from ackflow.sinks import MemorySink

    EmbeddedQueue(db).publish("a", [json.dumps({"n": i}).encode() for i in range(20)])
    src = EmbeddedQueueSource(db, "a", visibility_timeout=1.0)

    def slow(r):
        time.sleep(0.2)  # a batch takes ~2 s per job: longer than the 1 s lease
        return r

    deadline = time.monotonic() + 15  # without extension it could churn for ever: bound it
    engine = Engine(
        ackflow.Flow(src).map(slow, name="slow").to(MemorySink()),
        spark=spark,
        batch_size=20,
        max_inflight=60,
        until_idle=0.5,
        keepalive_s=keepalive_s,
        progress=lambda r, w: time.monotonic() > deadline and engine.request_stop(),
    )
    if not extended:
        # leases shorter than the keepalive would be handed out again while their batch
        # runs (every message processed twice at once): refused at start
        with pytest.raises(
            ConfigError,
            match=r"visibility_timeout \(1 s\) must be more than "
            r"twice the lease keepalive \(1000 s\)",
        ):
            engine.run()
        return
    report = engine.run()
    stats = EmbeddedQueue(db).stats("a")
    assert (stats["delivered_total"], stats["acked_total"]) == (20, 20)
    assert report.redelivered == 0


def test_ack_held_reports_pairs_whose_lease_was_lost(tmp_path):
    q = EmbeddedQueue(tmp_path / "q.db")
    q.publish("a", [b"1", b"2"])
    first = q.lease("a", 2, visibility_timeout=0.05)
    time.sleep(0.1)
    again = q.lease("a", 1, visibility_timeout=30)  # message 1 leased a second time
    stale = q.ack_held("a", [(m.row_id, m.deliveries) for m in first])
    assert stale == [(first[0].row_id, 1)] and again[0].row_id == first[0].row_id
    assert q.stats("a")["acked_total"] == 1


def test_publish_with_remember_never_queues_an_id_twice(tmp_path):
    q = EmbeddedQueue(tmp_path / "q.db")
    assert q.publish("out", [b"1", b"2"], msg_ids=["a", "b"], remember=True) == 2
    leased = q.lease("out", 10, visibility_timeout=30)
    q.ack("out", [(m.row_id, m.deliveries) for m in leased])
    # consumed and gone, but remembered: published again after a crash, not queued
    assert q.publish("out", [b"1", b"3"], msg_ids=["a", "c"], remember=True) == 1
    assert [m.msg_id for m in q.lease("out", 10, visibility_timeout=30)] == ["c"]
    with pytest.raises(ValueError, match="msg_id"):
        q.publish("out", [b"x"], remember=True)


def test_remembered_ids_can_be_forgotten_after_a_retention(db, monkeypatch):
    """The sink's remember_for_s: ids older than it are forgotten, so the file stops
    growing; an id published again after that is queued again (the stated trade-off)."""
    from ackflow.sinks import EmbeddedQueueSink

    q = EmbeddedQueue(db)
    assert q.publish("out", [b"1"], msg_ids=["k1"], remember=True) == 1
    q.ack("out", [(m.row_id, m.deliveries) for m in q.lease("out", 10, visibility_timeout=30)])
    assert q.publish("out", [b"1"], msg_ids=["k1"], remember=True) == 0  # remembered
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 3600)
    sink = EmbeddedQueueSink(db, "out", remember_for_s=60)
    sink.commit("b1", [])
    assert q.publish("out", [b"1"], msg_ids=["k1"], remember=True) == 1  # forgotten
    with pytest.raises(ConfigError, match="remember_for_s must be positive"):
        EmbeddedQueueSink(db, "out", remember_for_s=-1)
    q.close()


def test_a_process_killed_while_creating_the_file_leaves_it_usable(tmp_path):
    """The CI's SIGKILL test once killed the demo while it created its queue file: the
    tables were created one by one, so the next start found some of them and refused the
    file as "not an ackflow queue database" for good. The schema is now one transaction
    (a fault point after each statement exits the process there), and a file holding part
    of ackflow's own tables (left by the old code) is completed."""
    path = tmp_path / "q.db"
    code = f"from ackflow.embedded import EmbeddedQueue; EmbeddedQueue({str(path)!r})"
    for nth in (1, 3, 6):
        env = {**os.environ, "ACKFLOW_FAULTS": f"embedded.schema=exit@{nth}"}
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True)
        assert r.returncode != 0, "the fault point did not fire"
        with sqlite3.connect(path) as c:  # all or nothing: the cut transaction left none
            assert c.execute("SELECT count(*) FROM sqlite_master").fetchone()[0] == 0
    q = EmbeddedQueue(path)
    assert q.publish("q", [b"1"]) == 1

    old = tmp_path / "old.db"  # what the old code left when killed after two tables
    with sqlite3.connect(old) as c:
        c.execute(
            "CREATE TABLE messages (id INTEGER PRIMARY KEY AUTOINCREMENT, queue TEXT "
            "NOT NULL, msg_id TEXT, body BLOB NOT NULL, headers TEXT, deliveries "
            "INTEGER NOT NULL DEFAULT 0, visible_at REAL NOT NULL, leased INTEGER NOT "
            "NULL DEFAULT 0, published_at REAL NOT NULL, last_error TEXT)"
        )
    q = EmbeddedQueue(old)
    assert q.publish("q", [b"1"]) == 1 and q.stats("q")["ready"] == 1


def test_a_file_with_ackflow_tables_and_foreign_ones_is_refused(tmp_path):
    mixed = tmp_path / "mixed.db"
    with sqlite3.connect(mixed) as c:
        c.execute("CREATE TABLE messages (id INTEGER)")
        c.execute("CREATE TABLE users (id INTEGER)")
    with pytest.raises(ConfigError, match="not an ackflow queue database"):
        EmbeddedQueue(mixed)


def test_messages_given_back_keep_their_place_unless_they_may_kill_the_consumer(db):
    """A dead consumer's leases and released messages come back before what was
    published after them (as a broker requeues: a window would see them late behind the
    backlog); one leased CRASH_SUSPECT times and never settled (each consumer that had
    it died) goes behind the backlog, so that the rest still flows."""
    from ackflow.embedded import CRASH_SUSPECT

    q = EmbeddedQueue(db)
    q.publish("a", [b'{"n": 0}', b'{"n": 1}'], msg_ids=["m0", "m1"])
    q.lease("a", 1, visibility_timeout=300)  # m0, then the consumer dies
    q.publish("a", [b'{"n": 2}'], msg_ids=["m2"])
    q.close()
    src = EmbeddedQueueSource(db, "a")
    assert src.open() == 1
    order = [d.key for _ in range(3) for d in src.pull(1, 0.5)]  # one at a time: the order
    assert order == ["m0", "m1", "m2"]
    src.close()  # that consumer dies too: m0 was leased twice, m1 and m2 once
    for _ in range(CRASH_SUSPECT - 2):  # m0 first each time, and its consumer dies again
        src = EmbeddedQueueSource(db, "a")
        src.open()
        assert [d.key for d in src.pull(1, 0.5)] == ["m0"]
        src.close()
    src = EmbeddedQueueSource(db, "a")
    src.open()
    order = [d.key for _ in range(3) for d in src.pull(1, 0.5)]
    assert order == ["m1", "m2", "m0"]  # the suspect last
    src.close()
