"""Law 12, one identity, one contribution: two deliveries of one identity in flight at
once (a producer re-sending after a lost confirm, a redelivery racing a slow batch)
never both contribute rows; the second settles as what the first became.

The case from the chaos soak (issue 27 #10): `o-1` processed, then published twice more
with the same message_id; the two copies shared a batch, `group_by` folded both into one
group (a doubled aggregate) under a key digest of its own: the table held ('o-1', 6, 2)
and ('o-1', 12, 4).
"""

from __future__ import annotations

import json

import pytest

import ackflow
from ackflow.testing import KeyedSink, ListSource
from helpers import FAST


def lines(order):
    return [{"id": order["id"], "qty": order["qty"]}, {"id": order["id"], "qty": order["qty"]}]


def orders_flow(src, sink):
    return (
        ackflow.Flow(src)
        .flat_map(lines, name="lines")
        .group_by("id")
        .agg("sum(qty) AS qty", "count(*) AS n")
        .to(sink)
    )


@pytest.mark.spark
def test_a_resent_message_id_in_one_batch_contributes_once(spark):
    body = json.dumps({"id": "o-1", "qty": 3})
    src = ListSource([body, body, body], keys=["o-1", "o-1", "o-1"])
    sink = KeyedSink("orders")
    report = ackflow.run(orders_flow(src, sink), spark=spark, **{**FAST, "batch_size": 10})
    assert sorted((r["id"], r["qty"], r["n"]) for r in sink.rows.values()) == [("o-1", 6, 2)]
    assert report.acked == 3 and report.duplicates == 2
    assert src.final() == {"o-1": "acked"} and src.settled["o-1"] == ["acked"] * 3


def test_a_repeat_of_a_failed_message_is_given_back_not_failed(tmp_path):
    """The first fails (nacked for a retry): its repeat, which contributed nothing, is
    given back, and the message is then written once."""
    marker = str(tmp_path / "tried")

    def flaky(row, _marker=marker):
        import os

        if not os.path.exists(_marker):
            open(_marker, "w").close()
            raise ValueError("first try fails")
        return row

    body = json.dumps({"n": 1})
    src = ListSource(
        [body, body], keys=["m", "m"], policy=ackflow.RetryPolicy(max_deliveries=10, backoff_s=0.01)
    )
    sink = KeyedSink("out")
    flow = ackflow.Flow(src).map(flaky, name="flaky", schema="n BIGINT").to(sink)
    report = ackflow.run(flow, executor="local", **{**FAST, "batch_size": 10})
    assert report.duplicates >= 1 and report.dead_lettered == 0
    assert src.settled["m"][:2] == ["nacked", "released"]  # the repeat: given back
    assert src.settled["m"].count("acked") == 2  # each copy finally, once
    assert len(sink.rows) == 1 and not sink.conflicts
