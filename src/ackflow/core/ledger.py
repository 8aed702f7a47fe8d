"""The ledger: receipts in, outcomes out (law 1: nack by default).

A Spark job returns *receipts*: for each source message (its lineage id) and each
sink, how many rows were meant for the sink (``emitted``), how many the sink
confirmed (``written``) and the first error met on the way (``err_step``,
``err``). Several partial receipts for one message are summed. The ledger turns
them into outcomes with vectorised Arrow code:

* ack       -- a receipt exists, no error, and ``written == emitted`` for every sink
               (a message whose rows were all filtered out has ``emitted == 0``);
* failure   -- an error was recorded, or fewer rows were written than emitted;
* no proof  -- a message without any receipt fails: its lineage was lost.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

RECEIPT_SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("sink", pa.string()),
        ("emitted", pa.int64()),
        ("written", pa.int64()),
        ("err_step", pa.string()),
        ("err", pa.string()),
    ]
)

_SEP = "\x1f"


@dataclass(frozen=True)
class Failure:
    """Why a message failed: the step that failed and the error, as text."""

    step: str
    error: str

    def __str__(self) -> str:
        return f"step {self.step!r}: {self.error}"


@dataclass
class Outcomes:
    """What the ledger decided for one batch."""

    acked: list[int] = field(default_factory=list)
    failed: dict[int, Failure] = field(default_factory=dict)
    rows_written: dict[str, int] = field(default_factory=dict)  # physical rows, per sink


NO_RECEIPT = Failure("ledger", "no receipt came back for this message (lineage lost); not acked")


def settle_receipts(expected_ids: Sequence[int], receipts: pa.Table,
                    required_sinks: Sequence[str] | None = None) -> Outcomes:
    """Decide ack or failure for every id in ``expected_ids`` from ``receipts``.

    Every expected id gets exactly one outcome. Receipts for ids that were not
    expected are ignored (they cannot prove anything about this batch). With
    ``required_sinks`` (several branches), a message needs a receipt from each.

    >>> r = pa.Table.from_pylist([
    ...     {"id": 1, "sink": "s", "emitted": 2, "written": 2, "err_step": None, "err": None},
    ...     {"id": 2, "sink": "s", "emitted": 1, "written": 0, "err_step": "parse", "err": "boom"},
    ...     {"id": 3, "sink": "s", "emitted": 0, "written": 0, "err_step": None, "err": None},
    ... ], schema=RECEIPT_SCHEMA)
    >>> out = settle_receipts([1, 2, 3, 4], r)
    >>> out.acked, sorted(out.failed), str(out.failed[2])
    ([1, 3], [2, 4], "step 'parse': boom")
    """
    outcomes = Outcomes()
    expected = pa.array(expected_ids, type=pa.int64())
    receipts = receipts.select(RECEIPT_SCHEMA.names).cast(RECEIPT_SCHEMA)
    receipts = receipts.filter(pc.is_in(receipts["id"], value_set=expected))

    # One error text per row: "step<SEP>error", so that min() keeps the pair together.
    has_err = pc.is_valid(receipts["err"])
    joined = pc.if_else(
        has_err,
        pc.binary_join_element_wise(
            pc.fill_null(receipts["err_step"], "?"), receipts["err"], _SEP
        ),
        pa.nulls(receipts.num_rows, pa.string()),
    )
    per_sink_rows = receipts.append_column("error", joined)
    per_sink_rows = per_sink_rows.group_by(["id", "sink"]).aggregate(
        [("emitted", "sum"), ("written", "sum"), ("error", "min")]
    )
    short = pc.less(per_sink_rows["written_sum"], per_sink_rows["emitted_sum"])
    per_sink_rows = per_sink_rows.append_column("short", short)
    per_id = per_sink_rows.group_by("id").aggregate(
        [("error_min", "min"), ("short", "any"), ("sink", "min"), ("sink", "count_distinct")]
    )

    ok = pc.and_(pc.is_null(per_id["error_min_min"]), pc.invert(per_id["short_any"]))
    if required_sinks:
        enough = pc.greater_equal(per_id["sink_count_distinct"], len(set(required_sinks)))
        ok = pc.and_(ok, enough)
    outcomes.acked = pc.filter(per_id["id"], ok).to_pylist()
    bad = per_id.filter(pc.invert(ok))
    for mid, err, sink, short in zip(
        bad["id"].to_pylist(), bad["error_min_min"].to_pylist(), bad["sink_min"].to_pylist(),
        bad["short_any"].to_pylist(), strict=True,
    ):
        if err is not None:
            step, _, text = err.partition(_SEP)
            outcomes.failed[mid] = Failure(step, text)
        elif not short:
            outcomes.failed[mid] = Failure(
                "ledger", "a branch returned no receipt for this message (lineage lost)")
        else:
            outcomes.failed[mid] = Failure(
                sink or "sink", "fewer rows were written than were emitted; not acked"
            )

    seen = per_id["id"]
    missing = pc.filter(expected, pc.invert(pc.is_in(expected, value_set=seen)))
    for mid in missing.to_pylist():
        outcomes.failed[mid] = NO_RECEIPT
    outcomes.acked.sort()
    return outcomes


def compact_receipts(receipts: pa.Table) -> pa.Table:
    """Sum per-row receipts into one receipt per ``(id, sink)``, keeping one error.

    Used inside Spark tasks, so that a partition returns one small row per message
    rather than one per derived row.
    """
    receipts = receipts.select(RECEIPT_SCHEMA.names).cast(RECEIPT_SCHEMA)
    has_err = pc.is_valid(receipts["err"])
    joined = pc.if_else(
        has_err,
        pc.binary_join_element_wise(
            pc.fill_null(receipts["err_step"], "?"), receipts["err"], _SEP
        ),
        pa.nulls(receipts.num_rows, pa.string()),
    )
    grouped = (
        receipts.append_column("error", joined)
        .group_by(["id", "sink"], use_threads=False)
        .aggregate([("emitted", "sum"), ("written", "sum"), ("error", "min")])
    )
    parts = pc.split_pattern(grouped["error_min"], _SEP, max_splits=1)
    err_step = pc.list_element(parts, 0)
    err = pc.if_else(
        pc.is_valid(grouped["error_min"]),
        pc.list_element(pc.fill_null(parts, pa.scalar(["", ""], pa.list_(pa.string()))), 1),
        pa.nulls(grouped.num_rows, pa.string()),
    )
    return pa.table(
        {
            "id": grouped["id"],
            "sink": grouped["sink"],
            "emitted": grouped["emitted_sum"],
            "written": grouped["written_sum"],
            "err_step": err_step,
            "err": err,
        },
        schema=RECEIPT_SCHEMA,
    )
