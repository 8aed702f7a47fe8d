"""Groups across batches (``grouped_within``): a keyed buffer with a size and a timer.

Pure bookkeeping, no Spark: rows go in with the lineage ids of their messages; full
groups, and groups whose first row is older than the timeout, come out.
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Group:
    key: tuple[Hashable, ...]
    started: float
    rows: list[dict[str, Any]] = field(default_factory=list)
    row_ids: list[tuple[int, ...]] = field(default_factory=list)  # each row's message ids
    row_keys: list[str] = field(default_factory=list)  # each row's key (its identity)
    values: tuple[Any, ...] = ()  # the key values as the first row had them (written out)

    @property
    def members(self) -> list[int]:
        """One entry per row membership."""
        return [m for ids in self.row_ids for m in ids]

    def ordered_rows(self) -> list[dict[str, Any]]:
        """The rows in the order of their row keys (then of their values), not of their
        arrival: the group's row key is a digest of its members' keys, and a broker
        redelivers in any order, so a group written again must be the same row.

        >>> g = Group(("a",), 0.0, [{"v": 2}, {"v": 1}], [(2,), (1,)], ["m2", "m1"])
        >>> g.ordered_rows()
        [{'v': 1}, {'v': 2}]
        """
        order = sorted(
            range(len(self.rows)),
            key=lambda i: (self.row_keys[i], json.dumps(self.rows[i], sort_keys=True, default=str)),
        )
        return [self.rows[i] for i in order]


def canonical(value: Any) -> Hashable:
    """One hashable form for equal key values: a whole float (``-0.0``, ``2.0``) as its
    integer, a boolean as itself, a list as a tuple, an object as its sorted items.

    >>> canonical(-0.0), canonical(2.0), canonical(True), canonical([1, {"b": 2, "a": [3]}])
    (0, 2, True, (1, (('a', (3,)), ('b', 2))))
    """
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list | tuple):
        return tuple(canonical(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted(((str(k), canonical(v)) for k, v in value.items()), key=lambda kv: kv[0]))
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value  # type: ignore[no-any-return]


class GroupBuffer:
    """Holds rows per key until ``n`` rows or ``timeout_s`` since the first row.

    >>> b = GroupBuffer(n=2, timeout_s=5.0)
    >>> b.add(("a",), {"v": 1}, [1], now=0.0); b.add(("b",), {"v": 2}, [2], now=0.0)
    >>> [g.key for g in b.due(now=1.0)]  # none full, none old
    []
    >>> b.add(("a",), {"v": 3}, [3], now=1.0)
    >>> [(g.key, g.members) for g in b.due(now=1.0)]
    [(('a',), [1, 3])]
    >>> [g.key for g in b.due(now=5.0)]  # the timer flushes the partial group
    [('b',)]
    """

    def __init__(self, n: int, timeout_s: float) -> None:
        self.n = n
        self.timeout_s = timeout_s
        self._groups: dict[tuple[Hashable, ...], Group] = {}
        self._full: list[Group] = []

    def __len__(self) -> int:
        return len(self._groups) + len(self._full)

    def add(
        self,
        key: tuple[Any, ...],
        row: dict[str, Any],
        ids: Sequence[int],
        now: float,
        row_key: str = "",
    ) -> None:
        """Add a row to its group: rows whose ``key`` values are equal share one, and the
        group's key is the canonical form of those values (:func:`canonical`), so it
        does not depend on which row came first. A value of any shape may be a key
        (rows are outside data: a list or an object where a text was expected groups
        too, it never stops the run)."""
        values, key = key, tuple(canonical(v) for v in key)
        g = self._groups.get(key)
        if g is None:
            g = self._groups[key] = Group(key, now, values=values)
        g.rows.append(row)
        g.row_ids.append(tuple(ids))
        g.row_keys.append(row_key)
        if len(g.rows) >= self.n:
            self._full.append(self._groups.pop(key))

    def discard(self, ids: set[int]) -> None:
        """Take out the messages that will not be written through these groups (they
        failed, or their source lost them: they come again). A row of theirs alone is
        dropped; a row they share with other messages (made by a ``group_by`` before)
        stays for those others, who wait for it, as it was added for them only when
        they were live. A group left without rows is dropped.

        >>> b = GroupBuffer(n=3, timeout_s=5.0)
        >>> b.add(("a",), {"v": 1}, [1], now=0.0); b.add(("a",), {"v": 2}, [2], now=0.0)
        >>> b.add(("b",), {"v": 3}, [1], now=0.0); b.add(("c",), {"v": 4}, [1, 3], now=0.0)
        >>> b.discard({1})
        >>> [(g.key, g.members) for g in b.due(now=9.0)]
        [(('a',), [2]), (('c',), [3])]
        """
        if not ids:
            return
        for g in [*self._full, *self._groups.values()]:
            if all(ids.isdisjoint(r) for r in g.row_ids):
                continue
            row_ids = [tuple(m for m in r if m not in ids) for r in g.row_ids]
            keep = [i for i, r in enumerate(row_ids) if r]
            g.rows = [g.rows[i] for i in keep]
            g.row_ids = [row_ids[i] for i in keep]
            g.row_keys = [g.row_keys[i] for i in keep]
        self._full = [g for g in self._full if g.rows]
        self._groups = {k: g for k, g in self._groups.items() if g.rows}

    def due(self, now: float) -> list[Group]:
        """Take the groups that are full or timed out."""
        out, self._full = self._full, []
        old = [k for k, g in self._groups.items() if now - g.started >= self.timeout_s]
        out.extend(self._groups.pop(k) for k in old)
        return out

    def next_deadline(self) -> float | None:
        """When the oldest open group times out (None if there is none)."""
        if self._full:
            return 0.0
        starts = [g.started for g in self._groups.values()]
        return min(starts) + self.timeout_s if starts else None

    def drop_all(self) -> list[Group]:
        """Empty the buffer (shutdown): the caller gives the members back."""
        out = self._full + list(self._groups.values())
        self._full, self._groups = [], {}
        return out
