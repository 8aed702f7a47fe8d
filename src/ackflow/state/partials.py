"""A window's task side: a partition's rows -> partial aggregates per (keys, window).

Runs inside Spark tasks (pickled with the window sink). Each live row is one of:

* **applied**: its row key is in the store's applied keys (a redelivery of a row whose
  contribution is already committed): counted as written, contributes nothing again;
* **failed**: no usable event time (null, or not a time), or a group key that cannot
  be a key: the row's message fails with the reason (a dead letter names the window);
* **late**: its event time is below the watermark the task read: it goes to the
  ``on_late`` sink if there is one, else it fails with ``late: event time T <
  watermark W`` (never dropped silently);
* **contributing**: folded into the partial of each window it belongs to.

The partials, the contributing row keys and the largest event time are the task's
token; the driver merges them into the store in one transaction (:mod:`.store`).
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ackflow.state.spec import WindowSpec
from ackflow.windows import Hopping, Session, Tumbling

EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
LIMIT_S = 253_402_300_799  # 9999-12-31T23:59:59Z in epoch seconds
YEAR_1_S = -62_135_596_800  # 0001-01-01T00:00:00Z in epoch seconds
#: the times a window's start and end may take: what a Python datetime holds, in UTC
MIN_US, MAX_US = YEAR_1_S * 1_000_000, (LIMIT_S + 1) * 1_000_000 - 1


def outside_years(start: int, end: int) -> str | None:
    """Why a window from ``start`` to ``end`` (µs) cannot be written (its start or end is
    not a time of the years 1-9999 in UTC), or None. A row whose window is such fails
    alone: its result could never be written, and windows are written in order."""
    if start < MIN_US or end > MAX_US:
        return f"its window ({start} to {end} µs since the epoch) is outside the years 1-9999 in UTC"
    return None


def to_us(value: Any) -> int:
    """An event time in microseconds since the epoch: a timestamp (naive = UTC), a
    date, epoch seconds (a number), or ISO 8601 text. ValueError says why not."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a time")
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.UTC)
        delta = value - EPOCH
        us = (delta.days * 86400 + delta.seconds) * 1_000_000 + delta.microseconds
        if us < MIN_US:
            raise ValueError(f"{value.isoformat()} is before the year 1 in UTC")
        return us
    if isinstance(value, dt.date):
        return to_us(dt.datetime(value.year, value.month, value.day))
    if isinstance(value, (int, float)):
        if value != value or not YEAR_1_S <= value <= LIMIT_S:
            hint = " (milliseconds? give seconds)" if value == value and abs(value) < LIMIT_S * 1000 else ""
            raise ValueError(f"{value!r} is not a time in epoch seconds of the years 1-9999{hint}")
        return round(value * 1_000_000)
    if isinstance(value, str):
        text = value.strip()
        try:
            parsed = dt.datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith("Z") else text)
        except ValueError:
            raise ValueError(f"{value[:60]!r} is not an ISO 8601 time") from None
        return to_us(parsed)
    raise ValueError(f"a {type(value).__name__} is not a time")


def show_us(us: int) -> str:
    """A time in microseconds as ISO 8601 UTC text."""
    return (EPOCH + dt.timedelta(microseconds=us)).isoformat().replace("+00:00", "Z")


@dataclass
class Partials:
    """What one task hands the driver for one window operator."""

    watermark: int | None  # the watermark the task read (None: no data yet)
    #: (key values, window start, window end) -> (rows, accumulators); tumbling,
    #: hopping and session windows (a session's end is its last row + gap)
    parts: dict[tuple[tuple[Any, ...], int, int], tuple[int, list[Any]]] = field(default_factory=dict)
    #: count windows: (key values, (event time, row key), accumulators), one per row
    rows: list[tuple[tuple[Any, ...], tuple[int, str], list[Any]]] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)  # contributing row keys
    #: each slot's key text in the store (``gk_text``), made in the task, off the driver
    texts: dict[tuple[tuple[Any, ...], int, int], str] = field(default_factory=dict)
    max_t: int | None = None
    late: int = 0
    applied: int = 0
    #: the Arrow fold's partials as one table (:mod:`.columns`), in place of ``parts``
    table: Any = None

    def __getstate__(self) -> dict[str, Any]:
        """Pickled by columns: a task's token holds thousands of slots, and a list of
        plain values loads several times faster than as many small tuples (the driver
        loads every task's token)."""
        state = dict(self.__dict__)
        if "_cols" in state:  # (unpickled: in columns already)
            return state
        parts, texts = state.pop("parts"), state.pop("texts")
        slots, held = list(parts), list(parts.values())
        width = len(slots[0][0]) if slots else 0
        naggs = len(held[0][1]) if held else 0
        state["_cols"] = (
            len(slots),
            [list(c) for c in zip(*(s[0] for s in slots), strict=True)] if width else [],
            [s[1] for s in slots],
            [s[2] for s in slots],
            [h[0] for h in held],
            [list(c) for c in zip(*(h[1] for h in held), strict=True)] if naggs else [],
            [texts.get(s) for s in slots],
        )
        return state

    def has_slots(self) -> bool:
        """Whether it holds any window's partial."""
        cols = self.__dict__.get("_cols")
        return self.table is not None or bool(cols[0] if cols is not None else self.parts)

    def as_parts(self) -> tuple[dict[Any, tuple[int, list[Any]]], dict[Any, str | None]]:
        """The slots as ``parts`` and ``texts`` hold them (whichever fold made them)."""
        parts, texts = {}, {}
        for values, start, end, rows, accs, gk in self.slots():
            parts[(values, start, end)] = (rows, accs)
            texts[(values, start, end)] = gk
        return parts, texts

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickled, the slots stay in columns: ``parts`` and ``texts`` are not rebuilt
        (read them with :meth:`slots`)."""
        self.__dict__.update(state)

    def slots(self) -> Iterator[tuple[tuple[Any, ...], int, int, int, list[Any], str | None]]:
        """Each slot as (key values, start, end, rows, accumulators, key text or None)."""
        table = self.__dict__.get("table")
        if table is not None:
            from ackflow.state.columns import rows_of

            for gk, start, end, n, vals, acc in rows_of(table):
                yield vals, start, end, n, acc, gk
            return
        cols = self.__dict__.get("_cols")
        if cols is None:
            texts = getattr(self, "texts", {})  # (an executor of an older version: none)
            for slot, (rows, accs) in self.parts.items():
                yield (*slot, rows, accs, texts.get(slot))
            return
        n, keys, starts, ends, nrows, accs, texts = cols
        values = zip(*keys, strict=True) if keys else itertools.repeat((), n)
        lists = map(list, zip(*accs, strict=True)) if accs else ([] for _ in range(n))
        yield from zip(values, starts, ends, nrows, lists, texts, strict=True)


def contribute(
    spec: WindowSpec,
    rows: Any,
    row_keys: Sequence[str],
    watermark: int | None,
    applied: set[str],
    *,
    arrow: bool = True,
) -> tuple[Partials, dict[int, str], list[int]]:
    """Fold a partition's rows (an Arrow table) into partials.

    Returns the partials, the failed rows (index -> reason) and the late rows' indexes.
    ``arrow``: the common case folds in Arrow (:mod:`.fold`); False, row by row only."""
    if arrow:
        from ackflow.state.fold import fold

        done = fold(spec, rows, row_keys, watermark, applied)
        if done is not None:
            return done
    out = Partials(watermark)
    failed: dict[int, str] = {}
    late: list[int] = []
    n = rows.num_rows

    def values(name: str) -> list[Any]:  # a column no row held a value in yet is not sent
        return rows.column(name).to_pylist() if name in rows.column_names else [None] * n

    times: list[Any] = values(spec.time) if spec.time is not None else [None] * n
    key_cols = [values(k) for k in spec.by]
    inputs = [values(a.column) if a.column is not None else None for a in spec.aggs]
    kind = spec.kind
    sessions: dict[tuple[Any, ...], list[tuple[int, str, int, list[Any]]]] = {}
    for i in range(n):
        rk = row_keys[i]
        if rk in applied:
            out.applied += 1
            continue
        if spec.time is not None:
            raw = times[i]
            if raw is None:
                failed[i] = f"event time column {spec.time!r} is null"
                continue
            try:
                t = to_us(raw)
            except ValueError as e:
                failed[i] = f"event time column {spec.time!r}: {e}"
                continue
        else:
            t = 0
        if watermark is not None and spec.time is not None and t < watermark:
            late.append(i)
            out.late += 1
            continue
        gk = tuple(col[i] for col in key_cols)
        try:
            hash(gk)
        except TypeError:
            failed[i] = f"group key {spec.by} has a value that cannot be a key (a list or a map)"
            continue
        order = (t, rk)
        try:  # each value alone first: a value an aggregate cannot take fails its row only
            single = [a.add(a.init(), _value(inputs, j, i), order) for j, a in enumerate(spec.aggs)]
        except Exception as e:  # noqa: BLE001 - the row's own data
            failed[i] = f"aggregate: {type(e).__name__}: {e}"[:500]
            continue
        if isinstance(kind, (Tumbling, Hopping)):
            merged = []
            starts = kind.starts(t)
            why = outside_years(min(starts), max(starts) + kind.size_us) if starts else None
            if why is not None:
                failed[i] = f"event time column {spec.time!r}: {why}"
                continue
            try:  # a value that cannot join the others (a struct's max) fails its row only
                for start in starts:
                    slot = (gk, start, start + kind.size_us)
                    held = out.parts.get(slot)
                    if held is None and len(starts) == 1:  # a tumbling window's first row: its
                        merged.append((slot, (1, single)))  # own accumulators, shared by no slot
                        continue
                    if held is None:
                        held = (0, [a.init() for a in spec.aggs])
                    accs = [a.merge(acc, one) for a, acc, one in zip(spec.aggs, held[1], single, strict=True)]
                    merged.append((slot, (held[0] + 1, accs)))
            except Exception as e:  # noqa: BLE001 - the row's own data
                failed[i] = f"aggregate: {type(e).__name__}: {e}"[:500]
                continue
            out.parts.update(merged)
        elif isinstance(kind, Session):
            why = outside_years(t, t + kind.gap_us)
            if why is not None:
                failed[i] = f"event time column {spec.time!r}: {why}"
                continue
            sessions.setdefault(gk, []).append((t, rk, i, single))
        else:
            out.rows.append((gk, order, single))
        out.keys.append(rk)
        if spec.time is not None:
            out.max_t = t if out.max_t is None else max(out.max_t, t)
    if isinstance(kind, Session):
        for gk, members in sessions.items():
            members.sort(key=lambda m: (m[0], m[1]))
            start, end = members[0][0], members[0][0]
            count, accs = 0, [a.init() for a in spec.aggs]
            for t, _, _, single in members:
                if count and t >= end:  # a gap: the session so far is one partial
                    out.parts[(gk, start, end)] = (count, accs)
                    start, count, accs = t, 0, [a.init() for a in spec.aggs]
                end = t + kind.gap_us
                accs = [a.merge(acc, one) for a, acc, one in zip(spec.aggs, accs, single, strict=True)]
                count += 1
            out.parts[(gk, start, end)] = (count, accs)
    # by slot, not by values: 0.0 and -0.0 are one dict key but two texts
    out.texts = {slot: gk_text(slot[0]) for slot in out.parts}
    return out, failed, late


def gk_text(values: Sequence[Any]) -> str:
    """A group's key values as the store's key text (stable across runs)."""
    return json.dumps(list(values), default=str, separators=(",", ":"))


def _value(inputs: list[list[Any] | None], j: int, i: int) -> Any:
    col = inputs[j]
    return None if col is None else col[i]
