"""The pipeline of the window exactness test: daily Seattle weather records (the
vega_datasets package's ``seattle-weather.csv``) from an embedded queue into three
windows at once, by weather kind: tumbling (30 days), hopping (28 days every 14) and
session (3 days apart), and the tumbling and hopping ones again with only the aggregates
held in Arrow columns; each window's results go to a Parquet dataset of its own; and
a dedupe keeps the first record of each weather kind in each month.

Configured by environment variables (it runs in a subprocess that the test kills):
AF_QUEUE (the queue file), AF_OUT (the folder of the datasets). ``ACKFLOW_FAULTS``
arms fault points as usual.

``python window_flow.py`` runs it in this process with the in-process executor (no
JVM): the state store's fault points are on the driver, so that is the same code path,
fast.
"""

import datetime as dt
import os
import sys

import ackflow
from ackflow import windows as w
from ackflow.core.policy import RetryPolicy
from ackflow.flow import branch
from ackflow.sinks import Parquet
from ackflow.sources import EmbeddedQueue
from ackflow.state import winlog

# the open windows' change log folded every two rows, so that a crash can meet a fold
winlog.COMPACT_EVERY = 2

KINDS = {
    "tumbling": w.tumbling("30 days"),
    "hopping": w.hopping("28 days", every="14 days"),
    "session": w.session("3 days"),
    # the same two with only the aggregates the Arrow fold computes: their open windows
    # are held in Arrow columns (state/columns.py), the others' in a Python dict
    "tumbling_arrow": w.tumbling("30 days"),
    "hopping_arrow": w.hopping("28 days", every="14 days"),
}


def aggs(name):
    arrow = [
        w.count().alias("days"),
        w.sum_("precipitation").alias("rain_mm"),
        w.max_("temp_max").alias("hottest"),
        w.min_("temp_min").alias("coldest"),
        w.avg("wind").alias("mean_wind"),
    ]
    if name.endswith("_arrow"):
        return arrow
    return [
        *arrow,
        w.count_distinct("temp_max").alias("distinct_highs"),
        w.first("wind").alias("first_wind"),
        w.last("precipitation").alias("last_rain"),
    ]


def day(record):
    """The record's date as its event time (a timestamp), and its month."""
    return {**record, "day": dt.datetime.strptime(record["date"], "%Y/%m/%d"), "month": record["date"][:7]}


def flow(queue=None, out=None):
    queue = queue or os.environ["AF_QUEUE"]
    out = out or os.environ["AF_OUT"]
    source = EmbeddedQueue(queue, "weather", policy=RetryPolicy(max_deliveries=10, backoff_s=0.05))
    days = ackflow.Flow(source).map(day, name="day")
    return days.broadcast(
        *[
            branch()
            .window(kind, by="weather", time="day", lateness="10 days", idle=1.0, aggs=aggs(name), name=name)
            .to(Parquet(os.path.join(out, name), name=f"{name}_out"))
            for name, kind in KINDS.items()
        ],
        # the first day of each weather kind in each month (repeats are all within 62 days)
        branch()
        .dedupe(["weather", "month"], within="62 days", time="day", name="first_of_month")
        .to(Parquet(os.path.join(out, "first_of_month"), name="first_of_month_out")),
    )


if __name__ == "__main__":
    from ackflow.engine.loop import Engine

    report = Engine(
        flow(),
        executor="local",
        batch_size=100,
        max_inflight=300,
        until_idle=3.0,
        handle_signals=False,
    ).run()
    print(report.acked, report.dead_lettered, flush=True)
    sys.exit(0)
