"""The pipeline of the effectively-once tests: orders from an embedded queue, each
exploded into its line items, written to PostgreSQL and to Parquet (broadcast).

Configured by environment variables (it runs in a subprocess that the tests kill):
AF_QUEUE (queue file), AF_DSN, AF_TABLE, AF_PARQUET, and AF_CRASH_AFTER_COMMIT=N to
SIGKILL the process right after its N-th batch was committed and before its acks —
the worst moment for duplicates.
"""

import os
import signal

import ackflow
from ackflow.core.policy import RetryPolicy
from ackflow.sinks import Broadcast, Parquet, Postgres
from ackflow.sources import EmbeddedQueue


class CrashAfterCommit(Broadcast):
    def __init__(self, *branches, after):
        super().__init__(*branches, name="both")
        self.after = after
        self.commits = 0

    def commit(self, batch_id, tokens):
        super().commit(batch_id, tokens)
        self.commits += 1
        if self.after and self.commits >= self.after:
            os.kill(os.getpid(), signal.SIGKILL)


def check(order):
    if order.get("poison"):
        raise ValueError(f"order {order['order']} is poison")
    return order


def items(order):
    for j in range(order["items"]):
        yield {"order": order["order"], "line": j, "sku": f"sku-{order['order']}-{j}", "qty": j + 1}


def build(queue, dsn, table, parquet, crash_after=0, policy=None):
    sinks = [Postgres(dsn, table, create=True, name="pg"), Parquet(parquet, name="parquet")]
    source = EmbeddedQueue(queue, "orders", policy=policy or RetryPolicy(max_deliveries=3, backoff_s=0.05))
    return (
        ackflow.Flow(source)
        .map(check, name="check")
        .flat_map(items, name="items")
        .to(CrashAfterCommit(*sinks, after=crash_after))
    )


def flow():
    env = os.environ
    return build(
        env["AF_QUEUE"],
        env["AF_DSN"],
        env["AF_TABLE"],
        env["AF_PARQUET"],
        int(env.get("AF_CRASH_AFTER_COMMIT", "0")),
    )
