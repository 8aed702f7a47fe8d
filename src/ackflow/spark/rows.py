"""Task-side code: Python steps over Arrow batches, and sink writes with receipts.

Everything here runs inside Spark tasks (``mapInArrow``) and is pickled there with
the flow's functions and the sink. Each row carries internal columns: its message's
lineage id (``__af_id``) and its status (live, filtered, or failed with the step and
the error). A failing row never fails the batch: it becomes a failed row, and the
receipts carry the failure to the ledger.
"""

from __future__ import annotations

import itertools
import json
import math
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ackflow.core.errors import describe, where
from ackflow.core.ledger import RECEIPT_SCHEMA, WHOLE_WRITE, compact_receipts
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
    outside,
    prune_nulls,
    split_rescued,
    to_text,
)
from ackflow.flow import Filter, FlatMap, Map, Step
from ackflow.sinks.base import ROW_KEY, Sink

ID, BODY, STATUS, STEP, ERR = "__af_id", "__af_body", "__af_status", "__af_step", "__af_err"
SRC = "__af_src"  # the index of the message's source (merged flows)
RESERVED = "__af_"  # the prefix of ackflow's own columns; user fields may not use it
HDR = "__af_hdr"  # JSON {field: headers} to add to the first row, for sources that ask
IDS = "__af_ids"  # after a group_by: the ids of every member message of the row
KEY = ROW_KEY  # the row's deterministic key: its message's identity + its position
LIVE, FILTERED, FAILED = 0, 1, 2
LOCAL_TASK = threading.local()  # the in-process executor's task: its partition id


def local_partition() -> int:
    """The partition id of a task of the in-process executor (0 outside one)."""
    return int(getattr(LOCAL_TASK, "partition", 0))


def internal_schema(lineage: str = ID) -> pa.Schema:
    """The internal columns: lineage (one id, or a list after grouping), key and status."""
    id_type = pa.int64() if lineage == ID else pa.list_(pa.int64())
    return pa.schema([(lineage, id_type), (KEY, pa.string()), (STATUS, pa.int32()),
                      (STEP, pa.string()), (ERR, pa.string())])


def row_key(identity: str) -> str:
    """The key of a message's first row: its identity, unless the identity ends like a
    suffix ackflow adds (``#n`` for a flat_map child, ``~n`` for a repeat) or like the
    mark itself (``!``): then with a ``!`` after it.

    So no message's key is the key of another message's child or repeat (message
    ``a#1`` and the second child of message ``a`` would otherwise both be ``a#1``, and
    a keyed sink would keep one row of the two): a row key is ``row_key(identity)``,
    then any number of ``#n`` and ``~n``, and read from the right it names one message
    and one position.

    >>> row_key("a"), row_key("a#1"), row_key("#7"), row_key("b~2"), row_key("c!")
    ('a', 'a#1!', '#7!', 'b~2!', 'c!!')
    """
    if identity.endswith("!"):
        return identity + "!"
    # ends in ``#`` or ``~`` and digits? (string methods: a third of a regex's time for
    # keys ending in digits, such as a file's line number)
    stem = identity.rstrip("0123456789")
    return identity + "!" if stem != identity and stem.endswith(("#", "~")) else identity


def child_key(key: str, index: int) -> str:
    """The key of the ``index``-th row a flat_map made of the row keyed ``key``."""
    return f"{key}#{index}"


TASK_RECEIPTS = RECEIPT_SCHEMA.append(pa.field("token", pa.binary()))

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


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (only finite numbers are)")


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"{text} is too large for a number (not finite)")
    return value


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"the key {dup!r} appears twice in one object (no value is dropped "
                         "silently)")
    return obj


def _null_constants(name: str) -> None:
    return None  # NaN, Infinity, -Infinity: what pandas' and Python's json.dumps write


_DECODER = json.JSONDecoder(parse_constant=_no_constants, parse_float=_finite,
                            object_pairs_hook=_no_duplicates)
#: ``format="json_nan_as_null"``: NaN, Infinity and -Infinity (anywhere) read as null; a
#: number too large for a double (1e999) still fails its message: it is a number, and
#: null would drop its size silently
_NAN_NULL_DECODER = json.JSONDecoder(parse_constant=_null_constants, parse_float=_finite,
                                     object_pairs_hook=_no_duplicates)
_DECODERS = {"json": _DECODER, "json_nan_as_null": _NAN_NULL_DECODER}


def decode(body: bytes, fmt: str) -> dict[str, Any]:
    """Turn a message body into the first row a flow sees.

    JSON is read strictly: ``NaN``/``Infinity`` and an object with a key twice fail the
    message (no field is dropped or invented silently), as do invalid UTF-8 and nesting
    too deep for Python (each fails its own message in step ``decode``). The opt-in
    format ``"json_nan_as_null"`` reads ``NaN``, ``Infinity`` and ``-Infinity`` as null
    (at any depth), for producers that write them (pandas, Python's ``json.dumps``); a
    number that overflows a double (``1e999``) fails in both.

    >>> decode(b'{"a": NaN, "b": [1, -Infinity], "c": {"d": Infinity}}', "json_nan_as_null")
    {'a': None, 'b': [1, None], 'c': {'d': None}}
    """
    decoder = _DECODERS.get(fmt)
    if decoder is not None:
        # One decoder for every message: json.loads(body, **hooks) builds a new one per
        # call, which was a quarter of decoding's cost (4.6 against 8.6 us a message).
        # Bytes are read as json.loads reads them (UTF-8, or UTF-16/32 by its detection);
        # a body opening with "{" and no NUL after it is UTF-8 without asking.
        enc = ("utf-8" if body[:1] == b"{" and body[1:2] != b"\x00"
               else json.detect_encoding(body))
        obj = decoder.decode(body.decode(enc, "surrogatepass"))
        if not isinstance(obj, dict):
            raise ValueError(f"expected a JSON object, got a JSON {type(obj).__name__}")
        return obj
    if fmt == "text":
        return {"body": body.decode("utf-8")}
    return {"body": body}


def decode_batch(
    b: pa.RecordBatch, formats: Sequence[str]
) -> tuple[list[dict[str, Any] | None], list[int], list[str | None], list[str | None]]:
    """Decode a batch of message bodies, each by its source's format.

    Returns rows (None where decoding failed) and, per row, status, step and error.
    """
    n = b.num_rows
    rows: list[dict[str, Any] | None] = []
    status, steps, errs = [LIVE] * n, [None] * n, [None] * n
    origins = b.column(SRC).to_pylist()
    extra = b.column(HDR).to_pylist() if HDR in b.schema.names else [None] * n
    for i, body in enumerate(b.column(BODY).to_pylist()):
        fmt = formats[origins[i]]
        try:
            row = decode(body, fmt)
            if extra[i] is not None:
                row.update(json.loads(extra[i]))
            rows.append(row)
        except Exception as e:  # noqa: BLE001 - fails this message only
            rows.append(None)
            status[i], steps[i] = FAILED, "decode"
            errs[i] = f"could not decode the {fmt} payload: {describe(e)}"
    return rows, status, steps, errs


def run_steps(row: dict[str, Any], steps: Sequence[Step], key: str = "",
              tally: dict[str, list[int]] | None = None) -> list[Out]:
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
                            raise TypeError(
                                f"flat_map must yield dicts, got {type(child).__name__}"
                            )
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


def conform(
    rows: list[dict[str, Any]], data_schema: pa.Schema, status: list[int],
    step: list[str | None], err: list[str | None], step_name: str,
    mode: str | None = None, segment: str = "",
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
    checked = checked_columns(data_schema)
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
            _fail(rows, status, step, err, i, step_name, f"field {shady!r}: names starting "
                  f"with {RESERVED} (in any case) are reserved for ackflow")
            continue
        # an empty value outside the columns has nothing to lose and no column to make yet
        bad = None if mode is None else next((str(k) for k in extra if not empty(r[k])), None)
        if mode == RESCUE and bad is None and not empty(r.get(RESCUED)):
            bad = RESCUED  # a data field of that name is kept inside ackflow's column
        if bad is not None:  # a name Spark cannot hold fails the row, never makes a column
            odd = next((str(k) for k in extra if not empty(r[k]) and cannot_be_column(str(k))),
                       None)
            if odd is not None:
                _fail(rows, status, step, err, i, step_name,
                      f"field {odd!r}: {_outside(odd, data_schema.names)}")
                continue
        why = None  # bad is a new field; else why its value does not fit
        if bad is None:
            for name, t in checked:
                found = outside(r.get(name), t, name)
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
        _misfit(rows, status, step, err, i, step_name, mode or FREEZE, segment, data_schema,
                bad)
    _evolve_rows(pending, rows, status, step, err, step_name, segment, data_schema)
    try:
        return pa.Table.from_pylist(rows, schema=data_schema)
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
                except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError,
                        OverflowError):
                    pass
            if mode == EVOLVE:
                pending.append(i)
                continue
            if mode == RESCUE:
                _misfit(rows, status, step, err, i, step_name, mode, segment, data_schema,
                        None, e)
                continue
            rows[i] = {}
            status[i], step[i] = FAILED, step_name
            err[i] = f"row does not fit the columns {data_schema.names} of the step: {describe(e)}"
    if pending:
        _evolve_rows(pending, rows, status, step, err, step_name, segment, data_schema)
        for i in pending:
            rows[i] = {}
    return pa.Table.from_pylist(rows, schema=data_schema)


def _evolve_rows(pending: list[int], rows: list[dict[str, Any]], status: list[int],
                 step: list[str | None], err: list[str | None], step_name: str, segment: str,
                 data_schema: pa.Schema) -> None:
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
        delta = pa.schema([f for f in merged if f.name not in data_schema.names
                           or not f.type.equals(data_schema.field(f.name).type)])
        text = miss_error(segment, delta)
        for i in pending:
            _fail(rows, status, step, err, i, step_name, text)
        return
    for i in pending:
        _misfit(rows, status, step, err, i, step_name, EVOLVE, segment, data_schema, None)



def _fail(rows: list[dict[str, Any]], status: list[int], step: list[str | None],
          err: list[str | None], i: int, step_name: str, why: str) -> None:
    rows[i] = {}
    status[i], step[i], err[i] = FAILED, step_name, why


def _misfit(rows: list[dict[str, Any]], status: list[int], step: list[str | None],
            err: list[str | None], i: int, step_name: str, mode: str, segment: str,
            data_schema: pa.Schema, bad: str | None, error: Exception | None = None) -> None:
    """Row ``i`` does not fit the columns (``bad``: the first field outside them, at any
    depth; ``error``: Arrow refused a value): handle it by the segment's mode."""
    r = rows[i]
    names = data_schema.names
    if mode == FREEZE:
        _fail(rows, status, step, err, i, step_name,
              f"field {bad!r}: not among the columns {_shown(names)} of the stored schema, "
              "and the step's schema mode is 'freeze' (new fields are refused)")
        return
    if mode == RESCUE:
        try:
            rows[i] = _rescue(r, data_schema)
        except (TypeError, ValueError) as e:
            _fail(rows, status, step, err, i, step_name,
                  f"field {RESCUED!r}: the fields that do not fit cannot be kept as JSON: "
                  f"{describe(e)}")
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
        why = _unfit(r, data_schema) or (describe(error) if error is not None else
                                        f"field {bad!r} does not fit")
        _fail(rows, status, step, err, i, step_name,
              f"row does not fit the columns {_shown(names)} of the step: {why}")


def _unfit(row: dict[str, Any], data_schema: pa.Schema) -> str | None:
    """The first field of ``row`` whose value Arrow cannot hold (in its column's type,
    or at all for a new field), and why."""
    for k, v in row.items():
        i = data_schema.get_field_index(k) if isinstance(k, str) else -1
        try:
            pa.array([v], data_schema.field(i).type) if i >= 0 else pa.array([v])
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError,
                OverflowError) as e:
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
    kept[RESCUED] = json.dumps(rest, default=_json_default, allow_nan=False,
                               sort_keys=True) if rest else None
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


def fold(name: str) -> str:
    """A name as Spark's case-insensitive resolution sees it: Java's ``equalsIgnoreCase``
    matches two chars when the lower case of their upper cases agree (so the dotless i and
    ``i``, the long s and ``s``, the final and the plain sigma match). Names with one fold
    are one column to Spark."""
    out = []
    for c in name:
        u = c.upper()
        low = (u if len(u) == 1 else c).lower()
        out.append(low[0] if low else c)
    return "".join(out)


def reserved(name: str) -> bool:
    """Whether a name is (a case variant of) one of ackflow's own column names."""
    return fold(name).startswith(RESERVED)


def unaddressable(name: str) -> str | None:
    """Why Spark cannot address a column of this name (PySpark's own ``mapInArrow``
    looks every column up by name), or None."""
    if name == "" or name == "*":
        return "an empty name or '*' cannot be a Spark column"
    if "." in name or "`" in name:
        return "a name with '.' or '`' cannot be a Spark column (Spark reads it as a path)"
    return None


def _outside(name: str, columns: list[str]) -> str:
    """Why a field outside the inferred columns fails its row."""
    why = unaddressable(name)
    if why is not None:
        return f"{why}; rename the field in a map step"
    same = [c for c in columns if fold(c) == fold(name)]
    if same:
        return (f"differs from the column {same[0]!r} only in case, and Spark does not tell "
                "column names apart by case")
    return (f"not among the columns {_shown(columns)} of the step; give the step "
            "schema= to choose its columns (fields outside a given schema are left out)")


def make_segment(
    steps: Sequence[Step], formats: Sequence[str], data_in: list[str] | None, data_schema: pa.Schema,
    out_schema: pa.Schema, lineage: str = ID, tally: Tally | None = None, *,
    mode: str | None = None, segment: str = "",
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """A ``mapInArrow`` function running ``steps`` (decoding first if ``data_in`` is None);
    with a ``tally``, it adds each step's rows in, out and failed once per batch.
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
                rows, status, sname, errs = decode_batch(b, formats)
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
                    counts["decode"] = [n, n - bad, bad]
            o_id, o_key, o_st, o_step, o_err, o_rows = segment_rows(ids, keys, status, sname,
                                                                    errs, rows, steps, counts)
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
    steps: Sequence[Step], formats: Sequence[str], data_in: list[str] | None,
    lineage: str = ID, stride: int = 1,
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
                rows, status, _, _ = decode_batch(b, formats)
            else:
                status = b.column(STATUS).to_pylist()
                rows = b.select(data_in).to_pylist() if data_in else [{} for _ in ids]
            n = len(ids)
            _, _, o_st, _, _, o_rows = segment_rows(ids, [""] * n, status, [None] * n,
                                                    [None] * n, rows, steps)
            good.extend(r for st, r in zip(o_st, o_rows, strict=True) if st == LIVE)
        schema = infer_schema(good, name)
        yield pa.RecordBatch.from_pylist([{"schema": to_text(schema), "rows": len(good)}],
                                         schema=SAMPLE_SCHEMA)

    return sample


SAMPLE_SCHEMA = pa.schema([("schema", pa.string()), ("rows", pa.int64())])


def make_writer(
    sink: Sink, batch_id: str, data_cols: list[str], lineage: str = ID,
    order: Sequence[str] | None = None, tally: Tally | None = None,
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
        misfit = None  # live rows holding a value in a refused column, and why
        for c, why in refused.items():
            hit = pc.and_(live_mask, pc.is_valid(table.column(c)))
            if pc.any(hit).as_py():
                rows = np.flatnonzero(hit.to_numpy(zero_copy_only=False))
                misfit = misfit or {}
                for j in rows:
                    misfit.setdefault(int(j), f"column {c!r}: {why}")
                live_mask = pc.and_(live_mask, pc.invert(hit))
        live_idx = np.flatnonzero(live_mask.to_numpy(zero_copy_only=False))
        held = held_columns(table.schema, data_cols, getattr(sink, "key", None) or [])
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
            text = f"{WHOLE_WRITE}{describe(e)}{where(e)}"
            for j in live_idx:
                steps_l[j], errs_l[j] = sink.name, text
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
                0, "id", pc.list_flatten(members))
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
        lines = [{"id": None, "sink": name, "emitted": 0, "written": n, "err_step": None,
                  "err": None, "token": None} for name, n in counts.items()]
        if token is not None:
            lines.append({"id": None, "sink": sink.name, "emitted": -1, "written": 0,
                          "err_step": None, "err": None, "token": token})
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
    given = keys.to_pylist()
    taken = set(given)
    seen: dict[str, int] = {}
    out = []
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
    return pa.array(out, pa.string())


def infer_schema(rows: Sequence[dict[str, Any]], step: str) -> pa.Schema:
    """Columns and types from rows: every key seen, types unified across rows.

    Rows are outside data, so nothing in them may stop the run: a reserved ``__af_``
    field makes no column (the rows holding it fail, in :func:`conform`), and a key
    whose values have mixed types takes the type of most of them (ties: the first
    seen); the rows that do not fit fail alone, naming the step and the column. A key
    whose every value is null (or an empty list or object) makes a column of the null
    type: later steps see the field (as None) whatever the batch, and its first value
    evolves the column to that value's type; inside a struct such a field makes no
    field yet (:func:`~ackflow.core.schema.prune_nulls`). Sinks never see a null-typed
    column (:func:`held_columns`)."""
    keys: dict[str, None] = {}
    for r in rows:
        keys.update(dict.fromkeys(r))
    fields = []
    for k in keys:
        if not isinstance(k, str) or reserved(k):
            continue
        values = [_hollow(r.get(k)) for r in rows]
        try:
            t = pa.array(values).type
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError):
            t = _majority_type(values)
            if t is None:
                continue
        pruned = prune_nulls(t)
        fields.append(pa.field(k, pa.null() if pruned is None else pruned))
    return pa.schema(fields)


def held_columns(schema: pa.Schema, cols: Sequence[str], keys: Sequence[str]) -> list[str]:
    """``cols`` without those of the null type (a field that has held no value yet):
    a sink would have to guess their type, and a table column made as text could never
    take the numbers that come later. A row holds null there, so leaving the column out
    loses nothing; the sink's key columns are always kept (a null key fails its row)."""
    return [c for c in cols if c in keys or c not in schema.names
            or not pa.types.is_null(schema.field(c).type)]


def _hollow(value: Any) -> Any:
    """``value`` with each empty part (``[]``, ``{}``, or only such) made null: they hold
    nothing, so they give no type (a ``[{}]`` beside ``[true]`` is no conflict)."""
    if empty(value):
        return None
    if isinstance(value, dict):
        return {k: _hollow(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_hollow(v) for v in value]
    return value


def _majority_type(values: list[Any]) -> pa.DataType | None:
    """The Arrow type of the largest group of values of one Python type that Arrow can
    take (numbers of both kinds count as one group); in a group Arrow refuses as a
    whole, the type most of its values take one by one. None if Arrow can hold none of
    them: such a value fails its own message, and never makes a column (one ``2**64``
    must not make a string column that refuses every later integer)."""
    from collections import Counter

    groups: dict[str, list[Any]] = {}
    for v in values:
        if v is None:
            continue
        kind = "number" if isinstance(v, int | float) and not isinstance(v, bool) else \
            type(v).__name__
        groups.setdefault(kind, []).append(v)
    for _, group in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        try:
            return pa.array(group).type
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError):
            pass
        types: Counter[pa.DataType] = Counter()
        for v in group:
            try:
                types[pa.array([v]).type] += 1
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError):
                continue
        if types:
            return types.most_common(1)[0][0]
    return None
