"""Shared fixtures: one SparkSession (local[2]) for the whole test session."""

from __future__ import annotations

import pytest


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
def rabbitmq():
    """A throwaway RabbitMQ node (AMQP and stream listeners on 127.0.0.1, free ports)."""
    from ackflow.servers import RabbitMQServer

    server = RabbitMQServer(streams=True).start()
    yield server
    server.close()
