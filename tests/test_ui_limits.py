"""The status page bounds what a request can make the driver hold: every endpoint's
body is at most MAX_BODY_BYTES (413 by Content-Length before reading it, or once a
chunked body passes the limit, and the rest is never read), and a replay names at most
MAX_REPLAY_IDS dead letters. Real HTTP over a socket against the served page."""

from __future__ import annotations

import json
import socket
import time
import tracemalloc

import pytest

import ackflow
from ackflow.engine import RunReport
from ackflow.observe.status import EngineFacts, StatusBoard
from ackflow.observe.ui import MAX_BODY_BYTES, MAX_REPLAY_IDS, StatusServer
from ackflow.sinks import MemorySink
from ackflow.sources import EmbeddedQueue as EmbeddedQueueSource
from ackflow.testing import ListSource

SEND_AT_MOST = 48 * 1024 * 1024  # what a client tries to push (bounded in bytes and time)


@pytest.fixture
def server(tmp_path):
    flow = ackflow.Flow(ListSource([b"{}"])).to(MemorySink())
    board = StatusBoard(flow, RunReport())
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
            source={},
        )
    )
    # replay allowed on a source that can: the handler reads the body (before: all of it)
    s = StatusServer(board, EmbeddedQueueSource(tmp_path / "q.db", "q"), port=0, allow_replay=True)
    s.start()
    yield s
    s.close()


def head(server, method, path, extra):
    host = f"127.0.0.1:{server.address[1]}"
    lines = [
        f"{method} {path} HTTP/1.1",
        f"Host: {host}",
        f"Origin: http://{host}",
        "X-Ackflow-Replay: 1",
        f"X-Ackflow-Replay-Token: {server.replay_token}",
        "Content-Type: application/json",
        *extra,
        "",
        "",
    ]
    return "\r\n".join(lines).encode()


def push(server, request_head, body_pieces):
    """Send the head, then body pieces until the server stops taking them (closed, or
    not reading for 2 s) or SEND_AT_MOST; returns (status line, bytes sent, seconds)."""
    began = time.monotonic()
    sent = 0
    with socket.create_connection(("127.0.0.1", server.address[1]), timeout=2) as c:
        c.sendall(request_head)
        try:
            for piece in body_pieces:
                c.sendall(piece)
                sent += len(piece)
                if sent >= SEND_AT_MOST or time.monotonic() - began > 30:
                    break
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            pass
        c.settimeout(10)
        try:
            answer = c.recv(65536)
        except (ConnectionResetError, TimeoutError):
            answer = b""
    return answer.split(b"\r\n", 1)[0], sent, time.monotonic() - began


def pieces(size, chunked=False):
    block = b"x" * size
    framed = b"%x\r\n" % size + block + b"\r\n" if chunked else block
    while True:
        yield framed


def held_while(fn):
    tracemalloc.start()
    try:
        out = fn()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return out, peak


def test_a_declared_huge_body_is_refused_before_it_is_read(server):
    # before: the replay endpoint read it all (a 1.5 GB POST took the driver to 2.5 GB)
    (status, sent, _), peak = held_while(
        lambda: push(
            server, head(server, "POST", "/api/replay", ["Content-Length: 1500000000"]), pieces(256 * 1024)
        )
    )
    assert status == b"HTTP/1.1 413 Request Entity Too Large", status
    assert sent < SEND_AT_MOST  # the server stopped taking bytes
    assert peak < 8 * 1024 * 1024, peak


def test_a_chunked_body_is_cut_at_the_limit(server):
    (status, sent, _), peak = held_while(
        lambda: push(
            server,
            head(server, "POST", "/api/replay", ["Transfer-Encoding: chunked"]),
            pieces(64 * 1024, chunked=True),
        )
    )
    assert status == b"HTTP/1.1 413 Request Entity Too Large", status
    assert sent < SEND_AT_MOST
    assert peak < 8 * 1024 * 1024, peak


def test_every_endpoint_refuses_a_large_body(server):
    for path in ("/api/status", "/api/events", "/", "/nowhere"):
        status, _, _ = push(server, head(server, "GET", path, [f"Content-Length: {MAX_BODY_BYTES + 1}"]), [])
        assert status == b"HTTP/1.1 413 Request Entity Too Large", (path, status)


def test_a_content_length_lie_does_not_let_more_in(server):
    # declares a small body, sends far more: the rest is not a body the app sees, and
    # it is never held; the answer comes and the connection ends
    (status, sent, _), peak = held_while(
        lambda: push(
            server,
            head(server, "POST", "/api/replay", ["Content-Length: 12"]),
            [b'{"ids": [1]}', *([b"y" * (256 * 1024)] * (SEND_AT_MOST // (256 * 1024)))],
        )
    )
    assert status.startswith(b"HTTP/1.1 200"), status  # the 12 declared bytes: a replay
    assert sent < SEND_AT_MOST
    assert peak < 8 * 1024 * 1024, peak


def test_a_body_at_the_limit_is_read_and_ids_are_bounded(server):
    def post(body):
        status, _, _ = push(
            server, head(server, "POST", "/api/replay", [f"Content-Length: {len(body)}"]) + body, []
        )
        return status

    ids = json.dumps({"ids": list(range(1, MAX_REPLAY_IDS + 1))}).encode()
    assert post(ids).startswith(b"HTTP/1.1 200")
    too_many = json.dumps({"ids": list(range(1, MAX_REPLAY_IDS + 2))}).encode()
    assert post(too_many).startswith(b"HTTP/1.1 400")
    padded = ids[:-1] + b" " * (MAX_BODY_BYTES - len(ids)) + b"}"
    assert len(padded) == MAX_BODY_BYTES and post(padded).startswith(b"HTTP/1.1 200")
    assert post(padded + b" ").startswith(b"HTTP/1.1 413")
