"""Open windows held in Arrow columns: a batch's partials merged by one hash aggregate.

The driver holds an operator's open tumbling and hopping windows between batches
(:mod:`.held`). Where every aggregate is one the Arrow fold computes (``count``,
``sum``, ``min``, ``max``, ``avg``) and every task folded its rows in Arrow
(:mod:`.fold`: its partials are a table), the held windows are a table too, and a
batch merges into them as ``group_by(gk, start)`` over the held rows followed by each
task's, in the tasks' order: the order the Python merge takes, so the same values to
the bit (a group's sum adds its rows in row order; the inputs hold no NaN and no -0.0,
which the fold leaves to the row-by-row path).

Anything this cannot be sure of gives None and the caller holds the windows as a
Python dict again (:meth:`Columns.to_dict`): a task that folded row by row, column
types that differ between batches, an integer sum that could pass 2**63.

A window's table row: ``gk`` (key text), ``start``, ``end``, ``nrows``, its key
values ``k0..``, its accumulators ``a0..`` (an ``avg`` as ``a<j>s`` and ``a<j>c``: sum
and count), and two flags: ``__d`` (changed since the change log was last folded) and
``__t`` (the windows table has a row of it).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

#: hold windows in Arrow where it can (False: always as a Python dict; tests compare the two)
ENABLED = True
FLAGS = ("__d", "__t")
Slot = tuple[str, int]
#: a window as Python values: (key text, start, end, rows, key values, accumulators)
Change = tuple[str, int, int, int, tuple[Any, ...], list[Any]]


def layout(names: Sequence[str]) -> tuple[list[str], list[tuple[str, ...]]]:
    """A partials table's key columns, and per aggregate its accumulator columns."""
    keys = [f"k{j}" for j in itertools.takewhile(lambda j: f"k{j}" in names, itertools.count())]
    accs: list[tuple[str, ...]] = []
    for j in itertools.count():
        if f"a{j}" in names:
            accs.append((f"a{j}",))
        elif f"a{j}s" in names:
            accs.append((f"a{j}s", f"a{j}c"))
        else:
            return keys, accs
    raise AssertionError("unreachable")


def rows_of(table: pa.Table) -> Iterator[Change]:
    """Each row of a partials table as Python values, as the row-by-row fold holds them
    (an ``avg`` of no values is ``(0, 0)``)."""
    keys, accs = layout(table.column_names)
    col = {n: table.column(n).to_pylist() for n in ("gk", "start", "end", "nrows")}
    values = zip(*(table.column(k).to_pylist() for k in keys), strict=True) if keys else None
    lists: list[list[Any]] = []
    for names in accs:
        if len(names) == 1:
            lists.append(table.column(names[0]).to_pylist())
        else:
            s, c = (table.column(n).to_pylist() for n in names)
            lists.append([(x if n else 0, n) for x, n in zip(s, c, strict=True)])
    n = table.num_rows
    yield from zip(
        col["gk"],
        col["start"],
        col["end"],
        col["nrows"],
        values if values is not None else itertools.repeat((), n),
        map(list, zip(*lists, strict=True)) if lists else ([] for _ in range(n)),
        strict=True,
    )


def slots_of(table: pa.Table) -> list[Slot]:
    """The windows (key text, start) of a table's rows, in order."""
    return list(zip(table.column("gk").to_pylist(), table.column("start").to_pylist(), strict=True))


class Columns:
    """An operator's open windows as one Arrow table (see the module's docstring)."""

    def __init__(self, table: pa.Table, gone: list[Slot] | None = None) -> None:
        self.table = table
        #: windows written out since the last fold whose row the windows table still has
        self.gone: list[Slot] = gone or []
        #: the rows the last merge changed (the change log's row), until committed
        self.changed: pa.Table | None = None

    def __len__(self) -> int:
        return int(self.table.num_rows)

    def max_end(self) -> int | None:
        return pc.max(self.table.column("end")).as_py() if self.table.num_rows else None

    def data(self, table: pa.Table | None = None) -> pa.Table:
        """The rows without the flags."""
        table = self.table if table is None else table
        return table.drop_columns([f for f in FLAGS if f in table.column_names])

    # -- merging -----------------------------------------------------------------------

    def merge(self, tables: Sequence[pa.Table], fns: Sequence[str]) -> Columns | None:
        """The windows with the tasks' partials (``tables``, in the tasks' order) merged
        in, as a new object (this one is unchanged until the batch commits); its
        ``changed`` are the windows the batch touched. None: not in Arrow (types that
        differ, a sum that could wrap)."""
        held = self.data()
        schema = tables[0].schema if not held.num_rows else held.schema
        if any(not t.schema.equals(schema) for t in tables) or (
            held.num_rows and not held.schema.equals(schema)
        ):
            return None
        keys, accs = layout(schema.names)
        n_old = held.num_rows
        whole = pa.concat_tables([held, *tables] if n_old else tables)
        summed = ["nrows"] + [n for j, names in enumerate(accs) for n in names if _summed(fns[j])]
        for name in summed:
            col = whole.column(name)
            if pa.types.is_integer(col.type) and _may_wrap(col):
                return None
        total = whole.num_rows
        fresh = total - n_old
        flags = {"__c": pa.array([0] * n_old + [1] * fresh, pa.int8())}  # (changed by this batch)
        for name, value in (("__d", 1), ("__t", 0)):
            before = [self.table.column(name).combine_chunks()] if n_old else []
            flags[name] = pa.concat_arrays([*before, pa.array([value] * fresh, pa.int8())])
        for name, arr in flags.items():
            whole = whole.append_column(name, arr)
        plan: list[tuple[str, str]] = [("end", "max"), ("nrows", "sum")]
        plan += [(k, "min") for k in keys]
        for j, names in enumerate(accs):
            plan += [(n, "sum" if _summed(fns[j]) else fns[j]) for n in names]
        plan += [("__c", "max"), ("__d", "max"), ("__t", "max")]
        grouped = whole.group_by(["gk", "start"], use_threads=False).aggregate(plan)
        out = {"gk": grouped.column("gk"), "start": grouped.column("start")}
        for name, fn in plan:
            out[name] = grouped.column(f"{name}_{fn}")
        merged = pa.table(out)
        changed = merged.filter(pc.equal(merged.column("__c"), 1))
        new = Columns(merged.drop_columns(["__c"]), list(self.gone))
        new.changed = self.data(changed.drop_columns(["__c"]))
        return new

    # -- reading and removing ----------------------------------------------------------

    def ready(self, bound: int, limit: int, refused: set[Slot]) -> pa.Table:
        """The first ``limit`` windows whose end is at most ``bound``, by (end, key text,
        start), leaving out ``refused`` (the rows without the flags)."""
        table = self.table.filter(pc.less_equal(self.table.column("end"), bound))
        if not table.num_rows:
            return self.data(table)
        table = table.sort_by([("end", "ascending"), ("gk", "ascending"), ("start", "ascending")])
        table = table.slice(0, limit + len(refused))  # (UTF-8's byte order is the text's order)
        if refused:
            table = table.filter(pa.array([s not in refused for s in slots_of(table)], pa.bool_()))
        return self.data(table.slice(0, limit))

    def drop(self, gone: Sequence[Slot]) -> None:
        """``gone`` written out: their rows removed (those the windows table has a row
        of are remembered, for the next fold to delete)."""
        if not gone or not self.table.num_rows:
            return
        ids = pc.binary_join_element_wise(
            self.table.column("gk"), self.table.column("start").cast(pa.string()), "\x1f"
        )
        mask = pc.is_in(ids, value_set=pa.array([f"{g}\x1f{s}" for g, s in gone], pa.string()))
        out = self.table.filter(mask)
        tabled = out.filter(pc.equal(out.column("__t"), 1))
        self.gone += slots_of(tabled)
        self.table = self.table.filter(pc.invert(mask))

    def gone_now(self) -> list[Slot]:
        """The windows to delete from the table: written out since the last fold and
        not opened again since (a row that came later for it: its row is written)."""
        if not self.gone:
            return []
        held = set(slots_of(self.table))
        return [s for s in dict.fromkeys(self.gone) if s not in held]

    def dirty(self) -> list[Change]:
        """The windows changed since the last fold."""
        table = self.table.filter(pc.equal(self.table.column("__d"), 1))
        return list(rows_of(self.data(table))) if table.num_rows else []

    def folded(self) -> None:
        """The log was folded: every window has its row in the table, none is changed."""
        n = self.table.num_rows
        for name, value in (("__d", 0), ("__t", 1)):
            i = self.table.schema.get_field_index(name)
            self.table = self.table.set_column(i, name, pa.array([value] * n, pa.int8()))
        self.gone = []

    def slots(self, where: str) -> set[Slot]:
        """The windows whose flag ``where`` is set."""
        return set(slots_of(self.table.filter(pc.equal(self.table.column(where), 1))))

    def to_dict(self) -> dict[Slot, tuple[int, int, tuple[Any, ...], list[Any]]]:
        """The windows as the Python merge holds them: (key text, start) -> (end, rows,
        key values, accumulators)."""
        return {(gk, st): (end, n, values, accs) for gk, st, end, n, values, accs in rows_of(self.data())}

    # -- from a dict -------------------------------------------------------------------

    @staticmethod
    def from_dict(
        held: dict[Slot, tuple[int, int, tuple[Any, ...], list[Any]]],
        schema: pa.Schema,
        touched: set[Slot],
        tabled: set[Slot],
    ) -> Columns | None:
        """Windows held as a dict, in ``schema``'s columns; None if a value is not
        exactly of its column's type (an integer sum in a float column, a NaN)."""
        keys, accs = layout(schema.names)
        cols: dict[str, list[Any]] = {n: [] for n in schema.names}
        for (gk, start), (end, n, values, acc) in held.items():
            if len(values) != len(keys) or len(acc) != len(accs):
                return None
            cols["gk"].append(gk)
            cols["start"].append(start)
            cols["end"].append(end)
            cols["nrows"].append(n)
            for k, v in zip(keys, values, strict=True):
                cols[k].append(v)
            for names, a in zip(accs, acc, strict=True):
                if len(names) == 1:
                    cols[names[0]].append(a)
                else:
                    cols[names[0]].append(a[0] if a[1] else _zero(schema.field(names[0]).type))
                    cols[names[1]].append(a[1])
        for f in schema:
            if not all(_fits(v, f.type) for v in cols[f.name]):
                return None
        try:
            table = pa.table({n: pa.array(v, schema.field(n).type) for n, v in cols.items()}, schema=schema)
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            return None
        slots = list(held)
        table = table.append_column("__d", pa.array([1 if s in touched else 0 for s in slots], pa.int8()))
        table = table.append_column("__t", pa.array([1 if s in tabled else 0 for s in slots], pa.int8()))
        return Columns(table, [s for s in touched if s not in held and s in tabled])


def results(table: pa.Table, by: Sequence[str], aggs: Sequence[tuple[str, str]]) -> pa.Table | None:
    """Due windows' output rows (``by``'s key columns, ``window_start``, ``window_end``,
    an aggregate's result per (name, fn) of ``aggs``) made from their table (from
    :meth:`Columns.ready`) as :meth:`Aggregate.finish` makes them from Python values:
    the same values, the types Python's values have (int64, float64, string). None
    where Arrow would not give the same value: an average of integers past 2**53 (a
    float holds no such sum, Python divides exactly)."""
    keys, accs = layout(table.column_names)
    out: dict[str, Any] = {}
    for name, k in zip(by, keys, strict=True):
        col = table.column(k)
        out[name] = col.cast(pa.int64() if pa.types.is_integer(col.type) else pa.string())
    ts = pa.timestamp("us", tz="UTC")
    out["window_start"] = table.column("start").cast(ts)
    out["window_end"] = table.column("end").cast(ts)
    for (name, fn), names in zip(aggs, accs, strict=True):
        if fn != "avg":
            out[name] = table.column(names[0])
            continue
        total, n = (table.column(c) for c in names)
        if pa.types.is_integer(total.type):
            bounds = pc.min_max(total).as_py()
            if bounds["min"] is not None and max(-bounds["min"], bounds["max"]) > 2**53:
                return None
        quotient = pc.divide(total.cast(pa.float64()), n.cast(pa.float64()))
        out[name] = pc.if_else(pc.greater(n, 0), quotient, pa.scalar(None, pa.float64()))
    return pa.table(out)


def _summed(fn: str) -> bool:
    """Whether an accumulator column merges by summing (a count, a sum, an average's two)."""
    return fn in ("count", "sum", "avg")


def _may_wrap(col: pa.ChunkedArray) -> bool:
    """Whether an integer column's sum could pass 2**63 (its values' magnitudes added in floats)."""
    if col.null_count == len(col):
        return False
    magnitudes = pc.abs(col.cast(pa.float64(), safe=False))  # (rounded: 2**53 + 1 is no float)
    return bool(pc.sum(magnitudes).as_py() >= 2.0**62)


def _zero(t: pa.DataType) -> Any:
    return 0.0 if pa.types.is_floating(t) else 0


def _fits(v: Any, t: pa.DataType) -> bool:
    if v is None:
        return True
    if pa.types.is_floating(t):
        return type(v) is float and v == v and not (v == 0 and math.copysign(1.0, v) < 0)
    if pa.types.is_integer(t):
        return type(v) is int
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return type(v) is str
    return False
