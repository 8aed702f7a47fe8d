"""Broadcast: one stream written to several sinks, in the same Spark job."""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from ackflow.core.errors import ROW_DATA_MARK, WHOLE_WRITE, ConfigError, whole_write
from ackflow.sinks.base import ROW_KEY as KEY
from ackflow.sinks.base import PartitionResult, Sink, key_columns

MODES = ("all", "primary")


class Broadcast(Sink):
    """Write every row to several sinks (branches).

    * ``mode="all"``: a row counts as written only when **every** branch wrote it; a
      branch's failure fails the row, and the error names the branch.
    * ``mode="primary"``: the row goes to the first branch; rows it fails (or all, if
      it raises) are tried on each ``fallback`` sink in turn. A row counts as written
      when the primary or a fallback wrote it; the primary's failure is logged with the
      batch and counted in ``rows_written`` of the fallback that took the row.

    Each branch stages in the task and commits on the driver like a lone sink. If any
    branch's commit fails, the whole batch fails (nothing is acked).
    """

    def __init__(
        self, *branches: Sink, mode: str = "all", fallback: Sequence[Sink] = (), name: str = "broadcast"
    ) -> None:
        super().__init__(name)
        if mode not in MODES:
            raise ConfigError(f"broadcast: mode must be 'all' or 'primary', got {mode!r}")
        if not branches or not all(isinstance(b, Sink) for b in branches):
            raise ConfigError("broadcast: give one or more ackflow sinks as branches")
        if mode == "all" and fallback:
            raise ConfigError("broadcast: fallback= needs mode='primary'")
        if mode == "primary" and len(branches) != 1:
            raise ConfigError("broadcast(mode='primary'): give one primary sink and fallback=[...]")
        self.branches: tuple[Sink, ...] = (*branches, *fallback)
        names = [b.name for b in self.branches]
        if len(set(names)) != len(names):
            raise ConfigError(f"broadcast: branch names must be unique, got {names}")
        self.mode = mode
        self.wants_keys = any(b.wants_keys for b in self.branches)
        self.replays_in_place = all(b.replays_in_place for b in self.branches)
        # the branches' key columns, kept through the writer (a null key fails its row)
        self.key = list(dict.fromkeys(k for b in self.branches for k in key_columns(b))) or None

    def open(self) -> None:
        for b in self.branches:
            b.open()

    def prepare(self, schema: Any) -> None:
        for b in self.branches:
            b.prepare(self._schema_for(b, schema))

    def _not_for(self, branch: Sink, schema: pa.Schema) -> list[str]:
        """Other branches' key columns of the null type, kept for them only: ``branch``
        does not key by them, and a sink would have to guess their type (the writer
        leaves such a column out of a lone sink that does not key by it)."""
        mine = key_columns(branch)
        return [
            k
            for k in self.key or []
            if k not in mine and k in schema.names and pa.types.is_null(schema.field(k).type)
        ]

    def _schema_for(self, branch: Sink, schema: Any) -> Any:
        """The columns as ``branch`` gets them (:meth:`_not_for`)."""
        drop = self._not_for(branch, schema)
        return pa.schema([f for f in schema if f.name not in drop]) if drop else schema

    def _rows_for(self, branch: Sink, rows: Any) -> Any:
        """The rows as ``branch`` expects them: with the row keys only if it wants them,
        without the columns of :meth:`_not_for`."""
        drop = [KEY] if KEY in rows.column_names and not branch.wants_keys else []
        drop += self._not_for(branch, rows.schema)
        return rows.drop_columns(drop) if drop else rows

    def write_partition(self, batch_id: str, partition: int, rows: Any) -> PartitionResult:
        n = rows.num_rows
        tokens: dict[str, bytes | None] = {}
        counts: dict[str, int] = {}
        if self.mode == "all":
            failed: dict[int, str | tuple[str, str]] = {}
            for b in self.branches:
                try:
                    res = b.write_partition(batch_id, partition, self._rows_for(b, rows))
                except Exception as e:  # noqa: BLE001 - a branch failure fails its rows
                    whole = whole_write(e, branch=b.name, at=False)
                    res = PartitionResult(failed={i: (b.name, whole) for i in range(n)})
                for i, err in res.failed.items():
                    text = err[1] if isinstance(err, tuple) else err
                    if not text.startswith(WHOLE_WRITE):
                        text = f"branch {b.name!r}: {text}"
                    failed.setdefault(i, (b.name, text))
                tokens[b.name] = res.token
                counts[b.name] = n - len(res.failed)
            return PartitionResult(failed=failed, token=pickle.dumps(tokens), counts=counts)
        remaining = list(range(n))
        errors: dict[int, list[str]] = {}
        for b in self.branches:
            if not remaining:
                break
            subset = self._rows_for(b, rows.take(remaining))
            try:
                res = b.write_partition(batch_id, partition, subset)
                bad: dict[int, Any] = dict(res.failed)
            except Exception as e:  # noqa: BLE001
                res = PartitionResult()
                bad = {i: whole_write(e, at=False) for i in range(len(remaining))}
            tokens[b.name] = res.token
            counts[b.name] = len(remaining) - len(bad)
            for i, err in bad.items():
                text = err[1] if isinstance(err, tuple) else err
                errors.setdefault(remaining[i], []).append(f"branch {b.name!r}: {text}")
            remaining = [remaining[i] for i in sorted(bad)]
        primary = self.branches[0].name

        def joined(texts: list[str]) -> str:  # a write as a whole only if every branch's was
            if not all(ROW_DATA_MARK in t for t in texts):  # a row's data only if every branch says so
                texts = [t.replace(ROW_DATA_MARK, "") for t in texts]
            text = "; ".join(t.replace(WHOLE_WRITE, "", 1) for t in texts)
            whole = all(WHOLE_WRITE in t for t in texts)
            return f"{WHOLE_WRITE}{text}" if whole else text

        failed = {i: (primary, joined(errors[i])) for i in remaining}
        return PartitionResult(failed=failed, token=pickle.dumps(tokens), counts=counts)

    def _split(self, tokens: Sequence[bytes]) -> dict[str, list[bytes]]:
        per: dict[str, list[bytes]] = {b.name: [] for b in self.branches}
        for t in tokens:
            for name, tok in pickle.loads(t).items():
                if tok is not None:
                    per[name].append(tok)
        return per

    def commit(self, batch_id: str, tokens: Sequence[bytes]) -> None:
        per = self._split(tokens)
        for b in self.branches:
            try:
                b.commit(batch_id, per[b.name])
            except Exception as e:
                raise RuntimeError(f"branch {b.name!r}: commit failed: {e}") from e

    def abort(self, batch_id: str, tokens: Sequence[bytes]) -> None:
        per = self._split(tokens)
        for b in self.branches:
            b.abort(batch_id, per[b.name])

    def close(self) -> None:
        for b in self.branches:
            b.close()
