"""Backpressure: a stalled sink fills the window, pulling stops, nothing is nacked;
when the sink recovers the run resumes and nothing is lost. Metrics show it."""

import os
import threading
import time
import urllib.request

import pytest

import ackflow
from ackflow.engine import Engine
from ackflow.sinks import MemorySink
from ackflow.testing import ListSource
from helpers import bodies, wait_until

pytestmark = pytest.mark.spark


class StallingSink(MemorySink):
    """Blocks every write while the file ``gate`` exists (tasks run in other processes)."""

    def __init__(self, gate):
        super().__init__("stalling")
        self.gate = str(gate)

    def write_partition(self, batch_id, partition, rows):
        deadline = time.monotonic() + 120  # bounded, whatever happens to the test
        while os.path.exists(self.gate) and time.monotonic() < deadline:
            time.sleep(0.02)
        return super().write_partition(batch_id, partition, rows)


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def test_a_stalled_sink_throttles_without_nacks_and_recovers(spark, tmp_path):
    gate = tmp_path / "stall"
    gate.write_text("stalled")
    src = ListSource(bodies([{"n": i} for i in range(1200)]))
    sink = StallingSink(gate)
    port = free_port()
    samples = []
    engine = Engine(
        ackflow.Flow(src).to(sink),
        spark=spark,
        batch_size=100,
        max_inflight=300,
        max_concurrent_batches=2,
        batch_timeout_s=0.1,
        until_idle=1.0,
        metrics_port=port,
        progress=lambda r, w: samples.append((w.in_flight, w.throttled, r.pulled, r.nacked, r.acked)),
    )
    result = {}
    runner = threading.Thread(target=lambda: result.setdefault("report", engine.run()))
    runner.start()
    try:
        assert wait_until(lambda: engine.window.throttled, timeout=60)
        stalled_at = len(samples)
        # while stalled: several progress ticks with the window full and nothing settled
        assert wait_until(lambda: len(samples) >= stalled_at + 4, timeout=30)
        for in_flight, throttled, pulled, nacked, acked in samples[stalled_at:]:
            assert in_flight == 300 and throttled and pulled == 300
            assert nacked == 0 and acked == 0
        m = scrape(port)
        assert m["ackflow_in_flight"] == 300 and m["ackflow_max_inflight"] == 300
        assert m["ackflow_throttled"] == 1 and m["ackflow_throttle_episodes_total"] >= 1
        assert m["ackflow_messages_pulled_total"] == 300
        assert m.get("ackflow_messages_nacked_total", 0) == 0
    finally:
        gate.unlink()
    runner.join(180)
    assert not runner.is_alive()
    report = result["report"]
    assert report.acked == 1200 and report.nacked == 0 and report.dead_lettered == 0
    assert sorted(r["n"] for r in sink.rows) == list(range(1200))
    assert report.throttle_episodes >= 1
    assert all(len(v) == 1 for v in src.settled.values())


def test_metrics_cover_outcomes_and_bind_to_loopback(spark):
    port = free_port()
    src = ListSource([*bodies([{"n": i} for i in range(40)]), b"not json"])
    seen = {}

    def peek(report, window):
        if report.settled >= 41 and not seen:
            seen.update(scrape(port))

    ackflow.run(
        ackflow.Flow(src).to(MemorySink()),
        spark=spark,
        batch_size=50,
        max_inflight=100,
        until_idle=0.8,
        metrics_port=port,
        progress=peek,
    )
    assert seen["ackflow_messages_acked_total"] == 40
    assert seen['ackflow_messages_dead_lettered_total{step="decode"}'] == 1
    assert seen['ackflow_rows_written_total{sink="memory"}'] == 40
    assert seen["ackflow_batch_duration_seconds_count"] >= 1
    assert seen["ackflow_batch_size_messages_sum"] == 41
    assert "ackflow_bisections_total" in seen
    with pytest.raises(OSError):  # closed with the run
        scrape(port)
