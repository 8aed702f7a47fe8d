"""Decoding by the source's format; an undecodable payload fails that message only."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
    assert src.final() == {"m0": "acked", "m1": "dead_lettered", "m2": "dead_lettered", "m3": "acked"}
    assert src.failures["m1"].step == "decode"
    assert src.failures["m1"].error.startswith("could not decode the json payload: JSONDecodeError")
    assert "expected a JSON object, got a JSON list" in src.failures["m2"].error
    assert report.dead_lettered_by_step == {"decode": 2}


def test_text_gives_body_str_and_invalid_utf8_fails(spark):
    src = ListSource([b"hello", b"\xff\xfe bad", "h\u00e9".encode()], format="text")
    sink = MemorySink()
    ackflow.run(
        ackflow.Flow(src).map(lambda r: {"body": r["body"].upper()}, name="up").to(sink), spark=spark, **FAST
    )
    assert sorted(r["body"] for r in sink.rows) == ["HELLO", "H\u00c9"]
    assert src.final()["m1"] == "dead_lettered"
    assert "UnicodeDecodeError" in src.failures["m1"].error


def test_bytes_gives_body_bytes(spark):
    src = ListSource([b"\x00\x01", b"\xff"], format="bytes")
    sink = MemorySink()
    ackflow.run(
        ackflow.Flow(src).map(lambda r: {"size": len(r["body"])}, name="size").to(sink), spark=spark, **FAST
    )
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
    batch = pa.RecordBatch.from_pydict(
        {ID: list(range(n)), KEY: [str(i) for i in range(n)], BODY: bodies, SRC: [0] * n}
    )
    rows, status, steps, errs = decode_batch(batch, ["json"])
    assert status[0] == LIVE and status[-1] == LIVE and len(rows[-1]["big"]) == 10_000_000
    for i, (name, (_, reason)) in enumerate(HOSTILE_JSON.items(), start=1):
        assert status[i] == FAILED and steps[i] == "decode", name
        assert reason in errs[i], (name, errs[i])


@pytest.mark.parametrize(
    "encoding", ["utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be"]
)
def test_json_bodies_are_read_in_every_encoding_json_loads_reads(encoding):
    """The shared decoder reads bytes as json.loads does (its fast path is UTF-8 only)."""
    import json

    from ackflow.spark.rows import decode

    for text in ['{"a": "h\u00e9", "b": [1.5, 2]}', ' {"a": 1}', "{}", "[1]"]:
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

    bodies = [
        json.dumps(
            {f"k{j}_{i % 7}": 1.5 * i if j % 2 else {"n": [i, 2.25, "x" * j]} for j in range(6)}
        ).encode()
        for i in range(1000)
    ]
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


NAN_BODY = (
    b'{"a": NaN, "b": -Infinity, "c": Infinity, "n": 1.5,'
    b' "nested": {"x": [1, NaN, {"y": -Infinity}], "z": "NaN"}}'
)


def test_nan_and_infinity_fail_by_default_and_read_as_null_when_asked():
    """Strict by default; format json_nan_as_null reads NaN, Infinity and -Infinity as
    null at any depth (a string "NaN" stays a string); 1e999 fails in both modes."""
    from ackflow.spark.rows import decode

    with pytest.raises(ValueError, match="NaN is not JSON"):
        decode(NAN_BODY, "json")
    with pytest.raises(ValueError, match="-Infinity is not JSON"):
        decode(b'{"v": [{"w": -Infinity}]}', "json")
    assert decode(NAN_BODY, "json_nan_as_null") == {
        "a": None,
        "b": None,
        "c": None,
        "n": 1.5,
        "nested": {"x": [1, None, {"y": None}], "z": "NaN"},
    }
    for fmt in ("json", "json_nan_as_null"):
        with pytest.raises(ValueError, match="not finite"):
            decode(b'{"a": 1e999}', fmt)
        with pytest.raises(ValueError, match="not finite"):
            decode(b'{"a": [-1e999]}', fmt)


def test_an_unknown_format_is_refused():
    from ackflow.core.errors import ConfigError

    with pytest.raises(ConfigError, match="json_nan_as_null"):
        ListSource([], format="json-nan")


def test_pandas_output_flows_with_json_nan_as_null(spark):
    """What pandas writes (records through Python's json: NaN for a missing float) is
    dead-lettered by default and flows with the option, the NaNs as nulls."""
    import json

    import numpy as np
    import pandas as pd

    df = pd.DataFrame({"id": [1, 2, 3], "price": [9.5, np.nan, np.inf], "tags": [["a"], [], ["b"]]})
    bodies = [json.dumps(r) for r in df.to_dict("records")]
    assert "NaN" in bodies[1] and "Infinity" in bodies[2]
    strict, lenient = ListSource(bodies), ListSource(bodies, format="json_nan_as_null")
    sink = MemorySink()
    ackflow.run(ackflow.Flow(strict).to(MemorySink("strict")), spark=spark, **FAST)
    assert strict.final() == {"m0": "acked", "m1": "dead_lettered", "m2": "dead_lettered"}
    ackflow.run(ackflow.Flow(lenient).to(sink), spark=spark, **FAST)
    assert set(lenient.final().values()) == {"acked"}
    assert sorted((r["id"], r["price"]) for r in sink.rows) == [(1, 9.5), (2, None), (3, None)]


def test_files_jsonl_nan_as_null(spark, tmp_path):
    from ackflow.sources import FilesSource

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text(
        '{"id": 1, "v": NaN, "w": [2.5]}\n{"id": 2, "v": 1.5, "w": [Infinity, 1.0]}\n'
    )
    sink = MemorySink()
    report = ackflow.run(
        ackflow.Flow(FilesSource(tmp_path / "in", "jsonl_nan_as_null")).to(sink), spark=spark, **FAST
    )
    assert report.acked == 2
    assert sorted((r["id"], r["v"], r["w"]) for r in sink.rows) == [(1, None, [2.5]), (2, 1.5, [None, 1.0])]


# -- the fast reader (msgspec where it certainly reads as the exact reader) --------------

_space = st.sampled_from(["", " ", "\n", "\t", "\r\n ", "  "])
_number = st.one_of(
    st.integers(),  # beyond 64 bits too
    # digit runs of any length, and at Python's limit of 4300 digits (past it: an error)
    st.tuples(st.sampled_from("-123456789"), st.text("0123456789", min_size=17, max_size=60)).map("".join),
    st.sampled_from(["9" * 4300, "9" * 4301, "-" + "1" * 4300, "0." + "3" * 900, "1" * 30 + ".5e-20"]),
    # exponents of 10 000 and more (msgspec reads no digit past 10 000), some balanced by
    # mantissas of thousands of digits (found by review)
    st.sampled_from(["1e10000", "1e-100000", "0e999999", "-1e-400000", "1" + "0" * 10000 + "e-100000"]),
    st.sampled_from(["0." + "0" * 9999 + "1e100000", "-0." + "0" * 9999 + "1e100000"]),
    st.sampled_from(["0." + "0" * 99999 + "1e100005", "1" + "0" * 10000 + "E-000000000100000"]),
    st.integers(min_value=-(10**20), max_value=10**20),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.floats(allow_nan=False, allow_infinity=False).map(lambda f: f"{f:.17e}"),
    st.tuples(st.integers(-99, 99), st.integers(0, 10**6), st.integers(-400, 400)).map(
        lambda t: f"{t[0]}.{t[1]}e{t[2]}"
    ),
    st.sampled_from(
        ["1e999", "-1e999", "NaN", "Infinity", "-0", "-0.0", "1E5", "01", "1.", "2.2250738585072014e-308"]
    ),
).map(str)
_string = st.one_of(
    st.text(max_size=8).map(json.dumps),
    st.text(max_size=8).map(lambda t: json.dumps(t, ensure_ascii=False)),
    st.sampled_from(
        ['"\\ud800"', '"a\\":"', '"x\\u0022:"', '"12:30"', '"a : b"', '"\\u0000"', '"\x01"', '"\u00e9"']
    ),
)


def _json_text(value):
    return st.recursive(
        st.one_of(_number, _string, st.sampled_from(["true", "false", "null"])),
        lambda inner: st.one_of(
            st.tuples(st.lists(inner, max_size=3), _space).map(lambda t: "[" + ("," + t[1]).join(t[0]) + "]"),
            # keys from a small alphabet: one object often holds a key twice
            st.tuples(
                st.lists(
                    st.tuples(st.sampled_from(['"a"', '"b"', '"\\u0061"', '""', '"a\\":"']), _space, inner)
                ),
                _space,
            ).map(lambda t: "{" + t[1] + ",".join(f"{k}{s}:{t[1]}{v}" for k, s, v in t[0]) + "}"),
        ),
        max_leaves=value,
    )


_body = st.one_of(
    _json_text(10).map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.dictionaries(st.text(max_size=4), _json_text(4), max_size=4).map(
        lambda d: ("{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in d.items()) + "}").encode(
            "utf-8", "surrogatepass"
        )
    ),
    st.binary(max_size=40),
    st.sampled_from([b for b, _ in HOSTILE_JSON.values()]),
)


def _read(body, fmt, fast):
    from ackflow.spark.decode import decode

    try:
        got = decode(body, fmt, fast)
    except Exception as e:  # noqa: BLE001 - the error is the outcome compared
        return "error", type(e).__name__, str(e)
    return "row", repr(got)  # repr: 1 and 1.0, 0.0 and -0.0, and key order differ


@settings(max_examples=1500, deadline=None, derandomize=True)
@given(body=_body, fmt=st.sampled_from(["json", "json_nan_as_null"]))
def test_the_fast_reader_gives_every_body_what_the_exact_reader_gives(body, fmt):
    """Message by message, the same row or the same error with msgspec in front as with
    the exact reader alone: keys twice (written alike or escaped differently), integers
    past 64 bits, whitespace before colons, every float text, escapes, invalid UTF-8."""
    assert _read(body, fmt, True) == _read(body, fmt, False)


def test_the_fast_reader_takes_plain_bodies_and_leaves_the_doubtful_ones():
    """It does read the common case (else it saves nothing), and each doubt it rules out
    is left to the exact reader."""
    from ackflow.spark.decode import fast_json

    assert fast_json(b'{"id":1,"sku":"a:b","p":1.5,"t":"12:30"}') == {
        "id": 1,
        "sku": "a:b",
        "p": 1.5,
        "t": "12:30",
    }
    assert fast_json(b'{"a": {"b": [1, {"c": 2}]}, "d": []}') == {"a": {"b": [1, {"c": 2}]}, "d": []}
    for doubtful in [
        b'{"a": 1, "a": 2}',  # a key twice
        b'{"a": {"b": 1, "b": 2}}',  # twice, nested
        b'{"a": 1, "\\u0061": 2}',  # twice, escaped otherwise
        b'{"a" : 1}',  # whitespace before the colon: the count proves nothing
        b'{"a": "x\\":", "a": 1}',  # a string holding ": makes the count larger
        b'{"a": ' + b"[" * 600 + b"]" * 600 + b"}",  # many brackets
        b'{"a":1' + b"0" * 10000 + b"e-100000}",  # msgspec reads it as 1.0, the exact reader 0.0
        b'{"a": NaN}',  # what msgspec refuses goes to the exact reader, for its error
        b"[1, 2]",
    ]:
        assert fast_json(doubtful) is None, doubtful


@pytest.mark.parametrize("depth", [400, 900, 960, 990, 1000, 1010, 1023, 1030])
def test_the_fast_reader_and_the_exact_one_agree_on_deep_nesting(depth):
    """Both readers stop at Python's recursion limit, each from its own stack: neither
    is asked to tell near it."""
    for body in (b'{"a": ' + b"[" * depth + b"]" * depth + b"}", b'{"a":' * depth + b"1" + b"}" * depth):
        assert _read(body, "json", True) == _read(body, "json", False)


def test_a_key_is_never_read_under_another_keys_name():
    """A C reader that caches keys by their hash alone reads a key whose hash equals an
    earlier key's as that key (orjson does, with the second pair). The fast reader's cache
    compares the text: two keys of one hash, and thousands sharing its 512 slots, are
    each read as itself, in any order."""
    import random

    from ackflow.spark.decode import fast_json

    pair = [
        b'{"userid42": 1}',  # msgspec's hash of these two keys is the same (0x8c1d103c)
        b'{"aaaufOc0": 2}',
        b'{"I#mg+V{sb7U1,L2`0123456789abcdef":1}',  # the same in orjson's
        b'{"V]\\u00043)\\u0018qHe,\\u0007o\\u0016\\u0011w{0123456789abcdef":2}',
    ]
    rng = random.Random(7)
    keys = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789_") for _ in range(rng.randint(1, 32)))
        for _ in range(3000)
    ]
    bodies = pair + [json.dumps({k: i, "n": {k[::-1]: i}}).encode() for i, k in enumerate(keys)]
    for body in [*bodies, *rng.sample(bodies, len(bodies))]:
        assert fast_json(body) == _exact(body), body


def _exact(body):
    from ackflow.spark.decode import decode

    return decode(body, "json", False)


def test_without_msgspec_the_exact_reader_reads_every_body(monkeypatch):
    """An executor's Python without msgspec (ackflow ships itself, not its dependencies):
    every body is read, by the exact reader alone."""
    from ackflow.spark import decode as decoding

    monkeypatch.setattr(decoding, "_FAST_READER", None)
    monkeypatch.setattr(decoding, "fast_json", lambda body: pytest.fail("the fast reader was used"))
    assert decoding.decode(b'{"a": 1, "b": [2.5]}', "json", True) == {"a": 1, "b": [2.5]}
    with pytest.raises(ValueError, match="appears twice"):
        decoding.decode(b'{"a": 1, "a": 2}', "json", True)


def test_a_body_that_is_not_bytes_fails_as_it_did():
    """A null body (a null in the body column) or text: the exact reader's error, as before
    the fast reader (which takes bytes only)."""
    for body in (None, "{}", memoryview(b"{}")):
        assert _read(body, "json", True) == _read(body, "json", False)


@pytest.mark.parametrize("version", ["0.18.6", "0.23.0", "1.0", "x"])
def test_a_msgspec_not_compared_leaves_json_to_the_exact_reader(monkeypatch, version):
    """Executors use whatever msgspec they have (ackflow ships itself, not its
    dependencies): only the versions whose reading was compared are used."""
    import msgspec

    from ackflow.spark.decode import fast_reader

    assert fast_reader() is not None  # this one (tested)
    monkeypatch.setattr(msgspec, "__version__", version)
    assert fast_reader() is None
