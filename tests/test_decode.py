"""Decoding by the source's format; an undecodable payload fails that message only."""

import pytest

import ackflow
from ackflow.sinks import MemorySink
from ackflow.testing import ListSource
from helpers import FAST

pytestmark = pytest.mark.spark


def test_json_gives_fields_and_bad_json_fails_with_the_reason(spark):
    src = ListSource([b'{"a": 1}', b"{not json", b"[1, 2]", b'{"a": 2}'])
    sink = MemorySink()
    report = ackflow.run(ackflow.Flow(src).to(sink), spark=spark, **FAST)
    assert sorted(r["a"] for r in sink.rows) == [1, 2]
    assert src.final() == {"m0": "acked", "m1": "dead_lettered", "m2": "dead_lettered",
                           "m3": "acked"}
    assert src.failures["m1"].step == "decode"
    assert src.failures["m1"].error.startswith("could not decode the json payload: JSONDecodeError")
    assert "expected a JSON object, got a JSON list" in src.failures["m2"].error
    assert report.dead_lettered_by_step == {"decode": 2}


def test_text_gives_body_str_and_invalid_utf8_fails(spark):
    src = ListSource([b"hello", b"\xff\xfe bad", "h\u00e9".encode()], format="text")
    sink = MemorySink()
    ackflow.run(ackflow.Flow(src).map(lambda r: {"body": r["body"].upper()}, name="up").to(sink),
                spark=spark, **FAST)
    assert sorted(r["body"] for r in sink.rows) == ["HELLO", "H\u00c9"]
    assert src.final()["m1"] == "dead_lettered"
    assert "UnicodeDecodeError" in src.failures["m1"].error


def test_bytes_gives_body_bytes(spark):
    src = ListSource([b"\x00\x01", b"\xff"], format="bytes")
    sink = MemorySink()
    ackflow.run(ackflow.Flow(src).map(lambda r: {"size": len(r["body"])}, name="size").to(sink),
                spark=spark, **FAST)
    assert sorted(r["size"] for r in sink.rows) == [1, 2]
    assert set(src.final().values()) == {"acked"}


HOSTILE_JSON = {
    "nan": (b'{"a": NaN}', "NaN is not JSON"),
    "infinity": (b'{"a": -Infinity}', "-Infinity is not JSON"),
    "overflow": (b'{"a": 1e999}', "not finite"),
    "duplicate": (b'{"a": 1, "a": 2}', "the key 'a' appears twice"),
    "deep": (b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "RecursionError"),
    "utf8": (b'{"a": "\xff"}', "UnicodeDecodeError"),
    "nul": (b'{"a": 1}\x00', "JSONDecodeError"),
    "empty": (b"", "JSONDecodeError"),
}


def test_hostile_json_fails_alone_with_its_reason_and_the_rest_flows():
    """Driver-side: the decoding every task runs (no Spark needed to show the rule)."""
    import pyarrow as pa

    from ackflow.spark.rows import BODY, FAILED, ID, KEY, LIVE, SRC, decode_batch

    bodies = [b'{"ok": 1}', *(b for b, _ in HOSTILE_JSON.values()), b'{"big": "' + b"x" * 10_000_000 + b'"}']
    n = len(bodies)
    batch = pa.RecordBatch.from_pydict({ID: list(range(n)), KEY: [str(i) for i in range(n)],
                                        BODY: bodies, SRC: [0] * n})
    rows, status, steps, errs = decode_batch(batch, ["json"])
    assert status[0] == LIVE and status[-1] == LIVE and len(rows[-1]["big"]) == 10_000_000
    for i, (name, (_, reason)) in enumerate(HOSTILE_JSON.items(), start=1):
        assert status[i] == FAILED and steps[i] == "decode", name
        assert reason in errs[i], (name, errs[i])


@pytest.mark.parametrize("encoding", ["utf-8", "utf-8-sig", "utf-16", "utf-16-le",
                                      "utf-16-be", "utf-32", "utf-32-le", "utf-32-be"])
def test_json_bodies_are_read_in_every_encoding_json_loads_reads(encoding):
    """The shared decoder reads bytes as json.loads does (its fast path is UTF-8 only)."""
    import json

    from ackflow.spark.rows import decode

    for text in ['{"a": "h\u00e9", "b": [1.5, 2]}', ' {"a": 1}', '{}', '[1]']:
        body = text.encode(encoding)
        expected = json.loads(body)
        if isinstance(expected, dict):
            assert decode(body, "json") == expected, (encoding, text)
        else:
            with pytest.raises(ValueError, match="expected a JSON object"):
                decode(body, "json")


def test_the_shared_decoder_gives_each_thread_its_own_result():
    """The local executor decodes in several threads at once, through one decoder whose
    hooks call back into Python (where threads switch)."""
    import json
    import random
    import sys
    import threading

    from ackflow.spark.rows import decode

    bodies = [json.dumps({f"k{j}_{i % 7}": 1.5 * i if j % 2 else {"n": [i, 2.25, "x" * j]}
                          for j in range(6)}).encode() for i in range(1000)]
    expected = [json.loads(b) for b in bodies]
    wrong: list[int] = []

    def work(seed: int) -> None:
        order = list(range(len(bodies)))
        random.Random(seed).shuffle(order)
        wrong.extend(i for i in order if decode(bodies[i], "json") != expected[i])

    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(before)
    assert wrong == []
