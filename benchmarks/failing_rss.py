"""Driver memory when every message fails for minutes (bounded memory under failure).

    .venv/bin/python -m benchmarks.failing_rss --seconds 120

A Files source over many JSON lines and a sink that fails every row: each line is
nacked, waits its backoff and comes again, over and over. Lines waiting for a retry keep
their bodies, so they count against ``max_inflight``; driver RSS must stay flat however
long this goes on (before the fix, held bodies grew with throughput x backoff). Prints
one line per sample and a JSON summary (``rss_growth`` = last ÷ first sample after
warm-up, ``max_held`` = most bodies the source held).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import ackflow
from ackflow.engine import Engine
from ackflow.sources import Files
from ackflow.testing import FailingSink
from benchmarks.phases import rss_mb


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--lines", type=int, default=200_000)
    p.add_argument("--max-inflight", type=int, default=2000)
    p.add_argument("--backoff", type=float, default=2.0, help="retry backoff seconds")
    a = p.parse_args()
    folder = tempfile.mkdtemp(prefix="af-failing-")
    tmp = os.path.join(folder, ".in.tmp")
    with open(tmp, "w") as f:
        for i in range(a.lines):
            f.write(json.dumps({"n": i, "pad": "x" * 80}) + "\n")
    os.rename(tmp, os.path.join(folder, "in.jsonl"))
    src = Files(
        folder, policy=ackflow.RetryPolicy(max_deliveries=10**9, backoff_s=a.backoff, max_backoff_s=a.backoff)
    )
    samples: list[dict[str, float]] = []
    started = time.monotonic()
    engine_box: list[Engine] = []

    def progress(report: ackflow.RunReport, window: object) -> None:
        t = time.monotonic() - started
        if not samples or t - samples[-1]["t"] >= 5:
            held = sum(len(f.bodies) for f in src._files.values())
            samples.append(
                {
                    "t": round(t, 1),
                    "rss_mb": round(rss_mb(), 1),
                    "pulled": report.pulled,
                    "nacked": report.nacked,
                    "held": held,
                }
            )
            s = samples[-1]
            print(
                f"{s['t']:>7.1f} s  RSS {s['rss_mb']:>7.1f} MB  pulled {s['pulled']:>9,}  "
                f"nacked {s['nacked']:>9,}  bodies held {s['held']:>6,}",
                flush=True,
            )
        if t >= a.seconds and engine_box:
            engine_box[0].request_stop()

    engine = Engine(
        ackflow.Flow(src).to(FailingSink(raise_if=lambda r: True)),
        batch_size=500,
        max_inflight=a.max_inflight,
        progress=progress,
        handle_signals=False,
    )
    engine_box.append(engine)
    engine.run()
    warm = [s for s in samples if s["t"] >= 60] or samples  # after Spark's start and first jobs
    summary = {
        "seconds": a.seconds,
        "max_inflight": a.max_inflight,
        "pulled": samples[-1]["pulled"],
        "nacked": samples[-1]["nacked"],
        "rss_first_mb": warm[0]["rss_mb"],
        "rss_last_mb": warm[-1]["rss_mb"],
        "rss_growth": round(warm[-1]["rss_mb"] / warm[0]["rss_mb"], 3),
        "max_held": max(s["held"] for s in samples),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
