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

    @property
    def settled(self) -> int:
        return self.acked + self.nacked + self.dead_lettered

    @property
    def messages_per_s(self) -> float:
        return self.settled / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["messages_per_s"] = round(self.messages_per_s, 1)
        d["elapsed_s"] = round(self.elapsed_s, 3)
        return d
