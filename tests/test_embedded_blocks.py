"""The embedded queue in blocks (issue 32): a lease of several messages is one delivery on
the driver (engine/blocks.py), one input row per message in the job. A failing message
fails alone; law 12 holds for each message of a block; a crash or a stop loses and
doubles nothing; leases of a block (and of a split block's messages) are kept alive."""

import json

import pytest

import ackflow
from ackflow import faults
from ackflow.core.policy import RetryPolicy
from ackflow.core.settlement import Delivery, Settlement
from ackflow.embedded import EmbeddedQueue
from ackflow.engine.loop import Engine
from ackflow.sinks import Memory
from ackflow.sources import EmbeddedQueue as EmbeddedSource
from ackflow.sources.base import BlockSize
from ackflow.sources.embedded import embedded_block
from ackflow.testing import KeyedSink
from helpers import CountingPulls, must_be_positive
from helpers import run_local as run


def publish(db, n, bad=(), queue="q"):
    q = EmbeddedQueue(db)
    q.publish(queue, [json.dumps({"n": -i if i in bad else i}).encode() for i in range(n)])
    q.close()


class Counting(CountingPulls, EmbeddedSource):
    pulls: list = []


def test_a_bad_message_fails_alone_and_counts_add_up(tmp_path):
    db = str(tmp_path / "q.db")
    bad = {3, 4, 777, 1999}
    publish(db, 2000, bad)
    Counting.pulls = []
    sink = KeyedSink()
    src = Counting(db, "q", policy=RetryPolicy(max_deliveries=2, backoff_s=0.01))
    report = run(ackflow.Flow(src).map(must_be_positive, name="check").to(sink))
    assert max(Counting.pulls) > 1, "blocks were used"
    assert report.acked == 1996 and report.dead_lettered == 4 and report.nacked == 4
    assert report.pulled == report.acked + report.nacked + report.dead_lettered + report.split
    assert report.rows_written == {"keyed": 1996}  # a split block's rows counted once
    assert sorted(r["n"] for r in sink.rows.values()) == [i for i in range(2000) if i not in bad]
    assert not sink.conflicts
    q = EmbeddedQueue(db)
    dead = q.dead_letters("q")
    stats = q.stats("q")
    q.close()
    assert sorted(json.loads(d.body)["n"] for d in dead) == sorted(-i for i in bad)
    assert {d.step for d in dead} == {"check"}
    assert stats["ready"] + stats["leased"] + stats["delayed"] == 0


def test_no_blocks_for_a_sink_that_appends(tmp_path):
    db = str(tmp_path / "q.db")
    publish(db, 300, {5})
    Counting.pulls = []
    sink = Memory()
    report = run(
        ackflow.Flow(Counting(db, "q", policy=RetryPolicy(max_deliveries=1))).map(must_be_positive).to(sink)
    )
    assert set(Counting.pulls) == {1}
    assert report.acked == 299 and len(sink.rows) == 299


@pytest.mark.parametrize("point", ["batch.after_commit", "engine.mid_ack", "embedded.before_ack"])
def test_a_crash_between_two_durable_steps_loses_and_doubles_nothing(tmp_path, point):
    db = str(tmp_path / "q.db")
    bad = {10, 2500}
    publish(db, 3000, bad)
    sink = KeyedSink()

    def flow():
        src = EmbeddedSource(db, "q", policy=RetryPolicy(max_deliveries=1))
        return ackflow.Flow(src).map(must_be_positive, name="check").to(sink)

    faults.arm(point, "raise", nth=2)
    try:
        with pytest.raises(faults.InjectedFault):
            run(flow())
    finally:
        faults.disarm()
    # the leases of the crashed run are given back when the next consumer claims the queue
    run(flow())
    assert not sink.conflicts
    assert sorted(r["n"] for r in sink.rows.values()) == [i for i in range(3000) if i not in bad]
    q = EmbeddedQueue(db)
    stats, dead = q.stats("q"), q.dead_letters("q")
    q.close()
    assert stats["ready"] + stats["leased"] + stats["delayed"] == 0
    assert sorted(json.loads(d.body)["n"] for d in dead) == sorted(-i for i in bad)


def test_split_messages_keep_their_leases_and_a_stop_gives_them_back(tmp_path):
    db = str(tmp_path / "q.db")
    publish(db, 5)
    src = EmbeddedSource(db, "q", visibility_timeout=300)
    src.configure(max_inflight=100, error_sink=False)
    assert src.use_blocks(True)
    src.open()
    (block,) = src.pull(5, 0.1)
    assert block.messages == 5 and len({r[0] for r in block.handle}) == 5
    src.split([block])
    before = src.q._db.execute("SELECT max(visible_at) FROM messages").fetchone()[0]
    src.keepalive([])  # the split messages are not in the engine yet: extended too
    after = src.q._db.execute("SELECT max(visible_at) FROM messages").fetchone()[0]
    assert after > before
    first = src.pull(2, 0.1)
    assert [d.messages for d in first] == [1, 1]
    rest = src.stop_consuming()
    assert len(rest) == 3
    src.release([*first, *rest])
    stats = src.q.stats("q")
    src.close()
    assert stats["ready"] == 5 and stats["leased"] == 0


def test_a_block_with_a_message_in_flight_already_is_split_at_admission(tmp_path):
    """Law 12 for each message of a block: a block holding an identity that is in flight
    (a redelivery racing a slow batch) is split; its messages come one by one and the
    repeat waits for the first."""
    db = str(tmp_path / "q.db")
    publish(db, 1)
    engine = Engine(
        ackflow.Flow(EmbeddedSource(db, "q")).to(KeyedSink()), executor="local", handle_signals=False
    )
    split = []
    engine.flow.source.split = split.extend  # type: ignore[method-assign]
    engine._blocks = True
    rows_a = [(1, "m-1", b"{}", None, 1, 0.0), (2, "m-2", b"{}", None, 1, 0.0)]
    rows_b = [(3, "m-2", b"{}", None, 1, 0.0), (4, "m-3", b"{}", None, 1, 0.0)]
    a, b = embedded_block(rows_a), embedded_block(rows_b)
    engine.window.take(4)
    fresh = engine._admit([a, b])
    assert fresh == [a]
    assert split == [b] and b.state is Settlement.RELEASED
    assert engine.report.split == 2 and engine.window.in_flight == 2
    assert engine._live == {"m-1": a.lineage_id, "m-2": a.lineage_id}
    # one block repeating an identity inside itself is split too
    c = embedded_block([(5, "m-9", b"{}", None, 1, 0.0), (6, "m-9", b"{}", None, 1, 0.0)])
    engine.window.take(2)
    assert engine._admit([c]) == [] and split == [b, c]
    # its first settles: its identities are no longer live
    Delivery.settle_all([a], Settlement.ACKED)
    engine._forget([a])
    assert engine._live == {} and engine.window.in_flight == 0


def test_block_size_shrinks_where_blocks_split_and_grows_back():
    b = BlockSize(4096, start=4096)
    b.split(3)
    assert b.now == 512
    for _ in range(20):
        b.split()
    assert b.now == 1
    b.acked(3)
    assert b.now == 1
    b.acked(1)
    assert b.now == 2
    for _ in range(40):
        b.acked(10_000)
    assert b.now == 4096
    assert BlockSize(4096).now == 64  # a run starts with small blocks and grows


def test_a_blocks_rows_are_the_rows_of_its_messages_alone():
    """Keys that look like ackflow's own suffixes or an origin prefix, a publisher id
    starting with #, no id: the same row keys and bodies in a block as alone."""
    from ackflow.sinks.base import ROW_KEY
    from ackflow.sources.embedded import one
    from ackflow.spark.blocks import parts_rows
    from ackflow.spark.columns import BODY, HDR, ID, SRC, row_key
    from ackflow.spark.plan import INPUT_SCHEMA

    ids = ["a#1", "2|x", "#7", None, "c!", "b~2", "plain", "0|y"]
    rows = [(i + 1, m, b"body-%d" % i, None, 1, 0.0) for i, m in enumerate(ids)]
    alone = [one(r) for r in rows]
    block = embedded_block(rows)
    block.lineage_id = 9
    t = parts_rows([block], INPUT_SCHEMA, (ID, ROW_KEY, BODY, SRC, HDR))
    assert t.column(ROW_KEY).to_pylist() == [row_key(d.identity) for d in alone]
    assert t.column(BODY).to_pylist() == [d.body for d in alone]
    assert t.column(ID).to_pylist() == [9] * len(ids)
    assert len(set(t.column(ROW_KEY).to_pylist())) == len(ids)


def test_blocks_whose_bodies_pass_2_gib_together_make_their_input_rows():
    """Found by review: the blocks' bodies were copied into one binary array, which
    holds 2 GiB at most; past it the batch's input could not be made and the run
    stopped. (The bodies here are allocated, never written: no memory is touched.)"""
    import numpy as np
    import pyarrow as pa

    from ackflow.spark.columns import BODY, HDR, ID, KEY, SRC
    from ackflow.spark.plan import INPUT_SCHEMA, Plan

    def bodies(n, each):
        offsets = pa.py_buffer(np.arange(0, (n + 1) * each, each, dtype=np.int32).tobytes())
        return pa.Array.from_buffers(pa.binary(), n, [None, offsets, pa.allocate_buffer(n * each)])

    blocks = [
        Delivery(i, f"#b{i}", b"", messages=4, parts=([f"m{i}-{j}" for j in range(4)], bodies(4, 300 << 20)))
        for i in range(2)
    ]
    blocks[1].parts = (blocks[1].parts[0], pa.chunked_array([bodies(2, 300 << 20), bodies(2, 300 << 20)]))
    plan = Plan.__new__(Plan)  # (only what input_table reads)
    plan.flow = ackflow.Flow(EmbeddedSource("unused.db"))
    plan.parallelism = 2
    t = plan.input_table(blocks)
    assert t.schema == INPUT_SCHEMA and t.num_rows == 8
    assert t.column(ID).to_pylist() == [0] * 4 + [1] * 4
    assert t.column(KEY).to_pylist()[4].startswith("m1-0")
    assert sum(len(b) for b in t.column(BODY).chunks) == 8 and sum(
        c.nbytes for c in t.column(BODY).chunks
    ) > (2 << 30)
    assert t.column(SRC).null_count == 0 and t.column(HDR).null_count == 8


def test_many_blocks_make_as_many_input_batches_as_the_parallelism():
    """Each input batch becomes a Spark partition (a Python task): 400 blocks of 64
    messages made 400 tasks a batch once (the bodies kept as one chunk each), and the
    flow ran 20 times slower. (A structural check: how many batches, not how fast.)"""
    from ackflow.spark.plan import Plan

    rows = [(i + 1, f"m{i}", b"{}", None, 1, 0.0) for i in range(400 * 64)]
    blocks = [embedded_block(rows[i : i + 64]) for i in range(0, len(rows), 64)]
    plan = Plan.__new__(Plan)  # (only what input_table reads)
    plan.flow = ackflow.Flow(EmbeddedSource("unused.db"))
    plan.parallelism = 2
    t = plan.input_table(blocks)
    assert t.num_rows == 400 * 64 and len(t.to_batches()) == 2


def test_a_block_whose_lease_was_lost_counts_only_that_message_again(tmp_path):
    """A lease lost mid-block (a stalled engine): the queue acks the block's other
    messages; the engine counts them acked and the lost one redelivered, not the block."""
    db = str(tmp_path / "q.db")
    publish(db, 6)
    engine = Engine(
        ackflow.Flow(EmbeddedSource(db, "q")).to(KeyedSink()), executor="local", handle_signals=False
    )
    src = engine.flow.source
    src.configure(max_inflight=100, error_sink=False)
    engine._blocks = src.use_blocks(True)
    src.open()
    (block,) = src.pull(6, 0.1)
    engine.window.take(6)
    engine._admit([block])
    row = block.handle[2][0]
    src.q._db.execute("UPDATE messages SET deliveries = deliveries + 1 WHERE id = ?", (row,))  # leased again
    engine._ack([block])
    assert engine.report.acked == 5 and engine.report.redelivered == 1
    assert src.q.stats("q")["leased"] == 1  # the one leased again stays the queue's
    src.close()


def test_a_message_delivered_before_comes_alone_not_in_a_block(tmp_path):
    """A retried message (a poison one, often) never joins a block: it would split one
    block after another."""
    from ackflow.core.ledger import Failure

    db = str(tmp_path / "q.db")
    publish(db, 6)
    src = EmbeddedSource(db, "q", policy=RetryPolicy(max_deliveries=5, backoff_s=0.0))
    src.configure(max_inflight=100, error_sink=False)
    src.use_blocks(True)
    src.open()
    (block,) = src.pull(6, 0.1)
    src.split([block])
    alone = src.pull(6, 0.1)
    src.nack([(alone[0], Failure("check", "bad"))])
    src.release(alone[1:])
    again = src.pull(6, 0.5)
    sizes = sorted(d.messages for d in again)
    src.close()
    counts = {d.messages: d for d in again}
    assert sizes == [1, 5] and counts[1].delivery_count == 2
