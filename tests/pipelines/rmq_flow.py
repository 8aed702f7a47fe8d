"""The pipeline of the RabbitMQ fault tests: queue -> check -> exchange, poison messages
dead-lettered with provenance. Configured by environment variables (it runs in a
subprocess that the tests kill): AF_URL, AF_QUEUE, AF_OUT_EXCHANGE, AF_OUT_QUEUE, AF_DLX."""

import os

import ackflow
from ackflow.core.policy import RetryPolicy
from ackflow.sinks import RabbitMQ as RabbitMQSink
from ackflow.sources import RabbitMQ


def check(row):
    if row.get("poison"):
        raise ValueError(f"order {row['order']} is poison")
    return {"order": row["order"], "total": row["qty"] * 2}


def build(url, queue, out_exchange, out_queue, dlx):
    src = RabbitMQ(
        url,
        queue,
        dead_letter_exchange=dlx,
        policy=RetryPolicy(max_deliveries=3, backoff_s=0.05, max_backoff_s=0.5),
    )
    return (
        ackflow.Flow(src)
        .map(check, name="check")
        .to(RabbitMQSink(url, out_exchange, routing_key=out_queue, name="out"))
    )


def flow():
    e = os.environ
    return build(e["AF_URL"], e["AF_QUEUE"], e["AF_OUT_EXCHANGE"], e["AF_OUT_QUEUE"], e["AF_DLX"])
