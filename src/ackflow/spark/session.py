"""Spark session defaults for ackflow."""

from __future__ import annotations

import os
import sys
from typing import Any

from pyspark.sql import SparkSession


def _worker_pythonpath() -> str:
    """The driver's import path, so that Python workers import what the driver imports."""
    seen: list[str] = []
    for p in [*os.environ.get("PYTHONPATH", "").split(os.pathsep), *sys.path]:
        if p and os.path.isdir(p) and p not in seen:
            seen.append(os.path.abspath(p))
    return os.pathsep.join(dict.fromkeys(seen))


def _daemon(master: str, python: str) -> dict[str, str]:
    """Python workers that import pyspark from its installed package, not from the zip
    Spark puts first on their path (ackflow_daemon: 4 s sooner at the first job, 0.4 s
    per worker forked). Only for local masters (the daemon runs here, on the driver's
    import path) whose workers run this interpreter, and only when the daemon is a file
    in a directory on that path (not inside a zip or pex); elsewhere Spark's own daemon."""
    import importlib.util

    if not master.startswith("local") or (os.path.realpath(python) != os.path.realpath(sys.executable)):
        return {}
    spec = importlib.util.find_spec("ackflow_daemon")
    if spec is None or not spec.origin or not os.path.isfile(spec.origin):
        return {}
    return {"spark.python.daemon.module": "ackflow_daemon"}


def switched_on(spark: Any, name: str, default: bool = True) -> bool:
    """ackflow's session switch ``spark.ackflow.<name>``: ``default`` unless set to ``true``
    or ``false`` (the tests turn a fast path off to compare it with the plain one,
    message by message)."""
    value = str(spark.conf.get(f"spark.ackflow.{name}", "")).lower()
    return value != "false" if default else value == "true"


def session(
    master: str | None = None, conf: dict[str, Any] | None = None, log_level: str = "FATAL"
) -> SparkSession:
    """Get or create the SparkSession ackflow runs on.

    Defaults: ``local[*]``, loopback only, no UI, few shuffle partitions (batches are
    small), Arrow on, and the Python workers run this very interpreter with the
    driver's import path. ``conf`` overrides any of them. Spark's own log is quiet
    (``log_level="FATAL"``): a failed job is expected (it is bisected) and the engine
    reports it in one line.
    """
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ["PYTHONPATH"] = _worker_pythonpath()
    from ackflow.spark.classes import use_archive  # not at import: it is also run with -m

    use_archive()  # a class-data archive, when one is named (ackflow.spark.classes)
    local = (master or "local").startswith("local")
    if local:
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        quick_jit()
    builder = SparkSession.builder.master(master or "local[*]").appName("ackflow")
    defaults: dict[str, Any] = {
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.driver.host": "127.0.0.1",
        "spark.driver.bindAddress": "127.0.0.1",
        "spark.sql.shuffle.partitions": "4",
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        "spark.sql.execution.arrow.maxRecordsPerBatch": "10000",
        "spark.python.worker.reuse": "true",
        "spark.sql.session.timeZone": "UTC",
        # executors run this interpreter (set PYSPARK_PYTHON where workers differ)
        "spark.pyspark.python": os.environ["PYSPARK_PYTHON"],
    }
    defaults.update(conf or {})
    if "spark.python.daemon.module" not in defaults:  # decided on the merged conf
        defaults.update(
            _daemon(
                str(defaults.get("spark.master", master or "local[*]")), str(defaults["spark.pyspark.python"])
            )
        )
    for k, v in defaults.items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(log_level)
    quiet_pyspark_loggers()
    if not str(spark.sparkContext.master).startswith("local"):
        ship_ackflow(spark)
    return spark


#: cores at or below which a local driver's JVM compiles with C1 only (see quick_jit)
QUICK_JIT_CORES = 4


def quick_jit() -> None:
    """On a machine of few cores, the local driver's JVM stops at the C1 compiler
    (``-XX:TieredStopAtLevel=1``); called before the JVM starts, a no-op after.

    Measured on 2 cores (benchmarks.run, the ackflow phase): C2's compiler threads took
    as much CPU as the job's own threads, and with C1 alone the JVM's CPU per message
    fell from 33.7 to 20.4 µs (400 000 messages) and 23.4 to 17.4 µs (1.2 million), the
    rate rising 16 % and 10 %. With more cores C2 compiles beside the work and its code
    is faster, so it is kept. ``ACKFLOW_JIT=full`` keeps C2 anywhere, ``ACKFLOW_JIT=quick``
    asks for C1 anywhere; options of one's own in ``SPARK_SUBMIT_OPTS`` win."""
    want = os.environ.get("ACKFLOW_JIT", "")
    opts = os.environ.get("SPARK_SUBMIT_OPTS", "")
    if want == "full" or "TieredStopAtLevel" in opts or "PYSPARK_GATEWAY_PORT" in os.environ:
        return
    if want == "quick" or (os.cpu_count() or 1) <= QUICK_JIT_CORES:
        os.environ["SPARK_SUBMIT_OPTS"] = f"{opts} -XX:TieredStopAtLevel=1".strip()


def ship_ackflow(spark: SparkSession) -> str:
    """Send ackflow itself to the executors (a zip, with ``addPyFile``).

    Executors then import the same ackflow as the driver, whatever their Python has
    installed. Returns the path of the zip.
    """
    import shutil
    import tempfile

    import ackflow

    package_dir = os.path.dirname(os.path.abspath(ackflow.__file__))
    folder = tempfile.mkdtemp(prefix="ackflow-ship-")
    base = os.path.join(folder, "ackflow")
    archive = shutil.make_archive(base, "zip", root_dir=os.path.dirname(package_dir), base_dir="ackflow")
    spark.sparkContext.addPyFile(archive)
    return archive


def quiet_pyspark_loggers() -> None:
    """PySpark logs every failed query's full Java stack trace as JSON at ERROR.

    Failed jobs are expected in ackflow (they are bisected) and reported in one line
    by the engine, so those loggers are silenced.
    """
    import logging

    for name in ("DataFrameQueryContextLogger", "SQLQueryContextLogger"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.CRITICAL)
        logger.propagate = False
        logger.disabled = True
