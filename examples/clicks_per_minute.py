"""Files -> windows -> PostgreSQL: clicks per page per minute, from JSON lines.

Each line of a ``*.jsonl`` file dropped into the input folder is one click (its
event time in ``ts``, ISO 8601). A one-minute tumbling window per page counts the
clicks, their distinct users and the slowest load time; the window state lives in a
SQLite file in ``--state-dir`` and a line is acked (and its file finished) once its
contribution is committed there, not when its window closes. When the watermark
(the latest event time minus ``--lateness``) passes a window's end, or the input goes
quiet for ``--idle`` seconds, the window's row is upserted into the PostgreSQL table
(keyed by page and window start: a restart after a crash writes the same row again, in
place). A click older than the watermark is written to ``INPUT/late/`` (Parquet),
never dropped; a line that is not a click is dead-lettered beside its file.

Try it (with a PostgreSQL you can reach; ``ackflow servers`` starts a throwaway one)::

    python examples/clicks_per_minute.py /tmp/clicks --dsn postgresql://... --sample 3 --until-idle 5
    ackflow state show /tmp/clicks-state

``--sample N`` first writes N sample files (300 clicks each over five minutes, a few of
them late and a few invalid).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random

import ackflow
from ackflow import windows as w
from ackflow.core.policy import RetryPolicy
from ackflow.sinks import Parquet, Postgres
from ackflow.sources import Files

START = dt.datetime(2026, 11, 26, 9, 0, tzinfo=dt.UTC)


def check(click: dict) -> dict:
    """A valid click, or an exception naming what is wrong (the line is dead-lettered)."""
    for field in ("page", "user", "ts"):
        if not isinstance(click.get(field), str):
            raise ValueError(f"{field} is missing")
    return {"page": click["page"], "user": click["user"], "ts": click["ts"], "load_ms": click.get("load_ms")}


def build_flow(input_dir: str, dsn: str, table: str, lateness: float, idle: float) -> ackflow.Flow:
    source = Files(input_dir, "jsonl", policy=RetryPolicy(max_deliveries=1))
    return (
        ackflow.Flow(source)
        .map(check, name="check")
        .window(
            w.tumbling("1 minute"),
            by="page",
            time="ts",
            lateness=lateness,
            idle=idle,
            on_late=Parquet(os.path.join(input_dir, "late"), name="late"),
            aggs=[w.count().alias("clicks"), w.count_distinct("user").alias("users"), w.max_("load_ms")],
            name="per_minute",
        )
        .to(Postgres(dsn, table, key=["page", "window_start"], create=True, name="clicks"))
    )


def write_samples(input_dir: str, files: int, clicks: int = 300, seed: int = 1) -> None:
    """``files`` files of ``clicks`` clicks each, in time order over five minutes a file;
    every 100th click is invalid and every 75th one is ten minutes late. Each file is
    written under a temporary name and renamed, as a producer should."""
    rnd = random.Random(seed)
    os.makedirs(input_dir, exist_ok=True)
    for f in range(files):
        rows = []
        for i in range(clicks):
            at = START + dt.timedelta(minutes=5 * f, seconds=i * 300 / clicks)
            if i % 75 == 74 and f:
                at -= dt.timedelta(minutes=10)
            click = {
                "page": rnd.choice(["/", "/cart", "/search"]),
                "user": f"u{rnd.randrange(40)}",
                "ts": at.isoformat(),
                "load_ms": rnd.randrange(20, 900),
            }
            if i % 100 == 99:
                del click["page"]  # invalid
            rows.append(json.dumps(click))
        tmp = os.path.join(input_dir, f".part-{f}.jsonl")
        with open(tmp, "w") as out:
            out.write("\n".join(rows) + "\n")
        os.replace(tmp, os.path.join(input_dir, f"clicks-{f}.jsonl"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="See the module docstring for more.",
    )
    p.add_argument("input", help="the folder files are dropped into")
    p.add_argument("--dsn", required=True, help="PostgreSQL DSN (postgresql://user:pass@host/db)")
    p.add_argument("--table", default="clicks_per_minute", help="the results' table (created if missing)")
    p.add_argument("--state-dir", default=None, help="the window state's folder (default: INPUT-state)")
    p.add_argument("--lateness", type=float, default=30.0, help="seconds the watermark trails (default 30)")
    p.add_argument(
        "--idle", type=float, default=2.0, help="quiet seconds that close every window (default 2)"
    )
    p.add_argument("--sample", type=int, default=0, metavar="N", help="first write N sample files")
    p.add_argument(
        "--until-idle",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop after this long without new lines (default: until Ctrl-C)",
    )
    p.add_argument("--master", default=None, help="Spark master (default local[*])")
    args = p.parse_args(argv)
    if args.sample:
        write_samples(args.input, args.sample)
    flow = build_flow(args.input, args.dsn, args.table, args.lateness, args.idle)
    state = args.state_dir or args.input.rstrip("/") + "-state"
    report = ackflow.run(flow, master=args.master, until_idle=args.until_idle, state_dir=state)
    print(report.summary())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
