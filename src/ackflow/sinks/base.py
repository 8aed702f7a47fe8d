"""What every sink provides.

A sink is written in two places:

* :meth:`Sink.write_partition` runs **inside a Spark task**, once per partition
  of a batch, with the partition's rows as an Arrow table. The sink object is
  pickled to get there, so it must hold only configuration (open connections in
  ``write_partition``, not in ``__init__``). It returns a :class:`PartitionResult`:
  which rows failed (if any) and an optional *token* for the driver. Raising fails
  every row of the partition, never acks them.
* :meth:`Sink.commit` runs **on the driver** after the job succeeded, with every
  token; only when it returns are the batch's rows counted as written. If it
  raises, every message of the batch fails. :meth:`Sink.abort` is called instead
  when the job failed.

Writes must be safe to repeat: a Spark task may run again (a retry on a cluster),
and a message may be delivered again after a crash.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ackflow.core.errors import ConfigError

#: The column of row keys that sinks with ``wants_keys`` get (see :attr:`Sink.wants_keys`).
ROW_KEY = "__af_key"


@dataclass
class PartitionResult:
    """What one partition write reports: row index → error, and a token for commit.

    An error is a string, or a ``(step, error)`` pair when a composite sink wants the
    failure recorded under another name (a broadcast names the failing branch).

    ``counts`` (optional) reports rows written per branch name, for sinks that
    write to several places (the report then counts rows per branch).
    """

    failed: Mapping[int, str | tuple[str, str]] = field(default_factory=dict)
    token: bytes | None = None
    counts: Mapping[str, int] | None = None


class Sink(ABC):
    """Base class of sinks. Subclass it to write somewhere new."""

    def __init__(self, name: str) -> None:
        if not name or not isinstance(name, str):
            raise ConfigError("a sink needs a non-empty name")
        self.name = name

    #: True: ``write_partition`` also gets a ``__af_key`` column, each row's
    #: deterministic key (its message's identity and its position among the message's
    #: rows), the same when the message is delivered again. Keyed sinks use it to
    #: write a redelivered message's rows in place instead of twice.
    wants_keys: bool = False

    #: True: a row written again with the same key (a message delivered again) changes
    #: nothing, it is no second row. Flows whose every sink says so may read a file's
    #: lines in blocks (:mod:`ackflow.engine.blocks`): a block that fails comes again
    #: line by line, and its good lines' rows are written again.
    replays_in_place: bool = False

    def open(self) -> None:  # noqa: B027
        """Driver side, at start: check the configuration; fail with a clear message."""

    def prepare(self, schema: Any) -> None:  # noqa: B027
        """Driver side, before a job writes rows with these columns (a ``pyarrow.Schema``):
        check or create the destination; raise :class:`~ackflow.core.errors.FlowError`
        (which stops the run) if the rows cannot be written there."""

    @abstractmethod
    def write_partition(self, batch_id: str, partition: int, rows: Any) -> PartitionResult:
        """Task side: write ``rows`` (a ``pyarrow.Table``). See the module docstring."""

    def dead_letter_rows(self, table: Any) -> Any:
        """Driver side, for an error sink (``flow.on_error(sink)``): the dead letters to
        write, given as a ``pyarrow.Table`` in their standard columns (``message``,
        ``body`` as bytes, ``headers`` as JSON text, ``step``, ``error``, ``deliveries``,
        ``failed_at`` as epoch seconds). A sink whose readers are better served by other
        types reshapes them here (PostgreSQL: ``body`` as text, ``failed_at`` as
        ``timestamptz``); the default writes them as they are. Called before
        :meth:`prepare` with the table it returns."""
        return table

    def commit(self, batch_id: str, tokens: Sequence[bytes]) -> None:  # noqa: B027
        """Driver side, after the job succeeded: make the batch's writes visible."""

    def abort(self, batch_id: str, tokens: Sequence[bytes]) -> None:  # noqa: B027
        """Driver side, after the job failed: clean up what the tasks staged."""

    def close(self) -> None:  # noqa: B027
        """Driver side, at the end of a run."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def key_columns(sink: Any) -> list[str]:
    """The columns a sink keys its rows by (``key=``; one name or several), through a
    broadcast's branches too: they are kept even when null in every row of a batch, so
    that such a row fails alone at the sink, never the whole run.

    >>> class S:
    ...     key = "k"
    >>> key_columns(S()), key_columns(object())
    (['k'], [])
    """
    key = getattr(sink, "key", None)
    if key is None:
        return []
    return [key] if isinstance(key, str) else list(key)


def require_columns(sink: str, schema: Any, **columns: str | None) -> None:
    """``prepare``'s check that every configured column (``option=name``; None: not
    set) is among the flow's columns: a FlowError naming the option and the columns."""
    from ackflow.core.errors import FlowError

    for option, col in columns.items():
        if col is not None and col not in schema.names:
            raise FlowError(sink, f"{option} {col!r} is not among the flow's columns {list(schema.names)}")


def null_key_failures(rows: Any, key: Sequence[str] | None) -> dict[int, str]:
    """The rows (index -> reason) of an Arrow table whose ``key=`` column is null: each
    keyed sink fails them alone. A null is no key: it cannot be deduplicated (two null
    keys are one for ``DISTINCT ON``, a manifest or a set) nor overwritten in place
    (SQL's ``ON CONFLICT`` never matches NULL), so a redelivery would write it twice."""
    failed: dict[int, str] = {}
    for k in key or ():
        for i, null in enumerate(rows.column(k).is_null().to_pylist()):
            if null:
                failed.setdefault(i, f"key column {k!r} has no value (a null key cannot be written once)")
    return failed


def missing_id(value: Any, option: str, column: str | None) -> str | None:
    """Why a row's message id (the value of the ``option`` column) cannot be used, or
    None. Null and empty ids fail their row: a stand-in (``"None"``, the row key) would
    be one id for many rows, or one namespace with the column's own ids."""
    if value is None or value in ("", b""):
        return f"{option} {column!r} is empty: the row has no message id"
    return None
