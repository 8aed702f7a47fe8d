"""``ackflow dlq peek|replay`` against the real broker (the session's RabbitMQ node).

The broker's rules these tools are built on are tested first: every way of giving a
message back marks it ``redelivered`` and, on a quorum queue, spends a delivery. Then:
peek leaves a queue as it was (same messages, same order, nothing redelivered, no
delivery spent, even on a quorum queue with ``x-delivery-limit: 1``); replay strips the
past and keeps the ``message_id``; a crash mid-replay loses nothing; ackflow's own
dead letters (both routes) round-trip through replay into a fixed flow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pika
import pytest

from ackflow import Flow, dlq, faults
from ackflow.cli import main as cli
from ackflow.core.errors import ConfigError
from ackflow.core.policy import RetryPolicy
from ackflow.engine import Engine
from ackflow.sinks import MemorySink
from ackflow.sources import RabbitMQSource
from amqp import connect, names, publish

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
KINDS = {
    "classic": {"x-queue-type": "classic"},
    "quorum": {"x-queue-type": "quorum"},
    "quorum-limit": {"x-queue-type": "quorum", "x-delivery-limit": 1},
}


@pytest.fixture(scope="module")
def url(rabbitmq):
    return rabbitmq.url


def declare(url, queue, arguments=None):
    conn = connect(url)
    conn.channel().queue_declare(queue, durable=True, arguments=arguments)
    conn.close()


def dead_letters(url, queue, n, *, kind="classic"):
    """``n`` dead letters in a new queue, as a source's dead_letter_exchange leaves them;
    the last one has a body that is not UTF-8."""
    declare(url, queue, KINDS[kind])
    conn = connect(url)
    ch = conn.channel()
    ch.confirm_delivery()
    for i in range(n):
        body = b"\xff\xfe binary" if i == n - 1 else json.dumps({"n": i}).encode()
        headers = {
            "x-ackflow-step": "parse",
            "x-ackflow-error": f"ValueError: bad {i}",
            "x-ackflow-deliveries": 3,
            "x-ackflow-queue": "orders",
            "tenant": "a",
        }
        ch.basic_publish(
            "",
            queue,
            body,
            pika.BasicProperties(
                delivery_mode=2, message_id=f"m{i}", headers=headers, content_type="application/json"
            ),
        )
    conn.close()


def take_all(url, queue):
    """Every message of ``queue`` (acked): (redelivered, message_id, headers, body)."""
    conn = connect(url)
    ch = conn.channel()
    out = []
    while True:
        method, props, body = ch.basic_get(queue, auto_ack=False)
        if method is None:
            break
        out.append((method.redelivered, props.message_id, dict(props.headers or {}), body))
        ch.basic_ack(method.delivery_tag)
    conn.close()
    return out


def depth(url, queue):
    conn = connect(url)
    n = conn.channel().queue_declare(queue, passive=True).method.message_count
    conn.close()
    return n


@pytest.mark.parametrize("kind", ["classic", "quorum"])
def test_the_broker_marks_a_message_given_back_and_a_quorum_queue_counts_it(url, kind):
    """Why peek does not give messages back: basic.get + nack(requeue) and a channel
    closed before the ack both mark the message redelivered; a quorum queue also spends a
    delivery each time (its x-delivery-count grows)."""
    q = names(f"dlq-rule-{kind}")
    declare(url, q, KINDS[kind])
    publish(url, q, [{"n": 1}], ids=["m1"])
    conn = connect(url)
    ch = conn.channel()
    method, _, _ = ch.basic_get(q)
    ch.basic_nack(method.delivery_tag, requeue=True)
    other = conn.channel()
    method, _, _ = other.basic_get(q)
    other.close()  # given back by closing the channel
    method, props, _ = ch.basic_get(q)
    assert method.redelivered
    count = (props.headers or {}).get("x-delivery-count")
    assert count == (2 if kind == "quorum" else None)
    ch.basic_ack(method.delivery_tag)
    conn.close()


@pytest.mark.parametrize("window", [1, 2, 100])
@pytest.mark.parametrize("kind", list(KINDS))
def test_peek_leaves_the_queue_as_it_was(url, kind, window):
    q = names(f"dlq-peek-{kind}")
    dead_letters(url, q, 5, kind=kind)
    first = dlq.peek(url, q, 2, window=window)
    again = dlq.peek(url, q, 10, window=window)  # twice: on the limited quorum queue, a
    assert [d.message_id for d in first] == ["m0", "m1"]  # spent delivery would drop them
    assert [d.message_id for d in again] == [f"m{i}" for i in range(5)]
    d = again[0]
    assert (d.step, d.error, d.deliveries, d.source_queue) == ("parse", "ValueError: bad 0", 3, "orders")
    assert d.preview() == '{"n": 0}' and "\ufffd" in again[4].preview()
    left = take_all(url, q)
    assert [m[1] for m in left] == [f"m{i}" for i in range(5)]  # same order
    assert not any(m[0] for m in left), "a peeked message was left redelivered"
    assert all(m[2].get("x-delivery-count", 0) == 0 for m in left), "a delivery was spent"
    assert left[4][3] == b"\xff\xfe binary"
    assert all(m[2]["x-ackflow-step"] in ("parse", b"parse") and m[2]["tenant"] in ("a", b"a") for m in left)


def test_peek_of_a_missing_queue_says_so(url):
    with pytest.raises(ConfigError, match="does not exist"):
        dlq.peek(url, names("dlq-none"))


def test_replay_strips_the_past_and_keeps_the_message_id(url):
    q, target = names("dlq-src"), names("dlq-target")
    dead_letters(url, q, 4)
    declare(url, target)
    done = dlq.replay(url, q, target, count=3)
    assert (done.replayed, done.left, done.target) == (3, 1, f"queue {target!r}")
    got = take_all(url, target)
    assert [m[1] for m in got] == ["m0", "m1", "m2"]
    for redelivered, _, headers, _ in got:
        assert not redelivered
        assert {k for k in headers if k.startswith("x-")} == set(), headers
        assert headers["tenant"] in ("a", b"a")
    assert json.loads(got[0][3]) == {"n": 0}
    assert [m[1] for m in take_all(url, q)] == ["m3"]


def test_replay_to_an_exchange_routes_by_the_queue_it_came_from(url):
    q, ex, target = names("dlq-src"), names("dlq-ex"), "orders-" + names("x")
    declare(url, target)
    conn = connect(url)
    ch = conn.channel()
    ch.exchange_declare(ex, "direct", durable=True)
    ch.queue_bind(target, ex, routing_key=target)
    ch.confirm_delivery()
    ch.queue_declare(q, durable=True)
    ch.basic_publish(
        "",
        q,
        b"{}",
        pika.BasicProperties(message_id="m0", headers={"x-ackflow-step": "s", "x-ackflow-queue": target}),
    )
    conn.close()
    assert dlq.replay(url, q, f"exchange:{ex}").replayed == 1
    assert [m[1] for m in take_all(url, target)] == ["m0"]


def test_an_unroutable_replay_stops_and_keeps_the_dead_letter(url):
    q, ex = names("dlq-src"), names("dlq-nowhere")
    dead_letters(url, q, 2)
    conn = connect(url)
    conn.channel().exchange_declare(ex, "direct", durable=True)  # nothing bound
    conn.close()
    with pytest.raises(ConfigError, match="unroutable"):
        dlq.replay(url, q, ex, routing_key="none")
    assert depth(url, q) == 2


def test_a_crash_mid_replay_loses_nothing(url):
    """Killed between the copy's confirm and the dead letter's ack (fault point
    dlq.replay_published, exit): the third message is at the target and still a dead
    letter; the second replay sends it again. Every message arrives, one twice, with the
    same message_id (ackflow's identity absorbs it)."""
    q, target = names("dlq-crash"), names("dlq-target")
    dead_letters(url, q, 5)
    declare(url, target)
    env = {
        **os.environ,
        "PYTHONPATH": SRC,
        "ACKFLOW_AMQP_URL": url,
        "ACKFLOW_FAULTS": "dlq.replay_published=exit@3",
    }
    cmd = [sys.executable, "-m", "ackflow.cli", "dlq", "replay", q, "--to", target]
    crashed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert crashed.returncode == 137, crashed.stderr
    assert depth(url, q) == 3  # m2's ack never went
    env.pop("ACKFLOW_FAULTS")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "replayed 3 messages" in done.stdout
    assert "guest" not in done.stdout + done.stderr  # the URL's password is not shown
    ids = [m[1] for m in take_all(url, target)]
    assert sorted(set(ids)) == [f"m{i}" for i in range(5)]
    assert sorted(ids) == ["m0", "m1", "m2", "m2", "m3", "m4"]
    assert depth(url, q) == 0


def test_a_crash_mid_replay_with_a_window_duplicates_at_most_the_window(url):
    q, target = names("dlq-crash-w"), names("dlq-target")
    dead_letters(url, q, 30)
    declare(url, target)
    env = {
        **os.environ,
        "PYTHONPATH": SRC,
        "ACKFLOW_AMQP_URL": url,
        "ACKFLOW_FAULTS": "dlq.replay_published=exit@2",
    }
    cmd = [sys.executable, "-m", "ackflow.cli", "dlq", "replay", q, "--to", target, "--window", "8"]
    assert subprocess.run(cmd, env=env, capture_output=True, timeout=120).returncode == 137
    assert depth(url, q) == 22  # the first window's acks went, the second's did not
    env.pop("ACKFLOW_FAULTS")
    assert subprocess.run(cmd, env=env, capture_output=True, timeout=120).returncode == 0
    ids = [m[1] for m in take_all(url, target)]
    assert sorted(set(ids)) == sorted(f"m{i}" for i in range(30))
    assert len(ids) == 38 and depth(url, q) == 0  # 8 twice


def test_replay_in_windows_keeps_the_order(url):
    q, target = names("dlq-w"), names("dlq-target")
    dead_letters(url, q, 25)
    declare(url, target)
    assert dlq.replay(url, q, target, window=10).replayed == 25
    assert [m[1] for m in take_all(url, target)] == [f"m{i}" for i in range(25)]


def test_a_failed_ack_after_the_confirm_leaves_the_dead_letter(url):
    """The same boundary in process (raise): the copy is out, the dead letter stays."""
    q, target = names("dlq-raise"), names("dlq-target")
    dead_letters(url, q, 2)
    declare(url, target)
    faults.arm("dlq.replay_published", "raise")
    try:
        with pytest.raises(faults.InjectedFault):
            dlq.replay(url, q, target)
    finally:
        faults.disarm()
    assert depth(url, q) == 2 and [m[1] for m in take_all(url, target)] == ["m0"]


def test_a_crash_mid_peek_loses_nothing(url):
    q = names("dlq-peek-crash")
    dead_letters(url, q, 3)
    faults.arm("dlq.peek_copied", "raise", nth=2)
    try:
        with pytest.raises(faults.InjectedFault):
            dlq.peek(url, q, window=1)
    finally:
        faults.disarm()
    left = take_all(url, q)
    assert sorted(m[1] for m in left if m[1]) == ["m0", "m1", "m1", "m2"]  # m1 copied, its
    assert [m[2] for m in left if not m[1]] != []  # original not acked; the marker stays


def test_a_stale_marker_and_a_route_probe_do_not_disturb_the_order(url):
    """A crashed peek's marker is dropped by the next peek; a source's route probe
    (expiration 0, sitting behind dead letters) neither shows nor shifts the order."""
    q = names("dlq-marks")
    dead_letters(url, q, 2)
    conn = connect(url)
    ch = conn.channel()
    ch.confirm_delivery()
    ch.basic_publish("", q, b"", pika.BasicProperties(headers={dlq.PEEK_END: "old"}))
    ch.basic_publish("", q, b"", pika.BasicProperties(expiration="0", headers={dlq.PROBE: "route check"}))
    ch.basic_publish("", q, b"{}", pika.BasicProperties(message_id="m2"))
    conn.close()
    assert [d.message_id for d in dlq.peek(url, q)] == ["m0", "m1", "m2"]
    assert [d.message_id for d in dlq.peek(url, q)] == ["m0", "m1", "m2"]
    assert [m[1] for m in take_all(url, q)] == ["m0", "m1", "m2"]


def fails_until_fixed(row):
    if not FIXED:
        raise ValueError(f"order {row['n']} has no customer")
    return row


FIXED: list[bool] = []


@pytest.mark.parametrize("route", ["ackflow-dlx", "broker-dlx"])
@pytest.mark.parametrize("kind", ["classic", "quorum"])
def test_ackflow_dead_letters_round_trip(url, kind, route, capsys):
    """A flow dead-letters; `ackflow dlq peek` shows why; `replay` sends them back; the
    fixed flow writes them, and a replayed message that fails again gets its full retries
    (it is a first delivery, not a redelivery)."""
    q, dlx, dead = names(f"rt-{kind}"), names("rt-dlx"), names("rt-dead")
    conn = connect(url)
    ch = conn.channel()
    ch.exchange_declare(dlx, "fanout", durable=True)
    ch.queue_declare(dead, durable=True, arguments=KINDS[kind])
    ch.queue_bind(dead, dlx)
    args = dict(KINDS[kind])
    if route == "broker-dlx":
        args["x-dead-letter-exchange"] = dlx
    ch.queue_declare(q, durable=True, arguments=args)
    conn.close()
    publish(url, q, [{"n": i} for i in range(3)], ids=[f"o{i}" for i in range(3)])

    def run(max_deliveries):
        src = RabbitMQSource(
            url,
            q,
            policy=RetryPolicy(max_deliveries=max_deliveries, backoff_s=0.01, max_backoff_s=0.01),
            dead_letter_exchange=dlx if route == "ackflow-dlx" else None,
            reject_to_dlx=route == "broker-dlx",
        )
        sink = MemorySink("orders")
        report = Engine(
            Flow(src).map(fails_until_fixed, name="check").to(sink),
            executor="local",
            until_idle=0.3,
            handle_signals=False,
        ).run()
        return report, sink

    FIXED.clear()
    report, _ = run(2)
    assert report.dead_lettered == 3
    assert cli(["dlq", "peek", dead, "--url", url, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    # in the order they were given up, which retries may shuffle (seen in CI: o2 first
    # on a quorum queue); the dead-letter queue keeps that order from here on
    order = [d["message_id"] for d in shown]
    assert sorted(order) == ["o0", "o1", "o2"]
    if route == "ackflow-dlx":
        assert shown[0]["step"] == "check" and "no customer" in shown[0]["error"]
        assert shown[0]["deliveries"] == 2
    else:
        assert shown[0]["reason"] == "rejected" and shown[0]["source_queue"] == q
    assert cli(["dlq", "replay", dead, "--url", url, "--to", q, "--count", "1"]) == 0
    assert "replayed 1 messages" in capsys.readouterr().out
    report, _ = run(2)  # still broken: the replayed one is retried in full, then dead again
    assert report.dead_lettered == 1
    again = dlq.peek(url, dead, 10)
    assert [d.message_id for d in again] == [*order[1:], order[0]]  # the replayed one at the back
    if route == "ackflow-dlx":
        assert again[2].deliveries == 2  # not 1: no redelivered flag or count came along
    FIXED.append(True)
    assert dlq.replay(url, dead, q).replayed == 3
    report, sink = run(2)
    assert report.acked == 3 and sorted(r["n"] for r in sink.rows) == [0, 1, 2]
    assert depth(url, dead) == 0


def test_the_command_says_what_it_needs_and_shows_dead_letters(url, capsys, monkeypatch):
    monkeypatch.delenv("ACKFLOW_AMQP_URL", raising=False)
    assert cli(["dlq", "peek", "x"]) == 2
    assert "ACKFLOW_AMQP_URL" in capsys.readouterr().err
    q = names("dlq-text")
    dead_letters(url, q, 2)
    monkeypatch.setenv("ACKFLOW_AMQP_URL", url)
    assert cli(["dlq", "peek", q, "--count", "1"]) == 0
    out = capsys.readouterr()
    assert out.out.splitlines() == [
        "m0 from 'orders': step 'parse' after 3 deliveries: ValueError: bad 0",
        '    body: {"n": 0}',
    ]
    assert "guest" not in out.out + out.err
    assert cli(["dlq", "replay", q, "--to", names("nowhere")]) == 2
    assert "there is no queue or exchange named" in capsys.readouterr().err
    assert depth(url, q) == 2
