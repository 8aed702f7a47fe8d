"""Helpers of the Delta Lake and Iceberg tests: orders to publish, tables to read back."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pyarrow as pa

import ackflow
from ackflow.embedded import EmbeddedQueue
from ackflow.testing import ListSource
from helpers import FAST, bodies

HERE = os.path.dirname(os.path.abspath(__file__))
PIPELINE = os.path.join(HERE, "pipelines", "lake_flow.py")


def publish_orders(db, n, seed, queue="orders", prefix="o"):
    """n orders of 1-3 line items, 2% poison. Returns (expected (order, line) rows,
    poison message ids)."""
    rng = random.Random(seed)
    expected, poison, msgs, ids = set(), set(), [], []
    for i in range(n):
        order = {"order": i, "items": rng.randint(1, 3), "poison": i % 50 == 17}
        if order["poison"]:
            poison.add(f"{prefix}{i}")
        else:
            expected.update((i, j) for j in range(order["items"]))
        msgs.append(json.dumps(order).encode())
        ids.append(f"{prefix}{i}")
    q = EmbeddedQueue(db)
    try:
        q.publish(queue, msgs, msg_ids=ids)
    finally:
        q.close()
    return expected, poison


def delta_rows(path):
    """(order, line) pairs of the Delta table, read with deltalake and with polars (both
    must agree)."""
    import polars as pl
    from deltalake import DeltaTable

    t = DeltaTable(path).to_pyarrow_table(columns=["order", "line"])
    rows = list(zip(t.column("order").to_pylist(), t.column("line").to_pylist(), strict=True))
    frame = pl.read_delta(path, columns=["order", "line"])
    assert sorted(frame.iter_rows()) == sorted(rows), "polars and deltalake disagree"
    return rows


def iceberg_rows(catalog, table):
    from ackflow.sinks import Iceberg

    t = Iceberg(catalog, table)._load().scan(selected_fields=("order", "line")).to_arrow()
    return list(zip(t.column("order").to_pylist(), t.column("line").to_pylist(), strict=True))


def assert_exactly_once(rows, expected):
    assert len(rows) == len(set(rows)), f"{len(rows) - len(set(rows))} duplicate rows"
    assert set(rows) == expected, (
        f"missing {len(expected - set(rows))}, unexpected {len(set(rows) - expected)}"
    )


def queue_left(db, queue="orders"):
    q = EmbeddedQueue(db)
    try:
        s = q.stats(queue)
        return s["ready"] + s["leased"] + s["delayed"]
    finally:
        q.close()


def run_local(env, *args, timeout=120):
    """The pipeline in a subprocess with the in-process executor (no JVM)."""
    return subprocess.run(
        [sys.executable, PIPELINE, *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def dead_ids(db, queue="orders"):
    q = EmbeddedQueue(db)
    try:
        return {d.msg_id for d in q.dead_letters(queue)}
    finally:
        q.close()


#: a table made beforehand: ``qty`` is int32, so a larger qty is refused by the sink
ITEMS = pa.schema(
    [
        ("order", pa.int64()),
        ("line", pa.int64()),
        ("sku", pa.string()),
        ("qty", pa.int32()),
        ("ackflow_key", pa.string()),
    ]
)


def items(order):
    if order.get("poison"):
        raise ValueError(f"order {order['order']} is poison")
    return [
        {"order": order["order"], "line": j, "sku": f"s{j}", "qty": order["qty"]}
        for j in range(order["items"])
    ]


def run_refusing_orders(spark, sink, n=240):
    """``n`` orders through ``flat_map(items)`` into ``sink`` (a table with ``ITEMS``):
    every 40th has a qty the table refuses, every 50th is poison. Checks that exactly
    those fail (the refused ones in the sink's step) and the rest are acked; returns the
    run's report and the (order, line) pairs the table must hold."""
    orders = [
        {"order": i, "items": 1 + i % 3, "qty": 2**40 if i % 40 == 7 else i, "poison": i % 50 == 13}
        for i in range(n)
    ]
    src = ListSource(bodies(orders))
    report = ackflow.run(ackflow.Flow(src).flat_map(items, name="items").to(sink), spark=spark, **FAST)
    refused = {f"m{i}" for i in range(n) if i % 40 == 7}
    poison = {f"m{i}" for i in range(n) if i % 50 == 13}
    assert set(src.dead_letters) == refused | poison
    assert all(
        src.failures[m].step == sink.name and "cannot store" in src.failures[m].error for m in refused
    ), src.failures
    assert report.acked == n - len(refused | poison)
    expected = {
        (o["order"], j) for o in orders if f"m{o['order']}" not in refused | poison for j in range(o["items"])
    }
    return report, expected
