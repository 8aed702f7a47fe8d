"""The pipeline of the chaos soak (``benchmarks.chaos``), run as a child process.

    python -m benchmarks.chaos_pipeline CONFIG.json [--until-idle S]

Three sources merged (a RabbitMQ quorum queue, a RabbitMQ stream, a Files directory),
``map`` (validate), ``flat_map`` (one row per line item), ``group_by("id", "kind")``
(a Column aggregate: one row per message), ``join`` with a static DataFrame of kinds,
then a broadcast to PostgreSQL (upserts on ackflow's row key) and Parquet, with dead
letters to a PostgreSQL table keyed by the message identity.

Every group holds the rows of one message only (the group key contains the message's
unique ``id``), so each good message gives exactly one row in each sink, and a message
written twice under two identities shows up as two rows with the same ``id``.
The config file holds the servers' addresses (no passwords: the throwaway servers use
trust / guest on loopback).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import ackflow
from ackflow.sinks import Parquet, Postgres
from ackflow.sources import Files, RabbitMQ, RabbitMQStream

KINDS = ("book", "game", "tool", "food")


def validate(order: dict[str, Any]) -> dict[str, Any]:
    if order["qty"] <= 0:
        raise ValueError(f"order {order['id']} has qty {order['qty']}")
    return order


def lines(order: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"id": order["id"], "kind": order["kind"], "qty": order["qty"], "line": i}
            for i in range(order["lines"])]


def build(cfg: dict[str, Any]) -> ackflow.Flow:
    from pyspark.sql import functions as F

    spark = ackflow.session(master="local[2]")
    policy = ackflow.RetryPolicy(max_deliveries=cfg["max_deliveries"],
                                 backoff_s=cfg["backoff_s"], max_backoff_s=cfg["max_backoff_s"])
    queue = RabbitMQ(cfg["amqp_url"], cfg["queue"], policy=policy, name="queue",
                     arguments={"x-queue-type": "quorum"}, reconnect_max_s=2.0)
    stream = RabbitMQStream("127.0.0.1", cfg["stream_port"], cfg["stream"], "chaos",
                            offset="first", policy=policy, name="stream")
    files = Files(cfg["files_dir"], format="jsonl", policy=policy, name="files",
                  scan_interval_s=0.5)
    kinds = spark.createDataFrame([(k, k.upper(), i) for i, k in enumerate(KINDS)],
                                  "kind STRING, label STRING, rank INT")
    return (ackflow.merge(ackflow.Flow(queue), ackflow.Flow(stream), ackflow.Flow(files))
            .map(validate, name="validate",
                 schema="id STRING, kind STRING, qty BIGINT, lines BIGINT, pad STRING")
            .flat_map(lines, name="lines", schema="id STRING, kind STRING, qty BIGINT, line BIGINT")
            .group_by("id", "kind").agg(F.sum("qty").alias("total"),
                                        F.count(F.lit(1)).alias("n_lines"), name="per_order")
            .join(kinds, on="kind", how="inner", name="kinds")
            .broadcast(Postgres(cfg["dsn"], cfg["table"], mode="upsert", create=True,
                                connect_timeout=3, name="pg"),
                       Parquet(cfg["parquet_dir"], name="parquet"))
            .on_error(Postgres(cfg["dsn"], cfg["dead_table"], key=["message"], mode="upsert",
                               create=True, connect_timeout=3, name="dead")))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config")
    p.add_argument("--until-idle", type=float, default=None)
    a = p.parse_args()
    with open(a.config) as f:
        cfg = json.load(f)
    flow = build(cfg)
    report = ackflow.run(flow, master="local[2]", batch_size=cfg["batch_size"],
                         max_inflight=cfg["max_inflight"], until_idle=a.until_idle,
                         metrics_port=cfg.get("metrics_port"), drain_timeout_s=10)
    print(json.dumps({"acked": report.acked, "dead_lettered": report.dead_lettered,
                      "nacked": report.nacked}), flush=True)


if __name__ == "__main__":
    main()
