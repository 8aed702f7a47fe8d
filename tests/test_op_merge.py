"""merge: one flow over several sources; each message settles at its own source."""

import json

import pytest

import ackflow
from ackflow.core import ConfigError
from ackflow.embedded import EmbeddedQueue
from ackflow.sinks import MemorySink
from ackflow.sources import EmbeddedQueueSource
from ackflow.testing import ListSource
from helpers import FAST

pytestmark = pytest.mark.spark


def test_merged_sources_keep_their_formats_and_settle_at_home(spark, tmp_path):
    a = ListSource([json.dumps({"v": i}) for i in range(10)] + ["oops"], name="a")
    db = str(tmp_path / "q.db")
    EmbeddedQueue(db).publish("b", [f"text {i}".encode() for i in range(5)],
                              msg_ids=[f"m{i}" for i in range(5)])  # same keys as source a
    b = EmbeddedQueueSource(db, "b", format="text", name="b")

    def shape(r):
        return {"v": r["v"] if "v" in r else len(r["body"])}

    sink = MemorySink()
    report = ackflow.run(ackflow.merge(ackflow.Flow(a), ackflow.Flow(b)).map(shape, name="shape")
                         .to(sink), spark=spark, **FAST)
    assert report.acked == 15 and report.dead_lettered == 1
    assert sorted(r["v"] for r in sink.rows) == sorted([*range(10), *([6] * 5)])
    assert a.final()["m10"] == "dead_lettered" and len(a.final()) == 11
    stats = EmbeddedQueue(db).stats("b")
    assert stats["acked_total"] == 5 and stats["ready"] + stats["leased"] == 0


def test_merge_needs_bare_flows():
    a, b = ListSource([], name="a"), ListSource([], name="b")
    with pytest.raises(ConfigError, match="only a source"):
        ackflow.merge(ackflow.Flow(a).map(lambda r: r), ackflow.Flow(b))
    with pytest.raises(ConfigError, match="unique"):
        ackflow.merge(ackflow.Flow(a), ackflow.Flow(ListSource([], name="a")))
