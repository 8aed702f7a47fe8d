"""What a run reports."""

from __future__ import annotations

import collections
import re
from dataclasses import asdict, dataclass, field
from typing import Any

#: distinct (step, reason) pairs a report counts; later new ones are counted as "other"
REASONS_MAX = 1000


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
    #: messages of blocks that were split (one of them failed): sent again one by one, so
    #: pulled = acked + nacked + dead_lettered + released + split (engine/blocks.py)
    split: int = 0
    given_back_systemic: int = 0
    systemic_episodes: int = 0
    systemic: dict[str, Any] | None = None
    active_s: float = 0.0  # elapsed_s without the closing until_idle wait
    #: the current version of each segment's stored columns (ackflow.core.schema)
    schema_versions: dict[str, int] = field(default_factory=dict)
    #: this run's new versions: segment, version, changes, brought_by (message), at
    schema_changes: list[dict[str, Any]] = field(default_factory=list)
    #: dead letters per (step, reason: the error's first line with its numbers as "N"),
    #: for :meth:`summary` (not in :meth:`as_dict`, whose keys stay as they were)
    dead_letter_reasons: collections.Counter[tuple[str, str]] = field(
        default_factory=collections.Counter, repr=False
    )
    #: the first error seen of each reason, and whether others of it differed
    reason_examples: dict[tuple[str, str], tuple[str, bool]] = field(default_factory=dict, repr=False)

    def count_reason(self, step: str, error: str) -> None:
        """Count one dead letter's reason: its error's first line (cut to 100 chars), with
        numbers made alike so that "bad row 3" and "bad row 7" are one reason."""
        lines = error.strip().splitlines()
        text = lines[0][:100] if lines else "(no error text)"
        key = (step, re.sub(r"\d+", "N", text))
        if key not in self.dead_letter_reasons and len(self.dead_letter_reasons) >= REASONS_MAX:
            key = (step, "(other reasons)")
        self.dead_letter_reasons[key] += 1
        first, varied = self.reason_examples.get(key, (text, False))
        self.reason_examples[key] = (first, varied or first != text)

    @property
    def settled(self) -> int:
        return self.acked + self.nacked + self.dead_lettered

    @property
    def messages_per_s(self) -> float:
        span = self.active_s if self.active_s > 0 else self.elapsed_s
        return self.settled / span if span > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("dead_letter_reasons")
        d.pop("reason_examples")
        d["messages_per_s"] = round(self.messages_per_s, 1)
        d["elapsed_s"] = round(self.elapsed_s, 3)
        d["active_s"] = round(self.active_s, 3)
        if self.failures_total > len(self.failures):
            d["failures_cut"] = f"the first {len(self.failures)} of {self.failures_total} failures are listed"
        return d

    def summary(self) -> str:
        """A few lines for a person (``ackflow run`` without ``--json``).

        >>> r = RunReport(acked=98, dead_lettered=2, elapsed_s=2.0, active_s=2.0,
        ...               dead_lettered_by_step={"parse": 2},
        ...               rows_written={"orders": 98, "dead": 2})
        >>> r.count_reason("parse", "ValueError: bad json at line 3")
        >>> r.count_reason("parse", "ValueError: bad json at line 12")
        >>> print(r.summary())
        ackflow run: 100 messages settled in 2.0 s (50 messages/s)
          acked              98
          dead-lettered       2   parse: 2
            2 x parse: ValueError: bad json at line 3 (and alike)
          rows written       orders: 98, dead: 2
        """
        n = f"{self.settled:,}"
        lines = [
            f"ackflow run: {n} messages settled in {self.elapsed_s:.1f} s "
            f"({self.messages_per_s:,.0f} messages/s)",
            f"  acked          {self.acked:>6,}",
        ]
        if self.dead_lettered:
            steps = ", ".join(
                f"{k}: {v:,}" for k, v in sorted(self.dead_lettered_by_step.items(), key=lambda kv: -kv[1])
            )
            lines.append(f"  dead-lettered  {self.dead_lettered:>6,}   {steps}")
            top = self.dead_letter_reasons.most_common(3)
            for key, c in top:
                first, varied = self.reason_examples.get(key, (key[1], False))
                lines.append(f"    {c:,} x {key[0]}: {first}" + (" (and alike)" if varied else ""))
            rest = len(self.dead_letter_reasons) - len(top)
            if rest > 0:
                lines.append(f"    ... and {rest:,} other reason(s)")
        optional = [
            (self.nacked, "nacked", "failed, given back for a retry"),
            (self.released, "released", "given back unprocessed at shutdown"),
            (self.recovered, "recovered", "in flight at a crash, processed again"),
            (self.redelivered, "redelivered", "could not be settled: the broker sends them again"),
            (self.duplicates, "duplicates", "a copy of an identity already in flight"),
            (self.split, "split", "in a block with a failing message: sent again one by one"),
            (self.given_back_systemic, "given back", "every message failed alike (a systemic failure)"),
        ]
        lines += [f"  {label:<14} {value:>6,}   {why}" for value, label, why in optional if value]
        if self.systemic:
            lines.append(
                f"  systemic failure at step {self.systemic.get('step')!r}: {self.systemic.get('error')}"
            )
        if self.rows_written:
            rows = ", ".join(f"{k}: {v:,}" for k, v in self.rows_written.items())
            lines.append(f"  rows written       {rows}")
        for change in self.schema_changes:
            changes = change.get("changes") or []
            more = f" (+{len(changes) - 3} more)" if len(changes) > 3 else ""
            who = f", brought by message {change['brought_by']}" if change.get("brought_by") else ""
            lines.append(
                f"  schema: {change.get('segment')} version {change.get('version')}"
                f"{who}: {'; '.join(map(str, changes[:3]))}{more}"
            )
        return "\n".join(lines)
