"""What a run reports."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RunReport:
    """Totals of one :func:`ackflow.run`.

    ``recovered`` counts deliveries that a dead consumer had in flight and that this
    run received again: the only messages whose rows may have been written twice.
    ``released`` counts messages given back unprocessed at shutdown.
    ``redelivered`` counts deliveries the source could no longer settle (a broker
    connection or channel died under them): the broker delivers them again.
    ``given_back_systemic`` counts failed deliveries given back (not nacked, never
    dead-lettered) because every message failed the same way at one step (a systemic
    failure, :mod:`ackflow.core.systemic`); ``systemic`` is the episode in progress (its
    step, error, start, deliveries and batches) or None, ``systemic_episodes`` how many
    began. ``failures`` holds the first few failures (``failures_total`` counts them all).
    ``messages_per_s`` is over ``active_s``: the run's time without the final
    ``until_idle`` wait. ``schema_versions`` and ``schema_changes`` show the flow's
    stored columns (:mod:`ackflow.core.schema`): each version this run made, with the
    message that brought it.
    """

    acked: int = 0
    nacked: int = 0
    dead_lettered: int = 0
    released: int = 0
    recovered: int = 0
    redelivered: int = 0
    pulled: int = 0
    rows_written: dict[str, int] = field(default_factory=dict)
    batches: int = 0
    jobs: int = 0
    bisections: int = 0
    elapsed_s: float = 0.0
    throttle_episodes: int = 0
    batch_p50_s: float = 0.0
    batch_p99_s: float = 0.0
    dead_lettered_by_step: dict[str, int] = field(default_factory=dict)
    failures: list[dict[str, str]] = field(default_factory=list)  # the first few, for people
    failures_total: int = 0
    duplicates: int = 0  # deliveries of an identity already in flight (settled as it was)
    given_back_systemic: int = 0
    systemic_episodes: int = 0
    systemic: dict[str, Any] | None = None
    active_s: float = 0.0  # elapsed_s without the closing until_idle wait
    #: the current version of each segment's stored columns (ackflow.core.schema)
    schema_versions: dict[str, int] = field(default_factory=dict)
    #: this run's new versions: segment, version, changes, brought_by (message), at
    schema_changes: list[dict[str, Any]] = field(default_factory=list)

    @property
    def settled(self) -> int:
        return self.acked + self.nacked + self.dead_lettered

    @property
    def messages_per_s(self) -> float:
        span = self.active_s if self.active_s > 0 else self.elapsed_s
        return self.settled / span if span > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["messages_per_s"] = round(self.messages_per_s, 1)
        d["elapsed_s"] = round(self.elapsed_s, 3)
        d["active_s"] = round(self.active_s, 3)
        if self.failures_total > len(self.failures):
            d["failures_cut"] = (f"the first {len(self.failures)} of {self.failures_total} "
                                 "failures are listed")
        return d
