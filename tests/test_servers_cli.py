"""``python -m ackflow.servers``: throwaway servers for a person at a shell."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys

import pika
import psycopg
import pytest

from helpers import wait_until

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
ENV = {**os.environ, "PYTHONPATH": SRC}


def test_help_prints_usage():
    out = subprocess.run(
        [sys.executable, "-m", "ackflow.servers", "--help"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and "rabbitmq|postgres" in out.stdout
    assert "Ctrl-C" in out.stdout


def test_an_unknown_server_is_refused():
    out = subprocess.run(
        [sys.executable, "-m", "ackflow.servers", "mysql"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "unknown server(s) mysql" in out.stderr


def listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def processes_with(text: str) -> list[int]:
    """Pids whose command line or environment mentions ``text`` (a server's own dir)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        for what in ("cmdline", "environ"):
            try:
                with open(f"/proc/{pid}/{what}", "rb") as f:
                    if text.encode() in f.read():
                        found.append(int(pid))
                        break
            except OSError:
                continue
    return found


@pytest.mark.slow
@pytest.mark.parametrize("how", ["python -m", "ackflow servers"])
def test_servers_start_print_their_urls_and_stop_on_sigint(how, tmp_path):
    cmd = (
        [sys.executable, "-m", "ackflow.servers", "rabbitmq", "postgres"]
        if how == "python -m"
        else [sys.executable, "-m", "ackflow.cli", "servers"]
    )
    out = open(tmp_path / "out", "w+")
    proc = subprocess.Popen(cmd, env=ENV, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        assert wait_until(
            lambda: "ready:" in (tmp_path / "out").read_text() or proc.poll() is not None,
            timeout=120,
            every=0.2,
        )
        text = (tmp_path / "out").read_text()
        assert "ready:" in text, text
        amqp = re.search(r"^rabbitmq\s+(amqp://\S+)$", text, re.M).group(1)
        dsn = re.search(r"^postgres\s+(postgresql://\S+)$", text, re.M).group(1)
        ctl = re.search(r"^\s+(env HOME=(\S+) .*rabbitmqctl .*)$", text, re.M)
        psql = re.search(r"^\s+(\S*psql postgresql://\S+)$", text, re.M).group(1)
        assert "throwaway" in text  # the shown password is said to be the node's own
        conn = pika.BlockingConnection(pika.URLParameters(amqp))
        conn.channel().queue_declare("hello", durable=True)
        conn.close()
        with psycopg.connect(dsn) as c:
            assert c.execute("SELECT 1").fetchone() == (1,)
        listed = subprocess.run(ctl.group(1), shell=True, capture_output=True, text=True, timeout=120)
        assert "hello" in listed.stdout, listed.stderr
        assert (
            subprocess.run(
                [*psql.split(), "-Atc", "SELECT 41 + 1"], capture_output=True, text=True, timeout=60
            ).stdout.strip()
            == "42"
        )
        rmq_dir = ctl.group(2)
        ports = [int(re.search(r":(\d+)/", u).group(1)) for u in (amqp, dsn)]
        assert processes_with(rmq_dir)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0
        assert "stopped" in (tmp_path / "out").read_text()
        assert wait_until(lambda: not any(listening(p) for p in ports), timeout=30)
        assert wait_until(lambda: not processes_with(rmq_dir), timeout=30), processes_with(rmq_dir)
        assert not os.path.exists(rmq_dir)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
        out.close()


@pytest.mark.slow
@pytest.mark.kafka
def test_servers_start_a_kafka_broker_and_stop_it(tmp_path):
    from confluent_kafka.admin import AdminClient, NewTopic

    out = open(tmp_path / "out", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ackflow.cli", "servers", "kafka"],
        env=ENV,
        stdout=out,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert wait_until(
            lambda: "ready:" in (tmp_path / "out").read_text() or proc.poll() is not None,
            timeout=60,
            every=0.2,
        )
        text = (tmp_path / "out").read_text()
        assert "ready:" in text and "rabbitmq" not in text and "postgres" not in text, text
        bootstrap = re.search(r"^kafka\s+(127\.0\.0\.1:\d+)$", text, re.M).group(1)
        admin = AdminClient({"bootstrap.servers": bootstrap})
        for future in admin.create_topics([NewTopic("hello", num_partitions=2)]).values():
            future.result(30)
        assert "hello" in admin.list_topics(timeout=15).topics
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        assert "stopped" in (tmp_path / "out").read_text()
        assert wait_until(lambda: not listening(int(bootstrap.rsplit(":", 1)[1])), timeout=30)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
        out.close()
