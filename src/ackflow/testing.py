"""Helpers for testing flows: a scripted in-memory source and a failing sink.

:class:`ListSource` serves fixed message bodies and records how each delivery was
settled, so a test can assert the ack algebra: acked iff every derived row was
written, and settled exactly once.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from ackflow.core.ledger import Failure
from ackflow.core.policy import RetryPolicy
from ackflow.core.settlement import Delivery, Settlement
from ackflow.sinks.base import PartitionResult, Sink
from ackflow.sources.base import Source


class ListSource(Source):
    """Serve ``bodies`` (bytes or str) in order; failed ones come back per ``policy``.

    ``settled[key]`` lists every settlement of the message with that key, in order
    (``"acked"``, ``"nacked"``, ``"dead_lettered"``, ``"released"``);
    ``failures[key]`` keeps the last failure. Keys are ``"m0"``, ``"m1"``, ... or
    ``keys`` if given (a message's stable identity, as a broker's message id).
    """

    def __init__(
        self,
        bodies: Iterable[bytes | str],
        *,
        format: str = "json",
        policy: RetryPolicy | None = None,
        name: str = "list",
        keys: Sequence[str] | None = None,
    ) -> None:
        super().__init__(format=format, name=name)
        self.policy = policy or RetryPolicy(max_deliveries=1)
        self._bodies = [b.encode() if isinstance(b, str) else b for b in bodies]
        self._ready: list[int] = list(range(len(self._bodies)))
        self._delayed: list[tuple[float, int]] = []
        self.deliveries: Counter[str] = Counter()
        self.settled: dict[str, list[str]] = {}
        self.failures: dict[str, Failure] = {}
        self.dead_letters: dict[str, Failure] = {}
        self._lock = threading.Lock()
        self._keys = list(keys) if keys is not None else None
        if self._keys is not None and len(self._keys) != len(self._bodies):
            raise ValueError("keys and bodies must have the same length")

    def key(self, index: int) -> str:
        return self._keys[index] if self._keys is not None else f"m{index}"

    def pull(self, max_messages: int, timeout: float) -> list[Delivery]:
        deadline = time.monotonic() + timeout
        while True:
            now = time.monotonic()
            due = [i for t, i in self._delayed if t <= now]
            if due:
                self._delayed = [(t, i) for t, i in self._delayed if t > now]
                self._ready.extend(due)
            if self._ready or now >= deadline:
                break
            time.sleep(0.005)
        take, self._ready = self._ready[:max_messages], self._ready[max_messages:]
        out = []
        for i in take:
            k = self.key(i)
            self.deliveries[k] += 1
            out.append(Delivery(0, k, self._bodies[i], {}, self.deliveries[k], handle=i))
        return out

    def _record(self, d: Delivery, what: str) -> None:
        self.settled.setdefault(d.key, []).append(what)

    def ack(self, deliveries: Sequence[Delivery]) -> None:
        for d in deliveries:
            self._record(d, "acked")

    def fail(self, failures: Sequence[tuple[Delivery, Failure]]) -> list[Settlement]:
        out = []
        for d, f in failures:
            self.failures[d.key] = f
            if self.policy.exhausted(d.delivery_count):
                self.dead_letters[d.key] = f
                self._record(d, "dead_lettered")
                out.append(Settlement.DEAD_LETTERED)
            else:
                self.nack([(d, f)])
                out.append(Settlement.NACKED)
        return out

    def nack(self, failures: Sequence[tuple[Delivery, Failure]]) -> None:
        for d, f in failures:
            self.failures[d.key] = f
            self._record(d, "nacked")
            self._delayed.append(
                (time.monotonic() + self.policy.delay_after(d.delivery_count), int(d.handle))  # type: ignore[call-overload]
            )

    def release(self, deliveries: Sequence[Delivery]) -> None:
        """Give back without spending a delivery (as the embedded queue does)."""
        for d in deliveries:
            self._record(d, "released")
            self.deliveries[d.key] -= 1
            self._ready.append(int(d.handle))  # type: ignore[call-overload]

    def final(self) -> dict[str, str]:
        """The last settlement of every message that was delivered."""
        return {k: v[-1] for k, v in self.settled.items()}


class FailingSink(Sink):
    """A sink that fails rows for which ``fail_if(row)`` is true, or raises for the
    whole partition when ``raise_if(row)`` holds for any row; others are kept like
    :class:`~ackflow.sinks.MemorySink`."""

    def __init__(self, *, fail_if: Any = None, raise_if: Any = None, name: str = "failing") -> None:
        super().__init__(name)
        self.fail_if = fail_if
        self.raise_if = raise_if
        self.rows: list[dict[str, Any]] = []

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "rows": []}

    def write_partition(self, batch_id: str, partition: int, rows: Any) -> PartitionResult:
        from ackflow.sinks.memory import _to_ipc

        records = rows.to_pylist()
        if self.raise_if is not None and any(self.raise_if(r) for r in records):
            raise ValueError("sink exploded mid-write")  # (a row's data: its partition fails)
        failed = {}
        if self.fail_if is not None:
            failed = {i: "row refused by the sink" for i, r in enumerate(records) if self.fail_if(r)}
        keep = [i for i in range(len(records)) if i not in failed]
        return PartitionResult(failed=failed, token=_to_ipc(rows.take(keep)) if keep else None)

    def commit(self, batch_id: str, tokens: Sequence[bytes]) -> None:
        from ackflow.sinks.memory import _from_ipc

        for t in tokens:
            self.rows.extend(_from_ipc(t))


def present(value: Any) -> Any:
    """``value`` without its null fields, at every depth: a row written before a column
    was added and the same row written after it (null there) are one row, as a table
    holding both would read them."""
    if isinstance(value, dict):
        return {k: present(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [present(v) for v in value]
    return value


class KeyedSink(Sink):
    """An in-memory keyed sink (like PostgreSQL with ``key=``): rows are upserted by
    their row key, so a row written again after a redelivery is the same row.

    ``rows`` maps row key -> row; ``writes`` counts how often each key was committed;
    ``conflicts`` lists keys that were written with two different values (two rows
    sharing one identity: a lost row; null fields do not count, see :func:`present`).
    Rows where ``fail_if(row)`` are refused, a partition with a row where
    ``raise_if(row)`` raises, and the ``n``-th commit fails before
    (``fail_commits={n: "before"}``) or after (``"after"``) applying its rows.
    """

    wants_keys = True
    replays_in_place = True

    def __init__(
        self,
        name: str = "keyed",
        *,
        fail_if: Any = None,
        raise_if: Any = None,
        fail_commits: dict[int, str] | None = None,
    ) -> None:
        super().__init__(name)
        self.fail_if = fail_if
        self.raise_if = raise_if
        self.fail_commits = dict(fail_commits or {})
        self.rows: dict[str, dict[str, Any]] = {}
        self.writes: Counter[str] = Counter()
        self.conflicts: list[str] = []
        self.commits = 0
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:  # tasks get the predicates, not the data
        return {"name": self.name, "fail_if": self.fail_if, "raise_if": self.raise_if}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(  # type: ignore[misc]
            state["name"],
            fail_if=state["fail_if"],
            raise_if=state["raise_if"],
        )

    def same(self, old: dict[str, Any], new: dict[str, Any]) -> bool:
        """Whether a row written again under its key is the same row (null fields do not
        count); a subclass may compare more loosely (e.g. put ``_rescued`` back)."""
        return bool(present(old) == present(new))

    def write_partition(self, batch_id: str, partition: int, rows: Any) -> PartitionResult:
        from ackflow.sinks.base import ROW_KEY
        from ackflow.sinks.memory import _to_ipc

        records = rows.to_pylist()
        if self.raise_if is not None and any(self.raise_if(r) for r in records):
            raise ValueError(f"sink {self.name} exploded mid-write")
        failed = {}
        if self.fail_if is not None:
            failed = {i: "row refused by the sink" for i, r in enumerate(records) if self.fail_if(r)}
        keep = [i for i in range(len(records)) if i not in failed]
        if len({records[i][ROW_KEY] for i in keep}) != len(keep):
            raise RuntimeError(f"sink {self.name}: two rows of one partition share a key")
        return PartitionResult(failed=failed, token=_to_ipc(rows.take(keep)) if keep else None)

    def commit(self, batch_id: str, tokens: Sequence[bytes]) -> None:
        from ackflow.sinks.base import ROW_KEY
        from ackflow.sinks.memory import _from_ipc

        with self._lock:
            self.commits += 1
            when = self.fail_commits.pop(self.commits, None)
            if when == "before":
                raise RuntimeError(f"sink {self.name}: commit {self.commits} failed (injected)")
            for t in tokens:
                for row in _from_ipc(t):
                    key = row.pop(ROW_KEY)
                    if key in self.rows and not self.same(self.rows[key], row):
                        self.conflicts.append(key)
                    self.rows[key] = row
                    self.writes[key] += 1
            if when == "after":
                raise RuntimeError(f"sink {self.name}: commit {self.commits} applied, then failed (injected)")
