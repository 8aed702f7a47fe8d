"""Run one batch as one Spark job and bring its receipts back."""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from ackflow.core.errors import FlowError
from ackflow.spark.compile import CompiledFlow


class JobFailed(Exception):
    """The Spark job of a batch failed as a whole (not one row): bisect it."""


@dataclass
class JobResult:
    receipts: pa.Table  # one or more lines per message id
    tokens: list[bytes]  # for the sink's commit
    rows_written: dict[str, int]  # physical rows, per sink


def run_job(compiled: CompiledFlow, ids: list[int], bodies: list[bytes], batch_id: str,
            origins: list[int] | None = None) -> JobResult:
    """Run the batch's job; raise :class:`JobFailed` if Spark failed it as a whole.

    :class:`FlowError` (a step that cannot be compiled) passes through unchanged.
    """
    try:
        df = compiled.job(compiled.input_table(ids, bodies, origins), batch_id)
        table = df.toArrow()
    except FlowError:
        raise
    except Exception as e:
        raise JobFailed(summarize(e)) from e
    summary_mask = pc.is_null(table.column("id"))
    summary = table.filter(summary_mask)
    tokens = [t for t in summary.column("token").to_pylist() if t]
    written: dict[str, int] = {}
    for sink, n in zip(summary.column("sink").to_pylist(), summary.column("written").to_pylist(),
                       strict=True):
        written[sink] = written.get(sink, 0) + int(n or 0)
    return JobResult(table.filter(pc.invert(summary_mask)), tokens, written)


def summarize(e: BaseException) -> str:
    """One readable line from a Spark error (they run to hundreds of lines)."""
    text = str(e).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in lines:
        if any(k in ln for k in ("Error", "Exception", "[", "error")):
            head = ln
            break
    else:
        head = lines[0] if lines else type(e).__name__
    return f"{type(e).__name__}: {head[:500]}"
