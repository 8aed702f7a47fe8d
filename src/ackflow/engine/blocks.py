"""Blocks: deliveries that carry several source messages (a run of a file's lines).

A source that can (:meth:`~ackflow.sources.base.Source.use_blocks`) hands the engine a run
of messages as one :class:`~ackflow.core.settlement.Delivery` with ``messages > 1``: one
lineage id, one admission, one settlement, while each message's rows keep the message's
own identity (:meth:`~ackflow.spark.plan.Plan.input_table` makes one input row per
message, keyed as the message alone would be). So the rows and their keys are the ones
the messages make one by one, and a restart that cuts other blocks writes no row twice.

A block never fails as a whole: when any of its messages fails (or its batch does), the
engine settles it ``RELEASED`` and the source delivers its messages again one by one
(:meth:`~ackflow.sources.base.Source.split`), where the usual rules isolate, retry and
dead-letter each (the report counts them in ``split``). Blocks are used only in flows
where nothing keeps state by delivery or drops a row without a receipt (no
``grouped_within``, ``group_by``, window, dedupe or ``transform``) and every sink writes
a row again in place (``Sink.replays_in_place``): a split block's good messages are
written a second time.
"""

from __future__ import annotations

from collections.abc import Sequence

from ackflow.core.settlement import Delivery
from ackflow.flow import Flow, GroupBy, GroupedWithin, Transform


def blocks_allowed(flow: Flow) -> bool:
    """True when ``flow`` may take blocks: no step or sink keeps state per delivery."""
    # a block that fails writes its good lines' rows again: only where that is no second row
    return stateless(flow) and all(s.replays_in_place for s in flow.sinks)


def stateless(flow: Flow) -> bool:
    """True when no step or sink of ``flow`` keeps state by delivery or makes a row of
    several messages: a message's rows are the same whichever messages it runs with."""
    steps = flow.all_steps
    if any(isinstance(s, (GroupBy, GroupedWithin)) for s in steps):
        return False
    if any(isinstance(s, Transform) for s in steps):
        # a transform may drop a row without a receipt: a lost lineage fails its message,
        # and within a block the other lines' receipts would stand for the lost one
        return False
    sinks = [*flow.sinks]
    sinks += [b for s in flow.sinks for b in getattr(s, "branches", ())]
    if any(hasattr(s, "begin_job") or hasattr(s, "let_go") for s in sinks):
        return False  # a window or dedupe: state by delivery
    return bool(sinks)


def messages(deliveries: Sequence[Delivery]) -> int:
    """How many source messages ``deliveries`` carry."""
    return sum(d.messages for d in deliveries)


def live_all(live: dict[str, int], identities: list[str], lineage_id: int) -> bool:
    """Make each of a block's message ``identities`` live under ``lineage_id`` (law 12),
    unless one is live already or repeated in the block: then none (False)."""
    if len(set(identities)) != len(identities) or any(i in live for i in identities):
        return False
    live.update(dict.fromkeys(identities, lineage_id))
    return True
