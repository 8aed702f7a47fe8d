"""Every remaining connector at scale and in odd states (issue 29): the state that grows
over months of running (many batches and commits, many remembered keys and ids, many
offsets, many dead letters, a restart after that much history), about ten times the
sizes of the connectors' other tests, driven directly (sources by pull/ack/fail, sinks
by write_partition/commit) so that each test takes seconds, not minutes: the engine adds
nothing to what is checked here. Each test checks correctness after the growth (nothing
lost, each row or message once, dedupe still holding after a restart) and the bounds
the connector promises. The per-operation cost at 1x and 10x is measured by
``benchmarks/scale_sources.py`` and ``benchmarks/scale_sinks.py``.

Sizes: ``ACKFLOW_SCALE_MESSAGES`` (default 20 000) messages per source,
``ACKFLOW_SCALE_BATCHES`` (default 1 000) batches per sink."""

from __future__ import annotations

import json
import os
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ackflow import faults
from ackflow.core.ledger import Failure
from ackflow.core.policy import RetryPolicy
from ackflow.core.settlement import Settlement
from ackflow.embedded import EmbeddedQueue
from ackflow.sinks.base import ROW_KEY
from amqp import connections_to, count, drain, names, publish_many, setup, stream_publish

MESSAGES = int(os.environ.get("ACKFLOW_SCALE_MESSAGES", "20000"))
BATCHES = int(os.environ.get("ACKFLOW_SCALE_BATCHES", "1000"))
IN_FLIGHT_AT_CRASH = 300
SCHEMA = pa.schema([("id", pa.int64()), ("sku", pa.string()), ("qty", pa.int64())])


def poison(body: bytes) -> bool:
    return json.loads(body)["n"] % 10 == 0


class Ledger:
    """What a source handed out and how each delivery was settled."""

    def __init__(self) -> None:
        self.acked: dict[str, int] = {}
        self.failed: dict[str, int] = {}
        self.in_flight_at_crash: set[str] = set()

    def ack(self, deliveries) -> None:
        for d in deliveries:
            self.acked[d.key] = self.acked.get(d.key, 0) + 1

    def check_once(self, expected: int) -> None:
        assert len(self.acked) == expected, f"{len(self.acked)} of {expected} acked"
        twice = {k for k, n in self.acked.items() if n > 1}
        assert twice <= self.in_flight_at_crash, sorted(twice - self.in_flight_at_crash)[:5]
        assert all(n <= 2 for n in self.acked.values())


def drive(
    src, ledger: Ledger, *, settled_before_crash: int | None, deadline_s: float, chunk: int = 1000, done=None
) -> None:
    """Pull and settle until ``done()``: poison messages fail, the rest are acked. With
    ``settled_before_crash`` it returns once that many were acked, the last pull's
    ``IN_FLIGHT_AT_CRASH`` deliveries still unsettled (the caller then "crashes")."""
    deadline = time.monotonic() + deadline_s
    while not done():
        assert time.monotonic() < deadline, f"{len(ledger.acked)} acked after {deadline_s} s"
        got = src.pull(chunk, 0.2)
        if (
            settled_before_crash is not None
            and len(ledger.acked) + len(got) >= settled_before_crash
            and len(got) > IN_FLIGHT_AT_CRASH
        ):
            got, held = got[:-IN_FLIGHT_AT_CRASH], got[-IN_FLIGHT_AT_CRASH:]
            ledger.in_flight_at_crash = {d.key for d in held}
            settle(src, ledger, got)
            return
        settle(src, ledger, got)


def settle(src, ledger: Ledger, got) -> None:
    bad = [d for d in got if poison(d.body)]
    good = [d for d in got if not poison(d.body)]
    # a younger half first: the source must hold its contiguous commit or acks
    half = len(good) // 2
    for part in (good[half:], good[:half]):
        stale = src.ack(part) or []
        assert not stale, f"{len(stale)} acks refused"
        ledger.ack(part)
    if bad:
        states = src.fail([(d, Failure("check", "poison")) for d in bad])
        for d, s in zip(bad, states, strict=True):
            ledger.failed[d.key] = ledger.failed.get(d.key, 0) + 1
            assert s in (Settlement.NACKED, Settlement.DEAD_LETTERED), s


# -- sources ------------------------------------------------------------------------------


def test_embedded_queue_source_many_messages_dead_letters_ids_and_a_restart(tmp_path):
    """MESSAGES messages published with remembered ids, one in ten poison (retried once,
    then dead-lettered), a crash with messages in flight half way: every good message
    acked once (twice only if in flight at the crash), every poison one a dead letter,
    the queue empty, and every id still remembered after the restart."""
    from ackflow.sources import EmbeddedQueueSource

    db = str(tmp_path / "q.db")
    q = EmbeddedQueue(db)
    ids = [f"m{i}" for i in range(MESSAGES)]
    for k in range(0, MESSAGES, 5000):
        q.publish(
            "in",
            [json.dumps({"n": i}).encode() for i in range(k, min(k + 5000, MESSAGES))],
            msg_ids=ids[k : k + 5000],
            remember=True,
        )
    q.close()

    def start():
        src = EmbeddedQueueSource(db, "in", policy=RetryPolicy(max_deliveries=2, backoff_s=0.0))
        src.configure(max_inflight=2000, error_sink=False)
        return src, src.open()

    ledger, poisoned = Ledger(), MESSAGES // 10
    src, _ = start()
    drive(src, ledger, settled_before_crash=MESSAGES // 2, deadline_s=60, done=lambda: False)
    src.close()  # a crash: the leases of the in-flight messages are given back at the next open
    src, given_back = start()
    assert given_back >= IN_FLIGHT_AT_CRASH
    good = MESSAGES - poisoned
    drive(
        src,
        ledger,
        settled_before_crash=None,
        deadline_s=60,
        done=lambda: (
            len(ledger.acked) >= good
            and src.q.stats("in")["ready"] == 0
            and src.q.stats("in")["delayed"] == 0
        ),
    )
    stats = src.q.stats("in")
    src.close()
    ledger.check_once(good)
    assert stats["dead_lettered"] == poisoned and stats["leased"] == 0 and stats["ready"] == 0
    dead = EmbeddedQueue(db).dead_letters("in")
    assert sorted(d.msg_id for d in dead) == sorted(f"m{i}" for i in range(0, MESSAGES, 10))
    # (a poison message in flight at the crash came once more: 3 deliveries)
    assert all(d.deliveries >= 2 and d.step == "check" for d in dead)
    # dedupe after the restart: every remembered id is refused when published again
    q = EmbeddedQueue(db)
    assert q.publish("in", [b"{}"] * MESSAGES, msg_ids=ids, remember=True) == 0
    q.close()


@pytest.fixture
def rabbit_caps(monkeypatch):
    """The classic queue source's remembered ids, capped low so that the stream of
    messages here is 10x past the cap (the production caps are 100 000 / 200 000)."""
    import ackflow.sources.rabbitmq as mod

    monkeypatch.setattr(mod, "SEEN_MAX", 1000)
    monkeypatch.setattr(mod, "RETRY_KEYS_MAX", 2000)
    return mod


def test_rabbitmq_queue_source_many_messages_dead_letters_and_a_restart(rabbitmq, rabbit_caps):
    """MESSAGES messages on a classic queue, one in ten poison (nacked once, then a dead
    letter with provenance to the dead-letter exchange), a crash with messages in flight
    half way: every good message acked once (twice only if in flight at the crash), every
    poison one dead-lettered once, the queue empty, and the source's memory bounded by
    its caps and its window, not by the stream (the retry keys of settled deliveries are
    forgotten: before, they stayed until the cap)."""
    from ackflow.sources import RabbitMQ

    q, dlx, dead_q = names("scale"), names("scale-dlx"), names("scale-dead")
    setup(rabbitmq.url, queue=q, dlx=dlx, dead_queue=dead_q)
    publish_many(rabbitmq.url, q, [{"n": i} for i in range(MESSAGES)], [f"k{i}" for i in range(MESSAGES)])

    def start():
        src = RabbitMQ(
            rabbitmq.url, q, dead_letter_exchange=dlx, policy=RetryPolicy(max_deliveries=2, backoff_s=0.0)
        )
        src.configure(max_inflight=2000, error_sink=False)
        src.open()
        return src

    ledger, poisoned, good = Ledger(), MESSAGES // 10, MESSAGES - MESSAGES // 10
    src = start()
    drive(src, ledger, settled_before_crash=MESSAGES // 2, deadline_s=90, done=lambda: False)
    assert len(src._retry_keys) <= 2000 + IN_FLIGHT_AT_CRASH
    src.close()  # a crash: the broker delivers the unsettled messages again
    src = start()
    try:
        drive(
            src,
            ledger,
            settled_before_crash=None,
            deadline_s=90,
            done=lambda: len(ledger.acked) >= good and count(rabbitmq.url, dead_q) >= poisoned,
        )
        # the last nacks, dead letters and held acks are sent by the owner's next calls
        deadline = time.monotonic() + 15
        while (src._outstanding or count(rabbitmq.url, q)) and time.monotonic() < deadline:
            settle(src, ledger, src.pull(100, 0.2))
        assert len(src._seen) <= rabbit_caps.SEEN_MAX
        assert len(src._backs) <= rabbit_caps.SEEN_MAX
        assert len(src._retry_keys) <= 2000  # before: the cap (2000 here) was always reached
        assert len(src._retry_keys) == len(src._outstanding) == 0
    finally:
        src.close()
    ledger.check_once(good)
    assert count(rabbitmq.url, q) == 0
    dead, deadline = [], time.monotonic() + 30
    while len(dead) < poisoned and time.monotonic() < deadline:
        dead += drain(rabbitmq.url, dead_q)
    assert sorted(mid for mid, _, _ in dead) == sorted(f"k{i}" for i in range(0, MESSAGES, 10))
    assert all(h["x-ackflow-step"] == "check" for _, _, h in dead)


def test_rabbitmq_stream_source_many_offsets_retries_and_a_restart(rabbitmq):
    """MESSAGES offsets in a stream, settled out of order, one in ten failing once (retried
    from memory, then acked), a crash with messages in flight half way: the stored offset
    never passes an unsettled one, the restart resumes at it, every offset is acked (twice
    only if in flight at the crash), and the source holds nothing after the last ack."""
    from ackflow.sources import RabbitMQStream

    stream = names("scale-s")
    stream_publish(rabbitmq, stream, [json.dumps({"n": i}).encode() for i in range(MESSAGES)])

    def start():
        src = RabbitMQStream(
            "127.0.0.1",
            rabbitmq.stream_port,
            stream,
            "c1",
            policy=RetryPolicy(max_deliveries=3, backoff_s=0.0),
        )
        src.configure(max_inflight=2000, error_sink=True)
        src.open()
        return src

    ledger = Ledger()
    retried: set[str] = set()

    def settle_stream(src, got):
        first = [d for d in got if poison(d.body) and d.key not in retried]
        failing = {id(d) for d in first}
        rest = [d for d in got if id(d) not in failing]
        half = len(rest) // 2
        for part in (rest[half:], rest[:half]):  # younger first
            src.ack(part)
            ledger.ack(part)
        if first:
            assert src.fail([(d, Failure("check", "once")) for d in first]) == [Settlement.NACKED] * len(
                first
            )
            retried.update(d.key for d in first)

    src = start()
    deadline = time.monotonic() + 60
    held = []
    while not held:  # (a pull that crosses half way with too few to hold: the next one holds)
        assert time.monotonic() < deadline
        got = src.pull(1000, 0.5)
        if len(ledger.acked) + len(got) >= MESSAGES // 2 and len(got) > IN_FLIGHT_AT_CRASH:
            got, held = got[:-IN_FLIGHT_AT_CRASH], got[-IN_FLIGHT_AT_CRASH:]
        settle_stream(src, got)
    lowest_held = min(int(d.handle) for d in held)
    assert src.committed <= lowest_held  # the stored offset waits for the held ones
    stored = src.committed
    src.close()
    ledger.in_flight_at_crash = {f"{stream}@{o}" for o in range(stored, MESSAGES)}
    src = start()
    try:
        assert src.committed == stored  # resumed at the stored offset
        deadline = time.monotonic() + 60
        while src.committed < MESSAGES:
            assert time.monotonic() < deadline, f"committed {src.committed} of {MESSAGES}"
            settle_stream(src, src.pull(1000, 0.5))
        assert not src._bodies and not src._retry  # nothing held once all is settled
        assert src.status()["lag"] == 0
    finally:
        src.close()
    ledger.check_once(MESSAGES)
    assert {f"{stream}@{i}" for i in range(0, MESSAGES, 10)} <= retried
    # a third start: nothing more to read
    src = start()
    try:
        assert src.committed == MESSAGES and src.pull(100, 0.5) == []
    finally:
        src.close()


# -- sinks --------------------------------------------------------------------------------


def rows(n: int, per: int = 10) -> pa.Table:
    ids = list(range(n * per, (n + 1) * per))
    return pa.table(
        {
            "id": ids,
            "sku": [f"s{i % 977}" for i in ids],
            "qty": [i % 7 for i in ids],
            ROW_KEY: [f"m{i}#0" for i in ids],
        }
    )


def commit_batches(sink, numbers, prefix="b") -> float:
    """Stage and commit each batch number (one partition each); the seconds it took."""
    began = time.monotonic()
    for n in numbers:
        bid = f"{prefix}{n:06d}"
        result = sink.write_partition(bid, 0, rows(n))
        assert not result.failed, result.failed
        sink.commit(bid, [result.token] if result.token else [])
    return time.monotonic() - began


def redelivered(total: int) -> list[int]:
    """Old batch numbers delivered again after the restart (spread over the history)."""
    return list(range(0, total, max(1, total // 100)))


def test_parquet_sink_many_batches_keys_and_a_restart(tmp_path):
    """BATCHES batches (10 rows each) into one Parquet path, a batch staged but not
    committed at the "crash", then a new sink over the same path and a redelivery of
    ~100 old batches: every row once, one directory per committed batch, nothing staged
    left, the manifest holding every key."""
    from ackflow.sinks import ParquetSink

    path = tmp_path / "p"
    sink = ParquetSink(path)
    sink.open()
    sink.prepare(SCHEMA)
    commit_batches(sink, range(BATCHES))
    staged = sink.write_partition("crashed", 0, rows(BATCHES))  # never committed
    assert staged.token
    sink.close()
    again = ParquetSink(path)
    again.open()  # the unrecorded staged batch is removed
    assert os.listdir(path / "_staging") == []
    again.prepare(SCHEMA)
    commit_batches(again, redelivered(BATCHES), prefix="r")
    commit_batches(again, [BATCHES])  # the crashed batch, delivered again
    again.close()
    table = pq.read_table(path)
    want = (BATCHES + 1) * 10
    assert table.num_rows == want and len(set(table.column("id").to_pylist())) == want
    assert len([n for n in os.listdir(path) if n.startswith("batch=")]) == BATCHES + 1
    import sqlite3

    db = sqlite3.connect(path / "_manifest.db")
    assert db.execute("SELECT SUM(last - first + 1) FROM key_runs").fetchone()[0] == want  # keys in runs
    assert (
        db.execute("SELECT SUM(dropped) FROM batches").fetchone()[0] == len(redelivered(BATCHES)) * 10
    )  # every redelivered row left out, and counted
    db.close()


def test_postgres_sink_many_batches_and_a_restart(postgres, pg_table):
    """BATCHES / 2 batches of 40 rows upserted into one table, then a new sink object (a
    restart) that writes ~100 old batches again: every row once (the table's key)."""
    import psycopg

    from ackflow.sinks import Postgres

    def batch(n: int) -> pa.Table:
        return rows(n, per=40)

    sink = Postgres(postgres.dsn, pg_table, create=True)
    sink.open()
    sink.prepare(SCHEMA)
    for n in range(BATCHES // 2):
        result = sink.write_partition(f"b{n}", 0, batch(n))
        assert not result.failed
    again = Postgres(postgres.dsn, pg_table, create=True)
    again.open()
    again.prepare(SCHEMA)
    for n in redelivered(BATCHES // 2):
        assert not again.write_partition(f"r{n}", 0, batch(n)).failed
    with psycopg.connect(postgres.dsn) as c:
        total, distinct = c.execute(f'SELECT COUNT(*), COUNT(DISTINCT id) FROM "{pg_table}"').fetchone()
    assert total == distinct == BATCHES // 2 * 40


def test_delta_sink_log_stays_bounded_over_many_batches_and_a_crash(tmp_path):
    """BATCHES / 2 batches into one Delta table with ``keep_versions=50``: the log folder
    stays bounded (before: one JSON per batch, kept 30 days, and every commit listed the
    whole folder: 26 -> 75 ms per commit over 5 000 batches). Then a crash between the
    table commit and the key record, a new sink, and a redelivery of old batches: the
    unrecorded commit is found in the trimmed log, every row once, and time travel
    reaches ``keep_versions`` back."""
    from deltalake import DeltaTable

    from ackflow.sinks import Delta

    total, keep = BATCHES // 2, 50
    path = tmp_path / "t"
    sink = Delta(path, keep_versions=keep)
    sink.open()
    sink.prepare(SCHEMA)
    log_dir = path / "_delta_log"
    longest = 0
    for start in range(0, total, 50):
        commit_batches(sink, range(start, min(start + 50, total)))
        longest = max(longest, len(os.listdir(log_dir)))
    # keep versions + one checkpoint interval (100) + half a keep between trims +
    # checkpoints and the pointer (before: one entry per version, 500 here)
    assert longest <= keep + 100 + keep // 2 + 4, f"the log held {longest} entries"
    faults.arm("delta.after_commit", "raise")
    try:
        with pytest.raises(faults.InjectedFault):
            commit_batches(sink, [total])
    finally:
        faults.disarm()
    sink.close()
    again = Delta(path, keep_versions=keep)
    again.open()
    again.prepare(SCHEMA)
    commit_batches(again, [total])  # its messages came again: recorded, not re-added
    commit_batches(again, redelivered(total), prefix="r")
    commit_batches(again, [total + 1])
    again.close()
    table = DeltaTable(str(path))
    data = table.to_pyarrow_table()
    want = (total + 2) * 10
    assert data.num_rows == want and len(set(data.column("id").to_pylist())) == want
    version = table.version()
    assert version == total + 2  # the create, then one version per batch with new rows
    assert DeltaTable(str(path), version=version - keep).version() == version - keep
    assert len(os.listdir(log_dir)) <= keep + 100 + keep // 2 + 4


def test_rabbitmq_sink_many_partitions_bad_rows_and_a_restart(rabbitmq):
    """MESSAGES rows published in 200 partitions (one connection each), every 97th row
    with a routing key AMQP cannot carry, then a new sink object (a restart) that
    publishes 20 of the partitions again: the bad rows fail alone, every good row is
    confirmed and arrives with its row key as message id (a redelivered one with the
    same id), and no connection or file descriptor is left behind."""
    from ackflow.sinks import RabbitMQSink

    ex, out_q = names("scale-ex"), names("scale-out")
    setup(
        rabbitmq.url,
        queue=names("unused"),
        out_exchange=ex,
        out_queue=out_q,
        out_args={"x-max-length": 10 * MESSAGES},
    )
    per = MESSAGES // 200

    def part(p: int) -> pa.Table:
        ids = list(range(p * per, (p + 1) * per))
        return pa.table(
            {
                "n": ids,
                "rk": ["x" * 300 if i % 97 == 0 else out_q for i in ids],
                ROW_KEY: [f"m{i}#0" for i in ids],
            }
        )

    before = connections_to(rabbitmq.port)
    sink = RabbitMQSink(rabbitmq.url, ex, routing_key_column="rk")
    sink.open()
    bad: set[int] = set()
    for p in range(200):
        result = sink.write_partition("b", p, part(p))
        bad.update(p * per + i for i in result.failed)
        assert all("routing key" in why for why in result.failed.values())
    again = RabbitMQSink(rabbitmq.url, ex, routing_key_column="rk")
    again.open()
    for p in range(0, 200, 10):
        again.write_partition("r", p, part(p))
    assert bad == {i for i in range(MESSAGES) if i % 97 == 0}
    good = MESSAGES - len(bad)
    expected = good + sum(1 for p in range(0, 200, 10) for i in range(p * per, (p + 1) * per) if i % 97)
    got = []
    deadline = time.monotonic() + 30  # (drain stops after 0.5 s without a message)
    while len(got) < expected and time.monotonic() < deadline:
        got += drain(rabbitmq.url, out_q)
    got += drain(rabbitmq.url, out_q)  # nothing more may come
    ids = [mid for mid, _, _ in got]
    assert len(set(ids)) == good
    assert set(ids) == {f"m{i}#0" for i in range(MESSAGES) if i % 97}
    assert len(ids) == expected
    assert all(body["n"] == int(mid[1:-2]) for mid, body, _ in got)
    assert connections_to(rabbitmq.port) - before == set()  # every connection it made closed


def test_delta_log_is_bounded_when_the_table_writes_no_checkpoints_of_its_own(tmp_path):
    """A table made elsewhere with a checkpoint interval longer than ``keep_versions``:
    the sink makes a checkpoint itself, and the log stays bounded all the same."""
    from deltalake import DeltaTable

    from ackflow.sinks import Delta

    path = tmp_path / "t"
    columns = pa.schema([*SCHEMA, pa.field("ackflow_key", pa.string())])
    DeltaTable.create(str(path), columns, configuration={"delta.checkpointInterval": "100000"})
    sink = Delta(path, keep_versions=6, create=False)
    sink.open()
    sink.prepare(SCHEMA)
    longest = 0
    for n in range(60):
        commit_batches(sink, [n])
        longest = max(longest, len(os.listdir(path / "_delta_log")))
    sink.close()
    names = os.listdir(path / "_delta_log")
    assert any(".checkpoint." in n for n in names)
    # keep versions, up to keep more before the next checkpoint is old enough, half a keep
    # between trims, three checkpoints and the pointer (measured: 19 at most)
    assert longest <= 2 * 6 + 3 + 4, f"the log held {longest} entries"
    data = DeltaTable(str(path)).to_pyarrow_table()
    assert data.num_rows == 600 and len(set(data.column("id").to_pylist())) == 600


def test_embedded_queue_sink_many_batches_remembered_ids_and_a_restart(tmp_path):
    """BATCHES batches of 10 rows published into an embedded queue (every id remembered),
    then a new sink (a restart) publishing ~100 old batches again: each row is queued
    once. With ``remember_for_s``, ids past the horizon are forgotten: the remembered ids
    stay bounded by what the horizon holds, not by the history."""
    from ackflow.embedded import EmbeddedQueue
    from ackflow.sinks import EmbeddedQueue as EmbeddedQueueSink

    path = str(tmp_path / "out.db")
    sink = EmbeddedQueueSink(path, "next")
    sink.open()
    sink.prepare(SCHEMA)
    commit_batches(sink, range(BATCHES))
    again = EmbeddedQueueSink(path, "next")
    again.open()
    commit_batches(again, redelivered(BATCHES), prefix="r")
    q = EmbeddedQueue(path)
    assert q.stats("next")["ready"] == BATCHES * 10  # the redelivered rows were not queued
    ids = {json.loads(m["body"])["id"] for m in q.peek("next", BATCHES * 10)}
    assert ids == set(range(BATCHES * 10))
    q.close()
    # a horizon: ids older than it are forgotten, so the file stops growing
    bounded = EmbeddedQueueSink(str(tmp_path / "bounded.db"), "next", remember_for_s=0.05)
    bounded.open()
    for k in range(5):
        commit_batches(bounded, range(k * 100, (k + 1) * 100), prefix=f"h{k}")
        time.sleep(0.06)
    commit_batches(bounded, [499], prefix="last")  # its commit applies the retention
    import sqlite3

    db = sqlite3.connect(tmp_path / "bounded.db")
    remembered = db.execute("SELECT COUNT(*) FROM published_ids").fetchone()[0]
    db.close()
    assert remembered <= 110, remembered  # the last batches' ids, not all 5,000
