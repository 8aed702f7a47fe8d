"""The broker conformance matrix (issue 27): the RabbitMQ queue source against a real
broker, for every queue kind x dead-letter route x event, asserting where each message
ends (acked with its row written, still in the queue, in ackflow's dead letters, in the
broker's dead-letter queue), how many deliveries it spent, and that none is lost: what
docs/sources/rabbitmq.md ("What a release costs", "Delivery and failure") claims.

Queue kinds: classic; quorum; quorum with ``x-delivery-limit: 1``. Dead-letter routes:
none (the source refuses to start; so does a dead-letter exchange named but missing);
the flow's error sink (``on_error``); the queue's own ``x-dead-letter-exchange``
(``reject_to_dlx=True``); ackflow's copies with provenance (``dead_letter_exchange=``).
Events: a poison message; a transient failure then success; a stop with messages
waiting (release; they failed once before, so a quorum queue with a limit holds them at
their last delivery); a systemic failure (a sink down for every message) given back
until the sink heals.

One broker for the session, the in-process executor (no Spark: the source's and the
engine's behaviour is what is tested), a few small messages per cell.
"""

from __future__ import annotations

import collections
import os
import threading
import time

import pytest

from ackflow import Flow
from ackflow.core.errors import ConfigError
from ackflow.core.policy import RetryPolicy
from ackflow.engine.loop import Engine
from ackflow.sinks import Memory
from ackflow.sinks.memory import MemorySink
from ackflow.sources import RabbitMQ
from amqp import connect, names, publish
from helpers import wait_until

#: deliveries pulled, and what the sink saw, per (cell, message number): shared with the
#: tasks of the in-process executor (they run in this process). A step may run more than
#: once per delivery (the first batch's columns are sampled), so deliveries are counted
#: at the source.
DELIVERED: collections.Counter[tuple[str, int]] = collections.Counter()
SINK_TRIES: collections.Counter[tuple[str, int]] = collections.Counter()
HEALED: set[str] = set()

MAX_DELIVERIES = 4  # the retry policy's; a quorum queue's limit of 1 binds first
#: a retry's backoff longer than the until_idle wait: a run must not end as idle while the
#: source holds a failed message for its retry (it did: the message was neither retried
#: nor dead-lettered in that run, and went back to the queue when the channel closed)
BACKOFF_S, IDLE_S = 0.35, 0.2
LIMIT = 1
KINDS = {
    "classic": {"x-queue-type": "classic"},
    "quorum": {"x-queue-type": "quorum"},
    "quorum-limit": {"x-queue-type": "quorum", "x-delivery-limit": LIMIT},
}
ROUTES = ("error-sink", "broker-dlx", "ackflow-dlx")
EVENTS = ("poison", "transient", "release", "systemic")


def step(row):
    """Module-level (pickled by reference): fails by the row's ``kind``."""
    key = (row["cell"], row["n"])
    if row["kind"] == "poison":
        raise ValueError(f"message {row['n']} is poison")
    if row["kind"] == "transient" and DELIVERED[key] == 1:
        raise ConnectionError(f"message {row['n']}: a transient failure")
    if row["kind"] == "hold":  # holds its batch until the test asked the run to stop
        deadline = time.monotonic() + 30
        while not os.path.exists(row["gate"]) and time.monotonic() < deadline:
            time.sleep(0.01)
    return row


class DownSink(MemorySink):
    """A sink whose every write raises (as a whole: a systemic failure) until healed."""

    def __init__(self, cell: str) -> None:
        super().__init__("orders")
        self.cell = cell

    def write_partition(self, batch_id, partition, rows):
        for n in rows.column("n").to_pylist():
            SINK_TRIES[(self.cell, n)] += 1
        if self.cell not in HEALED:
            raise ConnectionRefusedError("orders database: connection refused")
        return super().write_partition(batch_id, partition, rows)


class Counting(RabbitMQ):
    """The queue source, counting the deliveries it hands out per message."""

    def pull(self, max_messages, timeout):
        got = super().pull(max_messages, timeout)
        for d in got:
            cell, n = d.key.rsplit("-", 1)
            DELIVERED[(cell, int(n))] += 1
        return got


class Cell:
    """One cell: its queue (with the kind's arguments and, for ``broker-dlx``, a
    dead-letter exchange bound to a queue of its own) and what the run left behind."""

    def __init__(self, url: str, kind: str, route: str, event: str, consumer: str = "process") -> None:
        self.url, self.kind, self.route, self.event = url, kind, route, event
        self.consumer = consumer
        self.id = names(f"{kind}-{route}-{event}")
        self.queue, self.dlx, self.dead_queue = self.id, self.id + "-dlx", self.id + "-dead"
        args = dict(KINDS[kind])
        conn = connect(url)
        ch = conn.channel()
        if route in ("broker-dlx", "ackflow-dlx"):
            ch.exchange_declare(self.dlx, "fanout", durable=True)
            ch.queue_declare(self.dead_queue, durable=True)
            ch.queue_bind(self.dead_queue, self.dlx)
        if route == "broker-dlx":
            args["x-dead-letter-exchange"] = self.dlx
        ch.queue_declare(self.queue, durable=True, arguments=args)
        conn.close()
        self.gate = f"/tmp/ackflow-conformance-{self.id}"

    def publish(self, kinds: list[str]) -> None:
        rows = [{"cell": self.id, "n": n, "kind": k, "gate": self.gate} for n, k in enumerate(kinds)]
        publish(self.url, self.queue, rows, ids=[f"{self.id}-{n}" for n in range(len(kinds))])
        self.published = set(range(len(kinds)))

    def source(self) -> RabbitMQ:
        return Counting(
            self.url,
            self.queue,
            name=self.queue,
            policy=RetryPolicy(max_deliveries=MAX_DELIVERIES, backoff_s=BACKOFF_S, max_backoff_s=BACKOFF_S),
            reject_to_dlx=self.route == "broker-dlx",
            dead_letter_exchange=self.dlx if self.route == "ackflow-dlx" else None,
            consumer=self.consumer,
        )

    def left(self, queue: str) -> list[tuple[int, dict]]:
        """Take every message of ``queue``: (n, headers)."""
        import json

        conn = connect(self.url)
        ch = conn.channel()
        out = []
        while True:
            method, props, body = ch.basic_get(queue, auto_ack=True)
            if method is None:
                break
            headers = dict(props.headers or {})
            headers["redelivered"] = method.redelivered
            out.append((json.loads(body)["n"], headers))
        conn.close()
        return out


def run_cell(cell: Cell, flow: Flow, **kw) -> tuple[Engine, dict]:
    opts = {
        "executor": "local",
        "batch_size": 10,
        "max_inflight": 50,
        "until_idle": IDLE_S,
        "batch_timeout_s": 0.02,
        "linger_s": 0.01,
        "handle_signals": False,
        "systemic_backoff_s": 0.05,
        "systemic_max_backoff_s": 0.1,
        **kw,
    }
    engine = Engine(flow, **opts)
    outcome: dict = {}

    def go():
        try:
            outcome["report"] = engine.run()
        except Exception as e:  # noqa: BLE001 - the test looks at it
            outcome["error"] = e

    t = threading.Thread(target=go, daemon=True)
    t.start()
    outcome["thread"] = t
    return engine, outcome


def finish(outcome: dict, timeout: float = 60):
    outcome["thread"].join(timeout)
    assert not outcome["thread"].is_alive(), "the run did not end"
    assert "error" not in outcome, outcome.get("error")
    return outcome["report"]


def dead_letters(cell: Cell, dead: Memory | None) -> dict[int, dict]:
    """Where dead letters went, by message number: {n: facts}."""
    if cell.route == "error-sink":
        import json

        assert dead is not None
        return {
            json.loads(r["body"])["n"]: {
                "step": r["step"],
                "error": r["error"],
                "deliveries": r["deliveries"],
            }
            for r in dead.rows
        }
    out = {}
    if cell.route == "ackflow-dlx":  # ackflow's copies, with their provenance headers
        for n, h in cell.left(cell.dead_queue):
            out[n] = {
                "step": h["x-ackflow-step"].decode()
                if isinstance(h["x-ackflow-step"], bytes)
                else h["x-ackflow-step"],
                "error": str(h["x-ackflow-error"]),
                "deliveries": h["x-ackflow-deliveries"],
            }
        return out
    for n, h in cell.left(cell.dead_queue):
        death = h["x-death"][0]
        out[n] = {
            "reason": death["reason"].decode() if isinstance(death["reason"], bytes) else death["reason"]
        }
    return out


def build(cell: Cell, sink=None):
    dead = Memory("dead") if cell.route == "error-sink" else None
    flow = Flow(cell.source()).map(step, name="check").to(sink or Memory("orders"))
    if dead is not None:
        flow = flow.on_error(dead)
    return flow, dead


def no_loss(cell: Cell, written: list[int], queued: list[int], dead: dict[int, dict]) -> None:
    """Every message is in exactly one place, and written at most once."""
    assert len(written) == len(set(written)), f"written twice: {written}"
    places = collections.Counter([*set(written), *queued, *dead])
    assert set(places) == cell.published, f"lost: {cell.published - set(places)}"
    assert all(c == 1 for c in places.values()), f"in two places: {places}"


# every cell with pika in its consumer process (the default); the strictest kind with pika
# in the driver too (consumer="inline")
CELLS = [(k, r, e, "process") for k in KINDS for r in ROUTES for e in EVENTS]
CELLS += [("quorum-limit", r, e, "inline") for r in ROUTES for e in EVENTS]


@pytest.fixture(scope="module")
def url(rabbitmq):
    return rabbitmq.url


@pytest.mark.parametrize("kind", list(KINDS))
def test_no_dead_letter_route_is_refused_at_start(url, kind):
    """docs/sources/rabbitmq.md: with no route for dead letters the source refuses to start (it will not
    drop poison messages); nothing is taken from the queue."""
    cell = Cell(url, kind, "none", "start")
    cell.publish(["ok"])
    flow = Flow(RabbitMQ(url, cell.queue)).map(step, name="check").to(Memory())
    with pytest.raises(ConfigError, match="say where dead letters go"):
        Engine(flow, executor="local", until_idle=0.2, handle_signals=False).run()
    assert [n for n, _ in cell.left(cell.queue)] == [0]


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_dead_letter_exchange_named_but_missing_is_refused_at_start(url, kind):
    """docs/sources/rabbitmq.md: a dead letter must reach a queue, proven at start: a queue whose
    x-dead-letter-exchange does not exist is refused with one line."""
    cell = Cell(url, kind, "none", "missing-dlx")
    conn = connect(url)
    q = cell.queue + "-m"
    conn.channel().queue_declare(
        q, durable=True, arguments={**KINDS[kind], "x-dead-letter-exchange": cell.id + "-nowhere"}
    )
    conn.close()
    flow = Flow(RabbitMQ(url, q, reject_to_dlx=True)).map(step, name="check").to(Memory())
    with pytest.raises(ConfigError, match="dead letters would be lost") as e:
        Engine(flow, executor="local", until_idle=0.2, handle_signals=False).run()
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(("kind", "route", "event", "consumer"), CELLS)
def test_conformance(url, kind, route, event, consumer):
    cell = Cell(url, kind, route, event, consumer)
    limited = kind == "quorum-limit"
    # the deliveries ackflow spends on a message that always fails
    last = LIMIT + 1 if limited else MAX_DELIVERIES

    if event == "poison":
        cell.publish(["ok", "poison", "ok"])
        flow, dead = build(cell)
        # a retry given back to the broker is out of the run's sight until it comes back:
        # under load that took longer than IDLE_S once, and the run ended idle with the
        # poison still queued (a fresh-clone CI run); 1 s of quiet is enough to see it back
        report = finish(run_cell(cell, flow, until_idle=1.0)[1])
        written = [r["n"] for r in flow.sink.rows]
        queued = [n for n, _ in cell.left(cell.queue)]
        dls = dead_letters(cell, dead)
        no_loss(cell, written, queued, dls)
        assert sorted(written) == [0, 2] and queued == [] and list(dls) == [1]
        assert report.acked == 2
        assert report.dead_lettered == 1
        assert DELIVERED[(cell.id, 1)] == last  # deliveries spent
        if route != "broker-dlx":
            assert dls[1]["step"] == "check" and "is poison" in dls[1]["error"]
            assert dls[1]["deliveries"] == last
        else:
            assert dls[1]["reason"] == "rejected"  # ackflow's reject, never the limit's drop

    elif event == "transient":
        cell.publish(["ok", "transient", "ok"])
        flow, dead = build(cell)
        report = finish(run_cell(cell, flow)[1])
        written = [r["n"] for r in flow.sink.rows]
        queued = [n for n, _ in cell.left(cell.queue)]
        dls = dead_letters(cell, dead)
        no_loss(cell, written, queued, dls)
        assert sorted(written) == [0, 1, 2] and not queued and not dls, (written, queued, dls, report)
        assert DELIVERED[(cell.id, 1)] == 2 and report.acked == 3 and report.nacked == 1

    elif event == "release":
        # 1..3 fail once, come back and wait behind the batch holding 0 (one batch at a
        # time) when the run is asked to stop: they are released, each after one failed
        # delivery (on the limited quorum queue: at its last delivery)
        cell.publish(["transient"] * 3 + ["hold"])
        flow, dead = build(cell)
        src = flow.source
        engine, outcome = run_cell(cell, flow, batch_size=3, max_concurrent_batches=1, until_idle=None)
        try:
            # 0..2 failed once and were pulled again while 3 holds its batch
            assert wait_until(lambda: engine.report.pulled >= 7 and len(engine.inflight) >= 4, timeout=20), (
                engine.report.pulled,
                len(engine.inflight),
            )
            engine.request_stop()
        finally:
            open(cell.gate, "w").close()
        report = finish(outcome)
        os.remove(cell.gate)
        written = [r["n"] for r in flow.sink.rows]
        left = cell.left(cell.queue)
        queued = [n for n, _ in left]
        dls = dead_letters(cell, dead)
        no_loss(cell, written, queued, dls)
        assert written == [3]
        assert all(DELIVERED[(cell.id, n)] == 2 for n in range(3))  # failed, then waited
        if limited:  # docs/sources/rabbitmq.md: at its last delivery a give-back would be dropped
            assert sorted(dls) == [0, 1, 2] and not queued
            assert report.dead_lettered == 3 and report.released == 0
            if route != "broker-dlx":
                assert {d["step"] for d in dls.values()} == {"release"}
                assert {d["deliveries"] for d in dls.values()} == {2}
            else:
                assert {d["reason"] for d in dls.values()} == {"rejected"}
        else:
            assert sorted(queued) == [0, 1, 2] and not dls and report.released == 3
            counts = {n: h.get("x-delivery-count") for n, h in left}
            if kind == "quorum":  # one failure and one give-back, each a delivery
                assert set(counts.values()) == {2}, counts
            else:  # classic: nothing the broker counts; it comes back redelivered
                assert set(counts.values()) == {None}
                assert all(h["redelivered"] for _, h in left)
            assert src.stats["nacks"] >= 6  # 3 failures and 3 give-backs

    else:  # systemic: the sink is down for every message until each was tried twice
        cell.publish(["ok"] * 6)
        flow, dead = build(cell, sink=DownSink(cell.id))
        engine, outcome = run_cell(cell, flow, until_idle=1.0)
        try:
            assert wait_until(
                lambda: (
                    all(SINK_TRIES[(cell.id, n)] >= 2 for n in range(6))
                    or "report" in outcome
                    or "error" in outcome
                ),
                timeout=30,
            )
        finally:
            HEALED.add(cell.id)
        # one more message: the step works again, the episode ends, the run goes idle
        publish(url, cell.queue, [{"cell": cell.id, "n": 6, "kind": "ok", "gate": ""}], ids=[f"{cell.id}-6"])
        cell.published.add(6)
        report = finish(outcome)
        written = [r["n"] for r in flow.sink.rows]
        queued = [n for n, _ in cell.left(cell.queue)]
        dls = dead_letters(cell, dead)
        no_loss(cell, written, queued, dls)
        assert report.given_back_systemic > 0
        if limited:
            # docs/sources/rabbitmq.md: a message at its last delivery is dead-lettered with its failure
            # rather than given back for the broker to drop
            assert sorted(dls) == list(range(6)) and written == [6]
            if route != "broker-dlx":
                assert {d["step"] for d in dls.values()} == {"orders"}
                assert all("connection refused" in d["error"] for d in dls.values())
        else:  # given back, never dead-lettered; written once the sink heals
            assert sorted(written) == list(range(7)) and not dls and not queued
            assert report.dead_lettered == 0 and report.acked == 7


class DeadDown(MemorySink):
    """An error sink whose writes raise until its cell is healed."""

    def __init__(self, cell: str) -> None:
        super().__init__("dead")
        self.cell = cell
        self.tries = 0

    def write_partition(self, batch_id, partition, rows):
        self.tries += 1
        if self.cell not in HEALED:
            raise ConnectionRefusedError("dead-letter database: connection refused")
        return super().write_partition(batch_id, partition, rows)


def refusing(cell: Cell, route: str):
    """The cell's dead-letter route, refusing until healed: the flow (with an error sink
    that raises, or a dead-letter queue that is full: x-overflow reject-publish, one
    message in), how many times it refused, and what heals it."""
    if route == "ackflow-dlx":
        conn = connect(cell.url)
        ch = conn.channel()
        ch.queue_delete(cell.dead_queue)
        full = {"x-max-length": 1, "x-overflow": "reject-publish"}
        ch.queue_declare(cell.dead_queue, durable=True, arguments=full)
        ch.queue_bind(cell.dead_queue, cell.dlx)
        conn.close()
        publish(cell.url, cell.dead_queue, [{"n": -1}])
    dead = DeadDown(cell.id) if route == "error-sink" else None
    flow = Flow(cell.source()).map(step, name="check").to(Memory("orders"))
    if dead is not None:
        flow = flow.on_error(dead)

    def tries() -> int:
        return dead.tries if dead is not None else flow.source.stats["dead_letters_refused"]

    def heal() -> None:
        if route == "ackflow-dlx":
            assert [n for n, _ in cell.left(cell.dead_queue)] == [-1]  # room again
        HEALED.add(cell.id)

    return flow, dead, tries, heal


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("route", ["error-sink", "ackflow-dlx"])
def test_a_dead_letter_route_that_refuses_loses_nothing(url, kind, route):
    """The dead-letter route is down when a poison message is given up (the error sink
    raises; ackflow's dead-letter queue is full, so the broker nacks the copy). A
    give-back of a message at a quorum queue's delivery limit would make the broker drop
    it: the message stays in flight and its dead letter is written again until the route
    heals; on the other kinds it may go back and come again. Either way it ends in the
    dead letters, with its provenance, once (the quorum-limit cells lost it before)."""
    cell = Cell(url, kind, route, "dead-down")
    cell.publish(["ok", "poison", "ok"])
    flow, dead, tries, heal = refusing(cell, route)
    _, outcome = run_cell(cell, flow, until_idle=1.0)
    try:
        assert wait_until(lambda: tries() >= 2 or "report" in outcome or "error" in outcome, timeout=30)
    finally:
        heal()
    report = finish(outcome)
    written = [r["n"] for r in flow.sink.rows]
    queued = [n for n, _ in cell.left(cell.queue)]
    dls = dead_letters(cell, dead)
    no_loss(cell, written, queued, dls)
    assert sorted(written) == [0, 2] and not queued and list(dls) == [1], (written, queued, dls)
    assert dls[1]["step"] == "check" and "is poison" in dls[1]["error"]
    assert report.dead_lettered == 1 and report.acked == 2
    assert report.failures_total == report.nacked + report.dead_lettered  # counted once each


@pytest.mark.parametrize("route", ["error-sink", "ackflow-dlx"])
@pytest.mark.parametrize("heals", [True, False])
def test_a_stop_while_a_dead_letter_is_held_writes_it_in_the_drain(url, route, heals, caplog):
    """A stop while a message at its last delivery waits for its dead-letter route: the
    drain writes its dead letter again until the drain timeout; if the route healed
    meanwhile it is dead-lettered, otherwise the give-back is the broker's to drop, and
    one error line says so (what docs/sources/rabbitmq.md promises)."""
    cell = Cell(url, "quorum-limit", route, f"dead-down-stop-{heals}")
    cell.publish(["ok", "poison", "ok"])
    flow, dead, tries, heal = refusing(cell, route)
    engine, outcome = run_cell(cell, flow, until_idle=None, drain_timeout_s=3.0)
    src = flow.source
    assert wait_until(
        lambda: tries() >= 2 and (len(engine.dead_waiting) == 1 or src.dead_letters_held == 1), timeout=30
    ), (tries(), outcome.get("error"))
    engine.request_stop()
    if heals:
        threading.Timer(0.5, heal).start()
    report = finish(outcome)
    written = [r["n"] for r in flow.sink.rows]
    assert sorted(written) == [0, 2]
    if heals:
        dls = dead_letters(cell, dead)
        queued = [n for n, _ in cell.left(cell.queue)]
        no_loss(cell, written, queued, dls)
        assert list(dls) == [1] and report.dead_lettered == 1 and not queued
        assert dls[1]["step"] == "check"  # its own failure, not the stop's
    else:  # still refused: nothing but what filled the dead-letter queue is there
        if dead is not None:
            assert not dead.rows
        else:
            assert [n for n, _ in cell.left(cell.dead_queue)] == [-1]
        assert report.dead_lettered == 0
        assert "the broker drops them" in caplog.text


def test_a_connection_lost_while_a_dead_letter_is_held_leaves_it_to_the_queues_own_route(rabbitmq, caplog):
    """The lost-connection case of the hold, against the broker: a message at its last
    delivery whose copy ackflow's full dead-letter queue refuses is held on the channel;
    the broker closes every connection. The channel's give-back spends the delivery the
    message did not have: the broker moves it to the queue's own x-dead-letter-exchange
    (reason delivery_limit), one error line says so, and the run reconnects and goes on."""
    url = rabbitmq.url
    cell = Cell(url, "quorum-limit", "ackflow-dlx", "dead-down-lost")
    own_dlx, own_dead = cell.id + "-own-dlx", cell.id + "-own-dead"
    conn = connect(url)
    ch = conn.channel()
    ch.exchange_declare(own_dlx, "fanout", durable=True)
    ch.queue_declare(own_dead, durable=True)
    ch.queue_bind(own_dead, own_dlx)
    ch.queue_delete(cell.queue)
    ch.queue_declare(
        cell.queue, durable=True, arguments={**KINDS["quorum-limit"], "x-dead-letter-exchange": own_dlx}
    )
    conn.close()
    cell.publish(["ok", "poison", "ok"])
    flow, _, tries, heal = refusing(cell, "ackflow-dlx")
    src = flow.source
    engine, outcome = run_cell(cell, flow, until_idle=None)
    try:
        assert wait_until(lambda: tries() >= 2 and src.dead_letters_held == 1, timeout=30), outcome.get(
            "error"
        )
        rabbitmq.ctl("close_all_connections", "test: the connection is lost while a dead letter is held")
        assert wait_until(lambda: src.dead_letters_held == 0 and src.connected, timeout=30)
        publish(url, cell.queue, [{"cell": cell.id, "n": 3, "kind": "ok", "gate": ""}], ids=[f"{cell.id}-3"])
        cell.published.add(3)
        assert wait_until(lambda: sorted(r["n"] for r in flow.sink.rows) == [0, 2, 3], timeout=30)
    finally:
        engine.request_stop()
        heal()
    finish(outcome)
    moved = cell.left(own_dead)
    assert [n for n, _ in moved] == [1]  # the broker's route has it, not lost
    death = moved[0][1]["x-death"][0]
    assert (
        death["reason"].decode() if isinstance(death["reason"], bytes) else death["reason"]
    ) == "delivery_limit"
    assert not cell.left(cell.queue) and not cell.left(cell.dead_queue)
    assert "went back with the channel" in caplog.text
