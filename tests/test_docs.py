"""The documentation is tested like code: the site builds in strict mode (a broken link,
a missing page or an API reference that does not resolve fails it), every example
marked runnable runs, and the facts the docs list (metric names) match the code.

A fenced ``python`` block right after a ``<!-- run -->`` line is runnable. The runnable
blocks of one page run in order, in one fresh Python process (so a page can build on
its earlier blocks and starts Spark at most once), in an empty temporary directory,
with this checkout's ``src`` first on the path. See docs/contributing.md.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"^<!-- run(?: needs=([a-z,]+))? -->$")
SERVERS = {"rabbitmq": "AMQP_URL", "postgres": "PG_DSN", "kafka": "KAFKA_BOOTSTRAP"}  # fixture: its variable
ADDRESS = {"rabbitmq": "url", "postgres": "dsn", "kafka": "bootstrap"}  # fixture: where it listens
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def runnable_blocks(text: str) -> list[tuple[str, set[str]]]:
    """The ```python blocks that follow a ``<!-- run -->`` line (blank lines between
    are allowed), each with the servers it needs (``<!-- run needs=rabbitmq,postgres -->``:
    the test starts them and sets ``AMQP_URL`` / ``PG_DSN``). A marker not followed by a
    python block is an error: it would silently turn an example into one that never runs."""
    lines = text.split("\n")
    blocks = []
    for i, line in enumerate(lines):
        marker = MARKER.match(line.strip())
        if marker is None:
            if line.strip().startswith("<!-- run"):
                raise AssertionError(f"line {i + 1}: not a run marker: {line.strip()!r}")
            continue
        needs = set(filter(None, (marker.group(1) or "").split(",")))
        if needs - SERVERS.keys():
            raise AssertionError(f"line {i + 1}: unknown servers {sorted(needs - SERVERS.keys())}")
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        if j >= len(lines) or lines[j].strip() != "```python":
            raise AssertionError(f"line {i + 1}: {MARKER} is not followed by a ```python block")
        end = lines.index("```", j + 1)
        blocks.append(("\n".join(lines[j + 1 : end]), needs))
    return blocks


def test_runnable_blocks_are_found():
    text = (
        "a\n<!-- run -->\n\n```python\nx = 1\n```\n```python\nnot run\n```\n"
        "<!-- run needs=postgres -->\n```python\ny = 2\n```\n"
    )
    assert runnable_blocks(text) == [("x = 1", set()), ("y = 2", {"postgres"})]
    with pytest.raises(AssertionError, match="not followed"):
        runnable_blocks("<!-- run -->\n```bash\nls\n```\n")
    with pytest.raises(AssertionError, match="not a run marker"):
        runnable_blocks("<!-- run: yes -->\n```python\nx = 1\n```\n")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env["NO_MKDOCS_2_WARNING"] = "1"
    return env


RUNNABLE = {p.relative_to(ROOT).as_posix(): runnable_blocks(p.read_text()) for p in PAGES}


def test_the_first_hour_is_runnable():
    """The README's flow and the getting-started flows are among what runs."""
    assert RUNNABLE["README.md"], "README.md has no runnable flow"
    assert len(RUNNABLE["docs/getting-started.md"]) >= 3


@pytest.mark.slow
@pytest.mark.parametrize("page", sorted(p for p, blocks in RUNNABLE.items() if blocks))
def test_examples_run(page, tmp_path, request):
    script = "\n\n".join(
        f"# --- block {i + 1} of {page}\n{code}" for i, (code, _) in enumerate(RUNNABLE[page])
    )
    (tmp_path / "example.py").write_text(script)
    env = _env()
    for server in set().union(*(needs for _, needs in RUNNABLE[page])):
        fixture = request.getfixturevalue(server)  # the session's throwaway server
        env[SERVERS[server]] = getattr(fixture, ADDRESS[server])
    r = subprocess.run(
        [sys.executable, "example.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, f"{page}: the runnable examples failed\n{r.stdout}\n{r.stderr[-6000:]}"


def test_site_builds_strictly(tmp_path):
    """``mkdocs build --strict``: any warning (a broken link or anchor, a page missing
    from the nav, an API reference that does not resolve) fails the build."""
    started = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "WARNING" not in out, out
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "reference" / "api" / "index.html").is_file()
    assert time.monotonic() - started < 60, "the docs build should stay under a minute"


def test_every_metric_is_documented():
    source = (ROOT / "src" / "ackflow" / "observe" / "metrics.py").read_text()
    page = (ROOT / "docs" / "operating" / "metrics.md").read_text()
    defined = re.findall(r'(Counter|Gauge|Histogram)\(\s*"(ackflow_\w+)"', source)
    assert len(defined) >= 20
    for kind, name in defined:
        exported = f"{name}_total" if kind == "Counter" else name
        assert f"`{exported}`" in page, f"metric {exported} is not in docs/operating/metrics.md"


def test_readme_is_a_front_door():
    text = (ROOT / "README.md").read_text()
    assert len(text.split("\n")) <= 200
    # .ci/run runs the line after the marker: it must still be the test command
    after = text.split("<!-- test-command -->\n", 1)[1].split("\n")
    assert after[0] == "```bash" and "pytest" in after[1], after[:2]
    for link in re.findall(r"\]\(((?:docs/|CHANGELOG)[^)#]*)", text):
        assert (ROOT / link).exists(), f"README links to {link}, which does not exist"


def test_one_version_everywhere():
    import tomllib

    import ackflow

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["version"] == ackflow.__version__ == "0.6.17"
    newest = re.search(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert newest and newest.group(1) == ackflow.__version__
    r = subprocess.run(
        [sys.executable, "-m", "ackflow.cli", "--version"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (r.returncode, r.stdout.strip()) == (0, f"ackflow {ackflow.__version__}")


def _listening(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp writes them) listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().split("\n")[1:]:
            cols = line.split()
            if len(cols) > 3 and cols[3] == "0A" and int(cols[1].split(":")[1], 16) == port:
                found.append(cols[1].split(":")[0])
    return found


@pytest.mark.slow
def test_docs_command_serves_the_site_on_loopback():
    import signal
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "ackflow.cli", "docs", "--port", str(port)],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        page = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as r:
                    page = r.read().decode()
                break
            except OSError:
                time.sleep(0.5)
        assert page is not None, f"ackflow docs served nothing: {proc.poll()}"
        assert "<title>ackflow</title>" in page and "Getting started" in page
        assert _listening(port) == ["0100007F"], "the docs server must bind 127.0.0.1 only"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert "WARNING" not in out, out


def test_docs_command_says_what_to_install(monkeypatch, capsys):
    from ackflow import cli

    monkeypatch.setattr(cli, "_find_spec", lambda name: None if name == "mkdocs" else object())
    assert cli.main(["docs"]) == 2
    err = capsys.readouterr().err
    assert "the docs need mkdocs, which are not installed" in err and "pip install" in err


def test_the_performance_picture_is_drawn_from_the_latest_run(tmp_path):
    from benchmarks import chart

    picture = ROOT / "docs/img/benchmark-latest.svg"
    run = re.search(r"\((\S+\.json)\)</text>", picture.read_text())
    assert run is not None, "the picture names its run in its title"
    out = tmp_path / "latest.svg"
    assert chart.main([str(ROOT / "benchmarks/measured" / run.group(1)), str(out)]) == 0
    assert out.read_text() == picture.read_text()
    assert "docs/img/benchmark-latest.svg" in (ROOT / "README.md").read_text()
    assert "img/benchmark-latest.svg" in (ROOT / "docs/performance.md").read_text()


def test_the_picture_stacks_each_phases_cpu_and_skips_what_was_not_run(tmp_path):
    from benchmarks import chart

    run = {
        "settings": {"messages": 1000},
        "peer": {"rate": 2000.0, "driver_cpu_us": 5.0, "spark_cpu_us": 30.0, "jvm_cpu_us": 20.0},
        "ackflow": {"rate": 1000.0, "driver_cpu_us": 10.0, "spark_cpu_us": 40.0, "jvm_cpu_us": 30.0},
        "rmq_limit": {"rate": 4000.0, "driver_cpu_us": 2.0, "broker_cpu_us": 8.0},
        "ackflow_rmq": {"rate": 500.0, "driver_cpu_us": 4.0, "consumer_cpu_us": 6.0, "broker_cpu_us": 8.0},
    }
    text = chart.svg(run, "t")
    parts = re.findall(
        r'width="([0-9.]+)" height="16" fill="[^"]+" data-part="(\w+)" data-us="([0-9.]+)"', text
    )
    assert [(p, float(us)) for _, p, us in parts] == [
        ("driver", 5.0), ("jvm", 20.0), ("python", 10.0),
        ("driver", 10.0), ("jvm", 30.0), ("python", 10.0),
        ("driver", 2.0), ("broker", 8.0),
        ("driver", 4.0), ("consumer", 6.0), ("broker", 8.0),
    ]  # fmt: skip
    per_us = {round(float(w) / float(us), 3) for w, _, us in parts}
    assert len(per_us) == 1  # one scale for every part of every phase
    assert "2 000/s" in text and "1 000/s" in text and ">50.0<" in text  # ackflow's CPU in all
    assert "RabbitMQ quorum" not in text and "Structured Streaming" not in text
    path = tmp_path / "latency.json"  # a run with no phase the picture shows: none drawn
    path.write_text(json.dumps({"settings": {"messages": 1}, "latency": {"rate": 5.0}}))
    assert chart.draw(path, tmp_path / "latency.svg") is False and not (tmp_path / "latency.svg").exists()


@pytest.mark.parametrize("page", [p.relative_to(ROOT).as_posix() for p in PAGES])
def test_code_fences_are_closed(page):
    """An unclosed or doubled fence swallows the text after it into a code block, which
    a strict build does not notice."""
    lines = [line.strip() for line in (ROOT / page).read_text().split("\n")]
    fences = [i for i, line in enumerate(lines) if line.startswith("```")]
    assert len(fences) % 2 == 0, f"{page}: an odd number of ``` fences"
    opened = fences[0::2]
    assert all(lines[i] != "```" for i in opened), f"{page}: a block opens without a language"
