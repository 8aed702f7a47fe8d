"""Recovery of offset sources, with real processes killed: a slow batch holding the
lowest offsets holds the commit back while later batches finish, and its crash leads
to reprocessing, not loss; SIGKILLs at random moments over a file directory and over
a RabbitMQ stream, then restarts: every message reaches the sink."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest

from ackflow.sources.files_state import read_state
from amqp import names, stream_publish
from helpers import wait_until

pytestmark = [pytest.mark.spark, pytest.mark.slow]

HERE = os.path.dirname(__file__)
PIPELINE = os.path.join(HERE, "pipelines", "offsets_flow.py")


def cmd(flow, until_idle=2):
    return [
        sys.executable,
        "-m",
        "ackflow.cli",
        "run",
        f"{PIPELINE}:{flow}",
        "--master",
        "local[2]",
        "--json",
        "--batch-size",
        "100",
        "--max-inflight",
        "600",
        "--max-concurrent-batches",
        "2",
        "--until-idle",
        str(until_idle),
    ]


def written(out):
    """The n values in the Parquet output (committed batches only)."""
    if not os.path.isdir(out) or not any(n.startswith("batch=") for n in os.listdir(out)):
        return []
    return pq.read_table(out, columns=["n"]).column("n").to_pylist()


def write_files(folder, files, per_file):
    n = 0
    for f in range(files):
        tmp = os.path.join(folder, f".f{f}.tmp")
        with open(tmp, "w") as out:
            for _ in range(per_file):
                out.write(json.dumps({"n": n}) + "\n")
                n += 1
        os.rename(tmp, os.path.join(folder, f"f{f:02d}.jsonl"))
    return n


def file_state(folder):
    return {e["name"]: e for e in read_state(folder).values()}


def kill_when(proc, cond, timeout=180):
    reached = wait_until(lambda: cond() or proc.poll() is not None, timeout=timeout, every=0.05)
    assert reached and proc.poll() is None, "the run ended before the kill"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)


def kill_at_random_moments(flow, env, out, kills=3):
    """Start the pipeline and SIGKILL it after a random amount of new output, ``kills``
    times."""
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    for _ in range(kills):
        target = len(written(out)) + rng.randint(200, 1200)
        proc = subprocess.Popen(cmd(flow), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            kill_when(proc, lambda t=target: len(written(out)) >= t)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)


def test_a_slow_batch_at_the_head_holds_the_commit_and_its_crash_loses_nothing(tmp_path):
    folder, out = tmp_path / "in", str(tmp_path / "out")
    folder.mkdir()
    total = write_files(folder, 1, 1500)
    env = {**os.environ, "AF_DIR": str(folder), "AF_OUT": out, "AF_SLOW_SECONDS": "120"}
    proc = subprocess.Popen(cmd("files_flow"), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # later batches finish and are acked while the first (line 1) is still running
        kill_when(proc, lambda: len(written(out)) >= 500)
        state = file_state(folder)
        assert state.get("f00.jsonl", {}).get("committed", 0) == 0, state
        assert 0 not in written(out)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    env["AF_SLOW_SECONDS"] = "0"
    done = subprocess.run(cmd("files_flow"), env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = written(out)
    assert set(got) == set(range(total))  # the slow batch was processed again
    assert len(got) == total  # and the Parquet manifest kept the rest from repeating
    assert os.listdir(folder / "done") == ["f00.jsonl"]


def test_sigkill_at_random_moments_over_a_file_directory(tmp_path):
    folder, out = tmp_path / "in", str(tmp_path / "out")
    folder.mkdir()
    total = write_files(folder, 6, 1000)
    env = {**os.environ, "AF_DIR": str(folder), "AF_OUT": out}
    kill_at_random_moments("files_flow", env, out)
    done = subprocess.run(cmd("files_flow"), env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert set(written(out)) == set(range(total))  # every line at least once
    assert sorted(os.listdir(folder / "done")) == [f"f{f:02d}.jsonl" for f in range(6)]


def test_sigkill_at_random_moments_over_a_stream(tmp_path, rabbitmq):
    stream, out = names("rec"), str(tmp_path / "out")
    total = 6000
    stream_publish(rabbitmq, stream, [json.dumps({"n": i}).encode() for i in range(total)])
    env = {**os.environ, "AF_STREAM_PORT": str(rabbitmq.stream_port), "AF_STREAM": stream, "AF_OUT": out}
    kill_at_random_moments("stream_flow", env, out)
    started = time.monotonic()
    done = subprocess.run(
        cmd("stream_flow", until_idle=3), env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert set(written(out)) == set(range(total)), time.monotonic() - started
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["dead_lettered"] == 0
