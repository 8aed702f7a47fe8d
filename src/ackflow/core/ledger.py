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

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from ackflow.core.errors import WHOLE_WRITE

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


def _ranked_errors(receipts: pa.Table, order: Sequence[str] | None) -> pa.Array:
    """One text per receipt row, ``rank<SEP>step<SEP>error`` (null without an error), so
    that ``min`` keeps the failure of the earliest step of the plan (``order``: step names
    in plan order; steps not in it, such as sinks, rank after every step)."""
    steps = pc.fill_null(receipts["err_step"], "?")
    n_order = len(order) if order else 0
    if order:
        rank = pc.fill_null(pc.index_in(steps, value_set=pa.array(list(order), pa.string())), n_order)
    else:
        rank = pa.array([0] * receipts.num_rows, pa.int32())
    rank_text = pc.utf8_lpad(pc.cast(rank, pa.string()), 6, "0")
    return pc.if_else(
        pc.is_valid(receipts["err"]),
        pc.binary_join_element_wise(rank_text, steps, receipts["err"], _SEP),
        pa.nulls(receipts.num_rows, pa.string()),
    )


#: a row's error that is not its message's: it waits for another message's row to settle
#: (a dedupe's first); the engine keeps the message in flight and runs it again, no
#: delivery spent
WAITS = "waits: "


@dataclass(frozen=True)
class Failure:
    """Why a message failed: the step that failed and the error, as text.

    ``whole``: the failure hit a write or a job as a whole (a sink's write that raised
    for a partition, a commit, a job whose messages each fail it alone the same way, a
    lost lineage), not something the step attributed to this message's own row: such
    failures are candidates for a *systemic* failure (:mod:`ackflow.core.systemic`)."""

    step: str
    error: str
    whole: bool = field(default=False, compare=False)
    waits: bool = field(default=False, compare=False)  # see WAITS
    #: rows of the message written before it failed, per sink (``(sink, rows)``): a
    #: block that is split writes them again, and the run counts them once
    written: tuple[tuple[str, int], ...] = field(default=(), compare=False)

    def __str__(self) -> str:
        return f"step {self.step!r}: {self.error}"


@dataclass
class Outcomes:
    """What the ledger decided for one batch."""

    acked: list[int] = field(default_factory=list)
    failed: dict[int, Failure] = field(default_factory=dict)
    rows_written: dict[str, int] = field(default_factory=dict)  # physical rows, per sink
    over_reported: list[int] = field(default_factory=list)  # ids a sink over-reported (a bug)


NO_RECEIPT = Failure("ledger", "no receipt came back for this message (lineage lost); not acked", whole=True)


def settle_receipts(
    expected_ids: Sequence[int],
    receipts: pa.Table,
    required_sinks: Sequence[str] | None = None,
    order: Sequence[str] | None = None,
) -> Outcomes:
    """Decide ack or failure for every id in ``expected_ids`` from ``receipts``.

    Every expected id gets exactly one outcome. Receipts for ids that were not
    expected are ignored (they cannot prove anything about this batch). With
    ``required_sinks`` (several branches), a message needs a receipt from each.
    A message failed by several rows keeps the failure of the earliest step in
    ``order`` (the plan's step names), the one that really caused it. A sink that
    reports more rows written than were emitted for a message is a bug: the message
    fails (never acked on over-success).

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

    # One error text per row that sorts by plan position, so that min() keeps the first.
    per_sink_rows = receipts.append_column("error", _ranked_errors(receipts, order))
    per_sink_rows = per_sink_rows.group_by(["id", "sink"]).aggregate(
        [("emitted", "sum"), ("written", "sum"), ("error", "min")]
    )
    short = pc.less(per_sink_rows["written_sum"], per_sink_rows["emitted_sum"])
    over = pc.greater(per_sink_rows["written_sum"], per_sink_rows["emitted_sum"])
    per_sink_rows = per_sink_rows.append_column("short", short).append_column("over", over)
    per_id = per_sink_rows.group_by("id").aggregate(
        [("error_min", "min"), ("short", "any"), ("over", "any"), ("sink", "min"), ("sink", "count_distinct")]
    )

    ok = pc.and_(
        pc.and_(pc.is_null(per_id["error_min_min"]), pc.invert(per_id["short_any"])),
        pc.invert(per_id["over_any"]),
    )
    if required_sinks:
        enough = pc.greater_equal(per_id["sink_count_distinct"], len(set(required_sinks)))
        ok = pc.and_(ok, enough)
    outcomes.acked = pc.filter(per_id["id"], ok).to_pylist()
    bad = per_id.filter(pc.invert(ok))
    for mid, err, sink, short, extra in zip(
        bad["id"].to_pylist(),
        bad["error_min_min"].to_pylist(),
        bad["sink_min"].to_pylist(),
        bad["short_any"].to_pylist(),
        bad["over_any"].to_pylist(),
        strict=True,
    ):
        if extra:
            outcomes.over_reported.append(mid)
            outcomes.failed[mid] = Failure(
                sink or "sink",
                "the sink reported more rows written than were emitted for "
                "this message (a bug in the sink or the plan); not acked",
            )
        elif err is not None:
            _, step, text = err.split(_SEP, 2)
            outcomes.failed[mid] = Failure(
                step, text, whole=text.startswith(WHOLE_WRITE), waits=text.startswith(WAITS)
            )
        elif not short:
            outcomes.failed[mid] = Failure(
                "ledger", "a branch returned no receipt for this message (lineage lost)"
            )
        else:
            outcomes.failed[mid] = Failure(
                sink or "sink", "fewer rows were written than were emitted; not acked"
            )

    if outcomes.failed:  # rows a failed message had written (a split block counts them once)
        done = per_sink_rows.filter(
            pc.and_(
                pc.is_in(per_sink_rows["id"], value_set=pa.array(list(outcomes.failed), pa.int64())),
                pc.greater(per_sink_rows["written_sum"], 0),
            )
        )
        wrote: dict[int, list[tuple[str, int]]] = {}
        for mid, sink, n in zip(
            done["id"].to_pylist(), done["sink"].to_pylist(), done["written_sum"].to_pylist(), strict=True
        ):
            wrote.setdefault(mid, []).append((sink, n))
        for mid, pairs in wrote.items():
            outcomes.failed[mid] = dataclasses.replace(outcomes.failed[mid], written=tuple(pairs))

    seen = per_id["id"]
    missing = pc.filter(expected, pc.invert(pc.is_in(expected, value_set=seen)))
    for mid in missing.to_pylist():
        outcomes.failed[mid] = NO_RECEIPT
    outcomes.acked.sort()
    return outcomes


def compact_receipts(receipts: pa.Table, order: Sequence[str] | None = None) -> pa.Table:
    """Sum per-row receipts into one receipt per ``(id, sink)``, keeping the failure of
    the earliest step in ``order`` (see :func:`settle_receipts`).

    Used inside Spark tasks, so that a partition returns one small row per message
    rather than one per derived row.
    """
    receipts = receipts.select(RECEIPT_SCHEMA.names).cast(RECEIPT_SCHEMA)
    ids = receipts["id"]
    if ids.null_count == 0 and pc.count_distinct(ids).as_py() == receipts.num_rows:
        # one row per message already (a map's rows): each group is that row, and the
        # sums and the min are its own values (a fifth of the grouping's cost)
        failed = pc.is_valid(receipts["err"])
        return receipts.set_column(
            4,
            "err_step",
            pc.if_else(
                failed, pc.fill_null(receipts["err_step"], "?"), pa.nulls(receipts.num_rows, pa.string())
            ),
        )
    return _compact_grouped(receipts, order)


def _compact_grouped(receipts: pa.Table, order: Sequence[str] | None) -> pa.Table:
    grouped = (
        receipts.append_column("error", _ranked_errors(receipts, order))
        .group_by(["id", "sink"], use_threads=False)
        .aggregate([("emitted", "sum"), ("written", "sum"), ("error", "min")])
    )
    parts = pc.split_pattern(pc.fill_null(grouped["error_min"], _SEP + _SEP), _SEP, max_splits=2)
    valid = pc.is_valid(grouped["error_min"])
    none = pa.nulls(grouped.num_rows, pa.string())
    return pa.table(
        {
            "id": grouped["id"],
            "sink": grouped["sink"],
            "emitted": grouped["emitted_sum"],
            "written": grouped["written_sum"],
            "err_step": pc.if_else(valid, pc.list_element(parts, 1), none),
            "err": pc.if_else(valid, pc.list_element(parts, 2), none),
        },
        schema=RECEIPT_SCHEMA,
    )
