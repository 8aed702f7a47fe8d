"""RabbitMQ queue -> validate -> PostgreSQL, with dead letters in a table of their own.

Orders are read from a RabbitMQ queue, checked, and upserted into a PostgreSQL table
keyed by ``order_id``. A message is acked only after its row is committed. An order
that fails the check is retried (the source's policy), then written as a dead letter to
a second table (``body`` as text, ``failed_at`` as timestamptz: docs/tools.md) and
only then acked: nothing is dropped, and nothing is acked early.

Try it with throwaway servers (``python -m ackflow.servers`` prints the URLs)::

    python examples/rabbitmq_to_postgres.py \\
        --amqp-url amqp://guest:guest@127.0.0.1:PORT/%2F \\
        --dsn postgresql://postgres@127.0.0.1:PORT/postgres --publish 1000 --until-idle 3

``--publish N`` first publishes N sample orders (one in ten invalid) the way a producer
should: persistent, with publisher confirms, and a ``message_id`` per order (ackflow's
identity of the message: a redelivered or re-sent order is written in place, not
twice). Then look at the result::

    psql DSN -c "SELECT count(*) FROM orders"
    psql DSN -c "SELECT message, step, error, left(body, 80) FROM orders_dead"

The password in a URL never reaches ackflow's output or logs; pass it in the URL or
through the environment (``ACKFLOW_AMQP_URL``, ``ACKFLOW_DSN``).
"""

from __future__ import annotations

import argparse
import json
import os
import random

import ackflow
from ackflow.core.policy import RetryPolicy
from ackflow.sinks import Postgres
from ackflow.sources import RabbitMQ


def validate(order: dict) -> dict:
    """The flow's one step: a valid order, or an exception naming what is wrong (its
    message is then retried and, once given up, dead-lettered with this error)."""
    if not isinstance(order.get("order_id"), str) or not order["order_id"]:
        raise ValueError("order_id is missing")
    qty = order.get("qty")
    if not isinstance(qty, int) or qty <= 0:
        raise ValueError(f"order {order['order_id']}: qty must be a positive integer, got {qty!r}")
    price = order.get("price")
    if not isinstance(price, int | float) or price < 0:
        raise ValueError(f"order {order['order_id']}: price must be a number >= 0")
    return {
        "order_id": order["order_id"],
        "customer": str(order.get("customer", "")),
        "qty": qty,
        "price": float(price),
        "total": round(qty * float(price), 2),
    }


def build_flow(amqp_url: str, queue: str, dsn: str, table: str, dead_table: str) -> ackflow.Flow:
    source = RabbitMQ(amqp_url, queue, declare=True, policy=RetryPolicy(max_deliveries=3, backoff_s=0.2))
    return (
        ackflow.Flow(source)
        .map(validate, name="validate")
        .to(Postgres(dsn, table, key=["order_id"], create=True, name="orders"))
        .on_error(Postgres(dsn, dead_table, create=True, name="dead letters"))
    )


def publish(amqp_url: str, queue: str, n: int, seed: int = 1) -> None:
    """Publish ``n`` sample orders (every tenth one invalid), persistent, with confirms
    and a ``message_id`` each."""
    import pika

    rnd = random.Random(seed)
    conn = pika.BlockingConnection(pika.URLParameters(amqp_url))
    ch = conn.channel()
    ch.queue_declare(queue, durable=True)
    ch.confirm_delivery()  # each publish returns once the broker has the message
    for i in range(n):
        order = {
            "order_id": f"o-{i}",
            "customer": f"c-{rnd.randrange(100)}",
            "qty": rnd.randrange(1, 5),
            "price": round(rnd.uniform(1, 100), 2),
        }
        if i % 10 == 9:
            order["qty"] = 0  # invalid: dead-lettered after its retries
        ch.basic_publish(
            "",
            queue,
            json.dumps(order).encode(),
            pika.BasicProperties(
                delivery_mode=2, message_id=order["order_id"], content_type="application/json"
            ),
        )
    conn.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="See the module docstring (or docs/tools.md) for more.",
    )
    p.add_argument(
        "--amqp-url",
        default=os.environ.get("ACKFLOW_AMQP_URL"),
        help="amqp://user:pass@host:5672/%%2F (default $ACKFLOW_AMQP_URL)",
    )
    p.add_argument(
        "--dsn",
        default=os.environ.get("ACKFLOW_DSN"),
        help="postgresql://user@host:5432/db (default $ACKFLOW_DSN)",
    )
    p.add_argument("--queue", default="orders", help="the queue to read (default orders)")
    p.add_argument("--table", default="orders", help="the orders table (default orders)")
    p.add_argument(
        "--dead-table", default="orders_dead", help="the dead letters' table (default orders_dead)"
    )
    p.add_argument(
        "--publish",
        type=int,
        default=0,
        metavar="N",
        help="first publish N sample orders (one in ten invalid)",
    )
    p.add_argument(
        "--until-idle",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop after this long without messages (default: until Ctrl-C)",
    )
    p.add_argument("--master", default=None, help="Spark master (default local[*])")
    args = p.parse_args(argv)
    if not args.amqp_url or not args.dsn:
        p.error("give --amqp-url and --dsn (or set ACKFLOW_AMQP_URL and ACKFLOW_DSN)")
    if args.publish:
        publish(args.amqp_url, args.queue, args.publish)
    flow = build_flow(args.amqp_url, args.queue, args.dsn, args.table, args.dead_table)
    report = ackflow.run(flow, master=args.master, until_idle=args.until_idle)
    print(report.summary())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
