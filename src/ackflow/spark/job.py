"""Run one batch as one Spark job and bring its receipts back."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from ackflow.core.errors import FlowError, StoreAway
from ackflow.core.settlement import Delivery
from ackflow.spark.plan import Plan


class JobFailed(Exception):
    """The Spark job of a batch failed as a whole (not one row): bisect it."""


@dataclass
class JobResult:
    receipts: pa.Table  # one or more lines per message id
    tokens: dict[str, list[bytes]]  # per sink name, for its commit
    rows_written: dict[str, int]  # physical rows, per sink


def run_job(compiled: Plan, deliveries: Sequence[Delivery], batch_id: str) -> JobResult:
    """Run the batch's job; raise :class:`JobFailed` if Spark failed it as a whole.

    :class:`FlowError` (a step that cannot be compiled) passes through unchanged.
    """
    return _run(compiled, compiled.input_table(deliveries), batch_id)


def run_rows_job(compiled: Plan, rows: pa.Table, batch_id: str) -> JobResult:
    """Like :func:`run_job`, for a flow compiled with ``rows_input=True``: ``rows`` holds
    data columns and ackflow's internal columns (lineage ``__af_ids``)."""
    per = max(1, -(-rows.num_rows // compiled.parallelism))
    return _run(compiled, pa.Table.from_batches(rows.to_batches(max_chunksize=per)), batch_id)


def _run(compiled: Plan, inputs: pa.Table, batch_id: str) -> JobResult:
    begun = []
    try:
        for sink in compiled.sinks:  # a window notes the watermark its tasks will read
            begin = getattr(sink, "begin_job", None)
            if begin is not None:
                try:
                    begin(batch_id)
                except StoreAway as e:  # named after the step whose state is away
                    raise StoreAway(sink.name, e.why) from None
                begun.append(sink)
        table = compiled.job(inputs, batch_id).toArrow()
    except (FlowError, StoreAway):
        # the run stops, or the batch fails as a whole (a store away): the window
        # forgets the job (its rows wait for no one)
        for sink in begun:
            sink.abort(batch_id, [])
        raise
    except Exception as e:  # Py4J, PythonException, SparkRuntimeException: the whole job
        raise JobFailed(summarize(e)) from e
    finally:
        compiled.release(batch_id)
    summary_mask = pc.is_null(table.column("id"))
    summary = table.filter(summary_mask).to_pylist()
    tokens: dict[str, list[bytes]] = {}
    written: dict[str, int] = {}
    for line in summary:
        if line["emitted"] < 0:
            if line["token"]:
                tokens.setdefault(line["sink"], []).append(line["token"])
        else:
            written[line["sink"]] = written.get(line["sink"], 0) + int(line["written"] or 0)
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
