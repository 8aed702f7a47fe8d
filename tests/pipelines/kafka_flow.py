"""The pipeline of the Kafka fault tests: topic -> check -> PostgreSQL (keyed by the
row key: effectively once), poison messages to a PostgreSQL dead-letter table. Configured
by environment variables (it runs in a subprocess that the tests kill): AF_BOOTSTRAP,
AF_TOPIC, AF_GROUP, AF_DSN, AF_TABLE, AF_DEAD, AF_ATTEMPTS."""

import os

import ackflow
from ackflow.core.policy import RetryPolicy
from ackflow.sinks import Postgres
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
    return (
        ackflow.Flow(src)
        .map(check, name="check")
        .to(Postgres(e["AF_DSN"], e["AF_TABLE"], create=True, name="orders"))
        .on_error(Postgres(e["AF_DSN"], e["AF_DEAD"], create=True, name="dead"))
    )
