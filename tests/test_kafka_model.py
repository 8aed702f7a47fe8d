"""The model-based test with a Kafka source, against the real broker (tansu, started by
the ``kafka`` fixture): what the engine's model test (tests/test_model.py) proves with a
simulated broker, here with Kafka's own rules (offsets, consumer groups, commits,
transaction markers, rebalances) in the loop.

An example is a topic of 1-3 partitions holding good messages, poison ones (a step
refuses them) and bodies that are not JSON, written by a transactional producer (its
commit markers are offsets no consumer receives; an aborted transaction's records, when
asked for, too on Kafka, while tansu 0.6 hands them to read_committed consumers, where
they are messages like any other); a retry policy; batch size, window and concurrency; fault points armed to
crash the run (the engine's and the Kafka source's own, some in its consumer thread);
and optionally a second group member that joins mid-run and leaves (a rebalance with
messages in flight). Each crash ends the run; the next run starts from what is durable
(the group's committed offsets, the delivery counts file, the keyed sinks).

After the runs, every example must show: every good message's rows once in the keyed
sink (a redelivery writes the same keys) and no dead letter of it; every poison and
undecodable message dead-lettered once with the step that refused it, never a row;
nothing else in either sink; the group's commits at every partition's end; and, checked
at each commit as it is made, no offset committed past a message that was not yet
written or dead-lettered (the Faust bug class).

``ACKFLOW_KAFKA_MODEL_EXAMPLES`` examples (12 in CI; each joins the group once per run,
about 3 s); a longer run:
    ACKFLOW_KAFKA_MODEL_EXAMPLES=100 .venv/bin/python -m pytest tests/test_kafka_model.py
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import ackflow
from ackflow import faults
from ackflow.core.errors import ConfigError
from ackflow.core.policy import RetryPolicy
from ackflow.engine.loop import Engine
from ackflow.sources.kafka import KafkaSource
from ackflow.testing import KeyedSink
from kafka_help import committed, ends

pytestmark = pytest.mark.kafka

EXAMPLES = int(os.environ.get("ACKFLOW_KAFKA_MODEL_EXAMPLES", "12"))
FAULTS = (
    "batch.after_job",
    "batch.after_commit",
    "engine.mid_ack",
    "engine.before_fail",
    "engine.dead_letter_written",
    "kafka.before_commit",  # the consumer thread
    "kafka.after_commit",  # the consumer thread
    "kafka.attempt_recorded",
)


@dataclass(frozen=True)
class KExample:
    partitions: int
    kinds: tuple[str, ...]  # per message: "ok" | "poison" | "bad"; message i in i % partitions
    aborted: bool  # an aborted transaction's records between the two halves
    max_deliveries: int
    batch_size: int
    window: int
    concurrency: int
    faults: tuple[tuple[str, int], ...]  # (point, nth hit) armed to raise
    joiner: bool  # a second member joins while the first has messages in flight


@st.composite
def kexamples(draw: Any) -> KExample:
    batch = draw(st.integers(1, 8))
    # a crash leaves the group: with a second member joining, that is the tansu bug above
    joiner = draw(st.sampled_from([False, False, False, True]))
    armed = tuple(
        draw(
            st.lists(
                st.tuples(st.sampled_from(FAULTS), st.integers(1, 3)), max_size=2, unique_by=lambda f: f[0]
            )
        )
    )
    return KExample(
        partitions=draw(st.integers(1, 3)),
        kinds=tuple(
            draw(st.lists(st.sampled_from(["ok", "ok", "ok", "poison", "bad"]), min_size=1, max_size=24))
        ),
        aborted=draw(st.booleans()),
        max_deliveries=draw(st.integers(1, 3)),
        batch_size=batch,
        window=draw(st.integers(batch, 24)),
        concurrency=draw(st.integers(1, 2)),
        faults=() if joiner else armed,
        joiner=joiner,
    )


def body(i: int, kind: str) -> bytes:
    return (
        b'{"i": %d, "kind": "not closed' % i if kind == "bad" else json.dumps({"i": i, "kind": kind}).encode()
    )


def check(r: dict[str, Any]) -> dict[str, Any]:
    if r["kind"] == "poison":
        raise ValueError(f"message {r['i']} is poison")
    return r


def split(r: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"i": r["i"], "part": j} for j in range(1 + r["i"] % 2)]


def keys(deliveries: Any) -> list[str]:
    """The messages' keys of ``deliveries``: a block's (kafka_blocks.py) are its parts'."""
    return [k for d in deliveries for k in (d.parts[0] if d.parts is not None else [d.key])]


class Watched(KafkaSource):
    """The Kafka source, with every commit checked against what the engine settled: an
    offset committed past a message not yet written or dead-lettered fails the test."""

    def __init__(
        self, *a: Any, settled: set[str], data: dict[int, set[int]], bad: list[str], hold: Any, **kw: Any
    ):
        super().__init__(*a, **kw)
        self.settled, self.data, self.bad, self.hold = settled, data, bad, hold
        self.handed: set[str] = set()

    def open(self) -> int:
        n = super().open()
        self._consumer = _CommitCheck(self._consumer, self)
        return n

    def pull(self, max_messages: int, timeout: float) -> Any:
        got = super().pull(max_messages, timeout)
        self.handed.update(keys(got))
        return got

    def ack(self, deliveries: Any) -> None:
        self.settled.update(keys(deliveries))
        super().ack(deliveries)

    @property
    def retries_waiting(self) -> int:  # a run is not idle while its source says it waits
        return super().retries_waiting + (1 if self.hold() else 0)


class _CommitCheck:
    def __init__(self, consumer: Any, src: Watched) -> None:
        self._c, self._src = consumer, src

    def __getattr__(self, name: str) -> Any:
        return getattr(self._c, name)

    def commit(self, *, offsets: Any, asynchronous: bool) -> Any:
        src = self._src
        for tp in offsets:
            handed = {
                int(k.rsplit("@", 1)[1]) for k in src.handed if k.startswith(f"{tp.topic}/{tp.partition}@")
            }
            unsettled = [
                off
                for off in src.data.get(tp.partition, set()) | handed
                if off < tp.offset and f"{tp.topic}/{tp.partition}@{off}" not in src.settled
            ]
            if unsettled:
                self._src.bad.append(
                    f"commit {tp.partition}@{tp.offset} passes unsettled {sorted(unsettled)}"
                )
        return self._c.commit(offsets=offsets, asynchronous=asynchronous)


def publish(kafka: Any, name: str, ex: KExample) -> dict[int, tuple[int, int]]:
    """Write the example's messages (two committed transactions, an aborted one between
    them if asked); returns each message's partition and offset."""
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": kafka.bootstrap, "transactional.id": f"tx-{name}", "linger.ms": 2})
    p.init_transactions(30)
    placed: dict[int, tuple[int, int]] = {}  # message -> (partition, offset)

    def report(i: int) -> Any:
        def on(err: Any, m: Any) -> None:
            assert err is None, err
            placed[i] = (m.partition(), m.offset())

        return on

    half = len(ex.kinds) // 2
    for part, aborted in ((range(half), False), (None, True), (range(half, len(ex.kinds)), False)):
        if aborted and not ex.aborted:
            continue
        p.begin_transaction()
        if part is None:
            for j in range(3):  # placed under -1, -2, -3
                p.produce(name, value=b"aborted", partition=j % ex.partitions, on_delivery=report(-1 - j))
            p.flush(30)  # on the broker, then aborted (an abort drops what was not sent)
            p.abort_transaction(30)
            continue
        for i in part:
            p.produce(name, value=body(i, ex.kinds[i]), partition=i % ex.partitions, on_delivery=report(i))
        p.commit_transaction(30)
    p.flush(30)
    assert len([i for i in placed if i >= 0]) == len(ex.kinds)
    return placed


def at_end(got: dict[int, int], want: dict[int, int]) -> bool:
    """Every partition committed at its end (an empty one needs no commit). At least
    there: tansu 0.6's high watermark can lag the real end (benchmarks/chaos_checks.py)."""
    return all(got[p] >= end or (end == 0 and got[p] < 0) for p, end in want.items())


def crashed(e: BaseException) -> bool:
    """An armed fault point that raised: in the engine's thread (InjectedFault), or in
    the consumer thread (the run stops with the consumer's failure)."""
    return isinstance(e, faults.InjectedFault) or (isinstance(e, ConfigError) and "InjectedFault" in str(e))


def run_example(kafka: Any, tmp: str, ex: KExample) -> None:
    name, group = f"m-{uuid.uuid4().hex[:8]}", f"g-{uuid.uuid4().hex[:6]}"
    kafka.create_topic(name, ex.partitions)
    where = publish(kafka, name, ex)
    data: dict[int, set[int]] = {}  # the offsets that hold a message, per partition
    for i, (part_no, off) in where.items():
        if i >= 0:  # (an aborted record is one where the broker hands it out)
            data.setdefault(part_no, set()).add(off)
    settled: set[str] = set()
    bad: list[str] = []
    out, dlq = KeyedSink("out"), KeyedSink("dlq")
    policy = RetryPolicy(max_deliveries=ex.max_deliveries, backoff_s=0.02)

    crashes: list[str] = []
    joiner: threading.Thread | None = None

    def flow(member: str) -> ackflow.Flow:
        src = Watched(
            kafka.bootstrap,
            name,
            group,
            policy=policy,
            attempts_path=os.path.join(tmp, f"attempts-{member}.db"),
            revoke_timeout_s=1.0,
            settled=settled,
            data=data,
            bad=bad,
            # the first member stays while the second is in the group: tansu 0.6 leaves a
            # joining member unassigned for good when the group's leader leaves meanwhile
            hold=(lambda: joiner is not None and joiner.is_alive()) if member == "a" else (lambda: False),
        )
        return ackflow.Flow(src).map(check, name="check").flat_map(split, name="split").to(out).on_error(dlq)

    def engine(member: str, until_idle: float) -> Engine:
        return Engine(
            flow(member),
            executor="local",
            batch_size=ex.batch_size,
            max_inflight=ex.window,
            max_concurrent_batches=ex.concurrency,
            batch_timeout_s=0.05,
            until_idle=until_idle,
            handle_signals=False,
            systemic_after=0,
        )

    def join() -> None:  # a second member: its own run, its own delivery counts
        time.sleep(4.0)
        second = engine("b", 1.0)
        timer = threading.Timer(60, second.request_stop)  # never assigned: see hold above
        timer.start()
        try:
            second.run()
        except Exception as e:  # noqa: BLE001 - reported as the example's failure
            bad.append(f"the second member failed: {type(e).__name__}: {e}")
        finally:
            timer.cancel()

    for point, nth in ex.faults:
        faults.arm(point, "raise", nth=nth)
    want = ends(kafka, name, ex.partitions)
    for part_no, off in where.values():  # past every record, whatever the watermark says
        want[part_no] = max(want[part_no], off + 1)
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            if ex.joiner and joiner is None:
                joiner = threading.Thread(target=join, daemon=True)
                joiner.start()
            try:
                engine("a", 1.5).run()
            except Exception as e:  # only the armed faults may stop a run
                if not crashed(e):
                    raise
                crashes.append(str(e)[:200])
                continue
            if joiner is not None:
                joiner.join(60)
            if at_end(committed(kafka, name, group, ex.partitions), want):
                break
        else:
            raise AssertionError(
                f"not done within 120 s: committed {committed(kafka, name, group, ex.partitions)}"
            )
    finally:
        faults.disarm()
    assert len(crashes) <= len(ex.faults), crashes
    assert not bad, bad
    # (a dead letter written again after a crash carries its later delivery count and
    # time: the error sink keeps one per message, the last; rows must never differ)
    assert not out.conflicts, out.conflicts
    rows = Counter((r["i"], r["part"]) for r in out.rows.values())
    want_rows = Counter((i, j) for i, k in enumerate(ex.kinds) if k == "ok" for j in range(1 + i % 2))
    assert rows == want_rows, f"rows {dict(rows - want_rows)} too many, {dict(want_rows - rows)} missing"
    dead = {r["message"]: r for r in dlq.rows.values()}
    assert len(dead) == len(dlq.rows), "a message dead-lettered under two keys"
    for i, kind in enumerate(ex.kinds):
        p, off = where[i]
        letter = dead.pop(f"{name}/{p}@{off}", None)
        if kind == "ok":
            assert letter is None, f"good message {i} dead-lettered: {letter}"
        else:
            assert letter is not None, f"{kind} message {i} was not dead-lettered"
            assert letter["step"] == ("check" if kind == "poison" else "decode"), letter
    # tansu 0.6 hands an aborted transaction's records to read_committed consumers (Kafka
    # does not): there they are messages like any other, not JSON, so dead-lettered once
    for i in range(-3, 0):
        if i in where:
            letter = dead.pop(f"{name}/{where[i][0]}@{where[i][1]}", None)
            assert letter is None or letter["step"] == "decode", letter
    assert not dead, f"dead letters of no message: {list(dead)}"


FIXED = [
    # a poison message at a partition's head, the commit crashing in the consumer thread
    KExample(1, ("poison", "ok", "ok", "bad"), True, 2, 2, 4, 1, (("kafka.before_commit", 1),), False),
    # a rebalance while the first member holds messages in flight, two batches at once
    KExample(3, ("ok",) * 10 + ("poison",) + ("ok",) * 9, False, 1, 3, 9, 2, (), True),
]


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    logging.getLogger("ackflow").setLevel(logging.CRITICAL)
    yield
    logging.getLogger("ackflow").setLevel(logging.NOTSET)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(ex=kexamples())
@example(ex=FIXED[0])
@example(ex=FIXED[1])
def test_kafka_model(kafka: Any, tmp_path: Any, ex: KExample) -> None:
    tmp = os.path.join(str(tmp_path), uuid.uuid4().hex[:6])
    os.makedirs(tmp)
    run_example(kafka, tmp, ex)
