"""The sink's side of a task: write a partition's live rows, return receipts.

Runs inside Spark tasks (``mapInArrow``), pickled there with the sink. A failed write
fails its rows, never acks them; the receipts carry each row's outcome to the ledger.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ackflow.core.errors import whole_write
from ackflow.core.ledger import RECEIPT_SCHEMA, compact_receipts
from ackflow.sinks.base import Sink, key_columns
from ackflow.spark.columns import (
    ERR,
    ID,
    KEY,
    LIVE,
    STATUS,
    STEP,
    TASK_RECEIPTS,
    local_partition,
)
from ackflow.spark.infer import held_columns
from ackflow.spark.rows import Tally, counting


def make_writer(
    sink: Sink,
    batch_id: str,
    data_cols: list[str],
    lineage: str = ID,
    order: Sequence[str] | None = None,
    tally: Tally | None = None,
    refused: dict[str, str] | None = None,
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """A ``mapInArrow`` function that writes a partition's live rows and returns receipts.

    A grouped row (lineage ``__af_ids``) gives one receipt line to each member id. With
    a ``tally``, it adds the sink's rows in (live), written by the task, and failed.
    ``refused``: columns (from the data) the sink's table cannot take, name -> why; they
    are not written, and a row with a value in one of them fails with the reason.
    """
    refused = {c: why for c, why in (refused or {}).items() if c in data_cols}
    data_cols = [c for c in data_cols if c not in refused]

    def write(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        chunks = list(batches)
        if not chunks:
            return
        table = pa.Table.from_batches(chunks)
        ctx = TaskContext.get()
        partition = ctx.partitionId() if ctx is not None else local_partition()
        status = table.column(STATUS)
        live_mask = pc.equal(status, LIVE)
        misfit: dict[int, str] | None = None  # live rows holding a value in a refused column, and why
        for c, why in refused.items():
            hit = pc.and_(live_mask, pc.is_valid(table.column(c)))
            if pc.any(hit).as_py():
                rows = np.flatnonzero(hit.to_numpy(zero_copy_only=False))
                misfit = misfit or {}
                for r in rows:
                    misfit.setdefault(int(r), f"column {c!r}: {why}")
                live_mask = pc.and_(live_mask, pc.invert(hit))
        live_idx = np.flatnonzero(live_mask.to_numpy(zero_copy_only=False))
        held = held_columns(table.schema, data_cols, key_columns(sink))
        keep = [*held, lineage] if getattr(sink, "wants_lineage", False) else held
        live = table.filter(live_mask).select(keep)
        if getattr(sink, "wants_keys", False):  # repeats numbered among all the rows, so
            # that a repeat failed in this attempt does not renumber the others (a retry
            # would then write a row under a key another row of it was written under);
            # join repeats are numbered at the join already
            keys = unique_keys(table.column(KEY)).take(pa.array(live_idx, pa.int64()))
            live = live.append_column(KEY, keys)
        n = table.num_rows
        written = np.zeros(n, dtype=np.int64)
        emitted = np.zeros(n, dtype=np.int64)
        emitted[live_idx] = 1
        err_step = table.column(STEP)
        err = table.column(ERR)
        if misfit:
            steps_l, errs_l = err_step.to_pylist(), err.to_pylist()
            for j, why in misfit.items():
                steps_l[j], errs_l[j] = sink.name, why
            err_step, err = pa.array(steps_l, pa.string()), pa.array(errs_l, pa.string())
        token = None
        counts = None
        try:
            result = sink.write_partition(batch_id, partition, live)
            written[live_idx] = 1
            token = result.token
            counts = result.counts
            if result.failed:
                steps_l, errs_l = err_step.to_pylist(), err.to_pylist()
                for i, e in result.failed.items():
                    j = int(live_idx[i])
                    written[j] = 0
                    steps_l[j], errs_l[j] = e if isinstance(e, tuple) else (sink.name, e)
                err_step, err = pa.array(steps_l, pa.string()), pa.array(errs_l, pa.string())
        except Exception as e:  # noqa: BLE001 - a failed write fails its rows, never acks them
            steps_l, errs_l = err_step.to_pylist(), err.to_pylist()
            text = whole_write(e)
            for k in live_idx:
                steps_l[k], errs_l[k] = sink.name, text
            err_step, err = pa.array(steps_l, pa.string()), pa.array(errs_l, pa.string())
        per_row = pa.table(
            {
                "id": pa.nulls(n, pa.int64()) if lineage != ID else table.column(ID),
                "sink": pa.array([sink.name] * n, pa.string()),
                "emitted": emitted,
                "written": written,
                "err_step": err_step,
                "err": err,
            },
            schema=RECEIPT_SCHEMA,
        )
        if lineage != ID:  # one line per member of each grouped row
            members = table.column(lineage).combine_chunks()
            per_row = per_row.take(pc.list_parent_indices(members)).set_column(
                0, "id", pc.list_flatten(members)
            )
        if tally is not None and (len(live_idx) or misfit) and counting():
            done = int(written[live_idx].sum())
            came = len(live_idx) + len(misfit or ())
            tally.add({sink.name: (came, done, came - done)})
        receipts = compact_receipts(per_row, order)
        receipts = receipts.append_column("token", pa.nulls(receipts.num_rows, pa.binary()))
        yield from receipts.to_batches()
        # the partition's summary: physical rows written (per branch if the sink has
        # several), then the sink's token on a line of its own (emitted = -1)
        if counts is None:
            counts = {sink.name: int(written[live_idx].sum()) if len(live_idx) else 0}
        lines: list[dict[str, Any]] = [
            {
                "id": None,
                "sink": name,
                "emitted": 0,
                "written": n,
                "err_step": None,
                "err": None,
                "token": None,
            }
            for name, n in counts.items()
        ]
        if token is not None:
            lines.append(
                {
                    "id": None,
                    "sink": sink.name,
                    "emitted": -1,
                    "written": 0,
                    "err_step": None,
                    "err": None,
                    "token": token,
                }
            )
        if lines:
            yield pa.RecordBatch.from_pylist(lines, schema=TASK_RECEIPTS)

    return write


def unique_keys(keys: pa.ChunkedArray | pa.Array) -> pa.Array:
    """Keys made unique within a partition: the n-th repeat of a key gets ``~n`` (the
    next ``n`` that names no other row).

    A join numbers its own repeats (see ``CompiledFlow._join``), a transform its own
    across the batch (``CompiledFlow._number_repeats``); this is the writer's last guard
    within its partition (a key repeated by a sink-side step). It numbers among all of the
    partition's rows, failed ones too, so a repeat that failed in one attempt does not
    renumber the others in the next.

    >>> unique_keys(pa.array(["k", "k", "k~1", "k"])).to_pylist()
    ['k', 'k~2', 'k~1', 'k~3']
    """
    plain = pa.types.is_string(keys.type) or pa.types.is_large_string(keys.type)
    if plain and keys.null_count == 0 and pc.count_distinct(keys).as_py() == len(keys):
        # no repeat (the common case): the keys as they are, no Python string per row
        whole = keys.combine_chunks() if isinstance(keys, pa.ChunkedArray) else keys
        return whole.cast(pa.string())
    return pa.array(numbered(keys.to_pylist()), pa.string())


def numbered(given: list[str | None]) -> list[str | None]:
    """:func:`unique_keys` of a list, one key at a time."""
    taken: set[str | None] = set(given)
    seen: dict[str | None, int] = {}
    out: list[str | None] = []
    for k in given:
        n = seen.get(k, 0)
        if n == 0:
            seen[k] = 1
            out.append(k)
            continue
        while f"{k}~{n}" in taken:
            n += 1
        seen[k] = n + 1
        taken.add(f"{k}~{n}")
        out.append(f"{k}~{n}")
    return out
