"""A message's identity is unique to it, and so is every row key derived from it.

Keyed sinks (Parquet's manifest, PostgreSQL's upsert, Delta and Iceberg) keep one row
per key: two messages whose rows share a key lose one of them, acked. These tests name
messages after other messages' keys, children and repeats, and check both are written.
"""

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import ackflow
from ackflow.core.errors import ConfigError
from ackflow.core.settlement import Delivery
from ackflow.embedded import EmbeddedQueue, message_key
from ackflow.sinks import EmbeddedQueueSink, ParquetSink
from ackflow.sinks.base import ROW_KEY, PartitionResult, Sink
from ackflow.sources import EmbeddedQueueSource
from ackflow.sources.merge import MergedSource
from ackflow.sources.rabbitmq_keys import message_key as amqp_key
from ackflow.spark.rows import (
    ERR,
    FAILED,
    ID,
    LIVE,
    STATUS,
    STEP,
    child_key,
    row_key,
)
from ackflow.spark.writer import make_writer, unique_keys
from ackflow.testing import ListSource
from helpers import FAST


def written(path):
    rows = pq.read_table(path).drop_columns(["batch"]).to_pylist()  # the batch folder
    return sorted(json.dumps(r, sort_keys=True) for r in rows)


def run_local(db, out, flow_steps=lambda f: f):
    flow = flow_steps(ackflow.Flow(EmbeddedQueueSource(db, "q")))
    return ackflow.run(flow.to(ParquetSink(out)), executor="local", handle_signals=False, **FAST)


def test_a_publishers_id_never_names_a_message_published_without_one(tmp_path):
    db, out = str(tmp_path / "q.db"), str(tmp_path / "out")
    q = EmbeddedQueue(db)
    q.publish("q", [b'{"n": 1}'])  # no msg_id: keyed by its row id, "#1"
    first = run_local(db, out)
    # another publisher's id is that very key; before, its row was taken for the first
    # message's (already written) and left out, and the message was acked
    q.publish("q", [b'{"n": 2}'], msg_ids=["#1"])
    second = run_local(db, out)
    assert (first.acked, second.acked) == (1, 1)
    assert written(out) == ['{"n": 1}', '{"n": 2}']
    assert message_key(1, None) != message_key(2, "#1")


def test_unique_keys_of_marked_identities_stay_unique():
    # a join repeats message k's row: k~1; a message named "k~1" must not get that key
    keys = unique_keys(pa.array([row_key("k"), row_key("k"), row_key("k~1")])).to_pylist()
    assert len(set(keys)) == 3


#: identities built of the pieces keys are made of, so that look-alikes come up often
names = st.lists(st.sampled_from(["a", "#1", "~1", "#", "~", "!", "1", "1|", "|"]), max_size=4).map("".join)
#: flat_map children (#n) and join repeats (~n), in any order
paths = st.lists(st.tuples(st.sampled_from("#~"), st.integers(0, 12)), max_size=3).map(tuple)


def message_of(key):
    """Read a row key from the right: drop its #n and ~n, then the mark."""
    while (m := re.search(r"[#~][0-9]+\Z", key)) is not None:
        key = key[: m.start()]
    return key[:-1] if key.endswith("!") and row_key(key[:-1]) == key else key


@settings(max_examples=400)
@given(
    st.lists(st.tuples(names, paths, st.integers(1, 3)), min_size=2, max_size=6, unique_by=lambda t: t[:2])
)
@example([("a~1", (), 1), ("a", (), 2)])  # a message named like a repeat
@example([("a#1", (), 1), ("a", (("#", 1),), 1)])  # ... like a flat_map child
@example([("a#1", (("#", 2),), 1), ("a", (("#", 1), ("#", 2)), 1)])
@example([("", (), 2), ("", (("~", 1),), 1)])  # a join's repeat and a transform's
def test_row_keys_name_one_message_and_one_position(rows):
    """Rows of messages (identity), at positions (flat_map #n and join ~n steps), some
    repeated by a transform (numbered by unique_keys): every key is distinct and reads
    back to its message, whatever the identities hold."""
    base, owners = [], []
    for identity, path, times in rows:
        k = row_key(identity)
        for sep, i in path:
            k = child_key(k, i) if sep == "#" else f"{k}~{i}"  # as the join writes a repeat
        base += [k] * times
        owners += [identity] * times
    keys = unique_keys(pa.array(base)).to_pylist()
    assert len(set(keys)) == len(keys)
    assert [message_of(k) for k in keys] == owners


@settings(max_examples=400)
@given(st.lists(st.tuples(st.integers(0, 3), names), min_size=2, max_size=6, unique=True))
@example([(0, "1|a"), (1, "a")])
def test_merged_identities_name_one_source_and_one_key(pairs):
    """Source 0 keeps its keys; a key of it that looks prefixed ("1|x") must not be the
    identity of source 1's "x"."""
    ids = {Delivery(0, key, b"", origin=origin).identity for origin, key in pairs}
    assert len(ids) == len(pairs)


def test_an_amqp_message_id_never_names_an_unnamed_delivery():
    unnamed = iter(["delivery:abc-1"])
    assert amqp_key(None, lambda: next(unnamed)) == "delivery:abc-1"
    assert amqp_key("delivery:abc-1") != "delivery:abc-1"
    assert len({amqp_key(m) for m in ("id:x", "x", "id:id:x", "delivery:x")}) == 4


class Keys(Sink):
    """A sink that keeps the row keys it is given."""

    wants_keys = True

    def __init__(self):
        super().__init__("keys")
        self.keys = []

    def write_partition(self, batch_id, partition, rows):
        self.keys += rows.column(ROW_KEY).to_pylist()
        return PartitionResult()

    def commit(self, batch_id, tokens):
        pass


def test_a_join_repeat_keeps_its_number_when_an_earlier_repeat_failed():
    """Message m matched three static rows; a step after the join failed the first. The
    other two keep the keys they get when none fails (m~1, m~2): numbered among the
    live rows only they were m and m~1, and the retry, writing all three, put the first
    under m: a first-write-wins sink kept the old row there and lost that one."""
    sink = Keys()
    write = make_writer(sink, "b1", ["n"])
    batch = pa.RecordBatch.from_pydict(
        {
            "n": [0, 1, 2],
            ID: [1, 1, 1],
            ROW_KEY: ["m", "m", "m"],
            STATUS: [FAILED, LIVE, LIVE],
            STEP: ["check", None, None],
            ERR: ["timeout", None, None],
        },
        schema=pa.schema(
            [
                ("n", pa.int64()),
                (ID, pa.int64()),
                (ROW_KEY, pa.string()),
                (STATUS, pa.int32()),
                (STEP, pa.string()),
                (ERR, pa.string()),
            ]
        ),
    )
    list(write(iter([batch])))
    assert sink.keys == ["m~1", "m~2"]


def test_a_merged_source_cannot_be_merged_again():
    a, b, c = (ListSource([], name=n) for n in "abc")
    with pytest.raises(ConfigError, match="cannot be merged again"):
        MergedSource(MergedSource(a, b), c)


def test_an_embedded_sink_fails_a_row_without_its_id_rather_than_use_the_row_key(tmp_path):
    """Falling back to the row key shared a namespace with the id column: message m2's
    row (no order id) and message m1's row with order id "m2" both published id m2, and
    the second was taken for the first (remembered ids are never queued again)."""
    db = str(tmp_path / "out.db")
    sink = EmbeddedQueueSink(db, "out", id_column="order_id")
    sink.open()
    rows = pa.table({"order_id": ["m2", None, ""], "n": [1, 2, 3], ROW_KEY: ["m1", "m2", "m3"]})
    result = sink.write_partition("b1", 0, rows)
    assert sorted(result.failed) == [1, 2] and "id_column 'order_id' is empty" in result.failed[1]
    leased = EmbeddedQueue(db).lease("out", 10, visibility_timeout=5)
    assert [(m.msg_id, json.loads(m.body)["n"]) for m in leased] == [("m2", 1)]


def test_an_embedded_sink_id_column_missing_from_the_columns_stops_at_start(tmp_path):
    from ackflow.core.errors import FlowError

    sink = EmbeddedQueueSink(str(tmp_path / "out.db"), "out", id_column="order_id")
    with pytest.raises(FlowError, match="id_column 'order_id' is not among"):
        sink.prepare(pa.schema([("n", pa.int64())]))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    keys=st.lists(st.one_of(st.none(), st.sampled_from(["k", "k~1", "k~2", "j", ""]), st.text(max_size=3))),
    chunks=st.integers(1, 3),
)
def test_unique_keys_without_a_repeat_are_the_keys_as_they_are(keys, chunks):
    """The writer's guard takes keys with no repeat and no null as they are (Arrow counts
    the distinct ones): the same keys, in the same order, as numbering them one by one."""
    from ackflow.spark.writer import numbered

    step = max(1, len(keys) // chunks)
    arr = pa.chunked_array([keys[i : i + step] for i in range(0, len(keys), step)] or [[]], pa.string())
    assert unique_keys(arr).to_pylist() == numbered(keys)
    assert unique_keys(arr).type == pa.string()
