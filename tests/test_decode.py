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
