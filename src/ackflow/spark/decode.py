"""Decoding message bodies into the first row a flow sees (in Spark tasks)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Any, cast

import pyarrow as pa

from ackflow.core.errors import describe
from ackflow.spark.columns import BODY, FAILED, HDR, LIVE, SRC


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (only finite numbers are)")


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"{text} is too large for a number (not finite)")
    return value


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"the key {dup!r} appears twice in one object (no value is dropped silently)")
    return obj


def _null_constants(name: str) -> None:
    return None  # NaN, Infinity, -Infinity: what pandas' and Python's json.dumps write


_DECODER = json.JSONDecoder(
    parse_constant=_no_constants, parse_float=_finite, object_pairs_hook=_no_duplicates
)
#: ``format="json_nan_as_null"``: NaN, Infinity and -Infinity (anywhere) read as null; a
#: number too large for a double (1e999) still fails its message: it is a number, and
#: null would drop its size silently
_NAN_NULL_DECODER = json.JSONDecoder(
    parse_constant=_null_constants, parse_float=_finite, object_pairs_hook=_no_duplicates
)
_DECODERS = {"json": _DECODER, "json_nan_as_null": _NAN_NULL_DECODER}

#: bodies this short nest less deep than _FEW_BRACKETS; longer ones count their brackets,
#: and go to the exact reader with _FEW_BRACKETS or more: far below the depth where either
#: reader stops (each at Python's recursion limit, from its own stack)
_SHORT = 200
_FEW_BRACKETS = 100
#: an exponent of 10 000 or more: msgspec stops reading an exponent's digits there (1e100000
#: is read as 1e10000), which a mantissa of thousands of digits can bring back into range
#: (1 followed by 10 000 zeros, e-100000: 1.0, where the exact reader gives 0.0). Only a
#: long body can hold such a mantissa; long bodies with such an exponent go to the exact one
_HUGE_EXPONENT = re.compile(rb"[eE][-+]?0*[1-9][0-9]{4}")
#: the msgspec versions whose reading was compared with the exact reader's (tests/test_decode.py
#: and two reviews of its source): another version on an executor leaves JSON to the exact one
_TESTED = ((0, 19), (0, 22))


def fast_reader() -> Any:
    """msgspec's JSON reader, or None (no msgspec, or a version not compared)."""
    try:
        import msgspec

        if _TESTED[0] <= tuple(int(p) for p in msgspec.__version__.split(".")[:2]) <= _TESTED[1]:
            return msgspec.json.Decoder()
    except Exception:  # noqa: BLE001 - no msgspec, or one that fails to load: the exact reader
        pass
    return None


#: one reader for every message (msgspec's key cache compares the key's text, not only its
#: hash: a key never comes back under another key's name). None where the executors' Python
#: lacks msgspec (ackflow ships itself to them as a zip, not its dependencies) or has another
#: version: the exact reader alone, as fast as before
_FAST_READER = fast_reader()


def fast_json(body: bytes) -> dict[str, Any] | None:
    """The object ``body`` holds, read by msgspec (a C reader), when that is certainly
    what the exact reader (``_DECODER``) gives; None when unsure, and the exact reader
    decides, with its own error if it fails.

    msgspec refuses what the exact reader refuses (NaN, Infinity, numbers that overflow
    a double, invalid UTF-8, control characters, extra data, integers past Python's digit
    limit; lone surrogates, which the exact reader keeps, too), so they can differ only
    where msgspec *accepts*. Three differences are ruled out:

    * a key twice in one object keeps the last value in msgspec: with no whitespace
      before any colon (JSON allows it; then the body goes to the exact reader), every
      key in the body is followed by ``":``, so the count of ``":`` is at least the
      keys written (a string holding ``":`` only adds); the keys msgspec returns,
      counted over every object, are at most the keys written, fewer if one repeats.
      Only when the two counts are equal is the object taken;
    * nesting: a body of 200 bytes or more with 100 brackets or more is left to the
      exact reader;
    * exponents of 10 000 or more (see ``_HUGE_EXPONENT``) in a body of 200 bytes or more.

    ``tests/test_decode.py`` compares the two readers body by body (keys twice, escaped
    keys, integers of any size, float texts, whitespace, hostile bytes).

    >>> fast_json(b'{"a": 1, "b": [1.5, {"c": null}]}'), fast_json(b'{"a": 1, "a": 2}')
    ({'a': 1, 'b': [1.5, {'c': None}]}, None)
    """
    if len(body) >= _SHORT and (
        body.count(b"{") + body.count(b"[") >= _FEW_BRACKETS or _HUGE_EXPONENT.search(body)
    ):
        return None
    if b" :" in body or b"\n:" in body or b"\t:" in body or b"\r:" in body:
        return None
    try:
        obj = _FAST_READER.decode(body)
    except Exception:  # noqa: BLE001 - any doubt: the exact reader decides, with its error
        return None
    if type(obj) is not dict:
        return None
    written = body.count(b'":')
    # the top object's keys are a lower bound of all: equal, and nested objects hold none
    if written == len(obj) or (written > len(obj) and written == _count_keys(obj)):
        return obj
    return None


def _count_keys(value: dict[str, Any]) -> int:
    """The keys of every object in ``value`` (msgspec's result: dicts, lists, scalars)."""
    keys, stack = 0, [cast(Any, value)]
    while stack:
        item: Any = stack.pop()
        if type(item) is dict:
            keys += len(item)
            item = item.values()
        for v in item:
            if type(v) is dict or type(v) is list:
                stack.append(v)
    return keys


def decode(body: bytes, fmt: str, fast: bool = True) -> dict[str, Any]:
    """Turn a message body into the first row a flow sees.

    JSON is read strictly: ``NaN``/``Infinity`` and an object with a key twice fail the
    message (no field is dropped or invented silently), as do invalid UTF-8 and nesting
    too deep for Python (each fails its own message in step ``decode``). The opt-in
    format ``"json_nan_as_null"`` reads ``NaN``, ``Infinity`` and ``-Infinity`` as null
    (at any depth), for producers that write them (pandas, Python's ``json.dumps``); a
    number that overflows a double (``1e999``) fails in both.

    >>> decode(b'{"a": NaN, "b": [1, -Infinity], "c": {"d": Infinity}}', "json_nan_as_null")
    {'a': None, 'b': [1, None], 'c': {'d': None}}
    """
    decoder = _DECODERS.get(fmt)
    if decoder is not None:
        if fast and _FAST_READER is not None and type(body) is bytes:  # or None: the exact reader
            obj = fast_json(body)
            if obj is not None:
                return obj
        # One decoder for every message: json.loads(body, **hooks) builds a new one per
        # call, which was a quarter of decoding's cost (4.6 against 8.6 us a message).
        # Bytes are read as json.loads reads them (UTF-8, or UTF-16/32 by its detection);
        # a body opening with "{" and no NUL after it is UTF-8 without asking.
        enc = "utf-8" if body[:1] == b"{" and body[1:2] != b"\x00" else json.detect_encoding(body)
        obj = decoder.decode(body.decode(enc, "surrogatepass"))
        if not isinstance(obj, dict):
            raise ValueError(f"expected a JSON object, got a JSON {type(obj).__name__}")
        return obj
    if fmt == "text":
        return {"body": body.decode("utf-8")}
    return {"body": body}


def decode_batch(
    b: pa.RecordBatch, formats: Sequence[str], fast: bool = True
) -> tuple[list[dict[str, Any] | None], list[int], list[str | None], list[str | None]]:
    """Decode a batch of message bodies, each by its source's format.

    Returns rows (None where decoding failed) and, per row, status, step and error.
    ``fast=False``: JSON only by the exact reader (see :func:`fast_json`; tests compare).
    """
    n = b.num_rows
    rows: list[dict[str, Any] | None] = []
    status: list[int] = [LIVE] * n
    steps: list[str | None] = [None] * n
    errs: list[str | None] = [None] * n
    origins = b.column(SRC).to_pylist()
    extra: list[Any] = b.column(HDR).to_pylist() if HDR in b.schema.names else [None] * n
    for i, body in enumerate(b.column(BODY).to_pylist()):
        fmt = formats[origins[i]]
        try:
            row = decode(body, fmt, fast)
            if extra[i] is not None:
                row.update(json.loads(extra[i]))
            rows.append(row)
        except Exception as e:  # noqa: BLE001 - fails this message only
            rows.append(None)
            status[i], steps[i] = FAILED, "decode"
            errs[i] = f"could not decode the {fmt} payload: {describe(e)}"
    return rows, status, steps, errs
