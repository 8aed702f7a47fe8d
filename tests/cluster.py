"""A throwaway Spark standalone cluster on loopback, from the installed pyspark.

A master and one worker, every port free and bound to 127.0.0.1, REST submission off,
logs and work directories under a temporary folder. Stopped by PID at the end.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field

import pyspark


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class Cluster:
    workdir: str
    cores: int = 2
    master_url: str = ""
    procs: list[subprocess.Popen] = field(default_factory=list)
    worker_ui: int = 0

    def _env(self) -> dict[str, str]:
        home = os.path.dirname(pyspark.__file__)
        env = dict(os.environ)
        env.update(
            {
                "SPARK_HOME": home,
                "SPARK_LOCAL_IP": "127.0.0.1",
                "SPARK_LOG_DIR": os.path.join(self.workdir, "logs"),
                "SPARK_WORKER_DIR": os.path.join(self.workdir, "work"),
                "SPARK_MASTER_OPTS": "-Dspark.master.rest.enabled=false",
                "SPARK_NO_DAEMONIZE": "1",
            }
        )
        return env

    def _spawn(self, *args: str, log: str) -> subprocess.Popen:
        home = os.path.dirname(pyspark.__file__)
        out = open(os.path.join(self.workdir, log), "wb")
        p = subprocess.Popen(
            [os.path.join(home, "bin", "spark-class"), *args],
            env=self._env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.procs.append(p)
        return p

    def start(self, timeout: float = 90) -> Cluster:
        os.makedirs(os.path.join(self.workdir, "work"), exist_ok=True)
        port = free_port()
        self.master_url = f"spark://127.0.0.1:{port}"
        self._spawn(
            "org.apache.spark.deploy.master.Master",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--webui-port",
            str(free_port()),
            log="master.log",
        )
        self._wait(lambda: _listening(port), timeout, "master")
        self.worker_ui = free_port()
        self._spawn(
            "org.apache.spark.deploy.worker.Worker",
            "--host",
            "127.0.0.1",
            "--port",
            str(free_port()),
            "--webui-port",
            str(self.worker_ui),
            "--cores",
            str(self.cores),
            "--memory",
            "2g",
            "--work-dir",
            os.path.join(self.workdir, "work"),
            self.master_url,
            log="worker.log",
        )
        self._wait(lambda: "Successfully registered with master" in self.log("worker.log"), timeout, "worker")
        return self

    def log(self, name: str) -> str:
        try:
            with open(os.path.join(self.workdir, name), errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def _wait(self, cond, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return
            if any(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.2)
        raise RuntimeError(
            f"spark {what} did not start:\n{self.log('master.log')[-2000:]}\n{self.log('worker.log')[-2000:]}"
        )

    def executor_pids(self) -> list[int]:
        """PIDs of executor JVMs started by this cluster's worker."""
        pids = []
        for p in os.listdir("/proc"):
            if not p.isdigit():
                continue
            try:
                with open(f"/proc/{p}/cmdline", "rb") as f:
                    cmd = f.read().split(b"\0")
                cwd = os.readlink(f"/proc/{p}/cwd")
            except OSError:
                continue
            if b"org.apache.spark.executor.CoarseGrainedExecutorBackend" in cmd and cwd.startswith(
                self.workdir
            ):
                pids.append(int(p))
        return pids

    def stop(self) -> None:
        for pid in self.executor_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)
