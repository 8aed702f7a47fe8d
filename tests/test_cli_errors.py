"""Operator-facing errors: inspection never writes, a bad file or flow is one clear line
and exit 2 (no traceback), queue files are private (0600)."""

import hashlib
import os
import sqlite3
import stat
import subprocess
import sys

import pytest

from ackflow.core.errors import ConfigError
from ackflow.embedded import EmbeddedQueue
from ackflow.engine.loop import Engine
from ackflow.flow import Flow
from ackflow.sinks import MemorySink
from ackflow.testing import ListSource


def cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "ackflow.cli", *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


def digest(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def one_clear_line(r, *words):
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("ackflow: error:")]
    assert len(lines) == 1, r.stderr  # Spark's own start-up lines may come before it
    for w in words:
        assert w in lines[0], lines[0]


@pytest.mark.parametrize("action", ["stats", "peek", "dead-letters", "replay"])
def test_a_foreign_sqlite_file_is_refused_and_left_unchanged(tmp_path, action):
    foreign = tmp_path / "app.db"
    with sqlite3.connect(foreign) as c:
        c.execute("CREATE TABLE users (id INTEGER, name TEXT)")
        c.execute("INSERT INTO users VALUES (1, 'ada')")
    before = digest(foreign)
    one_clear_line(
        cli("queue", action, "--db", str(foreign), "--queue", "q"), "not an ackflow queue database"
    )
    assert digest(foreign) == before  # before: ackflow's tables added, switched to WAL
    with sqlite3.connect(foreign) as c:
        assert c.execute("PRAGMA journal_mode").fetchone()[0] != "wal"


def test_a_file_that_is_not_a_database_is_one_line(tmp_path):
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not sqlite" * 100)
    one_clear_line(cli("queue", "stats", "--db", str(junk), "--queue", "q"), "not an ackflow queue database")


def test_flow_files_that_do_not_load_are_one_line(tmp_path):
    (tmp_path / "syntax.py").write_text("flow = (\n")
    one_clear_line(cli("run", f"{tmp_path}/syntax.py:flow"), "syntax error at line")
    (tmp_path / "boom.py").write_text("import no_such_module_here\n")
    one_clear_line(cli("run", f"{tmp_path}/boom.py:flow"), "ModuleNotFoundError")
    (tmp_path / "ok.py").write_text("x = 1\n")
    one_clear_line(cli("run", f"{tmp_path}/ok.py:flow"), "has no attribute 'flow'")
    one_clear_line(cli("run", f"{tmp_path}/ok.py:x"), "not an ackflow Flow")
    one_clear_line(cli("run", f"{tmp_path}/missing.py:flow"), "does not exist")


def test_queue_files_are_private(tmp_path):
    old = os.umask(0o022)
    try:
        q = EmbeddedQueue(tmp_path / "q.db")
        q.publish("a", [b"secret body"])
        for name in os.listdir(tmp_path):
            mode = stat.S_IMODE(os.stat(tmp_path / name).st_mode)
            assert mode & 0o077 == 0, (name, oct(mode))  # before: 0644
        q.close()
    finally:
        os.umask(old)


@pytest.mark.parametrize(
    "args, words",
    [
        (["demo", "--until-idle", "nan"], ["--until-idle", "a finite number", "'nan'"]),
        (["demo", "--until-idle", "inf"], ["--until-idle", "a finite number"]),
        (["demo", "--until-idle", "-1"], ["--until-idle", "must not be negative"]),
        (["demo", "--drain-timeout", "nan"], ["--drain-timeout", "a finite number"]),
        (["demo", "--drain-timeout", "-0.5"], ["--drain-timeout", "must not be negative"]),
        (["demo", "--poison-rate", "nan"], ["--poison-rate", "a finite number"]),
        (["demo", "--metrics-port", "-1"], ["--metrics-port", "between 0 and 65535"]),
        (["demo", "--metrics-port", "70000"], ["--metrics-port", "between 0 and 65535"]),
        (["run", "f.py:flow", "--until-idle", "NaN"], ["--until-idle", "a finite number"]),
        (["run", "f.py:flow", "--drain-timeout=-inf"], ["--drain-timeout", "a finite number"]),
        (["queue", "replay", "--db", "q.db", "--queue", "q", "--id", "-3"], ["--id", "must not be negative"]),
    ],
)
def test_numeric_options_refuse_nan_inf_and_negatives_in_one_line(tmp_path, args, words):
    # before: `--until-idle nan` ran forever, `--drain-timeout nan` never cancelled,
    # `--metrics-port -1` reached the engine
    r = cli(*args, cwd=tmp_path)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ": error:" in ln]
    assert len(errors) == 1, r.stderr
    for w in words:
        assert w in errors[0], errors[0]
    assert not os.listdir(tmp_path)  # refused before anything was created


@pytest.mark.parametrize(
    "option, value",
    [
        ("until_idle", float("nan")),
        ("until_idle", float("inf")),
        ("until_idle", -1),
        ("drain_timeout_s", float("nan")),
        ("drain_timeout_s", float("inf")),
        ("drain_timeout_s", -1.0),
        ("keepalive_s", float("nan")),
        ("keepalive_s", 0),
        ("keepalive_s", -5),
        ("batch_timeout_s", float("nan")),
        ("batch_timeout_s", 0),
        ("linger_s", float("nan")),
        ("linger_s", float("inf")),
        ("drain_timeout_s", "60"),
        ("keepalive_s", True),
    ],
)
def test_the_engine_refuses_meaningless_durations(option, value):
    flow = Flow(ListSource([])).to(MemorySink())
    with pytest.raises(ConfigError, match=f"^{option} must be .* seconds .*got"):
        Engine(flow, executor="local", handle_signals=False, **{option: value})
