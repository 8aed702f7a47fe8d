"""The pipeline of the Kafka fault tests: topic -> check -> PostgreSQL (keyed by the
row key: effectively once), or with AF_LAKE (a folder) a Delta and an Iceberg table
there (broadcast), poison messages to a PostgreSQL dead-letter table. Configured by
environment variables (it runs in a subprocess that the tests kill): AF_BOOTSTRAP,
AF_TOPIC, AF_GROUP, AF_DSN, AF_TABLE, AF_DEAD, AF_ATTEMPTS, AF_LAKE."""

import os

import ackflow
from ackflow.core.policy import RetryPolicy
from ackflow.sinks import Delta, Iceberg, Postgres
from ackflow.sources import Kafka


def check(row):
    if row.get("poison"):
        raise ValueError(f"order {row['order']} is poison")
    return {"order": row["order"], "total": row["qty"] * 2}


def flow():
    e = os.environ
    src = Kafka(
        e["AF_BOOTSTRAP"],
        e["AF_TOPIC"],
        e["AF_GROUP"],
        attempts_path=e["AF_ATTEMPTS"],
        policy=RetryPolicy(max_deliveries=2, backoff_s=0.05),
        revoke_timeout_s=3.0,
    )
    checked = ackflow.Flow(src).map(check, name="check")
    lake = e.get("AF_LAKE")
    if lake:  # two processes writing the same two tables at once
        out = checked.broadcast(
            Delta(os.path.join(lake, "delta"), name="delta"),
            Iceberg(f"sqlite:///{lake}/catalog.db", "kafka.orders", name="iceberg"),
        )
    else:
        out = checked.to(Postgres(e["AF_DSN"], e["AF_TABLE"], create=True, name="orders"))
    return out.on_error(Postgres(e["AF_DSN"], e["AF_DEAD"], create=True, name="dead"))
