"""The picture of a benchmark run: messages per second of each phase beside the limit or
peer it is measured against, and the CPU each message cost (the driver, Spark's JVM, Spark's
Python workers, the broker), as a plain SVG (no plotting library). ``benchmarks.run``
draws one beside its JSON; by hand:

    python -m benchmarks.chart benchmarks/measured/run6-full.json docs/img/benchmark-latest.svg
"""

from __future__ import annotations

import argparse
import json
import sys
from html import escape
from pathlib import Path
from typing import Any

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
    (
        "Kafka → Parquet",
        [("kafka_limit", "raw confluent-kafka consume + commit"), ("ackflow_kafka", "ackflow")],
    ),
    ("files → Parquet", [("ss_files", "Structured Streaming"), ("ackflow_files", "ackflow")]),
    (
        "embedded queue → lakehouse",
        [("ackflow_delta", "ackflow → Delta Lake"), ("ackflow_iceberg", "ackflow → Iceberg")],
    ),
    (
        "files → 1-minute windows, 10 000 keys",
        [
            ("ss_windows", "Structured Streaming, watermark"),
            ("ackflow_windows_base", "ackflow, the same flow without the window"),
            ("ackflow_windows", "ackflow, window in its state store"),
        ],
    ),
]
#: the parts of a message's CPU, stacked in this order: (name, legend, colour)
PARTS = [
    ("driver", "driver", "#3f51b5"),
    ("consumer", "consumer process", "#00bcd4"),
    ("jvm", "Spark JVM", "#ff9800"),
    ("python", "Spark Python workers", "#4caf50"),
    ("broker", "broker", "#9e9e9e"),
]
LABEL_W, RATE_W, CPU_W, BAR_H, GAP, TOP = 300, 300, 320, 16, 4, 80
WIDTH = LABEL_W + RATE_W + 40 + CPU_W + 80


def num(n: float) -> str:
    """12 345 (a thin space between thousands, as the docs write numbers)."""
    return f"{n:,.0f}".replace(",", " ")


def workers_cpu(r: dict[str, Any]) -> float | None:
    """CPU per message of Spark's Python workers: the JVM's tree without the JVM."""
    if r.get("spark_cpu_us") is None or r.get("jvm_cpu_us") is None:
        return None
    return float(r["spark_cpu_us"] - r["jvm_cpu_us"])


def cpu_parts(r: dict[str, Any]) -> dict[str, float]:
    """A phase's CPU per message in µs by part (the parts it measured)."""
    out = {
        "driver": r.get("driver_cpu_us"),
        "consumer": r.get("consumer_cpu_us"),
        "jvm": r.get("jvm_cpu_us"),
        "python": workers_cpu(r),
        "broker": r.get("broker_cpu_us"),
    }
    return {k: max(0.0, float(v)) for k, v in out.items() if v is not None}


def svg(run: dict[str, Any], title: str) -> str:
    shown = [(g, [(p, lab) for p, lab in phases if p in run]) for g, phases in GROUPS]
    shown = [(g, phases) for g, phases in shown if phases]
    rates = {p: run[p]["rate"] for _, phases in shown for p, _ in phases}
    cpus = {p: cpu_parts(run[p]) for p in rates}
    rate_scale = (RATE_W - 80) / max(rates.values())
    cpu_scale = (CPU_W - 50) / max(1.0, max(sum(c.values()) for c in cpus.values()))
    x_cpu = LABEL_W + RATE_W + 40
    out = [
        f'<text x="{LABEL_W}" y="{TOP - 30}" class="g">messages per second</text>',
        f'<text x="{x_cpu}" y="{TOP - 30}" class="g">CPU µs per message</text>',
    ]
    lx = x_cpu
    for _, legend, colour in PARTS:  # the legend, above the CPU bars
        out.append(f'<rect x="{lx}" y="{TOP - 19}" width="10" height="10" fill="{colour}"/>')
        out.append(f'<text x="{lx + 13}" y="{TOP - 10}" class="k">{escape(legend)}</text>')
        lx += 22 + 6 * len(legend)
    y = TOP
    for group, phases in shown:
        out.append(f'<text x="8" y="{y + 12}" class="g">{escape(group)}</text>')
        y += BAR_H + GAP
        for phase, label in phases:
            rate = rates[phase]
            cls = "a" if phase.startswith("ackflow") else "r"
            w = max(1.0, rate * rate_scale)
            out.append(f'<text x="{LABEL_W - 8}" y="{y + 12}" class="l">{escape(label)}</text>')
            out.append(f'<rect x="{LABEL_W}" y="{y}" width="{w:.1f}" height="{BAR_H}" class="{cls}"/>')
            out.append(f'<text x="{LABEL_W + w + 6:.1f}" y="{y + 12}" class="v">{num(rate)}/s</text>')
            x = float(x_cpu)
            for name, _, colour in PARTS:
                us = cpus[phase].get(name)
                if not us:
                    continue
                part_w = us * cpu_scale
                out.append(
                    f'<rect x="{x:.1f}" y="{y}" width="{part_w:.1f}" height="{BAR_H}" fill="{colour}" '
                    f'data-part="{name}" data-us="{us:.1f}"><title>{escape(name)} {us:.1f} µs</title></rect>'
                )
                x += part_w
            total = sum(cpus[phase].values())
            if total:
                out.append(f'<text x="{x + 6:.1f}" y="{y + 12}" class="v">{total:.1f}</text>')
            y += BAR_H + GAP
        y += GAP * 3
    height = y + 10
    return "\n".join(
        [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
            f'viewBox="0 0 {WIDTH} {height}" role="img" aria-label="{escape(title)}">',
            "<style>text{font:12px sans-serif;fill:#333}.g{font-weight:bold}.l{text-anchor:end}"
            ".v{fill:#555}.k{font-size:11px}.a{fill:#3f51b5}.r{fill:#b0b7c9}</style>",
            f'<rect width="{WIDTH}" height="{height}" fill="#fff"/>',
            f'<text x="8" y="22" class="g">{escape(title)}</text>',
            *out,
            "</svg>",
            "",
        ]
    )


def title_of(run: dict[str, Any], name: str) -> str:
    machine = run.get("machine", {})
    return f"{num(run['settings']['messages'])} messages, {machine.get('cpus', '?')} cores ({name})"


def draw(run_path: str | Path, out: str | Path) -> bool:
    """The picture of the run at ``run_path``, written to ``out``; False (nothing
    written) when none of its phases is one the picture shows (``--phases latency``)."""
    run = json.loads(Path(run_path).read_text())
    if not any(p in run for _, phases in GROUPS for p, _ in phases):
        return False
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(svg(run, title_of(run, Path(run_path).name)))
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.chart", description=__doc__)
    p.add_argument("run", help="a run's JSON (benchmarks/measured/*.json)")
    p.add_argument("out", help="the SVG to write")
    args = p.parse_args(argv)
    if not draw(args.run, args.out):
        print(f"{args.run} has no phase the picture shows; nothing drawn", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
