"""The pipeline of the chaos soak (``benchmarks.chaos``), run as a child process.

    python -m benchmarks.chaos_pipeline CONFIG.json [--until-idle S]

Four sources merged (a RabbitMQ quorum queue with ``x-delivery-limit`` and a
dead-letter exchange, a RabbitMQ stream, a Files directory, and a Kafka topic read as a
consumer group unless the soak runs without Kafka), ``map`` (validate),
``flat_map`` (one row per line item), ``grouped_within(4, 0.25, "id")`` (a message's
line items gathered across the batch boundary: the group row carries its members),
``map`` (one row per group), ``group_by("id", "kind")`` (a Column aggregate), ``join``
with a static DataFrame of kinds, ``transform`` (a DataFrame function adding a column),
then a broadcast to PostgreSQL (upserts on ackflow's row key), Parquet and a count
window (every 500 rows: their count and the sum of their totals, in durable state,
written to PostgreSQL when full), with dead letters to a PostgreSQL table keyed by the
message identity. The optional nested
``opt``, the list ``tags`` (often empty) and the nullable ``note`` ride along to both
sinks and must land as published.

Every group holds the rows of one message only (the group keys contain the message's
unique ``id``), so each good message gives exactly one row in each sink, and a message
written twice under two identities shows up as two rows with the same ``id``. (A
group of several messages would get a new row key when one of them, re-sent by its
producer after it was acked, joins another group: a second row. Law 12 holds a repeat
only while the first delivery is in flight.)
The config file holds the servers' addresses (no passwords: the throwaway servers use
trust / guest on loopback).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import ackflow
from ackflow import windows as w
from ackflow.sinks import Parquet, Postgres
from ackflow.sources import Files, Kafka, RabbitMQ, RabbitMQStream

KINDS = ("book", "game", "tool", "food")


EXTRA = (
    "opt STRUCT<code: STRING, dims: STRUCT<w: BIGINT, h: BIGINT>, marks: ARRAY<BIGINT>>, "
    "tags ARRAY<STRING>, note STRING"
)


def validate(order: dict[str, Any]) -> dict[str, Any]:
    if order["qty"] <= 0:
        raise ValueError(f"order {order['id']} has qty {order['qty']}")
    return {**order, "opt": order.get("opt")}  # optional: absent reads as null


def lines(order: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {
            "id": order["id"],
            "kind": order["kind"],
            "qty": order["qty"],
            "line": i,
            "opt": order["opt"],
            "tags": order["tags"],
            "note": order["note"],
        }
        for i in range(order["lines"])
    ]


def one_row(group: dict[str, Any]) -> dict[str, Any]:
    """A ``grouped_within`` group (one message's line items) as one row."""
    rows = group["rows"]
    first = rows[0]
    return {
        "id": group["id"],
        "kind": first["kind"],
        "qty": sum(r["qty"] for r in rows),
        "n_lines": group["count"],
        "members": sorted(r["line"] for r in rows),
        "opt": first["opt"],
        "tags": first["tags"],
        "note": first["note"],
    }


def label_len(df: Any) -> Any:
    from pyspark.sql import functions as F

    return df.withColumn("label_len", F.length("label"))


def build(cfg: dict[str, Any]) -> ackflow.Flow:
    from pyspark.sql import functions as F

    spark = ackflow.session(master="local[2]")
    policy = ackflow.RetryPolicy(
        max_deliveries=cfg["max_deliveries"], backoff_s=cfg["backoff_s"], max_backoff_s=cfg["max_backoff_s"]
    )
    queue = RabbitMQ(
        cfg["amqp_url"],
        cfg["queue"],
        policy=policy,
        name="queue",
        arguments={
            "x-queue-type": "quorum",
            "x-delivery-limit": cfg["delivery_limit"],
            "x-dead-letter-exchange": cfg["dlx"],
        },
        reconnect_max_s=2.0,
    )
    stream = RabbitMQStream(
        "127.0.0.1", cfg["stream_port"], cfg["stream"], "chaos", offset="first", policy=policy, name="stream"
    )
    files = Files(cfg["files_dir"], format="jsonl", policy=policy, name="files", scan_interval_s=0.5)
    sources = [ackflow.Flow(queue), ackflow.Flow(stream), ackflow.Flow(files)]
    if cfg.get("kafka"):
        kafka = Kafka(
            cfg["kafka"],
            cfg["kafka_topic"],
            "chaos",
            policy=policy,
            attempts_path=os.path.join(cfg["state_dir"], "kafka-attempts.db"),
            name="kafka",
        )
        sources.append(ackflow.Flow(kafka))
    kinds = spark.createDataFrame(
        [(k, k.upper(), i) for i, k in enumerate(KINDS)], "kind STRING, label STRING, rank INT"
    )
    return (
        ackflow.merge(*sources)
        .map(
            validate,
            name="validate",
            schema=f"id STRING, kind STRING, qty BIGINT, lines BIGINT, pad STRING, {EXTRA}",
        )
        .flat_map(lines, name="lines", schema=f"id STRING, kind STRING, qty BIGINT, line BIGINT, {EXTRA}")
        .grouped_within(4, 0.25, "id", name="gather")
        .map(
            one_row,
            name="one_row",
            schema=f"id STRING, kind STRING, qty BIGINT, n_lines BIGINT, members ARRAY<BIGINT>, {EXTRA}",
        )
        .group_by("id", "kind")
        .agg(
            F.sum("qty").alias("total"),
            F.sum("n_lines").alias("n_lines"),
            F.first("members").alias("members"),
            F.first("opt").alias("opt"),
            F.first("tags").alias("tags"),
            F.first("note").alias("note"),
            name="per_order",
        )
        .join(kinds, on="kind", how="inner", name="kinds")
        .transform(label_len, name="label_len")
        .broadcast(
            ackflow.branch().to(
                Postgres(cfg["dsn"], cfg["table"], mode="upsert", create=True, connect_timeout=3, name="pg")
            ),
            ackflow.branch().to(Parquet(cfg["parquet_dir"], name="parquet")),
            # every row counted once, through crashes and redeliveries (remember: longer
            # than any soak); the checks add up the written and the open windows
            ackflow.branch()
            .window(
                w.count_window(500),
                aggs=[w.count().alias("n"), w.sum_("total").alias("total")],
                remember="6h",
                name=cfg["window"],
            )
            .to(
                Postgres(
                    cfg["dsn"],
                    cfg["window_table"],
                    mode="upsert",
                    create=True,
                    connect_timeout=3,
                    name="pg_windows",
                )
            ),
        )
        .on_error(
            Postgres(
                cfg["dsn"],
                cfg["dead_table"],
                key=["message"],
                mode="upsert",
                create=True,
                connect_timeout=3,
                name="dead",
            )
        )
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config")
    p.add_argument("--until-idle", type=float, default=None)
    a = p.parse_args()
    with open(a.config) as f:
        cfg = json.load(f)
    flow = build(cfg)
    report = ackflow.run(
        flow,
        master="local[2]",
        batch_size=cfg["batch_size"],
        max_inflight=cfg["max_inflight"],
        until_idle=a.until_idle,
        metrics_port=cfg.get("metrics_port"),
        drain_timeout_s=10,
        state_dir=cfg["state_dir"],
    )
    print(
        json.dumps(
            {
                "acked": report.acked,
                "dead_lettered": report.dead_lettered,
                "nacked": report.nacked,
                "duplicates": report.duplicates,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
