"""Pipelines of the offset-source recovery tests (run in subprocesses that the tests
kill): a file directory or a RabbitMQ stream into Parquet. Environment: AF_OUT (Parquet
path), AF_DIR (files), AF_STREAM_PORT / AF_STREAM (stream), AF_SLOW_SECONDS (line/offset
0 sleeps that long in its Spark task: a slow batch holding the lowest offsets)."""

import os
import time

import ackflow
from ackflow.core.policy import RetryPolicy
from ackflow.sinks import Parquet
from ackflow.sources import Files, RabbitMQStream

POLICY = RetryPolicy(max_deliveries=3, backoff_s=0.05, max_backoff_s=0.5)


def work(row):
    if row["n"] == 0:
        time.sleep(float(os.environ.get("AF_SLOW_SECONDS", "0")))
    return {"n": row["n"]}


def files_flow():
    src = Files(os.environ["AF_DIR"], policy=POLICY, scan_interval_s=0.2)
    return ackflow.Flow(src).map(work, name="work", schema="n BIGINT").to(Parquet(os.environ["AF_OUT"]))


def stream_flow():
    src = RabbitMQStream(
        "127.0.0.1", int(os.environ["AF_STREAM_PORT"]), os.environ["AF_STREAM"], "pipeline", policy=POLICY
    )
    return (
        ackflow.Flow(src)
        .map(work, name="work", schema="n BIGINT")
        .to(Parquet(os.environ["AF_OUT"]))
        .on_error(Parquet(os.environ["AF_OUT"] + "-dead", name="dead"))
    )
