"""The driver loop: the window bound, shutdown, and errors that stop a run."""

import json
import signal
import subprocess
import sys
import textwrap

import pytest

import ackflow
from ackflow.core import ConfigError
from ackflow.sinks import MemorySink
from ackflow.testing import ListSource
from helpers import FAST, bodies, wait_until

pytestmark = pytest.mark.spark


def test_bad_options_fail_at_start_and_say_what_to_fix():
    flow = ackflow.Flow(ListSource([])).to(MemorySink())
    with pytest.raises(ConfigError, match=r"batch_size .* cannot exceed max_inflight"):
        ackflow.run(flow, batch_size=100, max_inflight=10)
    with pytest.raises(ConfigError, match="max_concurrent_batches must be a positive integer"):
        ackflow.run(flow, max_concurrent_batches=0)
    with pytest.raises(ConfigError, match="no sink"):
        ackflow.run(ackflow.Flow(ListSource([])))


def test_in_flight_never_exceeds_the_window(spark):
    seen = []
    src = ListSource(bodies([{"n": i} for i in range(500)]))
    report = ackflow.run(
        ackflow.Flow(src).to(MemorySink()),
        spark=spark,
        progress=lambda rep, w: seen.append(w.in_flight),
        **{**FAST, "batch_size": 40, "max_inflight": 80},
    )
    assert report.acked == 500 and max(seen) <= 80


def test_a_flow_error_stops_the_run_and_gives_everything_back(spark):
    src = ListSource(bodies([{"a": i} for i in range(30)]))
    with pytest.raises(ackflow.FlowError, match="step 'bad'"):
        ackflow.run(
            ackflow.Flow(src).filter("no_such_col > 1", name="bad").to(MemorySink()), spark=spark, **FAST
        )
    assert set(src.final().values()) == {"released"}


SIGNAL_FLOW = textwrap.dedent("""
    import json, sys, time
    import ackflow
    from ackflow.sinks import MemorySink
    from ackflow.testing import ListSource

    def slow(r):
        time.sleep(0.01)
        return r

    src = ListSource([json.dumps({"n": i}).encode() for i in range(100000)])
    sink = MemorySink()
    flow = ackflow.Flow(src).map(slow, name="slow").to(sink)
    report = ackflow.run(flow, master="local[2]", batch_size=200, max_inflight=400,
                         batch_timeout_s=0.2, drain_timeout_s=60,
                         progress=lambda r, w: print("progress", r.acked, flush=True))
    final = src.final()
    acked = {k for k, v in final.items() if v == "acked"}
    written = {f"m{r['n']}" for r in sink.rows}
    print("RESULT", json.dumps({"acked": len(acked), "released": report.released,
          "acked_not_written": len(acked - written),
          "unsettled": sum(src.deliveries.values()) - sum(len(v) for v in src.settled.values())}),
          flush=True)
""")


def test_sigterm_stops_pulling_drains_and_exits_cleanly(tmp_path):
    script = tmp_path / "flow.py"
    script.write_text(SIGNAL_FLOW)
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=tmp_path,
    )
    lines = []
    try:

        def acked_some():
            line = proc.stdout.readline()
            lines.append(line)
            return line.startswith("progress") and int(line.split()[1]) > 0

        assert wait_until(acked_some, timeout=120, every=0)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0
    result = json.loads(out.split("RESULT", 1)[1])
    assert 0 < result["acked"] < 100000  # it stopped early
    assert result["acked_not_written"] == 0
    assert result["unsettled"] == 0  # every delivery was settled (acked or released) once


def test_a_step_that_cannot_be_sent_to_executors_fails_at_start_naming_it(spark):
    import threading

    lock = threading.Lock()
    src = ListSource(bodies([{"n": 1}]))
    flow = ackflow.Flow(src).map(lambda r: (lock, r)[1], name="locked").to(MemorySink())
    with pytest.raises(ackflow.FlowError, match=r"step 'locked': cannot be sent to the executors"):
        ackflow.run(flow, spark=spark, **FAST)
    assert src.deliveries == {}  # nothing was pulled
