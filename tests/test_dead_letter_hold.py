"""A message at its last delivery whose dead letter the error sink refuses is held in
flight and written again (a give-back would make the broker drop it: a quorum queue's
x-delivery-limit; the real broker is in test_broker_conformance.py). Here the engine's
side of it, with grouped_within, whose members settle through several group jobs: each
case failed before its fix (found by review): a held member was acked by a later group's
success with no dead letter, the run crashed with a KeyError, or a member held twice was
written and settled twice."""

import json
import threading
import time

import ackflow
from ackflow import Flow
from ackflow.engine.loop import Engine
from ackflow.sinks.memory import MemorySink
from ackflow.testing import ListSource
from helpers import wait_until


class LastSource(ListSource):
    """A source whose listed messages are at their last delivery (a quorum queue's
    limit): a give-back would make the broker drop them."""

    def __init__(self, bodies, last):
        super().__init__(bodies, policy=ackflow.RetryPolicy(max_deliveries=1))
        self.last = set(last)

    def unreleasable(self, deliveries):
        return [d for d in deliveries if not d.settled and d.key in self.last]


class Down(MemorySink):
    """An error sink whose writes raise until ``healed`` is set."""

    def __init__(self):
        super().__init__("dead")
        self.healed = threading.Event()
        self.tries = 0

    def write_partition(self, batch_id, partition, rows):
        self.tries += 1
        if not self.healed.is_set():
            raise ConnectionRefusedError("dead-letter database: connection refused")
        return super().write_partition(batch_id, partition, rows)


def split(r):
    return [{"k": k, "poison": k in r["bad"]} for k in r["ks"]]


def check(g):
    if any(r["poison"] for r in g["rows"]):
        raise ValueError("the group has a poison row")
    return {"k": g["k"], "count": g["count"]}


def flow_of(src, dead, out, n, timeout_s):
    return (
        Flow(src)
        .flat_map(split, name="split")
        .grouped_within(n, timeout_s, "k")
        .map(check, name="after")
        .to(out)
        .on_error(dead)
    )


def start(flow, **kw):
    opts = {
        "executor": "local",
        "handle_signals": False,
        "batch_size": 10,
        "max_inflight": 10,
        "linger_s": 0.0,
        "batch_timeout_s": 0.01,
        **kw,
    }
    engine = Engine(flow, **opts)
    out: dict = {}

    def go():
        try:
            out["report"] = engine.run()
        except Exception as e:  # noqa: BLE001 - the test looks at it
            out["error"] = e

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return engine, out, t


def run_healing(src, n, timeout_s, until_idle):
    """Run until the error sink refused twice, heal it, and return (report, dead, out)."""
    dead, out = Down(), MemorySink("out")
    _, res, t = start(flow_of(src, dead, out, n, timeout_s), until_idle=until_idle)
    assert wait_until(lambda: dead.tries >= 2 or not t.is_alive(), timeout=30)
    dead.healed.set()
    t.join(30)
    assert not t.is_alive() and "error" not in res, res.get("error")
    return res["report"], dead, out


def dead_bodies(dead):
    return [json.loads(r["body"]) for r in dead.rows]


def test_a_held_member_whose_last_group_failed_is_dead_lettered_not_acked():
    """Its only group failed: it was held, then the group loop acked it (it had no group
    left) and the run crashed with a KeyError in _forget."""
    src = LastSource(
        bodies=[json.dumps({"ks": ["a"], "bad": []}), json.dumps({"ks": ["p"], "bad": ["p"]})], last=["m1"]
    )
    report, dead, out = run_healing(src, 1, 0.05, until_idle=1.0)
    assert dead_bodies(dead) == [{"ks": ["p"], "bad": ["p"]}]
    assert src.settled == {"m0": ["acked"], "m1": ["acked"]}  # m1: acked once its dead letter is written
    assert (report.acked, report.dead_lettered) == (1, 1)
    assert out.rows == [{"k": "a", "count": 1}]


def test_a_held_member_leaves_its_other_groups():
    """Its row in another group stayed there: that group's success acked the message and
    its dead letter was never written."""
    src = LastSource(
        bodies=[json.dumps({"ks": ["x"], "bad": []}), json.dumps({"ks": ["x", "y"], "bad": ["x"]})],
        last=["m1"],
    )
    report, dead, out = run_healing(src, 2, 0.4, until_idle=1.5)
    assert dead_bodies(dead) == [{"ks": ["x", "y"], "bad": ["x"]}]
    assert src.settled["m1"] == ["acked"] and report.dead_lettered == 1
    assert {"k": "y", "count": 1} not in out.rows  # its row in y left with it


def test_a_member_failing_in_two_groups_is_held_once_and_written_once():
    """Two of its groups failed in two jobs: it was held twice; the drain's retry wrote two
    dead letters and settled it twice (AlreadySettled)."""
    src = LastSource(
        bodies=[
            json.dumps({"ks": ["x"], "bad": []}),
            json.dumps({"ks": ["x", "y", "z"], "bad": ["x", "y"]}),
            json.dumps({"ks": ["y"], "bad": []}),
        ],
        last=["m1"],
    )
    dead, out = Down(), MemorySink("out")
    engine, res, t = start(
        flow_of(src, dead, out, 2, 30.0),
        until_idle=None,
        batch_size=1,
        max_concurrent_batches=2,
        drain_timeout_s=3.0,
    )
    assert wait_until(lambda: dead.tries >= 3 or not t.is_alive(), timeout=30)
    time.sleep(0.3)  # the other group's job too
    assert [w[2].key for w in list(engine.dead_waiting)] == ["m1"]
    dead.healed.set()
    engine.request_stop()
    t.join(30)
    assert not t.is_alive() and "error" not in res, res.get("error")
    assert dead_bodies(dead) == [{"ks": ["x", "y", "z"], "bad": ["x", "y"]}]
    assert src.settled["m1"] == ["acked"]
