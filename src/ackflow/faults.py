"""Named fault points (DESIGN.md, law 11: every boundary is a fault point).

Code marks each place where a crash or an error changes what is durable with
``faults.point("name")``. When nothing is armed this is one dictionary check and
costs nothing. A test, or the chaos soak, arms a point to *raise*
:class:`InjectedFault` or to *exit* the process at once (``os._exit``, like a
SIGKILL: no cleanup, no flush) on its n-th hit:

>>> from ackflow import faults
>>> faults.arm("doc.example", "raise", nth=2)
>>> faults.point("doc.example")            # first hit: nothing happens
>>> faults.point("doc.example")
Traceback (most recent call last):
...
ackflow.faults.InjectedFault: fault point 'doc.example' (hit 2)
>>> faults.point("doc.example")            # fired once, then disarmed

A process started with ``ACKFLOW_FAULTS="name=exit@3,other=raise@1"`` arms those
points at import (hits are counted per process; Spark's Python workers inherit the
variable, so points inside tasks can be armed that way too).

Every point in the code is listed in :data:`POINTS`; arming an unknown name is an
error, so a renamed point cannot silently stop being tested.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass

#: Every named point, with where it sits. Names are ``area.moment``.
POINTS: dict[str, str] = {
    "doc.example": "the docstring's example (no effect in the engine)",
    "schema.recorded": "a new version of a segment's columns is in the schema store; no sink "
    "evolved to it, no row of it written",
    "batch.after_job": "a batch's Spark job returned; no sink committed yet",
    "batch.after_commit": "every sink committed the batch; nothing acked yet",
    "engine.mid_ack": "between two chunks of a multi-message ack",
    "engine.before_fail": "before failed messages are nacked or dead-lettered at the source",
    "engine.dead_letter_written": "the error sink wrote dead letters; the source not settled",
    "embedded.schema": "embedded queue file creation: after each table or index of the "
    "schema, inside its one transaction",
    "engine.drain": "shutdown: while draining in-flight batches",
    "parquet.evolved": "Parquet prepare: the dataset's schema (_common_metadata) was "
    "evolved; prepare not returned",
    "parquet.before_record": "Parquet commit: files staged, batch not yet in the manifest",
    "parquet.after_record": "Parquet commit: batch recorded in the manifest, not renamed",
    "parquet.after_rename": "Parquet commit: batch directory renamed into place",
    "delta.evolved": "Delta prepare: the schema merge's version is committed (and fsynced); "
    "prepare not returned",
    "delta.before_commit": "Delta commit: task files written, rows already written left out, "
    "no Delta version yet",
    "delta.after_commit": "Delta commit: the version is in the log, its keys not yet recorded",
    "delta.after_record": "Delta commit: version and keys recorded, nothing acked yet",
    "delta.after_checkpoint": "Delta log trim: a checkpoint created (none recent enough), nothing deleted",
    "delta.after_trim": "Delta log trim: entries older than a checkpoint deleted",
    "iceberg.evolved": "Iceberg prepare: the schema update is committed; prepare not returned",
    "iceberg.before_commit": "Iceberg commit: task files written, no snapshot yet",
    "iceberg.committed": "Iceberg commit: the catalog points at the new snapshot; none of "
    "its files fsynced yet",
    "iceberg.synced_data": "Iceberg commit: the snapshot's data files fsynced",
    "iceberg.synced_manifests": "Iceberg commit: the manifests the snapshot wrote fsynced",
    "iceberg.synced_manifest_list": "Iceberg commit: the snapshot's manifest list fsynced",
    "iceberg.after_commit": "Iceberg commit: the snapshot is committed and every file it "
    "references (and the metadata JSON) durable; its keys not yet "
    "recorded",
    "iceberg.after_expire": "Iceberg maintenance: old snapshots expired, the files only "
    "they referenced not yet deleted",
    "iceberg.after_record": "Iceberg commit: snapshot and keys recorded, nothing acked yet",
    "postgres.evolved": "Postgres prepare: ALTER TABLE (new columns, widened types) "
    "committed; prepare not returned",
    "postgres.before_commit": "Postgres partition write: rows upserted, COMMIT not sent",
    "postgres.after_commit": "Postgres partition write: COMMIT done, task not returned",
    "dedupe.after_claim": "dedupe task: the partition's claims are committed; the sink has "
    "not written its rows",
    "dedupe.after_output": "dedupe commit: the sink committed the job's rows; its claims not "
    "yet marked committed",
    "state.watermark": "window state: the watermark moved (inside a batch's state transaction, "
    "or the idle advance's own update just committed)",
    "state.before_commit": "window state: a batch's partials, applied keys and watermark are "
    "in the transaction; COMMIT not sent",
    "state.after_commit": "window state: a batch's contribution is committed; nothing acked yet",
    "state.compact": "window state: the change log folded into the windows table, not yet "
    "emptied (inside the compaction's transaction)",
    "state.after_output": "window results: written and committed in the output sink; not yet "
    "deleted from the state store",
    "source.reconnect": "a source is about to reconnect to its broker",
    "rabbitmq.ack": "RabbitMQ source: before an ack (single or multiple) is sent",
    "rabbitmq.nack": "RabbitMQ source: before a nack or reject is sent",
    "rabbitmq.dead_letter": "RabbitMQ source: before a dead letter is published",
    "embedded.before_ack": "embedded queue: before the ack transaction",
    "files.before_commit": "Files source: before a state store transaction commits",
    "kafka.attempt_recorded": "Kafka source: a failed message's delivery count is in the "
    "attempts file; its retry not scheduled yet",
    "kafka.before_commit": "Kafka source: settled prefixes known, offsets not committed",
    "kafka.after_commit": "Kafka source: offsets committed, the attempts file not trimmed",
    "kafka.dead_lettered": "Kafka source: dead letters delivered to the dead-letter topic; "
    "their offsets not settled yet",
    "kafka.revoke_settled": "Kafka source: a revoke waited for its partitions' messages in "
    "flight; their offsets not committed yet",
    "dlq.peek_copied": "ackflow dlq peek: a message's copy is confirmed at the queue's "
    "tail, the original not yet acked",
    "dlq.replay_published": "ackflow dlq replay: the copy is confirmed at the target, the "
    "dead letter not yet acked",
}


class InjectedFault(RuntimeError):
    """Raised by an armed fault point (action ``raise``)."""


@dataclass
class _Arm:
    action: str  # "raise" | "exit"
    nth: int


_armed: dict[str, _Arm] = {}
_hits: dict[str, int] = {}
_lock = threading.Lock()


def point(name: str) -> None:
    """Mark a fault point. Free when nothing is armed."""
    if not _armed:
        return
    _hit(name)


def _hit(name: str) -> None:
    with _lock:
        n = _hits[name] = _hits.get(name, 0) + 1
        arm = _armed.get(name)
        if arm is None or n != arm.nth:
            return
        del _armed[name]
    if arm.action == "exit":
        sys.stderr.write(f"ackflow: fault point {name!r} (hit {n}): exiting now\n")
        sys.stderr.flush()
        os._exit(137)
    raise InjectedFault(f"fault point {name!r} (hit {n})")


def arm(name: str, action: str = "raise", *, nth: int = 1) -> None:
    """Make point ``name`` raise (``"raise"``) or kill the process (``"exit"``) on its
    ``nth`` hit from now (hits are counted from this call)."""
    if name not in POINTS:
        raise ValueError(f"unknown fault point {name!r}; known: {', '.join(sorted(POINTS))}")
    if action not in ("raise", "exit"):
        raise ValueError(f"fault action must be 'raise' or 'exit', got {action!r}")
    if nth < 1:
        raise ValueError("nth must be >= 1")
    with _lock:
        _hits[name] = 0
        _armed[name] = _Arm(action, nth)
    # hits counted from now on need _hit() to run: _armed is non-empty now


def disarm(name: str | None = None) -> None:
    """Disarm ``name`` (or every point)."""
    with _lock:
        if name is None:
            _armed.clear()
        else:
            _armed.pop(name, None)


def hits(name: str) -> int:
    """How often ``name`` was passed since it was last armed (counted only while some
    point is armed)."""
    return _hits.get(name, 0)


def active() -> bool:
    """True while any point is armed (for code that must do extra work to *have* a point,
    such as splitting an ack in two to have a middle)."""
    return bool(_armed)


def armed() -> dict[str, tuple[str, int]]:
    """The armed points: name -> (action, nth)."""
    with _lock:
        return {k: (v.action, v.nth) for k, v in _armed.items()}


def parse(spec: str) -> dict[str, tuple[str, int]]:
    """Parse ``"name=exit@3,other=raise"`` (``@n`` defaults to 1)."""
    out: dict[str, tuple[str, int]] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, rest = part.partition("=")
        if not sep:
            raise ValueError(f"fault spec {part!r}: expected name=raise|exit[@n]")
        action, _, nth = rest.partition("@")
        out[name.strip()] = (action.strip(), int(nth) if nth else 1)
    return out


def _arm_from_env() -> None:
    spec = os.environ.get("ACKFLOW_FAULTS", "")
    if not spec:
        return
    for name, (action, nth) in parse(spec).items():
        arm(name, action, nth=nth)


_arm_from_env()
