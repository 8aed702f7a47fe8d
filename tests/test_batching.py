"""Batch cutting adapts to the rate: an idle engine does not sit on messages until the
batch timeout (issue 15's latency at low load)."""

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
    report = ackflow.run(
        ackflow.Flow(src).to(MemorySink()),
        executor="local",
        batch_size=1000,
        max_inflight=1000,
        batch_timeout_s=10.0,
        until_idle=0.3,
        handle_signals=False,
    )
    assert report.acked == 150
    waits = [src.acked_at[k] - src.pulled_at[k] for k in src.pulled_at]
    # before: one batch of all 150, cut when the source ran dry after ~2 s
    assert report.batches >= 10
    assert max(waits) < 1.0


def test_a_negative_linger_fails_at_start():
    flow = ackflow.Flow(ListSource([])).to(MemorySink())
    with pytest.raises(ConfigError, match="linger_s must be >= 0 seconds"):
        ackflow.run(flow, executor="local", linger_s=-1)


def test_a_run_collects_garbage_less_often_and_gives_the_settings_back():
    """While a flow runs, young collections are rarer (measured: the driver's CPU a
    message); the setting is given back when the run ends, even when it fails."""
    import gc

    seen = []

    class Watching(ListSource):
        def pull(self, max_messages, timeout):
            seen.append(gc.get_threshold()[0])
            return super().pull(max_messages, timeout)

    before = gc.get_threshold()
    report = ackflow.run(
        ackflow.Flow(Watching([b'{"n": 1}'] * 5)).to(MemorySink()),
        executor="local",
        until_idle=0.2,
        handle_signals=False,
    )
    assert report.acked == 5
    assert seen and all(t >= 20_000 for t in seen)
    assert gc.get_threshold() == before

    class Broken(ListSource):
        def pull(self, max_messages, timeout):
            raise RuntimeError("the source broke")

    with pytest.raises(RuntimeError, match="the source broke"):
        ackflow.run(ackflow.Flow(Broken([])).to(MemorySink()), executor="local", handle_signals=False)
    assert gc.get_threshold() == before


def test_overlapping_runs_give_the_collector_settings_back_when_the_last_ends():
    import gc

    from ackflow.engine.collector import GC_YOUNG, fewer_collections

    before = gc.get_threshold()
    a, b = fewer_collections(), fewer_collections()
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)  # the first ends while the second still runs
    assert gc.get_threshold()[0] >= GC_YOUNG
    b.__exit__(None, None, None)
    assert gc.get_threshold() == before
    gc.set_threshold(0, *before[1:])  # an application that turned collection off
    try:
        with fewer_collections():
            assert gc.get_threshold()[0] == 0
    finally:
        gc.set_threshold(*before)
