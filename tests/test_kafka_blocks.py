"""Blocks for the Kafka source (sources/kafka_blocks.py), against the real broker: a
partition's first deliveries go to the engine as one delivery; its messages keep their
own identities; the commit passes a block only once it is acked; a block that fails
comes again one message at a time (each a first delivery); a block in flight when its
partition is revoked is let go with it, and its late ack commits nothing."""

from __future__ import annotations

import json
import time
import uuid

import pytest

import ackflow
from ackflow.core.policy import RetryPolicy
from ackflow.core.settlement import Delivery
from ackflow.sinks import MemorySink
from ackflow.testing import KeyedSink
from kafka_help import committed
from test_kafka import committed_soon, produce, produce_raw, pull_until, source, topic

pytestmark = pytest.mark.kafka


def messages(ds):
    return sum(d.messages for d in ds)


def pull_messages(src, n, timeout=60.0):
    got = []
    deadline = time.monotonic() + timeout
    while messages(got) < n and time.monotonic() < deadline:
        got += src.pull(n - messages(got), 0.2)
    return got


def opened(kafka, name, group, tmp_path, **kw):
    src = source(kafka, name, group, tmp_path, **kw)
    assert src.use_blocks(True)
    src.configure(max_inflight=10_000, error_sink=True)
    src.open()
    return src


def two_members(kafka, tmp_path, revoke_timeout_s):
    """A topic of two partitions holding 40 messages; member ``a`` open (blocks), ``b``
    configured, not open (its join revokes one partition from ``a``)."""
    name, group = topic(kafka, 2), f"g-{uuid.uuid4().hex[:6]}"
    produce(kafka, name, [b"%d" % i for i in range(40)], partitions=2)
    a = opened(kafka, name, group, tmp_path / "a", revoke_timeout_s=revoke_timeout_s)
    b = source(kafka, name, group, tmp_path / "b", revoke_timeout_s=revoke_timeout_s)
    b.configure(max_inflight=1000, error_sink=True)
    return name, group, a, b


def test_first_deliveries_come_as_blocks_with_each_message_s_identity_and_body(kafka, tmp_path):
    name, group = topic(kafka, 2), f"g-{uuid.uuid4().hex[:6]}"
    produce(kafka, name, [b"%d" % i for i in range(200)], partitions=2)
    src = opened(kafka, name, group, tmp_path)
    try:
        got = pull_messages(src, 200)
        blocks = [d for d in got if d.parts is not None]
        assert blocks and messages(got) == 200
        seen = {}
        for d in got:
            ids, bodies = d.parts if d.parts is not None else ([d.key], [d.body])
            for ident, body in zip(ids, bodies, strict=True):
                seen[ident] = body.as_py() if hasattr(body, "as_py") else body
        # each identity as the message alone would have it, and its own body
        want = {f"{name}/{i % 2}@{i // 2}": b"%d" % i for i in range(200)}
        assert seen == want
        assert all(Delivery(0, k, b"").identity == k for k in seen)
        assert src.status()["partitions"][f"{name}[0]"]["settled_to"] == 0  # in flight
        src.ack(got)
        want_c = {0: 100, 1: 100}
        assert committed_soon(kafka, name, group, want_c, 10) == want_c
    finally:
        src.close()


def test_the_commit_passes_a_block_only_once_it_is_acked(kafka, tmp_path):
    name, group = topic(kafka, 1), f"g-{uuid.uuid4().hex[:6]}"
    produce(kafka, name, [b"%d" % i for i in range(40)], partitions=1)
    src = opened(kafka, name, group, tmp_path)
    src.block_size.now = 8
    try:
        got = pull_messages(src, 40)
        assert [d.messages for d in got] == [8] * 5
        src.ack([got[0], got[2]])  # 0-7 and 16-23: the gap at 8-15 holds the commit
        assert committed_soon(kafka, name, group, {0: 8}, 10) == {0: 8}
        time.sleep(0.5)
        assert committed(kafka, name, group, 1) == {0: 8}
        src.ack(got[1:])
        assert committed_soon(kafka, name, group, {0: 40}, 10) == {0: 40}
    finally:
        src.close()


def test_a_split_or_released_block_comes_again_one_message_at_a_time(kafka, tmp_path):
    """Each a first delivery, with the headers a single delivery has; nothing commits
    past them until they settle; the next blocks are smaller."""
    name, group = topic(kafka, 1), f"g-{uuid.uuid4().hex[:6]}"
    produce_raw(kafka, name, [(0, b"%d" % i, b"k%d" % i, [("tenant", b"acme")]) for i in range(30)])
    src = opened(kafka, name, group, tmp_path)
    src.block_size.now = 10
    try:
        got = pull_messages(src, 30)
        assert [d.messages for d in got] == [10, 10, 10]
        src.split([got[0]])
        src.release([got[2]])  # (a stop: given back, no try spent)
        assert src.block_size.now == 5
        src.ack([got[1]])
        again = pull_until(src, 20)
        assert sorted(d.key for d in again) == sorted(f"{name}/0@{o}" for o in [*range(10), *range(20, 30)])
        assert all(d.parts is None and d.delivery_count == 1 for d in again)
        one = next(d for d in again if d.key == f"{name}/0@3")
        assert one.body == b"3" and one.headers["key"] == "k3" and one.headers["tenant"] == "acme"
        assert one.headers["offset"] == "3" and one.headers["partition"] == "0"
        time.sleep(0.5)
        assert committed(kafka, name, group, 1)[0] in (-1001, 0)  # 0-9 in flight again
        src.split([got[0]])  # twice, or after its ack: nothing comes again
        src.ack(again)
        assert committed_soon(kafka, name, group, {0: 30}, 10) == {0: 30}
        assert src.pull(100, 0.3) == []
    finally:
        src.close()


def test_a_block_in_flight_at_a_revoke_is_let_go_and_its_late_ack_commits_nothing(kafka, tmp_path):
    parts = 2
    name, group, a, b = two_members(kafka, tmp_path, 0.5)
    try:
        first = pull_messages(a, 40)
        assert all(d.parts is not None for d in first) and messages(first) == 40
        b.open()
        deadline = time.monotonic() + 60
        while not b.status()["partitions"] and time.monotonic() < deadline:
            b.pull(0, 0.1)
        [moved] = [int(t.split("[")[1].rstrip("]")) for t in b.status()["partitions"]]
        assert a.given_up == 20  # the moved partition's block, let go with it
        assert a._in_blocks == 20 and a._held() == 20
        stale = a.ack(first)  # late for the moved partition: commits nothing there
        assert [d.parts[0][0].split("@")[0] for d in stale] == [f"{name}/{moved}"]
        time.sleep(1.0)
        got = committed(kafka, name, group, parts)
        assert got[moved] in (-1001, 0) and got[1 - moved] == 20
        assert a._in_blocks == 0
        again = pull_until(b, 20)  # the new owner reads it all again
        assert sorted(d.key for d in again) == sorted(f"{name}/{moved}@{o}" for o in range(20))
        b.ack(again)
        want = {p: 20 for p in range(parts)}
        assert committed_soon(kafka, name, group, want, 10) == want
    finally:
        b.close()
        a.close()


def test_a_message_read_before_comes_alone_with_its_count(kafka, tmp_path):
    """A restart reads the uncommitted messages again: handed out before, they are not
    first deliveries, and come one by one with their counts (a poison one never splits
    block after block)."""
    name, group = topic(kafka, 1), f"g-{uuid.uuid4().hex[:6]}"
    produce(kafka, name, [b"%d" % i for i in range(10)], partitions=1)
    src = opened(kafka, name, group, tmp_path)
    try:
        [block] = pull_messages(src, 10)
        assert block.messages == 10
    finally:
        src.close()  # never acked
    src = opened(kafka, name, group, tmp_path)
    try:
        again = pull_messages(src, 10)
        assert len(again) == 10 and all(d.parts is None and d.delivery_count == 2 for d in again)
    finally:
        src.close()


def test_a_flow_over_blocks_dead_letters_only_the_poison_messages(spark, kafka, tmp_path):
    name, group = topic(kafka), f"g-{uuid.uuid4().hex[:6]}"
    bodies = [json.dumps({"i": i, "qty": -1 if i % 50 == 7 else 1}).encode() for i in range(600)]
    produce(kafka, name, bodies)

    def check(r):
        if r["qty"] < 0:
            raise ValueError(f"order {r['i']}: qty must be positive")
        return r

    out, dead = KeyedSink(), MemorySink("dead")
    src = source(kafka, name, group, tmp_path, policy=RetryPolicy(max_deliveries=2, backoff_s=0.05))
    report = ackflow.run(
        ackflow.Flow(src).map(check, name="check").to(out).on_error(dead),
        spark=spark,
        until_idle=3,
        batch_size=200,
        max_inflight=600,
    )
    assert report.split > 0  # blocks were used, and the poison ones split theirs
    assert report.acked == 588 and report.dead_lettered == 12
    assert sorted(r["i"] for r in out.rows.values()) == [i for i in range(600) if i % 50 != 7]
    assert not out.conflicts
    assert sorted(json.loads(r["body"])["i"] for r in dead.rows) == [i for i in range(600) if i % 50 == 7]
    # split: a first delivery, then a retry; the message's own identity as provenance
    assert all(r["step"] == "check" and r["deliveries"] == 2 for r in dead.rows)
    assert {r["message"] for r in dead.rows} == {f"{name}/{i % 3}@{i // 3}" for i in range(7, 600, 50)}
    assert committed(kafka, name, group) == {0: 200, 1: 200, 2: 200}


def test_a_block_split_while_its_partition_is_revoked_does_not_hold_the_revoke(kafka, tmp_path):
    """Found by review: a split during a revoke queued the block's messages for a retry
    that never came (their partition was going), and the revoke waited for them until
    its deadline, counting them as given up."""
    import threading

    name, _, a, b = two_members(kafka, tmp_path, 30)
    try:
        first = pull_messages(a, 40)
        assert len(first) == 2
        joined = threading.Thread(target=b.open)
        joined.start()
        deadline = time.monotonic() + 60
        while not any(p.revoking for p in a._parts.values()) and time.monotonic() < deadline:
            time.sleep(0.02)
        a.split(first)  # the moved partition's block: dropped; the other's: come again
        joined.join(60)
        while not b.status()["partitions"] and time.monotonic() < deadline:
            b.pull(0, 0.1)
        assert b.status()["partitions"] and time.monotonic() < deadline
        assert a.given_up == 0 and a._in_blocks == 0
        [kept] = [int(t.split("[")[1].rstrip("]")) for t in a.status()["partitions"]]
        again = pull_until(a, 20)
        assert sorted(d.key for d in again) == sorted(f"{name}/{kept}@{o}" for o in range(20))
        assert all(d.delivery_count == 1 for d in again)
        assert not any(k[0][1] != kept for k in a._bodies)
    finally:
        b.close()
        a.close()


class _Msg:
    def __init__(self, n):
        self._v = b"x" * n

    def value(self):
        return self._v


def test_a_block_holds_at_most_its_bytes():
    """Found by review: 4 096 large messages made a block past Arrow's 2 GiB a binary
    array holds, and the batch's input could not be built."""
    from ackflow.sources.kafka_blocks import BLOCK_BYTES, _cuts

    sizes = [BLOCK_BYTES // 3] * 7 + [BLOCK_BYTES * 2] + [10] * 5
    msgs = [_Msg(n) for n in sizes]
    cuts = _cuts(list(range(len(msgs))), msgs, 4096)
    assert [len(o) for o, _ in cuts] == [3, 3, 1, 1, 5]
    assert [o for o, _ in cuts][3] == [7]  # larger than a block: alone
    assert all(sum(len(m.value()) for m in ms) <= BLOCK_BYTES or len(ms) == 1 for _, ms in cuts)
    assert [len(o) for o, _ in _cuts(list(range(5)), [_Msg(1)] * 5, 2)] == [2, 2, 1]
