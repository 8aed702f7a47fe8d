"""The Kafka source against a real Kafka-compatible broker (tansu, started by the
``kafka`` fixture): contiguous per-partition commits, delivery counts that survive a
restart, backpressure by pausing, and rebalances that never commit past an unsettled
message nor clear one as if settled (the Faust bug class)."""

from __future__ import annotations

import json
import logging
import os
import time
import uuid

import pytest

import ackflow
from ackflow.core.ledger import Failure
from ackflow.core.policy import RetryPolicy
from ackflow.sinks import MemorySink
from ackflow.sources import Kafka
from kafka_help import committed

pytestmark = pytest.mark.kafka


def topic(kafka, partitions=3):
    name = f"t-{uuid.uuid4().hex[:8]}"
    kafka.create_topic(name, partitions)
    return name


def produce(kafka, name, bodies, partitions=3):
    from confluent_kafka import Producer

    p = Producer(
        {"bootstrap.servers": kafka.bootstrap, "enable.idempotence": True, "acks": "all", "linger.ms": 5}
    )
    for i, b in enumerate(bodies):
        p.produce(name, value=b, partition=i % partitions)
    assert p.flush(30) == 0


def committed_soon(kafka, name, group, partitions, timeout):
    """The group's committed offsets once they equal what every partition of the
    topic expects (``partitions``: partition -> offset), or as they are at ``timeout``."""
    deadline = time.monotonic() + timeout
    got = committed(kafka, name, group, len(partitions))
    while got != partitions and time.monotonic() < deadline:
        time.sleep(0.2)
        got = committed(kafka, name, group, len(partitions))
    return got


def source(kafka, name, group, tmp_path, **kw):
    kw.setdefault("attempts_path", str(tmp_path / f"attempts-{group}.db"))
    return Kafka(kafka.bootstrap, name, group, **kw)


def pull_until(src, n, timeout=60.0):
    got = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got += src.pull(n - len(got), 0.2)
    return got


def test_a_flow_lands_every_message_once_and_commits_to_the_end(spark, kafka, tmp_path):
    name, group = topic(kafka), f"g-{uuid.uuid4().hex[:6]}"
    bodies = [json.dumps({"i": i, "qty": -1 if i % 25 == 7 else 1}).encode() for i in range(300)]
    produce(kafka, name, bodies)

    def check(r):
        if r["qty"] < 0:
            raise ValueError(f"order {r['i']}: qty must be positive")
        return r

    out, dead = MemorySink("out"), MemorySink("dead")
    src = source(kafka, name, group, tmp_path, policy=RetryPolicy(max_deliveries=2, backoff_s=0.05))
    report = ackflow.run(
        ackflow.Flow(src).map(check, name="check").to(out).on_error(dead),
        spark=spark,
        until_idle=3,
        batch_size=100,
        max_inflight=300,
    )
    assert report.acked + report.dead_lettered == 300
    assert sorted(r["i"] for r in out.rows) == [i for i in range(300) if i % 25 != 7]
    assert sorted(json.loads(r["body"])["i"] for r in dead.rows) == [i for i in range(300) if i % 25 == 7]
    assert all(r["step"] == "check" and r["deliveries"] == 2 for r in dead.rows)
    assert all(r["message"].startswith(f"{name}/") for r in dead.rows)
    assert committed(kafka, name, group) == {0: 100, 1: 100, 2: 100}
    # a second run of the group reads nothing again
    more = [json.dumps({"i": i, "qty": 1}).encode() for i in range(300, 330)]
    produce(kafka, name, more)
    out2 = MemorySink("out")
    src2 = source(kafka, name, group, tmp_path)
    ackflow.run(ackflow.Flow(src2).to(out2).on_error(MemorySink("dead")), spark=spark, until_idle=3)
    assert sorted(r["i"] for r in out2.rows) == list(range(300, 330))
    assert committed(kafka, name, group) == {0: 110, 1: 110, 2: 110}


def test_the_commit_never_passes_an_unsettled_message(kafka, tmp_path):
    name, group = topic(kafka, 1), f"g-{uuid.uuid4().hex[:6]}"
    produce(kafka, name, [b"%d" % i for i in range(10)], partitions=1)
    src = source(kafka, name, group, tmp_path)
    src.configure(max_inflight=100, error_sink=True)
    src.open()
    try:
        got = pull_until(src, 10)
        assert [d.key for d in got] == [f"{name}/0@{i}" for i in range(10)]
        src.ack([d for d in got if d.key != f"{name}/0@3"])  # 3 is still in flight
        time.sleep(1.0)  # the consumer thread commits what is contiguous
        assert committed(kafka, name, group, 1) == {0: 3}
        src.ack([d for d in got if d.key == f"{name}/0@3"])
        assert committed_soon(kafka, name, group, {0: 10}, 10) == {0: 10}
    finally:
        src.close()


def poison_once(kafka, name, group, disk, **kw):
    """One process's life: open, fetch the poison message at the head, record its
    failure, then "crash" (close without settling). Its delivery count; the group's
    commit never passes it."""
    src = source(kafka, name, group, disk, **kw)
    src.configure(max_inflight=10, error_sink=True)
    src.open()
    try:
        got = pull_until(src, 2)
        head = next(d for d in got if d.body == b"poison")
        src.fail([(head, Failure("check", "poison"))])
    finally:
        src.close()
    assert committed(kafka, name, group, 1) in ({0: -1001}, {0: 0})  # never past it
    return head.delivery_count


def test_a_poison_message_at_the_head_keeps_its_delivery_count_across_restarts(kafka, tmp_path):
    """A crash after each failure (the source closed without settling) must not reset
    the count: the third delivery is the third, so the policy can give it up."""
    name, group = topic(kafka, 1), f"g-{uuid.uuid4().hex[:6]}"
    produce(kafka, name, [b"poison", b"ok"], partitions=1)
    counts = [poison_once(kafka, name, group, tmp_path) for _ in range(3)]
    assert counts == [1, 2, 3]


def test_delivery_counts_in_postgresql_follow_a_partition_to_another_process(kafka, postgres, tmp_path):
    """With ``attempts_dsn=``, the group's processes share the counts: a poison message
    at a partition's head that crashes one process after another (each with a disk of
    its own, empty) is counted 1, 2, 3 across them, so the policy can give it up (with
    the files alone each would count 1)."""
    name, group = topic(kafka, 1), f"g-{uuid.uuid4().hex[:6]}"
    produce(kafka, name, [b"poison", b"ok"], partitions=1)
    counts = [
        poison_once(kafka, name, group, tmp_path / f"disk-{process}", attempts_dsn=postgres.dsn)
        for process in range(3)
    ]
    assert counts == [1, 2, 3]


def test_shared_delivery_counts_survive_a_database_restart(kafka, postgres, tmp_path):
    """The counts' connection is lost when PostgreSQL restarts: the next write opens a
    new one and the count goes on (1, then 2 after the restart)."""
    import psycopg

    name, group = topic(kafka, 1), f"g-{uuid.uuid4().hex[:6]}"
    produce(kafka, name, [b"poison"], partitions=1)
    src = source(kafka, name, group, tmp_path, attempts_dsn=postgres.dsn, policy=RetryPolicy(backoff_s=0.05))
    src.configure(max_inflight=10, error_sink=True)
    src.open()
    try:
        first = pull_until(src, 1)
        assert first[0].delivery_count == 1
        postgres.stop()
        postgres.start()
        src.fail([(first[0], Failure("check", "poison"))])  # recorded on a new connection
        with psycopg.connect(postgres.dsn) as c:
            assert c.execute(
                "SELECT n FROM ackflow_kafka_attempts WHERE grp = %s AND topic = %s", (group, name)
            ).fetchall() == [(1,)]
        again = pull_until(src, 1)
        assert again[0].delivery_count == 2
    finally:
        src.close()
        if not postgres.running:
            postgres.start()
    src = source(kafka, name, group, tmp_path / "elsewhere", attempts_dsn=postgres.dsn)
    src.configure(max_inflight=10, error_sink=True)
    src.open()
    try:
        assert pull_until(src, 1)[0].delivery_count == 3  # another process goes on from 2
    finally:
        src.close()


def test_a_counts_store_failing_at_a_first_message_never_lets_the_commit_pass_it(kafka, tmp_path):
    """The counts are read before a partition's first message changes anything: when the
    store fails there (a database away at a rebalance), the pull fails, the message stays
    fetched, no commit passes it as a gap, and the next pull hands it out."""
    from ackflow.core.errors import SourceGone

    name, group = topic(kafka, 1), f"g-{uuid.uuid4().hex[:6]}"
    produce(kafka, name, [b"a", b"b"], partitions=1)
    src = source(kafka, name, group, tmp_path)
    src.configure(max_inflight=10, error_sink=True)
    src.open()
    store = src._store()
    real, calls = store.handed, []

    def away_once(tp):
        calls.append(tp)
        if len(calls) == 1:
            raise SourceGone("the counts database is away")
        return real(tp)

    store.handed = away_once
    try:
        deadline = time.monotonic() + 30
        while not calls and time.monotonic() < deadline:
            try:
                src.pull(2, 0.2)
            except SourceGone:
                break
        assert len(calls) == 1, "the store was never asked"
        time.sleep(1.0)  # the consumer thread commits whatever it may meanwhile
        assert committed(kafka, name, group, 1) in ({0: -1001}, {0: 0})
        got = pull_until(src, 2)
        assert [d.key for d in got] == [f"{name}/0@0", f"{name}/0@1"]
        src.ack(got)
        assert committed_soon(kafka, name, group, {0: 2}, 10) == {0: 2}
    finally:
        src.close()


def test_an_unreachable_attempts_database_stops_at_start_without_its_password(kafka, tmp_path):
    from ackflow.core.errors import ConfigError

    src = source(
        kafka, "t", "g", tmp_path, attempts_dsn="postgresql://app:s3cret@127.0.0.1:1/db?connect_timeout=2"
    )
    src.configure(max_inflight=10, error_sink=True)
    with pytest.raises(ConfigError, match="delivery counts in PostgreSQL") as e:
        src.open()
    assert "s3cret" not in str(e.value)


def test_a_full_window_pauses_the_partitions_and_loses_nothing(kafka, tmp_path):
    name, group = topic(kafka, 2), f"g-{uuid.uuid4().hex[:6]}"
    produce(kafka, name, [b"%d" % i for i in range(200)], partitions=2)
    src = source(kafka, name, group, tmp_path)
    src.configure(max_inflight=20, error_sink=True)
    src.open()
    seen = []
    try:
        got = pull_until(src, 20)
        time.sleep(1.0)  # the consumer thread would fetch more if it were not paused
        assert src.status()["paused"] is True
        assert len(got) == 20
        while True:
            src.ack(got)
            seen += [d.key for d in got]
            if len(seen) >= 200:
                break
            got = pull_until(src, 20, timeout=20)
            assert got, f"nothing more after {len(seen)} messages: the pause was not lifted"
            assert len(got) <= 20
        assert sorted(seen) == sorted(f"{name}/{i % 2}@{i // 2}" for i in range(200))
    finally:
        src.close()


def test_a_rebalance_with_messages_in_flight_commits_only_settled_prefixes(kafka, tmp_path):
    """The Faust scenario: member A holds messages in flight when member B joins and
    takes some of A's partitions. A lets them go after ``revoke_timeout_s`` without
    committing past its unsettled messages; B reads them again; A's late acks commit
    nothing; in the end every message was handed out and the commits reach the end."""
    parts = 4
    name, group = topic(kafka, parts), f"g-{uuid.uuid4().hex[:6]}"
    produce(kafka, name, [b"%d" % i for i in range(80)], partitions=parts)
    a = source(kafka, name, group, tmp_path / "a", revoke_timeout_s=1.0)
    b = source(kafka, name, group, tmp_path / "b", revoke_timeout_s=1.0)
    for s in (a, b):
        s.configure(max_inflight=1000, error_sink=True)
    a.open()
    try:
        held = pull_until(a, 80)
        assert len(held) == 80
        # settle the first half of each partition only
        first = [d for d in held if int(d.key.rsplit("@", 1)[1]) < 10]
        a.ack(first)
        time.sleep(1.0)
        assert committed(kafka, name, group, parts) == {p: 10 for p in range(parts)}
        b.open()
        moved = {int(t.split("[")[1].rstrip("]")) for t in b.status()["partitions"]}
        deadline = time.monotonic() + 60
        while not moved and time.monotonic() < deadline:
            b.pull(0, 0.1)
            moved = {int(t.split("[")[1].rstrip("]")) for t in b.status()["partitions"]}
            time.sleep(0.1)
        assert moved, "the second member got no partition"
        # the moved partitions' commits stayed at the settled prefix
        assert all(off == 10 for p, off in committed(kafka, name, group, parts).items() if p in moved)
        a.ack([d for d in held if d not in first])  # late: commits only A's own
        again = pull_until(b, 10 * len(moved), timeout=60)
        assert sorted(d.key for d in again) == sorted(f"{name}/{p}@{o}" for p in moved for o in range(10, 20))
        b.ack(again)
        want = {p: 20 for p in range(parts)}
        assert committed_soon(kafka, name, group, want, 20) == want
    finally:
        b.close()
        a.close()


def consume_all(kafka, name, n, timeout=60.0):
    from confluent_kafka import Consumer

    c = Consumer(
        {
            "bootstrap.servers": kafka.bootstrap,
            "group.id": f"r-{uuid.uuid4().hex[:6]}",
            "auto.offset.reset": "earliest",
            "session.timeout.ms": 6000,
            "heartbeat.interval.ms": 500,
            "max.poll.interval.ms": 10000,
        }
    )
    c.subscribe([name])
    out = []
    deadline = time.monotonic() + timeout
    try:
        while len(out) < n and time.monotonic() < deadline:
            for m in c.consume(100, 0.5):
                if m.error() is None:
                    out.append(m)
    finally:
        c.close()
    return out


def test_the_kafka_sink_acks_a_message_only_on_its_rows_delivery(spark, kafka):
    """Rows land once each, keyed by the row key (or a column), with ackflow-row-key; a
    row Kafka refuses on its own (larger than the producer's message.max.bytes) fails
    its message alone; a topic that does not exist stops the run at start."""
    from ackflow.core.errors import ConfigError
    from ackflow.sinks import Kafka as KafkaSink
    from ackflow.testing import ListSource

    name = topic(kafka, 2)
    bodies = [json.dumps({"i": i, "pad": "x" * (3000 if i == 4 else 1)}) for i in range(10)]
    dead = MemorySink("dead")
    src = ListSource(bodies, policy=RetryPolicy(max_deliveries=1))
    sink = KafkaSink(kafka.bootstrap, name, config={"message.max.bytes": 2000})
    report = ackflow.run(
        ackflow.Flow(src).flat_map(lambda r: [r, {**r, "copy": 1}], name="twice").to(sink).on_error(dead),
        spark=spark,
        until_idle=0.5,
    )
    assert (report.acked, report.dead_lettered) == (9, 1)
    assert "Kafka refused the row" in dead.rows[0]["error"]
    assert json.loads(dead.rows[0]["body"])["i"] == 4
    got = consume_all(kafka, name, 18, timeout=30)
    rows = sorted((json.loads(m.value())["i"], json.loads(m.value()).get("copy") or 0) for m in got)
    assert rows == sorted((i, c) for i in range(10) if i != 4 for c in (0, 1))
    heads = {dict(m.headers())["ackflow-row-key"].decode() for m in got}
    assert len(heads) == len(got)  # one message per row key
    assert all(m.key().decode() == dict(m.headers())["ackflow-row-key"].decode() for m in got)
    with pytest.raises(ConfigError, match="does not exist"):
        ackflow.run(
            ackflow.Flow(ListSource(["{}"])).to(KafkaSink(kafka.bootstrap, "nope-x")),
            spark=spark,
            until_idle=0.5,
        )


def start_pipeline(kafka, postgres, name, group, table, dead, attempts, idle, lake=None):
    import subprocess
    import sys

    here = os.path.dirname(__file__)
    env = {
        **os.environ,
        "AF_BOOTSTRAP": kafka.bootstrap,
        "AF_TOPIC": name,
        "AF_GROUP": group,
        "AF_DSN": postgres.dsn,
        "AF_TABLE": table,
        "AF_DEAD": dead,
        "AF_ATTEMPTS": attempts,
        **({"AF_LAKE": lake} if lake else {}),
    }
    cmd = [
        sys.executable,
        "-m",
        "ackflow.cli",
        "run",
        f"{os.path.join(here, 'pipelines', 'kafka_flow.py')}:flow",
        "--master",
        "local[2]",
        "--json",
        "--batch-size",
        "500",
        "--max-inflight",
        "1500",
        "--until-idle",
        str(idle),
    ]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def pg_rows(postgres, table):
    import psycopg
    from psycopg import sql

    try:
        with psycopg.connect(postgres.dsn) as c:
            return c.execute(
                sql.SQL("SELECT count(*), count(DISTINCT ackflow_key) FROM {}").format(sql.Identifier(table))
            ).fetchone()
    except psycopg.errors.UndefinedTable:
        return (0, 0)


def produce_orders(kafka, name, n, partitions):
    produce(
        kafka,
        name,
        [json.dumps({"order": i, "qty": i % 7, "poison": i % 100 == 3}).encode() for i in range(n)],
        partitions=partitions,
    )
    return n - len([i for i in range(n) if i % 100 == 3])


def lake_rows(lake, missing_ok=False):
    """(rows, distinct row keys) of the Delta table and of the Iceberg table."""
    from deltalake import DeltaTable

    from ackflow.sinks import Iceberg

    readers = (
        lambda: DeltaTable(os.path.join(lake, "delta")).to_pyarrow_table(columns=["ackflow_key"]),
        lambda: (
            Iceberg(f"sqlite:///{lake}/catalog.db", "kafka.orders")
            ._load()
            .scan(selected_fields=("ackflow_key",))
            .to_arrow()
        ),
    )
    out = []
    for read in readers:
        try:
            keys = read().column(0).to_pylist()
        except Exception:
            if not missing_ok:  # (not made yet, while the pipelines start)
                raise
            keys = []
        out.append((len(keys), len(set(keys))))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("sinks", ["postgres", "delta+iceberg"])
def test_two_pipelines_in_one_group_one_sigkilled_lose_nothing(kafka, postgres, tmp_path, sinks):
    """Two ackflow processes share a group's partitions; one is SIGKILLed mid-run. The
    other takes its partitions over (after the session times out) and reads on from
    their committed offsets: every valid order lands once (keyed upserts in PostgreSQL;
    in a Delta and an Iceberg table both processes commit to, the tables' shared key
    manifests), every poison one is dead-lettered, and the group's commits reach the end."""
    import signal

    from helpers import wait_until

    parts, n = 4, 6000
    name, group = topic(kafka, parts), f"g-{uuid.uuid4().hex[:6]}"
    table, dead = f"k_{uuid.uuid4().hex[:6]}", f"kd_{uuid.uuid4().hex[:6]}"
    valid = produce_orders(kafka, name, n, parts)
    lake = str(tmp_path / "lake") if sinks != "postgres" else None

    def written():
        return (
            pg_rows(postgres, table)[0]
            if lake is None
            else min(r for r, _ in lake_rows(lake, missing_ok=True))
        )

    a = start_pipeline(kafka, postgres, name, group, table, dead, str(tmp_path / "a.db"), 60, lake)
    b = start_pipeline(kafka, postgres, name, group, table, dead, str(tmp_path / "b.db"), 15, lake)
    try:
        assert wait_until(lambda: written() >= 1500 or a.poll() is not None, timeout=240, every=0.5)
        assert a.poll() is None, a.stderr.read()[-3000:]
        os.kill(a.pid, signal.SIGKILL)
        a.wait(30)
        assert b.wait(300) == 0, b.stderr.read()[-3000:]
    finally:
        for p in (a, b):
            if p.poll() is None:
                p.kill()
                p.wait(30)
            p.stderr.close()
    if lake is None:
        assert pg_rows(postgres, table) == (valid, valid)  # none missing, none twice
    else:
        assert lake_rows(lake) == [(valid, valid), (valid, valid)]  # Delta, Iceberg
    assert pg_rows(postgres, dead)[1] == n - valid
    assert committed(kafka, name, group, parts) == {p: n // parts for p in range(parts)}


def test_a_dead_letter_topic_takes_given_up_messages_with_provenance(spark, kafka, tmp_path):
    """Without an error sink, ``dead_letter_topic=`` takes the messages given up, with
    their identity, place, step, error and deliveries in headers; the commits pass them
    only after their delivery to that topic."""
    name, dlt, group = topic(kafka, 2), topic(kafka, 1), f"g-{uuid.uuid4().hex[:6]}"
    produce(kafka, name, [json.dumps({"i": i, "bad": i % 10 == 3}).encode() for i in range(40)], partitions=2)

    def check(r):
        if r["bad"]:
            raise ValueError(f"record {r['i']} is bad")
        return r

    out = MemorySink("out")
    src = source(
        kafka,
        name,
        group,
        tmp_path,
        dead_letter_topic=dlt,
        policy=RetryPolicy(max_deliveries=2, backoff_s=0.05),
    )
    report = ackflow.run(ackflow.Flow(src).map(check, name="check").to(out), spark=spark, until_idle=3)
    assert (report.acked, report.dead_lettered) == (36, 4)
    dead = consume_all(kafka, dlt, 4, timeout=30)
    heads = [{k: v.decode() for k, v in m.headers()} for m in dead]
    assert sorted(json.loads(m.value())["i"] for m in dead) == [3, 13, 23, 33]
    assert all(
        h["ackflow-step"] == "check"
        and "is bad" in h["ackflow-error"]
        and h["ackflow-deliveries"] == "2"
        and h["ackflow-topic"] == name
        and h["ackflow-message"] == f"{name}/{h['ackflow-partition']}@{h['ackflow-offset']}"
        for h in heads
    ), heads
    assert committed(kafka, name, group, 2) == {0: 20, 1: 20}
    with pytest.raises(ackflow.ConfigError, match="does not exist"):
        ackflow.run(
            ackflow.Flow(source(kafka, name, "g2", tmp_path, dead_letter_topic="no-such")).to(MemorySink()),
            spark=spark,
            until_idle=1,
        )


def test_offsets_never_delivered_are_gaps_that_never_hold_the_commit(kafka, tmp_path):
    """Transactions leave offsets no consumer receives (commit and abort markers, and
    an aborted transaction's records): the commit passes them, up to the partition's
    end, once every message around them settled."""
    from confluent_kafka import Producer

    name, group = topic(kafka, 1), f"g-{uuid.uuid4().hex[:6]}"
    p = Producer({"bootstrap.servers": kafka.bootstrap, "transactional.id": f"tx-{name}"})
    p.init_transactions(30)
    for batch in range(3):
        p.begin_transaction()
        for i in range(3):
            p.produce(name, value=b"%d-%d" % (batch, i))
        (p.abort_transaction if batch == 1 else p.commit_transaction)(30)
    src = source(kafka, name, group, tmp_path, config={"isolation.level": "read_committed"})
    src.configure(max_inflight=100, error_sink=True)
    src.open()
    try:
        got = pull_until(src, 6, timeout=30)
        assert sorted(d.body for d in got) == [b"0-0", b"0-1", b"0-2", b"2-0", b"2-1", b"2-2"]
        offsets = sorted(int(d.key.rsplit("@", 1)[1]) for d in got)
        assert offsets != list(range(6)), "the broker left no gap: nothing is tested"
        src.ack(got)
        from confluent_kafka import Consumer, TopicPartition

        c = Consumer({"bootstrap.servers": kafka.bootstrap, "group.id": "w"})
        end = c.get_watermark_offsets(TopicPartition(name, 0), 10)[1]
        c.close()
        assert committed_soon(kafka, name, group, {0: end}, 10) == {0: end}
        assert end > offsets[-1] + 1
    finally:
        src.close()


def test_a_partition_with_only_a_marker_after_its_commit_is_committed_to_its_end(kafka, tmp_path):
    """An assignment that reads no message (the partition holds only a transaction's
    commit marker after the group's commit) still commits the position the client moved
    to: the group's lag reaches 0 (it stayed at 1 for good before)."""
    from confluent_kafka import Consumer, Producer, TopicPartition

    name, group = topic(kafka, 1), f"g-{uuid.uuid4().hex[:6]}"
    p = Producer({"bootstrap.servers": kafka.bootstrap, "transactional.id": f"tx-{name}"})
    p.init_transactions(30)
    p.begin_transaction()
    p.produce(name, value=b"only")
    p.commit_transaction(30)
    c = Consumer({"bootstrap.servers": kafka.bootstrap, "group.id": group})
    end = c.get_watermark_offsets(TopicPartition(name, 0), 10)[1]
    assert end == 2, "the broker wrote no marker after the record: nothing is tested"
    c.commit(offsets=[TopicPartition(name, 0, 1)], asynchronous=False)  # past the record
    c.close()
    src = source(kafka, name, group, tmp_path)
    src.configure(max_inflight=10, error_sink=True)
    src.open()
    try:
        assert pull_until(src, 1, timeout=8) == []
        assert committed_soon(kafka, name, group, {0: end}, 15) == {0: end}
    finally:
        src.close()


def test_the_client_forgets_the_position_on_assign(kafka):
    """The source commits the client's position for an assignment that returned no
    message (the test above): that is safe only because librdkafka resets the position
    when a partition is assigned again, so it can never be the position reached in an
    earlier assignment past messages that were given up unsettled."""
    from confluent_kafka import Consumer, Producer, TopicPartition

    name = topic(kafka, 1)
    p = Producer({"bootstrap.servers": kafka.bootstrap})
    for i in range(10):
        p.produce(name, value=b"%d" % i)
    assert p.flush(30) == 0
    c = Consumer(
        {
            "bootstrap.servers": kafka.bootstrap,
            "group.id": f"g-{uuid.uuid4().hex[:6]}",
            "enable.auto.commit": False,  # as the source: the commit stays at 2
        }
    )
    tp = TopicPartition(name, 0)
    try:
        c.commit(offsets=[TopicPartition(name, 0, 2)], asynchronous=False)
        c.incremental_assign([tp])
        got = []
        deadline = time.monotonic() + 30
        while len(got) < 8 and time.monotonic() < deadline:
            got += [m for m in c.consume(10, 0.5) if m.error() is None]
        assert c.position([tp])[0].offset == 10
        c.incremental_unassign([tp])
        c.incremental_assign([tp])
        assert c.position([tp])[0].offset < 0  # not 10: read again from the commit
        again = []
        deadline = time.monotonic() + 30
        while not again and time.monotonic() < deadline:
            again = [m for m in c.consume(10, 0.5) if m.error() is None]
        assert again[0].offset() == 2
    finally:
        c.close()


def test_a_broker_restart_mid_run_loses_nothing_and_commits_to_the_end(spark, kafka_durable, tmp_path):
    """The broker (durable storage) is restarted while a flow runs: the source reports
    itself disconnected, keeps what it settled in memory, commits it when the broker
    answers again, and the run finishes with every message written and the group's
    commits at the end."""
    import threading

    kafka = kafka_durable
    name, group = topic(kafka, 2), f"g-{uuid.uuid4().hex[:6]}"
    n = 4000
    produce(kafka, name, [json.dumps({"i": i}).encode() for i in range(n)], partitions=2)
    out = MemorySink("out")
    restarted: dict[str, float] = {}

    def slow(r):
        time.sleep(0.001)
        return r

    def restart_when_half_done():
        deadline = time.monotonic() + 180
        while len(out.rows) < n // 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        restarted["at"] = len(out.rows)
        kafka.restart()
        restarted["done"] = time.monotonic()

    src = source(kafka, name, group, tmp_path)
    t = threading.Thread(target=restart_when_half_done, daemon=True)
    t.start()
    report = ackflow.run(
        ackflow.Flow(src).map(slow, name="slow").to(out).on_error(MemorySink("dead")),
        spark=spark,
        until_idle=8,
        batch_size=200,
        max_inflight=600,
    )
    t.join(60)
    assert "done" in restarted and restarted["at"] < n, restarted
    assert {r["i"] for r in out.rows} == set(range(n))  # none missing (a copy may repeat)
    assert report.dead_lettered == 0
    assert committed(kafka, name, group, 2) == {0: n // 2, 1: n // 2}


def test_a_late_settlement_from_an_earlier_assignment_settles_nothing(kafka, tmp_path):
    """A partition leaves member A (B joins) while A holds its messages in flight, and
    comes back to A (B leaves): A reads them again. A late ack of the first copies must
    not settle the second ones, still in flight: the commit stays put until they settle."""
    parts = 2
    name, group = topic(kafka, parts), f"g-{uuid.uuid4().hex[:6]}"
    produce(kafka, name, [b"%d" % i for i in range(20)], partitions=parts)
    a = source(kafka, name, group, tmp_path / "a", revoke_timeout_s=0.5)
    a.configure(max_inflight=1000, error_sink=True)
    a.open()
    b = source(kafka, name, group, tmp_path / "b", revoke_timeout_s=0.5)
    b.configure(max_inflight=1000, error_sink=True)
    try:
        first = pull_until(a, 20)
        assert len(first) == 20
        b.open()
        deadline = time.monotonic() + 60
        while not b.status()["partitions"] and time.monotonic() < deadline:
            b.pull(0, 0.1)
        moved = [int(t.split("[")[1].rstrip("]")) for t in b.status()["partitions"]]
        assert len(moved) == 1, moved
        b.close()  # leaves: the partition goes back to A, which reads it again
        second = pull_until(a, 10, timeout=60)
        assert sorted(d.key for d in second) == sorted(f"{name}/{moved[0]}@{o}" for o in range(10))
        a.ack(first)  # late, for the moved partition: the second copies are in flight
        time.sleep(1.0)
        assert committed(kafka, name, group, parts)[moved[0]] in (-1001, 0)
        a.ack(second)
        want = {p: 10 for p in range(parts)}
        assert committed_soon(kafka, name, group, want, 10) == want
    finally:
        b.close()
        a.close()


# -- found by an adversarial review (each failed on the first version) -------------------


def produce_raw(kafka, name, msgs):
    """msgs: (partition, value, key, headers)"""
    from confluent_kafka import Producer

    p = Producer(
        {"bootstrap.servers": kafka.bootstrap, "enable.idempotence": True, "acks": "all", "linger.ms": 5}
    )
    for part, value, key, headers in msgs:
        p.produce(name, value=value, key=key, headers=headers, partition=part)
    assert p.flush(30) == 0


def test_a_retried_message_keeps_its_key_and_headers(kafka, tmp_path):
    """Every delivery of one identity carries the same headers (a retry once lost the
    key, the timestamp and the message's own headers)."""
    name, group = topic(kafka, 1), f"g-{uuid.uuid4().hex[:6]}"
    produce_raw(kafka, name, [(0, b'{"a": 1}', b"k1", [("tenant", b"acme")])])
    src = source(kafka, name, group, tmp_path, policy=RetryPolicy(max_deliveries=5))
    src.configure(max_inflight=100, error_sink=True)
    src.open()
    try:
        [first] = pull_until(src, 1)
        src.nack([(first, Failure("step", "boom"))])
        [again] = pull_until(src, 1)
        assert again.key == first.key
        assert again.headers == first.headers
    finally:
        src.close()


def test_a_message_that_kills_the_process_has_its_delivery_counted(kafka, tmp_path):
    """The count is written when a message is handed out, not only when it fails: a
    message whose processing kills the process reaches max_deliveries across restarts."""
    name, group = topic(kafka, 1), f"g-{uuid.uuid4().hex[:6]}"
    produce_raw(kafka, name, [(0, b'{"a": 1}', None, None)])
    counts = []
    for _ in range(3):  # three runs, each 'crashes' while the message is in flight
        src = source(kafka, name, group, tmp_path, policy=RetryPolicy(max_deliveries=3))
        src.configure(max_inflight=100, error_sink=True)
        src.open()
        try:
            [d] = pull_until(src, 1)
            counts.append(d.delivery_count)
        finally:
            src.close()  # unsettled: like a crash, nothing of it is recorded
    assert counts == [1, 2, 3]


def test_a_hostile_header_key_does_not_escape_its_message(kafka, tmp_path):
    """A header key that is not UTF-8 (producers accept bytes) fails nothing, and a
    message's own header named like ackflow's (``key``) never stands in for them."""
    name, group = topic(kafka, 1), f"g-{uuid.uuid4().hex[:6]}"
    produce_raw(kafka, name, [(0, b'{"a": 1}', None, [(b"\xff\xfe", b"v")]), (0, b'{"a": 2}', None, None)])
    src = source(kafka, name, group, tmp_path)
    src.configure(max_inflight=100, error_sink=True)
    src.open()
    try:
        errors = []
        got = []
        deadline = time.monotonic() + 30
        while len(got) < 2 and time.monotonic() < deadline:
            try:
                got += src.pull(2, 0.2)
            except Exception as e:  # noqa: BLE001
                errors.append(f"{type(e).__name__}: {e}")
        assert not errors, errors[:1]
        assert [d.key for d in got] == [f"{name}/0@0", f"{name}/0@1"]
    finally:
        src.close()


def test_a_partition_paused_before_an_incremental_assign_is_resumed(kafka, tmp_path):
    """A partition paused by backpressure stays paused inside librdkafka across an
    incremental assignment: if acks bring the window below max_inflight while the
    assign callback runs (the handler below acks from inside it, as the engine's thread
    may at that moment), it must still be resumed (a source-wide paused flag, reset at
    assign, once left it stalled for good)."""
    name, group = topic(kafka, 2), f"g-{uuid.uuid4().hex[:6]}"
    produce_raw(kafka, name, [(i % 2, b"%d" % i, None, None) for i in range(200)])
    a = source(kafka, name, group, tmp_path / "a", revoke_timeout_s=0.5)
    b = source(kafka, name, group, tmp_path / "b", revoke_timeout_s=0.5)
    a.configure(max_inflight=10, error_sink=True)
    b.configure(max_inflight=1000, error_sink=True)
    acked: list[str] = []
    armed = []
    held = []

    class DrainOnAssign(logging.Handler):
        def emit(self, record):
            if armed and record.getMessage().startswith(f"source {a.name!r}: assigned"):
                armed.clear()
                a.ack(held)  # revoked ones are ignored (another assignment)
                acked.extend(d.key for d in held)
                while True:
                    got = a.pull(1000, 0)
                    if not got:
                        break
                    a.ack(got)
                    acked.extend(d.key for d in got)

    handler = DrainOnAssign()
    logger = logging.getLogger("ackflow.sources.kafka")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    a.open()
    try:
        end = time.monotonic() + 30
        while time.monotonic() < end and len(held) < 20:  # hold what is fetched
            held += a.pull(1000, 0.2)
        time.sleep(1.0)
        held += a.pull(1000, 0.2)
        assert a.status()["paused"] is True
        b.open()
        deadline = time.monotonic() + 60
        while len(a.status()["partitions"]) != 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(a.status()["partitions"]) == 1, "B took no partition"
        [kept] = a.status()["partitions"]
        kept_p = int(kept.split("[")[1].rstrip("]"))
        assert a.status()["paused"] is True  # still full: its in flight and inbox
        armed.append(1)
        b.close()
        while len(a.status()["partitions"]) != 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(a.status()["partitions"]) == 2
        # every message of the kept partition must eventually come
        produce_raw(kafka, name, [(kept_p, b"new", None, None)] * 10)
        want = {f"{name}/{kept_p}@{o}" for o in range(110)}
        deadline = time.monotonic() + 20
        while not want <= set(acked) and time.monotonic() < deadline:
            got = a.pull(5, 0.2)
            a.ack(got)
            acked.extend(d.key for d in got)
        missing = want - set(acked)
        assert not missing, f"{len(missing)} messages of {name}[{kept_p}] never came: status {a.status()}"
    finally:
        logger.removeHandler(handler)
        b.close()
        a.close()


def test_attempt_counts_keep_one_row_per_partition_for_first_deliveries(tmp_path):
    """First deliveries cost the partition's marks only; counts of later deliveries are
    rows; the high mark never goes down; a commit forgets the rows below it and moves
    the committed mark (an offset below it that comes again is a replay); all of it
    survives reopening the file, and a file that kept a row per delivery gets its marks
    from those rows."""
    import sqlite3

    from ackflow.sources.kafka_attempts import Attempts

    path = str(tmp_path / "a.db")
    a = Attempts(path)
    tp = ("t", 0)
    assert a.handed(tp) == (0, -1)
    a.record_pull([], {tp: 99})
    assert a.db.execute("SELECT count(*) FROM attempts").fetchone()[0] == 0
    a.record_pull([(tp, 5, 3), (tp, 20, 2)], {tp: 50, ("t", 1): 7})
    assert (a.handed(tp), a.handed(("t", 1))) == ((0, 99), (0, 7))
    assert (a.get(tp, 5), a.get(tp, 20), a.get(tp, 6)) == (3, 2, 0)
    a.forget(tp, 10)
    a.forget(tp, 8)  # never backwards
    a.forget(("t", 2), 4)  # committed before anything was handed out here
    a.close()
    b = Attempts(path)
    assert (b.get(tp, 5), b.get(tp, 20), b.handed(tp), b.handed(("t", 2))) == (0, 2, (10, 99), (4, -1))
    b.close()

    old = str(tmp_path / "old.db")
    with sqlite3.connect(old) as db:
        db.execute(
            "CREATE TABLE attempts (topic TEXT, part INTEGER, off INTEGER, n INTEGER, "
            "PRIMARY KEY (topic, part, off))"
        )
        db.executemany("INSERT INTO attempts VALUES ('t', 0, ?, ?)", [(40, 1), (41, 4), (42, 1)])
    c = Attempts(old)
    assert (c.handed(tp), c.get(tp, 41)) == ((40, 42), 4)
    c.close()
