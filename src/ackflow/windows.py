"""Windows over event time, and the aggregates they compute (:meth:`Flow.window`).

A window groups rows by keys and by time: **tumbling** (fixed, back to back),
**hopping** (fixed size, a new one every ``every``; a row is in ``size / every`` of
them), **session** (a key's rows closer than ``gap`` to each other), or **count** (a
key's next ``n`` rows, in the order they arrive). Each row's contribution is merged into
a durable state store in one transaction per batch; the message is acked when that
transaction is durable, never held until its window closes. A window's result is
written to the flow's sink once the watermark passes its end (``output="final"``), or
after every batch that changed it (``output="update"``).

Durations are seconds (a number), a :class:`datetime.timedelta`, or text such as
``"250ms"``, ``"30s"``, ``"5 minutes"``, ``"1h"``, ``"2 days"``.

>>> tumbling("1 minute")
Tumbling(size_us=60000000)
>>> hopping("10 minutes", every="5 minutes").size_us // hopping("10m", every="5m").every_us
2
>>> sum_("amount").alias("total").name, count().name, avg("price").name
('total', 'count', 'avg_price')

Aggregates keep a small accumulator per window: ``count``, ``sum_``, ``min_``,
``max_``, ``avg``, ``count_distinct`` (exact: the window keeps its distinct values),
``first``/``last`` (the value at the earliest/latest event time; ties by row key), and
:func:`python` for anything else (an object with ``init()``, ``add(acc, value)``,
``merge(a, b)`` and ``finish(acc)``; its accumulator must pickle). Nulls are skipped,
as in SQL and pandas: ``count("x")`` counts non-null values, ``count()`` counts rows.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ackflow.core.errors import ConfigError

US = 1_000_000
_UNITS = {
    "us": 1,
    "ms": 1_000,
    "s": US,
    "sec": US,
    "second": US,
    "m": 60 * US,
    "min": 60 * US,
    "minute": 60 * US,
    "h": 3600 * US,
    "hour": 3600 * US,
    "d": 86400 * US,
    "day": 86400 * US,
}


def duration_us(value: object, what: str) -> int:
    """``value`` (seconds, a timedelta, or text like ``"5 minutes"``) in microseconds.

    >>> duration_us("250ms", "x"), duration_us(1.5, "x"), duration_us("2 hours", "x")
    (250000, 1500000, 7200000000)
    >>> duration_us("10us", "x"), duration_us("30s", "x"), duration_us("5 mins", "x")
    (10, 30000000, 300000000)
    """
    if isinstance(value, dt.timedelta):
        us = round(value.total_seconds() * US)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        us = round(value * US) if value == value and abs(value) < 1e12 else -1
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]+)\s*", value.lower())
        word = m.group(2) if m else ""
        unit = _UNITS.get(word, _UNITS.get(word[:-1]) if word.endswith("s") else None)
        if m is None or unit is None:
            raise ConfigError(
                f"{what}: {value!r} is not a duration (say '30s', '5 minutes', '1h', or give seconds)"
            )
        us = round(float(m.group(1)) * unit)
    else:
        raise ConfigError(f"{what}: expected a duration, got {type(value).__name__}")
    if us < 0:
        raise ConfigError(f"{what}: {value!r} is not a duration >= 0")
    if us > 10**18:  # (as a number of seconds is bounded: a window's end stays an int64)
        raise ConfigError(f"{what}: {value!r} is longer than 31 000 years")
    return us


# -- window kinds --------------------------------------------------------------------


@dataclass(frozen=True)
class Tumbling:
    size_us: int

    def starts(self, t: int) -> list[int]:
        return [t - t % self.size_us]


@dataclass(frozen=True)
class Hopping:
    size_us: int
    every_us: int

    def starts(self, t: int) -> list[int]:
        """Every window start ``s`` (a multiple of ``every``) with ``s <= t < s + size``."""
        last = t - t % self.every_us
        out = []
        s = last
        while s > t - self.size_us:
            out.append(s)
            s -= self.every_us
        return out[::-1]


@dataclass(frozen=True)
class Session:
    gap_us: int


@dataclass(frozen=True)
class Count:
    n: int


Kind = Tumbling | Hopping | Session | Count


def tumbling(size: object) -> Tumbling:
    """Back-to-back windows of ``size`` (aligned to the Unix epoch)."""
    us = duration_us(size, "tumbling(size)")
    if us <= 0:
        raise ConfigError("tumbling(size): the size must be > 0")
    return Tumbling(us)


def hopping(size: object, *, every: object) -> Hopping:
    """Windows of ``size`` starting every ``every`` (a row is in ``size / every``)."""
    s, e = duration_us(size, "hopping(size)"), duration_us(every, "hopping(every)")
    if e <= 0 or s <= 0:
        raise ConfigError("hopping: size and every must be > 0")
    if e > s:
        raise ConfigError(
            f"hopping: every ({every}) cannot exceed the size ({size}): rows would fall between"
        )
    return Hopping(s, e)


def session(gap: object) -> Session:
    """A key's rows less than ``gap`` apart form one window; it ends ``gap`` after its last row."""
    us = duration_us(gap, "session(gap)")
    if us <= 0:
        raise ConfigError("session(gap): the gap must be > 0")
    return Session(us)


def count_window(n: int) -> Count:
    """A key's rows ``n`` at a time, in the order they arrive (no event time needed)."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ConfigError(f"count_window(n): n must be a positive integer, got {n!r}")
    return Count(n)


# -- aggregates ----------------------------------------------------------------------


def _hashable(v: Any) -> Any:
    if isinstance(v, (list, dict)):
        return json.dumps(v, sort_keys=True, default=str)
    return v


@dataclass(frozen=True)
class Aggregate:
    """One output column of a window: ``fn`` over the input column ``column``.

    ``column`` is a column name, a Spark Column (evaluated before the window, as a
    hidden column), or None for ``count()``. The accumulator methods run in Spark tasks
    (``init``/``add``) and on the driver (``merge``/``finish``)."""

    fn: str
    column: Any = None
    name: str = ""
    impl: Any = None  # python(): the user's aggregator

    def alias(self, name: str) -> Aggregate:
        if not isinstance(name, str) or not name:
            raise ConfigError("alias: a non-empty column name")
        return dataclasses.replace(self, name=name)

    def init(self) -> Any:
        if self.fn == "python":
            return self.impl.init()
        return {"count": 0, "avg": (0, 0), "count_distinct": set()}.get(self.fn)

    def add(self, acc: Any, value: Any, order: tuple[int, str]) -> Any:
        fn = self.fn
        if fn == "count":
            return acc + (1 if self.column is None or value is not None else 0)
        if value is None:
            return acc
        if fn == "python":
            return self.impl.add(acc, value)
        if fn == "sum":
            return value if acc is None else acc + value
        if fn == "min":
            return value if acc is None or value < acc else acc
        if fn == "max":
            return value if acc is None or value > acc else acc
        if fn == "avg":
            return (acc[0] + value, acc[1] + 1)
        if fn == "count_distinct":
            acc.add(_hashable(value))
            return acc
        if fn == "first":
            return (order, value) if acc is None or order < acc[0] else acc
        return (order, value) if acc is None or order > acc[0] else acc  # last

    def merge(self, a: Any, b: Any) -> Any:
        fn = self.fn
        if fn == "python":
            return self.impl.merge(a, b)
        if fn == "count":
            return a + b
        if fn == "avg":
            return (a[0] + b[0], a[1] + b[1])
        if fn == "count_distinct":
            return a | b
        if a is None or b is None:
            return b if a is None else a
        if fn == "sum":
            return a + b
        if fn in ("min", "first"):
            return b if b < a else a
        return b if b > a else a  # max, last

    def finish(self, acc: Any) -> Any:
        fn = self.fn
        if fn == "python":
            return self.impl.finish(acc)
        if fn == "avg":
            return acc[0] / acc[1] if acc[1] else None
        if fn == "count_distinct":
            return len(acc)
        if fn in ("first", "last"):
            return None if acc is None else acc[1]
        return acc


def merger(aggs: Sequence[Aggregate]) -> Callable[[list[Any], list[Any]], list[Any]]:
    """One function that merges two windows' accumulators (a list per window, one per
    aggregate of ``aggs``), as each aggregate's :meth:`Aggregate.merge` does, without
    its dispatch on ``fn`` per call (the driver merges every window a batch touched)."""
    fns = [_merge_fn(a) for a in aggs]
    if len(fns) == 1:
        (f0,) = fns
        return lambda x, y: [f0(x[0], y[0])]
    if len(fns) == 2:
        f0, f1 = fns
        return lambda x, y: [f0(x[0], y[0]), f1(x[1], y[1])]
    return lambda x, y: [f(a, b) for f, a, b in zip(fns, x, y, strict=True)]


def _merge_fn(agg: Aggregate) -> Callable[[Any, Any], Any]:
    if agg.fn == "count":
        return operator.add
    if agg.fn == "sum":
        return lambda a, b: b if a is None else a if b is None else a + b
    if agg.fn == "min":
        return lambda a, b: b if a is None else a if b is None else b if b < a else a
    if agg.fn == "max":
        return lambda a, b: b if a is None else a if b is None else b if b > a else a
    return agg.merge


def _agg(fn: str, column: Any, name: str | None) -> Aggregate:
    if column is not None and not isinstance(column, str) and not _is_column(column):
        raise ConfigError(f"{fn}: give a column name or a Spark Column, got {type(column).__name__}")
    default = fn if column is None else f"{fn}_{column}" if isinstance(column, str) else fn
    return Aggregate(fn, column, name or default)


def count(column: Any = None, *, name: str | None = None) -> Aggregate:
    """Rows in the window, or with ``column`` its non-null values."""
    return _agg("count", column, name)


def sum_(column: Any, *, name: str | None = None) -> Aggregate:
    return _agg("sum", column, name)


def min_(column: Any, *, name: str | None = None) -> Aggregate:
    return _agg("min", column, name)


def max_(column: Any, *, name: str | None = None) -> Aggregate:
    return _agg("max", column, name)


def avg(column: Any, *, name: str | None = None) -> Aggregate:
    return _agg("avg", column, name)


def count_distinct(column: Any, *, name: str | None = None) -> Aggregate:
    """Exact: the window keeps its distinct values until it is written."""
    return _agg("count_distinct", column, name)


def first(column: Any, *, name: str | None = None) -> Aggregate:
    """The non-null value at the earliest event time (ties: the lowest row key)."""
    return _agg("first", column, name)


def last(column: Any, *, name: str | None = None) -> Aggregate:
    """The non-null value at the latest event time (ties: the highest row key)."""
    return _agg("last", column, name)


def python(aggregator: Any, column: Any, *, name: str | None = None) -> Aggregate:
    """A Python aggregator: an object with ``init()``, ``add(acc, value)``,
    ``merge(a, b)`` and ``finish(acc)`` (picklable, like a step's function)."""
    for method in ("init", "add", "merge", "finish"):
        if not callable(getattr(aggregator, method, None)):
            raise ConfigError(f"python(aggregator): it has no {method}() method")
    agg = _agg("python", column, name)
    return dataclasses.replace(agg, impl=aggregator, name=name or f"{type(aggregator).__name__.lower()}")


def _is_column(obj: object) -> bool:
    return any(c.__name__ == "Column" and c.__module__.startswith("pyspark") for c in type(obj).__mro__)


def __getattr__(name: str) -> Any:  # ackflow.windows.PostgresState, without importing psycopg early
    if name == "PostgresState":
        from ackflow.state.pg import PostgresState

        return PostgresState
    raise AttributeError(name)
