"""The pipeline of the lakehouse crash tests: orders from an embedded queue, each
exploded into its line items, written to a Delta table, an Iceberg table, or both
(broadcast).

Configured by environment variables (it runs in a subprocess that the tests kill):
AF_QUEUE (queue file), AF_SINKS ("delta", "iceberg" or "delta,iceberg"), AF_DELTA (the
Delta table's path), AF_CATALOG (the Iceberg catalog's URL), AF_TABLE (the Iceberg
table). ``ACKFLOW_FAULTS`` arms fault points as usual.

``python lake_flow.py`` runs it in this process with the in-process executor (no JVM):
the commit's fault points are on the driver, so that is the same code path, fast.
"""

import os
import sys

import ackflow
from ackflow.core.policy import RetryPolicy
from ackflow.sinks import Broadcast, Delta, Iceberg
from ackflow.sources import EmbeddedQueue


def check(order):
    if order.get("poison"):
        raise ValueError(f"order {order['order']} is poison")
    return order


def items(order):
    for j in range(order["items"]):
        yield {"order": order["order"], "line": j, "sku": f"sku-{order['order']}-{j}", "qty": j + 1}


def sinks(env=os.environ):
    out = []
    for kind in env.get("AF_SINKS", "delta").split(","):
        if kind == "delta":
            out.append(Delta(env["AF_DELTA"], name="delta"))
        else:
            out.append(Iceberg(env["AF_CATALOG"], env["AF_TABLE"], name="iceberg"))
    return out[0] if len(out) == 1 else Broadcast(*out, name="both")


def flow(queue=None, name="orders"):
    source = EmbeddedQueue(
        queue or os.environ["AF_QUEUE"], name, policy=RetryPolicy(max_deliveries=2, backoff_s=0.05)
    )
    return ackflow.Flow(source).map(check, name="check").flat_map(items, name="items").to(sinks())


if __name__ == "__main__":
    from ackflow.engine.loop import Engine

    queue = sys.argv[1] if len(sys.argv) > 1 else None
    report = Engine(
        flow(queue, *sys.argv[2:3]),
        executor="local",
        batch_size=60,
        max_inflight=180,
        until_idle=1.0,
        batch_timeout_s=0.05,
        handle_signals=False,
    ).run()
    print(report.acked, report.dead_lettered, flush=True)
