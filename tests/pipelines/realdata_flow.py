"""The pipeline of the real-data schema test: JSON records from a Files directory or an
embedded queue, through map(identity), into Parquet, PostgreSQL and Delta (broadcast).

Configured by environment variables (it runs in a subprocess that the test kills):
AF_SOURCE (files or queue), AF_IN (the directory or the queue file), AF_PARQUET,
AF_DSN, AF_TABLE, AF_DELTA.
"""

import os

import ackflow
from ackflow.core.policy import RetryPolicy
from ackflow.sinks import Broadcast, Delta, Parquet, Postgres
from ackflow.sources import EmbeddedQueueSource, Files


def flow():
    env = os.environ
    policy = RetryPolicy(max_deliveries=3, backoff_s=0.05)
    source = (
        Files(env["AF_IN"], format="jsonl", policy=policy, scan_interval_s=0.2)
        if env["AF_SOURCE"] == "files"
        else EmbeddedQueueSource(env["AF_IN"], "records", policy=policy)
    )
    sinks = Broadcast(
        Parquet(env["AF_PARQUET"], name="parquet"),
        Postgres(env["AF_DSN"], env["AF_TABLE"], create=True, name="pg"),
        Delta(env["AF_DELTA"], name="delta"),
        name="all",
    )
    return ackflow.Flow(source).map(lambda r: r, name="record").to(sinks)
