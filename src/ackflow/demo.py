"""The demo: synthetic orders through an embedded queue, Spark, and a table.

``ackflow demo`` publishes order events (a share of them poison: malformed JSON
or invalid orders), runs the pipeline below on local Spark, and checks the result
against what it published: every valid order's line items in the output (Parquet by
default; a Delta Lake table with ``--sink delta``, an Iceberg table with ``--sink
iceberg``), every poison message dead-lettered with the step and cause.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass
from typing import Any

from ackflow.core.policy import RetryPolicy
from ackflow.embedded import EmbeddedQueue, message_key
from ackflow.flow import Flow
from ackflow.sinks.base import Sink
from ackflow.sinks.parquet import ParquetSink
from ackflow.sources.base import Source
from ackflow.sources.embedded import EmbeddedQueueSource

QUEUE = "orders"
SINKS = ("parquet", "delta", "iceberg")
ICEBERG_TABLE = "demo.orders"
SKUS = [f"sku-{i:03d}" for i in range(200)]


@dataclass(frozen=True)
class DemoPaths:
    workdir: str
    sink: str = "parquet"

    @property
    def db(self) -> str:
        return os.path.join(self.workdir, "queue.db")

    @property
    def output(self) -> str:
        """The Parquet folder, the Delta table, or the Iceberg warehouse (with the
        catalog ``catalog.db`` in it)."""
        return os.path.join(
            self.workdir,
            {"parquet": "orders.parquet", "delta": "orders.delta", "iceberg": "iceberg"}[self.sink],
        )

    @property
    def catalog(self) -> str:
        return "sqlite:///" + os.path.join(self.output, "catalog.db")

    def make_sink(self) -> Sink:
        if self.sink == "delta":
            from ackflow.sinks.delta import DeltaSink

            return DeltaSink(self.output, name="delta")
        if self.sink == "iceberg":
            from ackflow.sinks.iceberg import IcebergSink

            os.makedirs(self.output, exist_ok=True)
            return IcebergSink(self.catalog, ICEBERG_TABLE, name="iceberg")
        return ParquetSink(self.output, name="parquet")

    def read_keys(self) -> Any:
        """The output's ``order_id`` and ``line`` columns (a ``pyarrow.Table``), or None if
        nothing was written yet."""
        import pyarrow.parquet as pq

        cols = ["order_id", "line"]
        if not os.path.isdir(self.output):
            return None
        if self.sink == "delta":
            from deltalake import DeltaTable

            if not DeltaTable.is_deltatable(self.output):
                return None
            return DeltaTable(self.output).to_pyarrow_table(columns=cols)
        if self.sink == "iceberg":
            from pyiceberg.exceptions import NoSuchTableError

            from ackflow.sinks.iceberg import IcebergSink

            try:
                table = IcebergSink(self.catalog, ICEBERG_TABLE)._load()
            except NoSuchTableError:
                return None
            return table.scan(selected_fields=tuple(cols)).to_arrow()
        if not any(n.startswith("batch=") for n in os.listdir(self.output)):
            return None
        return pq.read_table(self.output, columns=cols)

    @property
    def manifest(self) -> str:
        return os.path.join(self.workdir, "manifest.json")


def order_event(i: int, rng: random.Random) -> dict[str, Any]:
    return {
        "order_id": f"o-{i:07d}",
        "customer": f"c-{rng.randrange(5000):04d}",
        "ts": f"2026-11-{1 + i % 28:02d}T{i % 24:02d}:{i % 60:02d}:00Z",
        "items": [
            {"sku": rng.choice(SKUS), "qty": rng.randint(1, 5), "price": round(rng.uniform(1, 99), 2)}
            for _ in range(rng.randint(1, 3))
        ],
    }


def poison_body(i: int, rng: random.Random) -> tuple[bytes, str]:
    """A message that must be dead-lettered, and the step expected to reject it."""
    event = order_event(i, rng)
    kind = rng.choice(["malformed", "negative_qty", "no_items", "missing_customer"])
    if kind == "malformed":
        return json.dumps(event).encode()[:-7], "decode"
    if kind == "negative_qty":
        event["items"][0]["qty"] = -rng.randint(1, 9)
    elif kind == "no_items":
        event["items"] = []
    else:
        del event["customer"]
    return json.dumps(event).encode(), "validate"


def publish(
    paths: DemoPaths, messages: int, poison_rate: float, seed: int = 7, rabbit: RabbitDemo | None = None
) -> dict[str, Any]:
    """Start afresh in ``paths.workdir``: queue ``messages`` orders (in the embedded
    queue, or in RabbitMQ); return the manifest."""
    kept = os.path.join(paths.workdir, "dead_letters.jsonl")  # RabbitMQ's, from a last run
    for p in (paths.db, paths.db + "-wal", paths.db + "-shm", paths.manifest, kept):
        if os.path.exists(p):
            os.remove(p)
    for kind in SINKS:
        shutil.rmtree(DemoPaths(paths.workdir, kind).output, ignore_errors=True)
    os.makedirs(paths.workdir, exist_ok=True)
    rng = random.Random(seed)
    bodies, ids, poison = [], [], {}
    valid_items = 0
    for i in range(messages):
        mid = f"order-{i:07d}"
        if rng.random() < poison_rate:
            body, step = poison_body(i, rng)
            poison[mid] = step
        else:
            event = order_event(i, rng)
            valid_items += len(event["items"])
            body = json.dumps(event, separators=(",", ":")).encode()
        bodies.append(body)
        ids.append(mid)
    if rabbit is not None:
        rabbit.publish(bodies, ids)
    else:
        q = EmbeddedQueue(paths.db)
        try:
            q.publish(QUEUE, bodies, msg_ids=ids)  # one transaction: all or nothing
        finally:
            q.close()
    manifest = {"messages": messages, "poison": poison, "valid_items": valid_items, "sink": paths.sink}
    with open(paths.manifest + ".tmp", "w") as f:
        json.dump(manifest, f)
    os.replace(paths.manifest + ".tmp", paths.manifest)  # the demo exists once this is here
    return manifest


def validate(order: dict[str, Any]) -> dict[str, Any]:
    """Reject orders that cannot be booked; the error names the order and the reason."""
    oid = order.get("order_id")
    if not oid:
        raise ValueError("order has no order_id")
    if not order.get("customer"):
        raise ValueError(f"order {oid} has no customer")
    items = order.get("items")
    if not items:
        raise ValueError(f"order {oid} has no line items")
    for item in items:
        if not isinstance(item.get("qty"), int) or item["qty"] <= 0:
            raise ValueError(f"order {oid}: item {item.get('sku')} has qty {item.get('qty')}")
    return order


def line_items(order: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {
            "order_id": order["order_id"],
            "customer": order["customer"],
            "ts": order["ts"],
            "line": n,
            "sku": item["sku"],
            "qty": int(item["qty"]),
            "price": float(item["price"]),
        }
        for n, item in enumerate(order["items"])
    ]


def build_flow(paths: DemoPaths, rabbit: RabbitDemo | None = None) -> Flow:
    policy = RetryPolicy(max_deliveries=3, backoff_s=0.2, max_backoff_s=1.0)
    source: Source = EmbeddedQueueSource(paths.db, QUEUE, format="json", policy=policy)
    if rabbit is not None:
        source = rabbit.source(policy)
    return (
        Flow(source)
        .map(validate, name="validate")
        .flat_map(line_items, name="items")
        .with_columns(total="CAST(qty * price AS DECIMAL(12, 2))", day="to_date(ts)", name="totals")
        .to(paths.make_sink())
    )


def verify(paths: DemoPaths, rabbit: RabbitDemo | None = None) -> dict[str, Any]:
    """Compare the queue and the output (Parquet, Delta or Iceberg) with the manifest."""
    with open(paths.manifest) as f:
        manifest = json.load(f)
    if rabbit is not None:
        stats, dead_steps = rabbit.stats(paths)
    else:
        q = EmbeddedQueue(paths.db)
        try:
            stats = q.stats(QUEUE)
            dead_steps = {message_key(d.row_id, d.msg_id): d.step for d in q.dead_letters(QUEUE)}
        finally:
            q.close()
    poison: dict[str, str] = manifest["poison"]
    found_orders: set[str] = set()
    rows = 0
    table = paths.read_keys()
    if table is not None:
        rows = table.num_rows
        found_orders = set(table.column("order_id").to_pylist())
        distinct = len(
            set(zip(table.column("order_id").to_pylist(), table.column("line").to_pylist(), strict=True))
        )
    else:
        distinct = 0
    expected_orders = manifest["messages"] - len(poison)
    wrongly_dead = [m for m in dead_steps if m not in poison]
    poison_missing = [m for m in poison if m not in dead_steps]
    bad_reason = [m for m, step in dead_steps.items() if m in poison and step != poison[m]]
    return {
        "sink": paths.sink,
        "queue": stats,
        "valid_orders_expected": expected_orders,
        "valid_orders_in_parquet": len(found_orders),
        "line_items_expected": manifest["valid_items"],
        "line_items_in_parquet": distinct,
        "duplicate_rows": rows - distinct,
        "poison_expected": len(poison),
        "poison_dead_lettered": len(poison) - len(poison_missing),
        "dead_lettered_wrongly": len(wrongly_dead),
        "dead_letter_reason_mismatch": len(bad_reason),
        "ok": (
            len(found_orders) == expected_orders
            and distinct == manifest["valid_items"]
            and not poison_missing
            and not wrongly_dead
            and not bad_reason
            and stats["ready"] + stats["leased"] + stats["delayed"] == 0
        ),
    }


class RabbitDemo:
    """The demo through a real RabbitMQ broker: queue ``ackflow-demo-orders``, dead
    letters (with their provenance headers) to exchange ``ackflow-demo-dlx`` and queue
    ``ackflow-demo-dead``. The check reads the dead letters off that queue and keeps
    them in ``WORKDIR/dead_letters.jsonl``."""

    QUEUE, DLX, DEAD = "ackflow-demo-orders", "ackflow-demo-dlx", "ackflow-demo-dead"

    def __init__(self, url: str) -> None:
        self.url = url

    def _channel(self) -> Any:
        import pika

        from ackflow.core.errors import ConfigError
        from ackflow.core.secrets import redact

        try:
            conn = pika.BlockingConnection(pika.URLParameters(self.url))
        except Exception as e:  # noqa: BLE001
            raise ConfigError(
                f"cannot connect to RabbitMQ at {redact(self.url)}: {type(e).__name__}: {redact(str(e))}"
            ) from None
        ch = conn.channel()
        ch.exchange_declare(self.DLX, "fanout", durable=True)
        ch.queue_declare(self.DEAD, durable=True)
        ch.queue_bind(self.DEAD, self.DLX)
        ch.queue_declare(self.QUEUE, durable=True)
        return conn, ch

    def publish(self, bodies: list[bytes], ids: list[str]) -> None:
        import pika

        from ackflow.sinks.rabbitmq import publish_confirmed

        conn, ch = self._channel()
        ch.queue_purge(self.QUEUE)
        ch.queue_purge(self.DEAD)
        conn.close()
        props = [pika.BasicProperties(delivery_mode=2, message_id=m) for m in ids]
        failed = publish_confirmed(
            self.url, "", [(self.QUEUE, b, p) for b, p in zip(bodies, props, strict=True)]
        )
        if failed:
            raise RuntimeError(f"{len(failed)} demo messages were not confirmed by the broker")

    def source(self, policy: RetryPolicy) -> Source:
        from ackflow.sources.rabbitmq import RabbitMQSource

        return RabbitMQSource(self.url, self.QUEUE, policy=policy, dead_letter_exchange=self.DLX)

    def stats(self, paths: DemoPaths) -> tuple[dict[str, int], dict[str, str]]:
        conn, ch = self._channel()
        kept = os.path.join(paths.workdir, "dead_letters.jsonl")
        with open(kept, "a") as f:
            while True:
                method, props, body = ch.basic_get(self.DEAD, auto_ack=False)
                if method is None:
                    break
                h = props.headers or {}
                f.write(
                    json.dumps(
                        {
                            "msg_id": props.message_id,
                            "step": h.get("x-ackflow-step"),
                            "error": h.get("x-ackflow-error"),
                            "deliveries": h.get("x-ackflow-deliveries"),
                            "body": body.decode("utf-8", "replace"),
                        }
                    )
                    + "\n"
                )
                f.flush()
                ch.basic_ack(method.delivery_tag)
        left = ch.queue_declare(self.QUEUE, passive=True).method.message_count
        conn.close()
        dead: dict[str, str] = {}
        with open(kept) as f:
            for line in f:
                d = json.loads(line)
                dead[d["msg_id"]] = d["step"]
        stats = {"ready": left, "leased": 0, "delayed": 0, "dead_lettered": len(dead)}
        return stats, dead
