"""Settlement order and guards, shutdown after a lost channel, cleanup on every path."""

import json
import signal
import socket

import pytest

import ackflow
from ackflow.core.errors import AlreadySettled
from ackflow.core.ledger import Failure
from ackflow.core.settlement import Delivery, Settlement
from ackflow.engine.loop import Engine
from ackflow.sinks import MemorySink
from ackflow.testing import FailingSink, ListSource
from helpers import FAST, bodies


class RecordingSource(ListSource):
    """Counts what reaches the broker."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls = []

    def ack(self, deliveries):
        self.calls.append(("ack", [d.key for d in deliveries]))
        return super().ack(deliveries)

    def fail(self, failures):
        self.calls.append(("fail", [d.key for d, _ in failures]))
        return super().fail(failures)


def engine_for(src):
    return Engine(ackflow.Flow(src).to(MemorySink()), handle_signals=False)


def test_a_second_settle_raises_before_the_broker_hears_of_it():
    src = RecordingSource([b"{}"])
    e = engine_for(src)
    (d,) = src.pull(1, 0.1)
    d.lineage_id = 1
    e._ack([d])
    with pytest.raises(AlreadySettled):
        e._ack([d])
    with pytest.raises(AlreadySettled):
        e._fail("b", [(d, Failure("s", "e"))])
    assert src.calls == [("ack", ["m0"])]  # before: the second ack and the fail reached it


def test_a_stale_ack_is_released_not_counted_acked():
    class Stale(RecordingSource):
        def ack(self, deliveries):
            super().ack(deliveries)
            return list(deliveries)  # the channel died: none was acked

    src = Stale([b"{}"])
    e = engine_for(src)
    (d,) = src.pull(1, 0.1)
    e._ack([d])
    assert d.state is Settlement.RELEASED and e.report.acked == 0 and e.report.redelivered == 1


class LosesEverythingOnce(ListSource):
    """The channel dies while the first batch runs: every delivery so far is lost."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.handed = []
        self.lost = False

    def pull(self, n, timeout):
        got = super().pull(n, timeout)
        self.handed += got
        return got

    def take_lost(self):
        if self.lost or not self.handed:
            return []
        self.lost = True
        return list(self.handed)


@pytest.mark.spark
def test_stop_after_a_channel_loss_does_not_settle_twice(spark):
    src = LosesEverythingOnce(bodies([{"n": i} for i in range(20)]))
    e = Engine(
        ackflow.Flow(src).to(MemorySink()),
        spark=spark,
        handle_signals=False,
        batch_size=50,
        max_inflight=100,
        batch_timeout_s=5.0,
    )
    orig = e._drop_lost

    def drop_then_stop():
        orig()
        if src.lost:
            e.request_stop()  # the pending batch holds deliveries the loss released

    e._drop_lost = drop_then_stop
    report = e.run()  # before: AlreadySettled at stop
    assert report.redelivered >= 1 and report.acked == 0


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.spark
def test_a_source_that_cannot_open_leaves_no_metrics_server_behind(spark):
    class Broken(ListSource):
        def open(self):
            raise OSError("broker unreachable")

    port = free_port()
    with pytest.raises(OSError):
        ackflow.run(ackflow.Flow(Broken([])).to(MemorySink()), spark=spark, metrics_port=port, **FAST)
    with socket.socket() as s:  # before: still served by the leaked server
        s.bind(("127.0.0.1", port))


@pytest.mark.spark
def test_an_error_during_drain_still_closes_everything(spark):
    closed = []

    class Src(ListSource):
        def close(self):
            closed.append("source")

    class Sink(MemorySink):
        def close(self):
            closed.append("sink")

    before = signal.getsignal(signal.SIGTERM)
    e = Engine(ackflow.Flow(Src(bodies([{"n": 1}]))).to(Sink()), spark=spark, **FAST)

    def broken_shutdown(pool):
        pool.shutdown()
        raise RuntimeError("drain failed")

    e._shutdown = broken_shutdown
    with pytest.raises(RuntimeError, match="drain failed"):
        e.run()
    assert sorted(closed) == ["sink", "source"]  # before: neither was closed
    assert signal.getsignal(signal.SIGTERM) == before


@pytest.mark.spark
def test_a_failing_error_sink_is_counted_and_the_messages_retried(spark):
    src = ListSource(bodies([{"n": 1}]), policy=ackflow.RetryPolicy(max_deliveries=1))
    flow = (
        ackflow.Flow(src)
        .map(lambda r: 1 / 0, name="boom")
        .to(MemorySink())
        .on_error(FailingSink(raise_if=lambda r: True, name="dead"))
    )
    e = Engine(flow, spark=spark, handle_signals=False, **{**FAST, "until_idle": 0.5})
    e.run()
    assert src.settled["m0"][0] == "nacked"  # not dropped
    assert e.metrics.dead_letter_write_failures._value.get() >= 1


def test_a_delivery_is_revised_once_only():
    d = Delivery(1, "k", b"")
    d.settle(Settlement.ACKED)
    d.revise(Settlement.RELEASED)
    with pytest.raises(AlreadySettled):
        d.revise(Settlement.NACKED)
    assert json.dumps(d.state.value) == '"released"'


class UnsentAcksSource(ListSource):
    """The first acks are "held" and their channel dies: the broker never hears of them
    and delivers those messages again (as the RabbitMQ source's held acks)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.lose_next = True
        self.unsent = []

    def ack(self, deliveries):
        if self.lose_next:
            self.lose_next = False
            self.unsent = list(deliveries)
            with self._lock:  # the broker has them again
                self._ready.extend(d.handle for d in deliveries)
            return None
        return super().ack(deliveries)

    def take_unsent_acks(self):
        unsent, self.unsent = self.unsent, []
        return unsent


@pytest.mark.spark
def test_acks_that_never_reached_the_broker_are_not_counted(spark):
    """Issue 27 #11: held RabbitMQ acks were counted acked before they were sent; when
    their channel died they came back and were counted again (the report said 2 acks
    for 1 message)."""
    src = UnsentAcksSource(bodies([{"n": i} for i in range(5)]))
    report = ackflow.run(ackflow.Flow(src).to(MemorySink()), spark=spark, **{**FAST, "batch_size": 5})
    assert src.final() == {f"m{i}": "acked" for i in range(5)}
    assert report.acked == 5 and report.redelivered == 5 and report.pulled == 10
