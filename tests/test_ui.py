"""The live status page, in a real headless Chromium (Debian's, driven by Playwright):
a real run on the embedded queue, counters moving, a stalled sink throttling the window,
poison messages dead-lettered with their reason and replayed from the page, bodies
shown as text, replay refused without the guard header or from another origin, and the
server on 127.0.0.1 only."""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

import ackflow
from ackflow.cli import main
from ackflow.core.errors import ConfigError
from ackflow.core.ledger import Failure
from ackflow.core.policy import RetryPolicy
from ackflow.core.settlement import Delivery
from ackflow.embedded import EmbeddedQueue
from ackflow.engine import Engine, RunReport
from ackflow.observe.status import PREVIEW_BYTES, EngineFacts, StatusBoard
from ackflow.observe.ui import StatusServer
from ackflow.sinks import MemorySink
from ackflow.sources import EmbeddedQueue as EmbeddedQueueSource
from ackflow.testing import FailingSink, ListSource
from helpers import wait_until

CHROMIUM = os.environ.get("ACKFLOW_CHROMIUM", "/usr/bin/chromium")
HOSTILE = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2"><b>bold?</b>'
SECRET_DSN = "postgresql://app:s3cret@db.internal/shop"
N = "(id) => Number(document.getElementById(id).textContent.split('/')[0].replace(/[,\\s]/g, ''))"


@pytest.fixture(scope="module")
def browser():
    if not (os.path.exists(CHROMIUM) or shutil.which(CHROMIUM)):
        pytest.fail(
            f"no Chromium at {CHROMIUM}: run scripts/install-services.sh (it installs "
            "Debian's chromium) or set ACKFLOW_CHROMIUM"
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield b
        b.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 1400})
    p = context.new_page()
    errors: list[str] = []
    p.on("pageerror", lambda e: errors.append(str(e)))
    p.errors = errors
    yield p
    context.close()


def wait_js(page, expression: str, arg=None, timeout_s: float = 60) -> None:
    """Wait, with a deadline, until ``expression`` (a JS function of ``arg``) is true."""
    page.wait_for_function(expression, arg=arg, timeout=timeout_s * 1000)


def count(page, element_id: str) -> int:
    return int(page.evaluate(f"({N})('{element_id}')"))


def http(
    url: str, *, method: str = "GET", headers: dict[str, str] | None = None, body: bytes | None = None
) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def other_addresses() -> set[str]:
    """This machine's non-loopback IPv4 addresses (none on an isolated box)."""
    found: set[str] = set()
    try:
        found |= {i[4][0] for i in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
    except OSError:
        pass
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent: picks the outgoing address
            found.add(s.getsockname()[0])
    except OSError:
        pass
    return {a for a in found if not ipaddress.ip_address(a).is_loopback}


class StallingSink(MemorySink):
    """Its commit (on the driver) blocks while the file ``gate`` exists."""

    def __init__(self, gate):
        super().__init__("orders")
        self.gate = str(gate)

    def commit(self, batch_id, tokens):
        deadline = time.monotonic() + 120  # bounded, whatever happens to the test
        while os.path.exists(self.gate) and time.monotonic() < deadline:
            time.sleep(0.02)
        super().commit(batch_id, tokens)


def publish(db, start: int, n: int) -> None:
    q = EmbeddedQueue(db)
    q.publish(
        "orders",
        [json.dumps({"n": i}).encode() for i in range(start, start + n)],
        msg_ids=[f"order-{i}" for i in range(start, start + n)],
    )
    q.close()


@pytest.mark.spark
@pytest.mark.slow
def test_status_page_during_a_real_run(spark, tmp_path, page, browser):
    db = str(tmp_path / "queue.db")
    gate, reject = tmp_path / "stall", tmp_path / "reject"
    reject.write_text("poison is refused while this file exists")
    reject_path = str(reject)

    def validate(row):
        if row.get("poison") and os.path.exists(reject_path):
            raise ValueError(f"poison order {row['n']}: cannot book it at {SECRET_DSN}")
        return {"n": row["n"]}

    publish(db, 0, 200)
    sink = StallingSink(gate)
    source = EmbeddedQueueSource(
        db, "orders", policy=RetryPolicy(max_deliveries=2, backoff_s=0.1, max_backoff_s=0.2)
    )
    engine = Engine(
        ackflow.Flow(source).map(validate, name="validate").to(sink),
        spark=spark,
        batch_size=50,
        max_inflight=150,
        max_concurrent_batches=2,
        batch_timeout_s=0.1,
        ui_port=0,
        ui_allow_replay=True,
    )
    result: dict = {}
    runner = threading.Thread(target=lambda: result.setdefault("report", engine.run()))
    runner.start()
    try:
        assert wait_until(lambda: engine.ui is not None, 120)
        host, port = engine.ui.address
        url = engine.ui.url
        assert (host, url) == ("127.0.0.1", f"http://127.0.0.1:{port}/")
        for addr in other_addresses():  # loopback only: another address of this host refuses
            with pytest.raises(OSError):
                socket.create_connection((addr, port), timeout=3).close()

        # -- counters move, live (no reload) ------------------------------------------------
        token = engine.ui.replay_token
        assert engine.ui.replay_url == f"{url}#replay-token={token}" and len(token) >= 32
        page.goto(engine.ui.replay_url)  # the operator's link: the page keeps the token
        wait_js(page, f"() => ({N})('c-acked') >= 1", timeout_s=120)
        assert page.text_content("#source-name") == "embedded:orders"
        wait_js(page, f"() => ({N})('c-acked') === 200")
        publish(db, 200, 200)
        wait_js(page, f"() => ({N})('c-acked') === 400 && ({N})('c-inflight') === 0")
        assert count(page, "c-rows") == 400 and count(page, "c-nacked") == 0
        sink_node = page.locator('#graph g.node[data-role="sink"][data-name="orders"]')
        wait_js(
            page,
            "() => document.querySelector('#graph g.node.sink').textContent.includes('rows written 400')",
        )
        assert "rows written 400" in sink_node.text_content()
        for step in ("decode", "validate"):  # counted in the Spark tasks (not the sampler's)
            node = f'#graph g.node[data-name="{step}"]'
            wait_js(
                page, f"() => document.querySelector('{node}').textContent.includes('rows in 400 · out 400')"
            )
        names = page.eval_on_selector_all("#graph g.node", "ns => ns.map(n => n.dataset.name)")
        assert names == ["embedded:orders", "decode", "validate", "orders", "dead letters"]

        # -- a stalled sink: the window fills, pulling stops, nothing is nacked ------------
        gate.write_text("stalled")
        publish(db, 400, 600)
        wait_js(page, "() => document.getElementById('window-state').textContent.includes('FULL')")
        wait_js(page, f"() => ({N})('c-inflight') === 150")
        assert page.text_content("#state") == "throttled"
        assert page.text_content("#c-inflight") == "150 / 150"
        waits = page.text_content("#waits")
        wait_js(
            page,
            "() => /sink commit2 batches, 100 messages/.test(document.getElementById('waits').textContent)",
        )
        waits = page.text_content("#waits")
        assert "waiting to be batched50 messages" in waits, waits
        wait_js(page, "() => document.querySelectorAll('#chart-window rect.shade').length > 0")
        wait_js(page, f"() => ({N})('episodes-count') >= 1")
        assert count(page, "c-nacked") == 0 and count(page, "c-pulled") == 550
        gate.unlink()
        wait_js(page, f"() => ({N})('c-acked') === 1000 && ({N})('c-inflight') === 0")
        assert page.text_content("#state") == "running"

        # -- poison: dead-lettered with its step and reason; bodies shown as text ----------
        q = EmbeddedQueue(db)
        poison_body = json.dumps({"n": -1, "poison": True, "note": HOSTILE})
        q.publish(
            "orders",
            [poison_body.encode(), b"<script>window.__pwned = 3</script> not json"],
            msg_ids=["poison-1", "broken-1"],
        )
        q.close()
        rows = page.locator("#dead-letters tbody tr")
        wait_js(page, "() => document.querySelectorAll('#dead-letters tbody tr').length === 2")
        poison = rows.filter(has_text="poison-1")
        assert poison.locator("td.step").text_content() == "validate"
        assert poison.locator("td.deliveries").text_content() == "2"
        error = poison.locator("td.error").text_content()
        assert error.startswith("ValueError: poison order -1: cannot book it at postgresql://app:***@")
        assert "s3cret" not in page.content() and b"s3cret" not in http(url + "api/status")[1]
        assert poison.locator("pre.body").text_content() == poison_body  # as text, whole
        broken = rows.filter(has_text="broken-1")
        assert broken.locator("td.step").text_content() == "decode"
        assert "could not decode the json payload" in broken.locator("td.error").text_content()
        assert broken.locator("pre.body").text_content() == ("<script>window.__pwned = 3</script> not json")
        assert page.locator("#dead-letters script, #dead-letters img, #dead-letters b").count() == 0
        assert page.evaluate("window.__pwned") is None
        assert count(page, "c-dead") == 2 and count(page, "c-nacked") == 2
        node = page.locator('#graph g.node[data-name="validate"]').text_content()
        assert "failed: 2" in node and "nacked 1 · dead 1" in node  # deliveries that failed

        page.select_option("#dl-step", "decode")  # filter by step
        wait_js(page, "() => document.querySelectorAll('#dead-letters tbody tr').length === 1")
        assert "broken-1" in rows.first.text_content()
        page.select_option("#dl-step", "validate")
        wait_js(
            page, "() => document.querySelector('#dead-letters tbody tr').textContent.includes('poison-1')"
        )
        assert rows.count() == 1
        shot = os.environ.get("ACKFLOW_UI_SCREENSHOT")  # docs/ui.png is made this way
        page.select_option("#dl-step", "")
        wait_js(page, "() => document.querySelectorAll('#dead-letters tbody tr').length === 2")
        page.screenshot(path=str(tmp_path / "ui.png"))
        assert (tmp_path / "ui.png").read_bytes()[:4] == b"\x89PNG"
        if shot:
            page.screenshot(path=shot)

        # -- replay is refused without the guard header, from another origin or host -------
        poison_id = int(poison.get_attribute("data-id"))
        body = json.dumps({"ids": [poison_id]}).encode()
        api = url + "api/replay"
        own = {"Content-Type": "application/json", "Origin": url.rstrip("/")}
        assert http(api, method="POST", headers=own, body=body)[0] == 403  # no header
        # issue 27 #13: every header a page or another local process can send, but not the
        # run's token (a forged request from another user of this host)
        forged = {**own, "X-Ackflow-Replay": "1"}
        for extra in ({}, {"X-Ackflow-Replay-Token": "guess"}, {"X-Ackflow-Replay-Token": token[:-1]}):
            status, answer = http(api, method="POST", body=body, headers={**forged, **extra})
            assert status == 403 and b"replay token is missing or wrong" in answer
        assert token not in http(url + "api/status")[1].decode()
        assert token not in http(url)[1].decode()
        assert page.url == url  # the token left the address bar
        status, answer = http(
            api,
            method="POST",
            body=body,
            headers={**own, "X-Ackflow-Replay": "1", "Origin": "http://evil.example"},
        )
        assert status == 403 and b"cross-site" in answer
        status, _ = http(
            api, method="POST", body=body, headers={**own, "X-Ackflow-Replay": "1"} | {"Origin": "null"}
        )
        assert status == 403
        status, _ = http(
            api,
            method="POST",
            body=body,
            headers={
                **own,
                "X-Ackflow-Replay": "1",
                "Host": f"evil.example:{port}",
                "Origin": f"http://evil.example:{port}",
            },
        )  # DNS rebinding: a foreign Host
        assert status == 421
        assert http(url + "api/status", headers={"Host": f"evil.example:{port}"})[0] == 421
        assert http(api, headers=own)[0] == 405  # GET is no replay
        # a page of another origin, in the browser: the custom header needs a preflight,
        # which this server never grants, so the request is not sent
        other = browser.new_page()
        other.goto("about:blank")
        outcome = other.evaluate(
            """async ([api, body]) => {
            try {
              const r = await fetch(api, {method: "POST", body,
                headers: {"Content-Type": "application/json", "X-Ackflow-Replay": "1"}});
              return "sent: " + r.status;
            } catch (e) { return "blocked: " + e.message; }
        }""",
            [api, body.decode()],
        )
        other.close()
        assert outcome.startswith("blocked"), outcome
        check = EmbeddedQueue(db, readonly=True)
        # two failures of different steps: the order they reach the dead letters is not a promise
        assert sorted(d.msg_id for d in check.dead_letters("orders")) == ["broken-1", "poison-1"]

        # -- replay from the page: the poison message, now accepted, is written -------------
        reject.unlink()
        poison.locator("input.dl-select").check()
        page.click("#replay")
        wait_js(page, "() => document.getElementById('replay-status').textContent.startsWith('replayed 1')")
        assert wait_until(lambda: any(r["n"] == -1 for r in sink.rows), 60)
        assert [d.msg_id for d in check.dead_letters("orders")] == ["broken-1"]
        check.close()
        wait_js(page, f"() => ({N})('c-acked') === 1001")
        wait_js(page, "() => document.querySelector('#dead-letters tr.replayed') !== null")
        assert "replayed" in rows.filter(has_text="poison-1").text_content()
        assert rows.filter(has_text="broken-1").locator("input.dl-select").is_enabled()
        again = page.evaluate(
            """async (id) => {
            const r = await fetch("/api/replay", {method: "POST", body: JSON.stringify({ids: [id]}),
              headers: {"Content-Type": "application/json", "X-Ackflow-Replay": "1",
                        "X-Ackflow-Replay-Token": sessionStorage.getItem("ackflow-replay-token")}});
            return [r.status, await r.json()];
        }""",
            poison_id,
        )
        assert again == [200, {"replayed": 0, "ids": [], "skipped": [poison_id], "kept": {}}]
        assert page.errors == []
    finally:
        if gate.exists():
            gate.unlink()
        engine.request_stop()
        runner.join(180)
    assert not runner.is_alive()
    report = result["report"]
    assert report.acked == 1001 and report.dead_lettered == 2 and report.nacked == 2
    assert sorted(r["n"] for r in sink.rows) == [-1, *range(1000)]
    with pytest.raises(OSError):  # the page went away with the run
        socket.create_connection(("127.0.0.1", port), timeout=3).close()


def bodies(n: int) -> list[bytes]:
    return [b"not json" if i % 10 == 9 else json.dumps({"n": i}).encode() for i in range(n)]


def rows_by_step(flow: ackflow.Flow, **engine: object) -> dict:
    """Run ``flow`` with the status page on; the rows per step of its last snapshot."""
    run = Engine(
        flow, batch_size=25, max_inflight=100, until_idle=0.3, ui_port=0, handle_signals=False, **engine
    )
    run.run()
    assert run.board is not None
    return run.board.current()[1]["rows_by_step"]


def test_rows_in_out_and_failed_per_step_are_counted_in_the_tasks():
    # 100 messages, 10 undecodable; map fails n % 7 == 0 (13 of the 90); the filter drops
    # odd n; flat_map makes 3 rows of each; the sink refuses rows with n % 11 == 0
    def check(row):
        if row["n"] % 7 == 0:
            raise ValueError("a seventh")
        return row

    sink = FailingSink(fail_if=lambda r: r["n"] % 11 == 0, name="out")
    flow = (
        ackflow.Flow(ListSource(bodies(100)))
        .map(check, name="check")
        .filter(lambda r: r["n"] % 2 == 0, name="even")
        .flat_map(lambda r: [{"n": r["n"], "k": k} for k in range(3)], name="three")
        .to(sink)
    )
    good = [n for n in range(100) if n % 10 != 9 and n % 7 != 0]
    even = [n for n in good if n % 2 == 0]
    refused = 3 * sum(1 for n in even if n % 11 == 0)
    rows = rows_by_step(flow, executor="local")
    assert rows == {
        "decode": {"in": 100, "out": 90, "failed": 10},
        "check": {"in": 90, "out": len(good), "failed": 90 - len(good)},
        "even": {"in": len(good), "out": len(even), "failed": 0},
        "three": {"in": len(even), "out": 3 * len(even), "failed": 0},
        "out": {"in": 3 * len(even), "out": 3 * len(even) - refused, "failed": refused},
    }


@pytest.mark.spark
def test_rows_around_spark_steps_are_read_off_their_neighbours(spark):
    flow = (
        ackflow.Flow(ListSource(bodies(60)))
        .map(lambda r: {"n": r["n"], "g": r["n"] % 4}, name="tag")
        .group_by("g")
        .agg("count(*) AS c", name="per_g")
        .with_columns({"d": "c * 2"}, name="double")
        .map(lambda r: {**r, "e": 1}, name="after")  # its sampler runs tag again: uncounted
        .to(MemorySink())
    )
    rows = rows_by_step(flow, spark=spark)
    groups = rows["memory"]["in"]
    assert 4 <= groups <= 4 * 3  # each batch of 25 groups its own rows (at most 4 groups)
    assert rows["decode"] == {"in": 60, "out": 54, "failed": 6}
    assert rows["tag"] == {"in": 54, "out": 54, "failed": 0}
    assert rows["per_g"] == {"in": 54, "out": None, "failed": None}  # double follows it
    assert rows["double"] == {"in": None, "out": groups, "failed": None}
    assert rows["after"] == {"in": groups, "out": groups, "failed": 0}
    assert rows["memory"] == {"in": groups, "out": groups, "failed": 0}


def board_with_a_dead_letter(body: bytes) -> StatusBoard:
    flow = ackflow.Flow(ListSource([b"{}"])).map(lambda r: r, name="parse").to(MemorySink())
    board = StatusBoard(flow, RunReport())
    d = Delivery(1, "m-1", body, delivery_count=3)
    board.failed(d, Failure("parse", f"ValueError: no good ({SECRET_DSN})"), "dead_lettered")
    board.publish(
        EngineFacts(
            state="running",
            in_flight=0,
            max_inflight=10,
            throttled=False,
            throttle_episodes=0,
            batching=0,
            jobs=(),
            held=0,
            connected=True,
            source={"url": "amqp://user:hunter2@broker:5672/%2F"},
        )
    )
    return board


def test_replay_is_off_unless_allowed_and_previews_are_bounded(page):
    body = b"<script>window.__pwned = 1</script>" + b"x" * 5000
    board = board_with_a_dead_letter(body)
    server = StatusServer(board, ListSource([]), port=0, allow_replay=False)
    server.start()
    try:
        url = server.url
        status, raw = http(url + "api/status")
        snap = json.loads(raw)
        assert status == 200 and snap["replay"] == {
            "allowed": False,
            "supported": False,
            "enabled": False,
            "replayed": [],
        }
        (dl,) = snap["dead_letters"]
        assert len(dl["body"]) == PREVIEW_BYTES and dl["truncated"] and dl["body_bytes"] == len(body)
        assert "hunter2" not in raw.decode() and "s3cret" not in raw.decode()
        assert snap["source"]["details"]["url"] == "amqp://user:***@broker:5672/%2F"
        status, answer = http(
            url + "api/replay",
            method="POST",
            body=b'{"ids": [1]}',
            headers={"Content-Type": "application/json", "X-Ackflow-Replay": "1", "Origin": url.rstrip("/")},
        )
        assert status == 403 and b"replay is off" in answer
        page.goto(url)
        wait_js(page, "() => document.querySelectorAll('#dead-letters tbody tr').length === 1", timeout_s=20)
        assert page.locator("#replay").is_disabled()
        assert page.locator("input.dl-select").is_disabled()
        assert page.text_content("#replay-note") == "this source cannot replay dead letters"
        text = page.text_content("#dead-letters pre.body")
        assert text.startswith("<script>window.__pwned = 1</script>xxx")
        assert text.endswith(f"({len(body):,} bytes in all)")
        assert page.evaluate("window.__pwned") is None
        headers = urllib.request.urlopen(url, timeout=10).headers
        assert "script-src 'self'" in headers["Content-Security-Policy"]
        assert page.errors == []
    finally:
        server.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.address[1]), timeout=3).close()


def test_a_port_in_use_and_replay_without_the_page_are_clear_errors(tmp_path, capsys):
    board = board_with_a_dead_letter(b"{}")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = StatusServer(board, ListSource([]), port=taken.getsockname()[1])
        with pytest.raises(ConfigError, match=r"status page: cannot listen on 127\.0\.0\.1"):
            server.start()
    flow = ackflow.Flow(ListSource([])).to(MemorySink())
    with pytest.raises(ConfigError, match="ui_allow_replay needs the status page"):
        Engine(flow, ui_allow_replay=True)
    with pytest.raises(ConfigError, match="ui_port must be a TCP port"):
        Engine(flow, ui_port=70000)
    with pytest.raises(SystemExit):
        main(["run", "flow.py:flow", "--ui-port", "70000"])
    assert "must be between 0 and 65535" in capsys.readouterr().err
    assert main(["run", str(tmp_path / "none.py") + ":flow", "--ui-allow-replay"]) == 2
    assert "--ui-allow-replay needs --ui-port" in capsys.readouterr().err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.spark
@pytest.mark.slow
def test_ackflow_run_serves_the_page_with_ui_port(tmp_path):
    import subprocess
    import sys
    import textwrap

    db = str(tmp_path / "q.db")
    publish(db, 0, 300)
    (tmp_path / "flow.py").write_text(
        textwrap.dedent(f"""
        import ackflow
        from ackflow.sinks import MemorySink
        from ackflow.sources import EmbeddedQueue

        flow = ackflow.Flow(EmbeddedQueue({db!r}, "orders")).to(MemorySink())
    """)
    )
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ackflow.cli",
            "run",
            "flow.py:flow",
            "--ui-port",
            str(port),
            "--until-idle",
            "3",
            "--json",
            "--master",
            "local[2]",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen: dict = {}

    def finished() -> bool:
        try:
            status, raw = http(f"http://127.0.0.1:{port}/api/status")
        except OSError:
            return False
        seen.update(json.loads(raw) if status == 200 else {})
        return seen.get("totals", {}).get("acked") == 300

    try:
        assert wait_until(finished, timeout=180, every=0.05), seen
        assert seen["state"] in ("running", "stopped") and seen["window"]["max_inflight"] == 10000
        assert seen["rows_written"] == {"memory": 300}
        assert seen["replay"]["allowed"] is False and seen["replay"]["supported"] is True
        out, err = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-2000:]
    assert f"status page: http://127.0.0.1:{port}/" in err
    assert json.loads(out.strip().splitlines()[-1])["acked"] == 300


def test_the_page_shows_each_windows_state(tmp_path, page):
    """A windowed flow: the page's Windows panel shows the watermark, the open windows
    and the late rows, as the metrics do (the in-process executor: no JVM needed)."""
    from ackflow import windows as w

    bodies = [json.dumps({"t": t, "k": "a", "v": 1}) for t in (100.0, 101.0, 130.0, 5.0)]
    src = ListSource(bodies)
    flow = (
        ackflow.Flow(src)
        .window(w.tumbling("10s"), by="k", time="t", aggs=[w.count()], idle=600, name="per_10s")
        .to(MemorySink("out"))
    )
    engine = Engine(
        flow,
        executor="local",
        ui_port=0,
        metrics_port=0,
        state_dir=str(tmp_path),
        batch_size=3,
        max_concurrent_batches=1,
        handle_signals=False,
    )
    t = threading.Thread(target=engine.run, daemon=True)
    t.start()
    try:
        assert wait_until(lambda: engine.ui is not None and src.final().get("m3") is not None, timeout=30)
        page.goto(engine.ui.url)
        page.wait_for_function("() => !document.getElementById('windows').hidden", timeout=15000)
        shown = "() => document.getElementById('window-states').textContent.replace(/\\s/g, '')"
        page.wait_for_function(
            f"() => ({shown})().includes('openwindows1') && ({shown})().includes('laterows1')", timeout=15000
        )
        text = page.inner_text("#window-states")
        assert "per_10s" in text and "1970-01-01T00:02:10Z" in text  # watermark: 130 s
        raw = http(f"http://127.0.0.1:{engine.metrics.port}/metrics")[1].decode()
        assert 'ackflow_window_open{window="per_10s"} 1.0' in raw  # [100, 110) closed by 130
        assert 'ackflow_window_results_written{window="per_10s"} 1.0' in raw
        assert 'ackflow_window_late_rows{window="per_10s"} 1.0' in raw
        assert src.failures["m3"].error.startswith("late: event time 5.0")
    finally:
        engine.request_stop()
        t.join(30)
