"""grouped_within(n, timeout, *keys): groups across batches; members stay unsettled
(and count against the window) until their group is written; a timer flushes."""

import json

import pytest

import ackflow
from ackflow.sinks import MemorySink
from ackflow.testing import FailingSink, ListSource

pytestmark = pytest.mark.spark


class CheckingSource(ListSource):
    """Asserts, at every ack, that the acked message's row is already in the sink."""

    def __init__(self, bodies, sink):
        super().__init__(bodies)
        self.sink = sink
        self.early_acks = []

    def ack(self, deliveries):
        written = {r["n"] for g in self.sink.rows for r in g["rows"]}
        self.early_acks += [d.key for d in deliveries if json.loads(d.body)["n"] not in written]
        super().ack(deliveries)


def bodies(n, keys="ab"):
    return [json.dumps({"n": i, "k": keys[i % len(keys)]}) for i in range(n)]


def test_groups_span_batches_and_members_wait_for_the_write(spark):
    sink = MemorySink()
    src = CheckingSource(bodies(24), sink)
    report = ackflow.run(ackflow.Flow(src).grouped_within(6, 30.0, "k", name="six").to(sink),
                         spark=spark, batch_size=4, max_inflight=40, batch_timeout_s=0.1,
                         until_idle=0.3)
    assert report.acked == 24 and src.early_acks == []
    assert sorted((g["k"], g["count"]) for g in sink.rows) == [("a", 6)] * 2 + [("b", 6)] * 2
    assert sorted(r["n"] for g in sink.rows for r in g["rows"]) == list(range(24))
    assert report.batches >= 6  # batches of 4 messages made groups of 6: across batches


def test_a_full_window_cannot_deadlock_the_timer_flushes(spark):
    sink = MemorySink()
    seen = []
    src = ListSource(bodies(30))
    report = ackflow.run(ackflow.Flow(src).grouped_within(1000, 0.3, name="big").to(sink),
                         spark=spark, batch_size=3, max_inflight=6, batch_timeout_s=0.05,
                         until_idle=0.5, progress=lambda r, w: seen.append(w.in_flight))
    assert report.acked == 30
    assert max(seen) <= 6 and report.throttle_episodes >= 1  # the window filled with held rows
    assert all(g["count"] <= 6 for g in sink.rows)  # partial groups, flushed by the timer


def test_a_failed_group_fails_every_member_across_batches(spark):
    src = ListSource(bodies(12, keys="abc"))
    sink = FailingSink(fail_if=lambda g: g["k"] == "b")
    report = ackflow.run(ackflow.Flow(src).grouped_within(4, 30.0, "k").to(sink), spark=spark,
                         batch_size=3, max_inflight=20, batch_timeout_s=0.05, until_idle=0.3)
    final = src.final()
    assert {k for k, v in final.items() if v != "acked"} == {f"m{i}" for i in range(1, 12, 3)}
    assert report.acked == 8 and report.dead_lettered == 4
    assert src.failures["m4"].step == "failing"


def test_steps_before_and_after_the_window(spark):
    def check(r):
        if r["n"] == 5:
            raise ValueError("five")
        return r

    sink = MemorySink()
    src = ListSource(bodies(10))
    flow = (ackflow.Flow(src).map(check, name="check").filter(lambda r: r["n"] != 7, name="no7")
            .grouped_within(3, 0.3, "k")
            .map(lambda g: {"k": g["k"], "sum": sum(r["n"] for r in g["rows"])}, name="sum")
            .to(sink))
    report = ackflow.run(flow, spark=spark, batch_size=4, max_inflight=20,
                         batch_timeout_s=0.05, until_idle=0.5)
    assert src.final()["m5"] == "dead_lettered" and src.final()["m7"] == "acked"
    assert report.acked == 9
    assert sum(g["sum"] for g in sink.rows) == sum(i for i in range(10) if i not in (5, 7))
