"""The picture of a benchmark run for the docs: messages per second of each ackflow phase
beside the limit or peer it is measured against, as a plain SVG (no plotting library).

    python -m benchmarks.chart benchmarks/measured/run5-full.json docs/img/benchmark-latest.svg
"""

from __future__ import annotations

import argparse
import json
from html import escape
from pathlib import Path

# (group, [(phase, label)]): the reference phases first, ackflow's last
GROUPS = [
    (
        "embedded queue → Parquet",
        [
            ("limit", "lease + ack, no processing"),
            ("peer", "hand-written Spark loop, no settlement"),
            ("ackflow", "ackflow"),
        ],
    ),
    ("→ PostgreSQL", [("pg_limit", "driver parses, COPY + upsert, acks"), ("ackflow_pg", "ackflow")]),
    (
        "RabbitMQ classic queue → Parquet",
        [("rmq_limit", "raw pika consume + ack"), ("ackflow_rmq", "ackflow")],
    ),
    (
        "RabbitMQ quorum queue → Parquet",
        [("rmq_limit_quorum", "raw pika consume + ack"), ("ackflow_rmq_quorum", "ackflow")],
    ),
    ("files → Parquet", [("ss_files", "Structured Streaming"), ("ackflow_files", "ackflow")]),
    (
        "embedded queue → lakehouse",
        [("ackflow_delta", "ackflow → Delta Lake"), ("ackflow_iceberg", "ackflow → Iceberg")],
    ),
]
WIDTH, LABEL_W, BAR_H, GAP, TOP = 860, 300, 16, 4, 44


def num(n: float) -> str:
    """12 345 (a thin space between thousands, as the docs write numbers)."""
    return f"{n:,.0f}".replace(",", " ")


def svg(run: dict, title: str) -> str:
    rates = {p: run[p]["rate"] for _, phases in GROUPS for p, _ in phases if p in run}
    top = max(rates.values())
    scale = (WIDTH - LABEL_W - 90) / top
    out, y = [], TOP
    for group, phases in GROUPS:
        out.append(f'<text x="8" y="{y + 12}" class="g">{escape(group)}</text>')
        y += BAR_H + GAP
        for phase, label in phases:
            if phase not in rates:
                continue
            rate = rates[phase]
            cls = "a" if phase.startswith("ackflow") else "r"
            w = max(1.0, rate * scale)
            out.append(f'<text x="{LABEL_W - 8}" y="{y + 12}" class="l">{escape(label)}</text>')
            out.append(f'<rect x="{LABEL_W}" y="{y}" width="{w:.1f}" height="{BAR_H}" class="{cls}"/>')
            out.append(f'<text x="{LABEL_W + w + 6:.1f}" y="{y + 12}" class="v">{num(rate)}/s</text>')
            y += BAR_H + GAP
        y += GAP * 3
    height = y + 10
    return "\n".join(
        [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
            f'viewBox="0 0 {WIDTH} {height}" role="img" aria-label="{escape(title)}">',
            "<style>text{font:12px sans-serif;fill:#333}.g{font-weight:bold}.l{text-anchor:end}"
            ".v{fill:#555}.a{fill:#3f51b5}.r{fill:#b0b7c9}</style>",
            f'<rect width="{WIDTH}" height="{height}" fill="#fff"/>',
            f'<text x="8" y="22" class="g">{escape(title)}</text>',
            *out,
            "</svg>",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.chart", description=__doc__)
    p.add_argument("run", help="a run's JSON (benchmarks/measured/*.json)")
    p.add_argument("out", help="the SVG to write")
    args = p.parse_args(argv)
    run = json.loads(Path(args.run).read_text())
    machine = run.get("machine", {})
    title = (
        f"messages per second, {num(run['settings']['messages'])} messages, "
        f"{machine.get('cpus', '?')} cores ({Path(args.run).name})"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(svg(run, title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
