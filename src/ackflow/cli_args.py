"""The ``ackflow`` command's arguments: every subcommand, its options and their
checks (a bad value is refused by argparse with a line that says what to give)."""

from __future__ import annotations

import argparse
import math
import os
from typing import Any


def _number(kind: type, low: float | None, high: float | None, what: str) -> Any:
    """An argparse type: a finite number of ``kind`` within [low, high], or a clear
    error (``nan`` and ``inf`` are refused: ``--until-idle nan`` would never end)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected {what} (a finite number), got {text!r}")
        if low is not None and high is not None and not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be between {low} and {high}, got {value}")
        if low is not None and value < low:
            raise argparse.ArgumentTypeError(
                f"must be at least {low}, got {value}" if low else f"must not be negative, got {value}"
            )
        return value

    return parse


_positive_int = _number(int, 1, None, "a whole number")
_seconds = _number(float, 0, None, "seconds")
_rate = _number(float, 0, 1, "a number between 0 and 1")
_port = _number(int, 0, 65535, "a TCP port")


def _engine_options(p: argparse.ArgumentParser, batch: int, inflight: int) -> None:
    p.add_argument(
        "--batch-size", type=_positive_int, default=batch, help=f"messages per Spark job (default {batch})"
    )
    p.add_argument(
        "--max-inflight",
        type=_positive_int,
        default=inflight,
        help=f"unsettled messages at most; pulling stops when full (default {inflight})",
    )
    p.add_argument(
        "--max-concurrent-batches",
        type=_positive_int,
        default=2,
        help="Spark jobs in flight at once (default 2)",
    )
    p.add_argument(
        "--drain-timeout",
        type=_seconds,
        default=60.0,
        help="on SIGINT/SIGTERM, seconds to let running batches finish (default 60)",
    )
    p.add_argument(
        "--systemic-stop-after",
        type=_seconds,
        default=300.0,
        metavar="SECONDS",
        help="stop the run when every message has failed the same way at one step "
        "for this long; they are given back, never dead-lettered (default 300)",
    )
    p.add_argument(
        "--schema-mode",
        choices=("evolve", "rescue", "freeze"),
        default="evolve",
        help="rows that bring new fields or wider types: evolve the columns "
        "(default), keep what does not fit in a _rescued JSON column, or "
        "freeze the columns and fail such messages",
    )
    p.add_argument(
        "--state-dir",
        default=None,
        metavar="DIR",
        help="where the flow's columns are kept and versioned (DIR/schemas.db; "
        "default: beside a sink's or the source's own state)",
    )
    p.add_argument("--master", default=None, help="Spark master (default local[*])")
    p.add_argument(
        "--metrics-port",
        type=_port,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics on this port (off by default)",
    )
    p.add_argument(
        "--metrics-host", default="127.0.0.1", help="address for the metrics port (default 127.0.0.1)"
    )
    p.add_argument(
        "--ui-port",
        type=_port,
        default=None,
        metavar="PORT",
        help="serve the live status page on this port (off by default)",
    )
    p.add_argument("--ui-host", default="127.0.0.1", help="address for the status page (default 127.0.0.1)")
    p.add_argument(
        "--ui-allow-replay",
        action="store_true",
        help="let the status page replay dead letters (embedded queue; off by default)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    p.add_argument("-v", "--verbose", action="store_true", help="log every failure")


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="ackflow",
        description="Acknowledged streaming pipelines on Apache Spark.",
    )
    from ackflow import __version__

    top.add_argument("--version", action="version", version=f"ackflow {__version__}")
    sub = top.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the demo pipeline on an embedded queue")
    demo.add_argument(
        "--messages", type=_positive_int, default=100_000, help="order events to publish (default 100000)"
    )
    demo.add_argument(
        "--poison-rate", type=_rate, default=0.01, help="share of malformed or invalid events (default 0.01)"
    )
    demo.add_argument(
        "--workdir",
        default="ackflow-demo",
        help="directory for the queue and the output (default ./ackflow-demo)",
    )
    demo.add_argument(
        "--resume", action="store_true", help="process what is already queued in --workdir; publish nothing"
    )
    demo.add_argument(
        "--until-idle",
        type=_seconds,
        default=3.0,
        help="stop after this many seconds without messages (default 3)",
    )
    demo.add_argument("--seed", type=int, default=7, help="random seed of the events")
    demo.add_argument(
        "--sink",
        choices=("parquet", "delta", "iceberg"),
        default=None,
        help="where the line items go: Parquet (default), a Delta Lake table, or "
        "an Iceberg table (SQL catalog on SQLite); --resume keeps the demo's own",
    )
    demo.add_argument(
        "--source",
        choices=("embedded", "rabbitmq"),
        default="embedded",
        help="where the orders are queued (default: the embedded queue)",
    )
    demo.add_argument(
        "--windows",
        action="store_true",
        help="the windowed demo: orders per customer per minute in durable window state, "
        "some late, some poison (embedded queue, Parquet)",
    )
    demo.add_argument(
        "--amqp-url",
        default=None,
        help="RabbitMQ URL for --source rabbitmq (amqp://user:pass@host:5672/%%2F)",
    )
    _engine_options(demo, 5000, 20000)

    run = sub.add_parser("run", help="run a flow defined in a Python file")
    run.add_argument("target", help="path/to/file.py:name (a Flow, or a function returning one)")
    run.add_argument(
        "--until-idle",
        type=_seconds,
        default=None,
        help="stop after this many seconds without messages (default: run until a signal)",
    )
    _engine_options(run, 2000, 10000)

    queue = sub.add_parser("queue", help="inspect or repair an embedded queue")
    qsub = queue.add_subparsers(dest="action", required=True)
    for name, text in (
        ("stats", "counts: ready, leased, delayed, dead-lettered, totals"),
        ("peek", "show the first messages"),
        ("dead-letters", "show dead letters with their step and error"),
        ("replay", "move dead letters back to the queue for another try"),
    ):
        q = qsub.add_parser(name, help=text)
        q.add_argument("--db", required=True, help="path of the queue file")
        q.add_argument("--queue", required=True, help="queue name")
        q.add_argument("--json", action="store_true", help="print JSON")
        if name in ("peek", "dead-letters"):
            q.add_argument("--limit", type=_positive_int, default=10)
        if name == "replay":
            q.add_argument(
                "--id",
                type=_number(int, 0, None, "a dead-letter id"),
                action="append",
                dest="ids",
                help="replay only this dead letter (repeatable); default all",
            )

    dlq = sub.add_parser(
        "dlq",
        help="read or replay a RabbitMQ dead-letter queue",
        description="Read or replay the dead letters a RabbitMQ source left in a queue "
        "(see docs/tools.md). The URL comes from --url or ACKFLOW_AMQP_URL.",
    )
    dsub = dlq.add_subparsers(dest="action", required=True)
    peek = dsub.add_parser(
        "peek",
        help="show dead letters, leaving the queue as it was",
        description="Show the first messages of QUEUE: message id, ackflow's failure headers "
        "(step, error, deliveries) and a body preview. No delivery is spent and "
        "no message is left redelivered: the queue is rotated once (each "
        "message copied to its tail with confirms, then the original acked).",
    )
    rep = dsub.add_parser(
        "replay",
        help="send dead letters back for another try",
        description="Publish each dead letter of QUEUE to --to with ackflow's x-ackflow-* "
        "headers and the broker's x-death/x-delivery-count removed and its "
        "message_id kept; each dead letter is acked only after the broker "
        "confirmed its copy (a crash duplicates at most one message, never "
        "loses one).",
    )
    for d in (peek, rep):
        d.add_argument("queue", help="the dead-letter queue")
        d.add_argument(
            "--url",
            default=os.environ.get("ACKFLOW_AMQP_URL"),
            help="amqp://user:pass@host:5672/%%2F (default $ACKFLOW_AMQP_URL)",
        )
        d.add_argument("--json", action="store_true", help="print JSON")
    peek.add_argument("--count", type=_positive_int, default=10, help="messages to show (default 10)")
    peek.add_argument(
        "--window",
        type=_positive_int,
        default=500,
        help="copies confirmed at a time (default 500; a crash mid-peek "
        "leaves at most this many messages twice)",
    )
    rep.add_argument(
        "--to",
        required=True,
        metavar="TARGET",
        help="a queue, or an exchange (write queue:NAME or exchange:NAME if both exist)",
    )
    rep.add_argument(
        "--routing-key",
        default=None,
        help="for an exchange target (default: the queue the message was dead-lettered from)",
    )
    rep.add_argument(
        "--count",
        type=_positive_int,
        default=None,
        help="replay at most this many (default: all the queue holds now)",
    )
    rep.add_argument(
        "--window",
        type=_positive_int,
        default=1,
        help="copies confirmed at a time (default 1: a crash duplicates at most "
        "one message; larger is faster, and a crash duplicates at most "
        "this many)",
    )

    servers = sub.add_parser(
        "servers",
        help="start throwaway RabbitMQ, PostgreSQL and Kafka on loopback",
        description="Start throwaway servers on 127.0.0.1 (free ports, data in a temporary "
        "directory), print their URLs, and stop them on Ctrl-C or SIGTERM. Same "
        "as python -m ackflow.servers.",
    )
    servers.add_argument(
        "which",
        nargs="*",
        metavar="rabbitmq|postgres|kafka",
        help="which servers (default: rabbitmq and postgres)",
    )

    schema = sub.add_parser("schema", help="show a flow's stored columns and their history")
    ssub = schema.add_subparsers(dest="action", required=True)
    for name, text in (
        ("show", "the current columns of each step"),
        ("history", "every version: its changes, when, and the message that brought it"),
    ):
        s = ssub.add_parser(name, help=text)
        s.add_argument("store", help="the schema store: a state directory or its schemas.db")
        s.add_argument("--step", default=None, help="only this segment (as listed)")
        s.add_argument("--json", action="store_true", help="print JSON")

    state = sub.add_parser("state", help="show a flow's window state: watermarks and open windows")
    stsub = state.add_subparsers(dest="action", required=True)
    st = stsub.add_parser("show", help="each window's watermark, counters and open windows")
    st.add_argument("store", help="the state directory (state_dir) or its windows.db")
    st.add_argument("--window", default=None, help="only this window (by name)")
    st.add_argument("--limit", type=int, default=20, help="open windows to list per window (default 20)")
    st.add_argument("--json", action="store_true", help="print JSON")

    docs = sub.add_parser(
        "docs", help="build the documentation site and serve it on 127.0.0.1 (needs the dev extras: MkDocs)"
    )
    docs.add_argument("--port", type=_port, default=8000, help="port to serve on (default 8000)")
    return top
