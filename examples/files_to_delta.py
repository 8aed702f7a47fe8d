"""Files -> Delta Lake: JSON lines from a folder into a Delta table, effectively-once.

Every ``*.jsonl`` file dropped into the input folder is read line by line; each line
is one message (its identity: the file's instance and the line number). Lines are
parsed, checked and appended to a Delta table in one Delta version per batch; a line
counts as done only once its version is committed, and a restart after a crash writes
no row twice (the sink records the row keys it committed). A finished file is moved to
``INPUT/done/``. A line that fails the check is dead-lettered beside its file
(``INPUT/done/<file>.dead.jsonl``, e.g. ``events-0.jsonl.dead.jsonl``: the line,
its step and error).

Try it::

    python examples/files_to_delta.py /tmp/events /tmp/events-table --sample 5 --until-idle 3

``--sample N`` first writes N sample files of events (a few lines invalid). Read the
table with ``deltalake``::

    python -c "from deltalake import DeltaTable; print(DeltaTable('/tmp/events-table').to_pandas())"

On a Spark standalone cluster, give its master: ``--master spark://HOST:7077``. The
executors run ``check`` and write the Delta files, so every worker needs the same
Python with ackflow and deltalake installed, and both folders on a file system every
worker and the driver share (``tests/test_cluster.py`` runs this example on a loopback
cluster).
"""

from __future__ import annotations

import argparse
import json
import os
import random

import ackflow
from ackflow.core.policy import RetryPolicy
from ackflow.sinks import Delta
from ackflow.sources import Files


def check(event: dict) -> dict:
    """A valid event, or an exception naming what is wrong (the line is dead-lettered)."""
    if not isinstance(event.get("user"), str):
        raise ValueError("user is missing")
    if event.get("kind") not in ("view", "click", "buy"):
        raise ValueError(f"unknown kind {event.get('kind')!r}")
    return {
        "user": event["user"],
        "kind": event["kind"],
        "ms": int(event.get("ms", 0)),
        "day": str(event.get("day", "")),
    }


def build_flow(input_dir: str, table: str) -> ackflow.Flow:
    source = Files(input_dir, "jsonl", policy=RetryPolicy(max_deliveries=1))
    return ackflow.Flow(source).map(check, name="check").to(Delta(table, partition_by="day", name="events"))


def write_samples(input_dir: str, files: int, lines: int = 200, seed: int = 1) -> None:
    """``files`` files of ``lines`` events each; every 50th line is invalid. Each file is
    written under a temporary name and renamed, as a producer should (the source skips
    names starting with '.' or '_')."""
    rnd = random.Random(seed)
    os.makedirs(input_dir, exist_ok=True)
    for f in range(files):
        rows = []
        for i in range(lines):
            event = {
                "user": f"u{rnd.randrange(50)}",
                "kind": rnd.choice(["view", "click", "buy"]),
                "ms": rnd.randrange(1000),
                "day": f"2026-01-0{1 + f % 3}",
            }
            if i % 50 == 49:
                event["kind"] = "teleport"  # invalid
            rows.append(json.dumps(event))
        tmp = os.path.join(input_dir, f".part-{f}.jsonl")
        with open(tmp, "w") as out:
            out.write("\n".join(rows) + "\n")
        os.replace(tmp, os.path.join(input_dir, f"events-{f}.jsonl"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="See the module docstring for more.",
    )
    p.add_argument("input", help="the folder files are dropped into")
    p.add_argument("table", help="the Delta table's folder (created if missing)")
    p.add_argument(
        "--sample",
        type=int,
        default=0,
        metavar="N",
        help="first write N sample files (200 events each, 4 invalid)",
    )
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
    report = ackflow.run(build_flow(args.input, args.table), master=args.master, until_idle=args.until_idle)
    print(report.summary())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
