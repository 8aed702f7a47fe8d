"""Task-side code: Python steps over Arrow batches, and the columns rows must fit.

Everything here runs inside Spark tasks (``mapInArrow``) and is pickled there with
the flow's functions. Each row carries internal columns (:mod:`ackflow.spark.columns`):
its message's lineage id (``__af_id``) and its status (live, filtered, or failed with
the step and the error). A failing row never fails the batch: it becomes a failed row,
and the receipts carry the failure to the ledger. Bodies are decoded in
:mod:`ackflow.spark.decode`, columns inferred in :mod:`ackflow.spark.infer`, and sinks
written in :mod:`ackflow.spark.writer`.
"""

from __future__ import annotations

import itertools
import json
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import pyarrow as pa

from ackflow.core.errors import describe
from ackflow.core.schema import (
    EVOLVE,
    FREEZE,
    RESCUE,
    RESCUED,
    blank_empties,
    checked_columns,
    empty,
    merge_schemas,
    miss_error,
    null_map_entry,
    outside,
    plain_types,
    split_rescued,
    to_text,
)
from ackflow.flow import Filter, FlatMap, Map, Step
from ackflow.spark.columns import (  # noqa: F401 - also re-exported: task code names them here
    BODY,
    ERR,
    FAILED,
    FILTERED,
    HDR,
    ID,
    IDS,
    KEY,
    LIVE,
    LOCAL_TASK,
    RESERVED,
    SRC,
    STATUS,
    STEP,
    TASK_RECEIPTS,
    child_key,
    fold,
    internal_schema,
    local_partition,
    reserved,
    row_key,
    rows_table,
    unaddressable,
)
from ackflow.spark.decode import decode, decode_batch  # noqa: F401 - decode re-exported
from ackflow.spark.infer import held_columns, infer_schema  # noqa: F401 - held_columns re-exported

# -- rows in, out and failed per step (for the status page) -------------------------------

#: step or sink name -> (rows in, rows out, rows failed), summed over tasks
Counts = dict[str, tuple[int, int, int]]


class Tally(Protocol):
    """Where tasks add their row counts: a Spark accumulator (:class:`CountsParam`), or a
    :class:`LocalTally` in the in-process executor. Tasks add once per Arrow batch."""

    def add(self, term: Counts) -> None: ...

    @property
    def value(self) -> Counts: ...


#: a Spark local property: "1" while a job runs that must not count rows (the sampler
#: that infers columns, the prefixes run to locate a poison message)
NO_COUNT = "ackflow.nocount"


def counting() -> bool:
    """Whether this task's rows count (see :data:`NO_COUNT`)."""
    if getattr(LOCAL_TASK, "nocount", False):
        return False
    from pyspark import TaskContext

    ctx = TaskContext.get()
    return ctx is None or ctx.getLocalProperty(NO_COUNT) != "1"


def add_counts(a: Counts, b: Counts) -> Counts:
    """``a`` plus ``b``, as a new dict (``a`` is never changed: a reader may hold it).

    >>> add_counts({"parse": (3, 2, 1)}, {"parse": (1, 1, 0), "sink": (2, 2, 0)})
    {'parse': (4, 3, 1), 'sink': (2, 2, 0)}
    """
    out = dict(a)
    for name, (i, o, f) in b.items():
        x = out.get(name, (0, 0, 0))
        out[name] = (x[0] + i, x[1] + o, x[2] + f)
    return out


class CountsParam:
    """The ``AccumulatorParam`` of row counts: merging makes a new dict, so the driver's
    readers (the status page) never see one change under them."""

    def zero(self, value: Counts) -> Counts:
        return {}

    def addInPlace(self, a: Counts, b: Counts) -> Counts:
        return add_counts(a, b)


_LOCAL_TALLIES: weakref.WeakValueDictionary[int, LocalTally] = weakref.WeakValueDictionary()
_LOCAL_IDS = itertools.count(1)


def _local_tally(token: int) -> LocalTally:
    return _LOCAL_TALLIES[token]


class LocalTally:
    """Row counts of the in-process executor. Its tasks run on unpickled copies of the
    task functions; a copy of this object is this object (it pickles as a reference
    into this process), so what the tasks add is seen here."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value: Counts = {}
        self._token = next(_LOCAL_IDS)
        _LOCAL_TALLIES[self._token] = self

    def add(self, term: Counts) -> None:
        with self._lock:
            self._value = add_counts(self._value, term)

    @property
    def value(self) -> Counts:
        return self._value

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return _local_tally, (self._token,)


Out = tuple[int, "dict[str, Any] | None", "str | None", "str | None", str]


def run_steps(
    row: dict[str, Any], steps: Sequence[Step], key: str = "", tally: dict[str, list[int]] | None = None
) -> list[Out]:
    """Run ``row`` through the Python steps; return the rows out and the failures.

    Each row out carries its key: ``key`` itself through map and filter, and
    ``key#i`` for the i-th row a flat_map yields, so that a redelivered message gives
    its rows the same keys again (the position among the message's rows, not the
    order of arrival, names a row). ``tally`` (if given) gets each step's rows in, out
    and failed added.
    """
    items = [(row, key)]
    outs: list[Out] = []
    for step in steps:
        nxt: list[tuple[dict[str, Any], str]] = []
        failed = len(outs)
        for r, k in items:
            try:
                if isinstance(step, Map):
                    out = step.fn(r)
                    if not isinstance(out, dict):
                        raise TypeError(
                            f"map must return a dict, got {type(out).__name__} (use filter to drop)"
                        )
                    nxt.append((out, k))
                elif isinstance(step, Filter):
                    if step.fn(r):
                        nxt.append((r, k))
                elif isinstance(step, FlatMap):
                    children = []
                    for j, child in enumerate(step.fn(r)):
                        if not isinstance(child, dict):
                            raise TypeError(f"flat_map must yield dicts, got {type(child).__name__}")
                        children.append((child, child_key(k, j)))
                    nxt.extend(children)
            except Exception as e:  # noqa: BLE001 - any user error fails only this row
                outs.append((FAILED, None, step.name, describe(e), k))
        if tally is not None:
            t = tally.setdefault(step.name, [0, 0, 0])
            t[0] += len(items)
            t[1] += len(nxt)
            t[2] += len(outs) - failed
        items = nxt
    outs.extend((LIVE, r, None, None, k) for r, k in items)
    if not outs:
        outs.append((FILTERED, None, None, None, key))
    return outs


def segment_rows(
    ids: Sequence[int],
    keys: Sequence[str],
    status: Sequence[int],
    steps_: Sequence[str | None],
    errs: Sequence[str | None],
    rows: Sequence[dict[str, Any] | None],
    steps: Sequence[Step],
    tally: dict[str, list[int]] | None = None,
) -> tuple[list[int], list[str], list[int], list[str | None], list[str | None], list[dict[str, Any]]]:
    o_id: list[int] = []
    o_key: list[str] = []
    o_status: list[int] = []
    o_step: list[str | None] = []
    o_err: list[str | None] = []
    o_rows: list[dict[str, Any]] = []
    for i, mid in enumerate(ids):
        row = rows[i]
        if status[i] != LIVE or row is None:
            outs: list[Out] = [(status[i], None, steps_[i], errs[i], keys[i])]
        else:
            outs = run_steps(row, steps, keys[i], tally)
        for st, r, sname, err, k in outs:
            o_id.append(mid)
            o_key.append(k)
            o_status.append(st)
            o_step.append(sname)
            o_err.append(err)
            o_rows.append(r if r is not None else {})
    return o_id, o_key, o_status, o_step, o_err, o_rows


#: conform() checks a row with fewer fields than checked columns by the row's own fields
#: (the same answer: a missing field is None, which fits every column; the first column
#: that does not fit, in the columns' order, is the one named). Tests compare both ways.
BY_ROW_FIELDS = True


def conform(
    rows: list[dict[str, Any]],
    data_schema: pa.Schema,
    status: list[int],
    step: list[str | None],
    err: list[str | None],
    step_name: str,
    mode: str | None = None,
    segment: str = "",
) -> pa.Table:
    """Rows → Arrow with ``data_schema``; a row that does not fit fails on its own, and so
    does a row with a field named like ackflow's own columns (``__af_...``).

    ``mode`` (columns inferred from data, see :mod:`ackflow.core.schema`): a row with a
    field outside the columns, at any depth, or a value of another type is never written
    without it: ``freeze`` fails the row; ``evolve`` fails it with a *schema miss*
    (:func:`~ackflow.core.schema.miss_error`, the engine evolves the columns of
    ``segment`` and runs its message again) unless its type cannot widen, which fails
    it naming the field; ``rescue`` writes the rest into the ``_rescued`` JSON column.
    ``mode=None`` (``schema=`` given: the user chose the columns): fields outside them
    are left out."""
    names = set(data_schema.names)
    checked = [(name, t, plain_types(t)) for name, t in checked_columns(data_schema)]
    check_at = {c[0]: j for j, c in enumerate(checked)}
    # (two columns of one name: the loop over columns; tests turn BY_ROW_FIELDS off to compare)
    wide = BY_ROW_FIELDS and len(check_at) == len(checked)
    pending: list[int] = []  # rows that need more columns (mode evolve), typed together
    unfit: dict[str, bool] = {}  # new field name -> it cannot become a column (rows share them)
    folded = {fold(c) for c in data_schema.names}

    def cannot_be_column(name: str) -> bool:
        if name not in unfit:
            unfit[name] = unaddressable(name) is not None or fold(name) in folded
        return unfit[name]

    for i, r in enumerate(rows):
        if status[i] != LIVE:
            continue
        extra = [] if names.issuperset(r) else [k for k in r if k not in names]
        shady = next((str(k) for k in extra if reserved(str(k))), None)
        if shady is not None:
            _fail(
                rows,
                status,
                step,
                err,
                i,
                step_name,
                f"field {shady!r}: names starting with {RESERVED} (in any case) are reserved for ackflow",
            )
            continue
        # an empty value outside the columns has nothing to lose and no column to make yet
        bad = None if mode is None else next((str(k) for k in extra if not empty(r[k])), None)
        if mode == RESCUE and bad is None and not empty(r.get(RESCUED)):
            bad = RESCUED  # a data field of that name is kept inside ackflow's column
        if bad is not None:  # a name Spark cannot hold fails the row, never makes a column
            odd = next((str(k) for k in extra if not empty(r[k]) and cannot_be_column(str(k))), None)
            if odd is not None:
                _fail(
                    rows,
                    status,
                    step,
                    err,
                    i,
                    step_name,
                    f"field {odd!r}: {_outside(odd, data_schema.names)}",
                )
                continue
        why = None  # bad is a new field; else why its value does not fit
        if bad is None:
            columns = checked
            if wide and type(r) is dict and len(r) < len(checked):
                # only the columns the row has, in the same order: a missing field is None,
                # which fits every column
                columns = [checked[j] for j in sorted(check_at.get(k, -1) for k in r) if j >= 0]
            for name, t, plain in columns:
                value = r.get(name)
                if type(value) in plain:  # outside() would pass it
                    continue
                found = outside(value, t, name)
                if found is not None and (mode is not None or found[1] is not None):
                    bad, why = found
                    break
        if bad is None:
            continue
        if why is not None and mode in (None, FREEZE):
            _fail(rows, status, step, err, i, step_name, f"field {bad!r}: {why}")
            continue
        if mode == EVOLVE:
            pending.append(i)
            continue
        _misfit(rows, status, step, err, i, step_name, mode or FREEZE, segment, data_schema, bad)
    _evolve_rows(pending, rows, status, step, err, step_name, segment, data_schema)
    try:
        return rows_table(rows, data_schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError):
        pass
    pending = []
    for i, r in enumerate(rows):
        if status[i] != LIVE:
            rows[i] = {}
            continue
        try:
            pa.Table.from_pylist([r], schema=data_schema)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError) as e:
            blank = blank_empties(r, data_schema)
            if blank is not None:  # an empty list or object where the column holds another
                try:  # kind: it holds nothing, and is written as null
                    pa.Table.from_pylist([blank], schema=data_schema)
                    rows[i] = blank
                    continue
                except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError):
                    pass
            if mode == EVOLVE:
                pending.append(i)
                continue
            if mode == RESCUE:
                _misfit(rows, status, step, err, i, step_name, mode, segment, data_schema, None, e)
                continue
            rows[i] = {}
            status[i], step[i] = FAILED, step_name
            err[i] = f"row does not fit the columns {data_schema.names} of the step: {describe(e)}"
    if pending:
        _evolve_rows(pending, rows, status, step, err, step_name, segment, data_schema)
        for i in pending:
            rows[i] = {}
    return rows_table(rows, data_schema)


def _evolve_rows(
    pending: list[int],
    rows: list[dict[str, Any]],
    status: list[int],
    step: list[str | None],
    err: list[str | None],
    step_name: str,
    segment: str,
    data_schema: pa.Schema,
) -> None:
    """Rows that need more columns (mode ``evolve``): typed together, they become schema
    misses that share one error text naming only what must change (new fields, wider
    types), so a batch where a new field arrives costs one inference, not one per row.
    If they disagree among themselves (a conflict), each row is judged alone."""
    if not pending:
        return
    try:
        wanted = infer_schema([rows[i] for i in pending], step_name)
        merged, changes, conflicts = merge_schemas(data_schema, wanted)
    except Exception:  # noqa: BLE001 - outside data: judged row by row below
        changes, conflicts = [], ["untyped"]
    if changes and not conflicts:
        delta = pa.schema(
            [
                f
                for f in merged
                if f.name not in data_schema.names or not f.type.equals(data_schema.field(f.name).type)
            ]
        )
        text = miss_error(segment, delta)
        for i in pending:
            _fail(rows, status, step, err, i, step_name, text)
        return
    for i in pending:
        _misfit(rows, status, step, err, i, step_name, EVOLVE, segment, data_schema, None)


def _fail(
    rows: list[dict[str, Any]],
    status: list[int],
    step: list[str | None],
    err: list[str | None],
    i: int,
    step_name: str,
    why: str,
) -> None:
    rows[i] = {}
    status[i], step[i], err[i] = FAILED, step_name, why


def _misfit(
    rows: list[dict[str, Any]],
    status: list[int],
    step: list[str | None],
    err: list[str | None],
    i: int,
    step_name: str,
    mode: str,
    segment: str,
    data_schema: pa.Schema,
    bad: str | None,
    error: Exception | None = None,
) -> None:
    """Row ``i`` does not fit the columns (``bad``: the first field outside them, at any
    depth; ``error``: Arrow refused a value): handle it by the segment's mode."""
    r = rows[i]
    names = data_schema.names
    if mode == FREEZE:
        _fail(
            rows,
            status,
            step,
            err,
            i,
            step_name,
            f"field {bad!r}: not among the columns {_shown(names)} of the stored schema, "
            "and the step's schema mode is 'freeze' (new fields are refused)",
        )
        return
    if mode == RESCUE:
        try:
            rows[i] = _rescue(r, data_schema)
        except (TypeError, ValueError) as e:
            _fail(
                rows,
                status,
                step,
                err,
                i,
                step_name,
                f"field {RESCUED!r}: the fields that do not fit cannot be kept as JSON: {describe(e)}",
            )
        return
    try:
        row_schema = infer_schema([r], step_name)
    except Exception as e:  # noqa: BLE001 - outside data: its own row's failure
        _fail(rows, status, step, err, i, step_name, f"row cannot be typed: {describe(e)}")
        return
    _, changes, conflicts = merge_schemas(data_schema, row_schema)
    if conflicts:
        _fail(rows, status, step, err, i, step_name, conflicts[0])
    elif changes:
        _fail(rows, status, step, err, i, step_name, miss_error(segment, row_schema))
    else:
        why = _unfit(r, data_schema) or (
            describe(error) if error is not None else f"field {bad!r} does not fit"
        )
        _fail(
            rows,
            status,
            step,
            err,
            i,
            step_name,
            f"row does not fit the columns {_shown(names)} of the step: {why}",
        )


def _unfit(row: dict[str, Any], data_schema: pa.Schema) -> str | None:
    """The first field of ``row`` whose value Arrow cannot hold (in its column's type,
    or at all for a new field), and why."""
    for k, v in row.items():
        i = data_schema.get_field_index(k) if isinstance(k, str) else -1
        at = null_map_entry(v, data_schema.field(i).type, str(k)) if i >= 0 else None
        if at is not None:  # Arrow would abort the process on it, not raise
            return f"field {at!r}: a list with a null entry cannot be a map"
        try:
            pa.array([v], data_schema.field(i).type) if i >= 0 else pa.array([v])
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError) as e:
            return f"field {k!r}: {describe(e)}"
    return None


def _shown(columns: list[str]) -> list[str]:
    return columns if len(columns) <= 20 else [*columns[:20], "..."]


def _rescue(row: dict[str, Any], data_schema: pa.Schema) -> dict[str, Any]:
    """``row`` with what does not fit its column moved into ``_rescued`` (JSON)."""
    # the row is a struct of the columns (ackflow's own _rescued aside: a data field of
    # that name is rescued like any other that does not fit)
    columns = pa.struct([f for f in data_schema if f.name != RESCUED])
    kept, rest = split_rescued({k: v for k, v in row.items() if k != RESCUED}, columns)
    rest = dict(rest or {})
    if not empty(row.get(RESCUED)):
        rest[RESCUED] = row[RESCUED]
    kept[RESCUED] = json.dumps(rest, default=_json_default, allow_nan=False, sort_keys=True) if rest else None
    return kept


def _json_default(v: Any) -> Any:
    import base64
    import datetime as dt
    import decimal

    if isinstance(v, bytes | bytearray):
        return base64.b64encode(bytes(v)).decode()
    if isinstance(v, dt.datetime | dt.date | dt.time):
        return v.isoformat()
    if isinstance(v, decimal.Decimal):
        return str(v)
    if isinstance(v, set | frozenset):
        return sorted(v, key=repr)
    raise TypeError(f"a {type(v).__name__} value has no JSON form")


def _outside(name: str, columns: list[str]) -> str:
    """Why a field outside the inferred columns fails its row."""
    why = unaddressable(name)
    if why is not None:
        return f"{why}; rename the field in a map step"
    same = [c for c in columns if fold(c) == fold(name)]
    if same:
        return (
            f"differs from the column {same[0]!r} only in case, and Spark does not tell "
            "column names apart by case"
        )
    return (
        f"not among the columns {_shown(columns)} of the step; give the step "
        "schema= to choose its columns (fields outside a given schema are left out)"
    )


def make_segment(
    steps: Sequence[Step],
    formats: Sequence[str],
    data_in: list[str] | None,
    data_schema: pa.Schema,
    out_schema: pa.Schema,
    lineage: str = ID,
    tally: Tally | None = None,
    *,
    mode: str | None = None,
    segment: str = "",
    fast_json: bool = True,
    counted_in: bool = False,
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """A ``mapInArrow`` function running ``steps`` (decoding first if ``data_in`` is None);
    with a ``tally``, it adds each step's rows in, out and failed once per batch
    (``counted_in``: the driver counted every message into decoding and out of it, as
    when the JVM decodes most of them; this function then adds only its failures).
    ``mode``: the columns were inferred; how a row that does not fit them is handled
    (see :func:`conform`); ``segment`` names the columns' history in the schema store."""
    last = steps[-1].name if steps else "decode"
    id_type = out_schema.field(lineage).type

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        count = tally is not None and counting()
        for b in batches:
            ids = b.column(lineage).to_pylist()
            keys = b.column(KEY).to_pylist()
            n = len(ids)
            rows: list[dict[str, Any] | None]
            if data_in is None:
                rows, status, sname, errs = decode_batch(b, formats, fast_json)
            else:
                status = b.column(STATUS).to_pylist()
                sname = b.column(STEP).to_pylist()
                errs = b.column(ERR).to_pylist()
                rows = b.select(data_in).to_pylist() if data_in else [{} for _ in range(n)]
            counts: dict[str, list[int]] | None = None
            if count:
                counts = {}
                if data_in is None:
                    bad = status.count(FAILED)
                    counts["decode"] = [0, -bad, bad] if counted_in else [n, n - bad, bad]
            o_id, o_key, o_st, o_step, o_err, o_rows = segment_rows(
                ids, keys, status, sname, errs, rows, steps, counts
            )
            if counts is not None and last in counts:
                before = o_st.count(FAILED)
                data = conform(o_rows, data_schema, o_st, o_step, o_err, last, mode, segment)
                misfit = o_st.count(FAILED) - before  # rows that do not fit the columns
                if misfit:
                    c = counts[last]
                    c[1] -= misfit
                    c[2] += misfit
            else:
                data = conform(o_rows, data_schema, o_st, o_step, o_err, last, mode, segment)
            if tally is not None and counts:
                tally.add({k: (v[0], v[1], v[2]) for k, v in counts.items()})
            internal = [
                pa.array(o_id, id_type),
                pa.array(o_key, pa.string()),
                pa.array(o_st, pa.int32()),
                pa.array(o_step, pa.string()),
                pa.array(o_err, pa.string()),
            ]
            table = pa.Table.from_arrays([*data.columns, *internal], schema=out_schema)
            yield from table.to_batches()

    return run


def make_sampler(
    steps: Sequence[Step],
    formats: Sequence[str],
    data_in: list[str] | None,
    lineage: str = ID,
    stride: int = 1,
    fast_json: bool = True,
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """A ``mapInArrow`` function returning, per partition, the columns inferred from
    every good output row of the steps (a schema as text, see
    :func:`~ackflow.core.schema.to_text`), and how many rows it saw: a field that
    appears in one row of the batch takes part. ``stride`` > 1: only every
    ``stride``-th message is run (a probe, see ``Plan.probe``)."""
    name = steps[-1].name if steps else "decode"

    def sample(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        good: list[dict[str, Any]] = []
        for b in batches:
            if stride > 1:
                b = b.take(pa.array(range(0, b.num_rows, stride), pa.int64()))
            ids = b.column(lineage).to_pylist()
            if data_in is None:
                rows, status, _, _ = decode_batch(b, formats, fast_json)
            else:
                status = b.column(STATUS).to_pylist()
                rows = b.select(data_in).to_pylist() if data_in else [{} for _ in ids]
            n = len(ids)
            _, _, o_st, _, _, o_rows = segment_rows(
                ids, [""] * n, status, [None] * n, [None] * n, rows, steps
            )
            good.extend(r for st, r in zip(o_st, o_rows, strict=True) if st == LIVE)
        schema = infer_schema(good, name)
        yield pa.RecordBatch.from_pylist(
            [{"schema": to_text(schema), "rows": len(good)}], schema=SAMPLE_SCHEMA
        )

    return sample


SAMPLE_SCHEMA = pa.schema([("schema", pa.string()), ("rows", pa.int64())])
