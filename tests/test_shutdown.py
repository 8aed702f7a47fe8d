"""Shutdown of `ackflow run`: SIGTERM drains within --drain-timeout and gives back the
rest; a second signal exits at once. Either way, nothing acked was unwritten."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pyarrow.parquet as pq
import pytest

from ackflow.embedded import EmbeddedQueue
from helpers import wait_until

pytestmark = [pytest.mark.spark, pytest.mark.slow]

N = 20000


@pytest.fixture
def setup(tmp_path):
    db = str(tmp_path / "q.db")
    out = str(tmp_path / "out")
    EmbeddedQueue(db).publish(
        "in", [json.dumps({"n": i}).encode() for i in range(N)], msg_ids=[f"m{i}" for i in range(N)]
    )
    (tmp_path / "flow.py").write_text(
        textwrap.dedent(f"""
        import time
        import ackflow
        from ackflow.sources import EmbeddedQueue
        from ackflow.sinks import Parquet

        def slow(r):
            time.sleep(0.004)
            return {{"id": "m" + str(r["n"])}}

        flow = ackflow.Flow(EmbeddedQueue({db!r}, "in")).map(slow, name="slow").to(Parquet({out!r}))
    """)
    )
    return tmp_path, db, out


def start(tmp_path, drain):
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ackflow.cli",
            "run",
            "flow.py:flow",
            "--master",
            "local[2]",
            "--batch-size",
            "400",
            "--max-inflight",
            "1200",
            "--drain-timeout",
            str(drain),
            "--json",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def stats(db):
    q = EmbeddedQueue(db)
    try:
        return q.stats("in"), {m["msg_id"] for m in q.peek("in", N)}
    finally:
        q.close()


def written_ids(out):
    if not os.path.isdir(out) or not any(n.startswith("batch=") for n in os.listdir(out)):
        return set()
    return set(pq.read_table(out, columns=["id"]).column("id").to_pylist())


def assert_nothing_acked_unwritten(db, out):
    _, queued = stats(db)
    acked = {f"m{i}" for i in range(N)} - queued
    assert acked, "nothing was acked before the signal"
    assert acked <= written_ids(out)


def test_sigterm_drains_then_gives_back_the_rest(setup):
    tmp_path, db, out = setup
    proc = start(tmp_path, drain=1)
    try:
        assert wait_until(lambda: stats(db)[0]["acked_total"] > 0, timeout=120, every=0.1)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-2000:]
    s, _ = stats(db)
    assert s["leased"] == 0  # every delivery was settled or given back
    assert s["ready"] > 0  # it stopped early: the rest waits in the queue
    assert_nothing_acked_unwritten(db, out)


def test_a_second_signal_exits_at_once(setup):
    tmp_path, db, out = setup
    proc = start(tmp_path, drain=60)
    try:
        assert wait_until(lambda: stats(db)[0]["acked_total"] > 0, timeout=120, every=0.1)
        proc.send_signal(signal.SIGTERM)
        # signals sent back to back are merged by the kernel: wait until the first was seen
        assert wait_until(lambda: "stopping; draining" in proc.stderr.readline(), timeout=30, every=0)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    assert_nothing_acked_unwritten(db, out)
    # what it held stays leased until the next consumer takes the queue over
    from ackflow.sources import EmbeddedQueue as Source

    held = stats(db)[0]["leased"]
    src = Source(db, "in")
    assert src.open() == held
    src.close()
    assert stats(db)[0]["leased"] == 0
