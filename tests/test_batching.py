"""Batch cutting adapts to the rate: an idle engine does not sit on messages until the
batch timeout (issue 15's latency at low load)."""

import gc
import time

import pytest

import ackflow
from ackflow.core import ConfigError
from ackflow.sinks import MemorySink
from ackflow.testing import ListSource
from helpers import bodies


class Trickle(ListSource):
    """One message per pull, 10 ms apart: a slow, steady source that never runs dry
    until its end (so the old "nothing more to pull" cut never fired)."""

    def __init__(self, n: int) -> None:
        super().__init__(bodies([{"n": i} for i in range(n)]))
        self.pulled_at: dict[str, float] = {}
        self.acked_at: dict[str, float] = {}

    def pull(self, max_messages, timeout):
        time.sleep(0.01)
        got = super().pull(1, timeout)
        for d in got:
            self.pulled_at[d.key] = time.monotonic()
        return got

    def ack(self, deliveries):
        now = time.monotonic()
        for d in deliveries:
            self.acked_at[d.key] = now
        return super().ack(deliveries)


def test_an_idle_engine_cuts_small_batches_instead_of_waiting_for_the_timeout():
    src = Trickle(150)
    report = ackflow.run(ackflow.Flow(src).to(MemorySink()), executor="local",
                         batch_size=1000, max_inflight=1000, batch_timeout_s=10.0,
                         until_idle=0.3, handle_signals=False)
    assert report.acked == 150
    waits = [src.acked_at[k] - src.pulled_at[k] for k in src.pulled_at]
    # before: one batch of all 150, cut when the source ran dry after ~2 s
    assert report.batches >= 10
    assert max(waits) < 1.0


def test_a_negative_linger_fails_at_start():
    flow = ackflow.Flow(ListSource([])).to(MemorySink())
    with pytest.raises(ConfigError, match="linger_s must be >= 0 seconds"):
        ackflow.run(flow, executor="local", linger_s=-1)


def test_the_collector_is_tuned_for_the_run_and_put_back_after_it():
    """The window's many live objects: the run freezes what exists at its start and
    collects the youngest generation less often; both are undone when it ends, also
    when it ends by an error."""
    before = gc.get_threshold()
    during = []

    def watch(report, window):
        during.append((gc.get_threshold()[0], gc.get_freeze_count()))

    flow = ackflow.Flow(ListSource(bodies([{"n": i} for i in range(300)]))).to(MemorySink())
    report = ackflow.run(flow, executor="local", batch_size=10, max_inflight=20,
                         until_idle=0.7, handle_signals=False, progress=watch)
    assert report.acked == 300
    assert during and all(t >= 50_000 and frozen > 0 for t, frozen in during)
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0

    def boom(r):
        raise KeyboardInterrupt  # escapes the run (not a row error)

    with pytest.raises(KeyboardInterrupt):
        ackflow.run(ackflow.Flow(ListSource(bodies([{"n": 1}]))).map(boom).to(MemorySink()),
                    executor="local", until_idle=0.3, handle_signals=False)
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
