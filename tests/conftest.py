"""Shared fixtures: one SparkSession (local[2]) for the whole test session."""

from __future__ import annotations

import os
import sys
import time

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """Every Spark driver the tests start (the fixture's and those of the ``ackflow run``
    children) maps one class-data archive, built once per virtualenv, Spark version and
    Java: each start is ~7 s shorter (ackflow/spark/classes.py). A failed build is not
    tried again (its marker file stays); ``ACKFLOW_CLASS_ARCHIVE=`` (empty) turns it
    off. Only start-up speed depends on it."""
    _quick_jit()
    if "ACKFLOW_CLASS_ARCHIVE" in os.environ or hasattr(config, "workerinput"):
        return
    if config.option.collectonly or config.option.help:
        return
    import hashlib
    import shutil

    import pyspark

    from ackflow.spark.classes import ARCHIVE_ENV, build

    java = os.path.realpath(shutil.which("java") or "java")
    tag = hashlib.sha256(f"{pyspark.__version__} {java}".encode()).hexdigest()[:12]
    path = os.path.join(sys.prefix, f"ackflow-spark-classes-{tag}.jsa")
    failed = path + ".failed"
    if not os.path.isfile(path):
        if os.path.exists(failed):
            return
        started = time.monotonic()
        try:
            build(path)
            print(f"\nclass archive built in {time.monotonic() - started:.0f} s: {path}")
        except Exception as e:  # noqa: BLE001 - only start-up speed depends on it
            print(f"\nclass archive not built ({e}); Spark starts the slow way")
            with open(failed, "w") as f:
                f.write(f"{e}\n")
            return
    os.environ[ARCHIVE_ENV] = path


def _quick_jit() -> None:
    """The tests' Spark drivers compile with the JVM's quick compiler only
    (``-XX:TieredStopAtLevel=1``): most of them live seconds (the ``ackflow run``
    children the crash tests kill and restart), where the optimising compiler's work
    never pays back on 2 cores. Measured: a child's start to its first jobs 7.4 s ->
    5.3 s; the session's own driver ran the Spark model test equally fast either way.
    Only speed depends on it; ``SPARK_SUBMIT_OPTS`` naming a tier keeps its own. The
    library's own choice (``session.quick_jit``), asked for on any number of cores."""
    from ackflow.spark.session import quick_jit

    os.environ.setdefault("ACKFLOW_JIT", "quick")
    quick_jit()


@pytest.fixture(scope="session")
def spark():
    from ackflow.spark.session import session

    s = session("local[2]")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def postgres():
    """A throwaway PostgreSQL cluster on 127.0.0.1 (a free port) for the whole session."""
    from ackflow.servers import PostgresServer

    server = PostgresServer().start()
    yield server
    server.close()


@pytest.fixture
def pg_table(postgres, request):
    """A fresh table name per test (dropped before use)."""
    import psycopg
    from psycopg import sql

    name = "t_" + request.node.name.replace("[", "_").replace("]", "").replace("-", "_")[:50]
    with psycopg.connect(postgres.dsn, autocommit=True) as c:
        c.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(name)))
    return name


@pytest.fixture(scope="session")
def kafka():
    """A throwaway Kafka-compatible broker (tansu, in-memory storage) on 127.0.0.1."""
    from ackflow.servers import KafkaServer

    server = KafkaServer().start()
    yield server
    server.close()


@pytest.fixture(scope="session")
def kafka_durable():
    """The Kafka-compatible broker with S3 storage (moto's S3 server, on loopback): it
    keeps topics and committed offsets across :meth:`restart`."""
    from ackflow.servers import KafkaServer

    server = KafkaServer(durable=True).start()
    yield server
    server.close()


@pytest.fixture(scope="session")
def rabbitmq():
    """A throwaway RabbitMQ node (AMQP and stream listeners on 127.0.0.1, free ports)."""
    from ackflow.servers import RabbitMQServer

    server = RabbitMQServer(streams=True).start()
    from amqp import connect  # the tests' shared dead-letter exchange, bound to a queue

    conn = connect(server.url)
    ch = conn.channel()
    ch.exchange_declare("ackflow-tests-dlx", "fanout", durable=True)
    ch.queue_declare("ackflow-tests-dead", durable=True, arguments={"x-max-length": 100_000})
    ch.queue_bind("ackflow-tests-dead", "ackflow-tests-dlx")
    conn.close()
    yield server
    server.close()
