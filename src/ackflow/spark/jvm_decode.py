"""JSON decoded in the JVM, for the messages it certainly decodes as Python does.

A flow whose first steps are Column steps (or none: ``Flow(src).with_columns(...).to(sink)``)
decodes its messages and nothing else in its first Python pass. Once its columns are
known, that pass is done by Spark's own JSON reader (``from_json``) for every message
whose outcome is certainly the same as the Python decoder's, and by the Python decoder
(:func:`~ackflow.spark.rows.make_segment`) for the others, in one job: the two parts are
joined (``unionByName``) before the Column steps.

Spark's reader differs from the strict one (:mod:`ackflow.spark.decode`) in ways that
would lose or change data: a key twice keeps the last value, ``1e999`` becomes infinity,
a number in a string column becomes its text, invalid UTF-8 and lone surrogates become
replacement characters, text after the object is ignored, an integer past 2**53 in a
double column is rounded, and a field outside the columns is dropped. So a message goes
the JVM's way only if every check below holds, all made in the JVM before and after
``from_json`` (``tests/test_jvm_decode.py`` runs the hostile-input bodies both ways and
compares every row and dead letter):

* its source's format is ``json`` and it has no headers to add;
* its bytes are valid UTF-8 (``is_valid_utf8``: surrogates are not);
* it is one flat object: ``{``, then no bracket and no backslash (so no escape, no nested
  value, no second object), then ``}``, with JSON white space only around it;
* no white space before a colon, so that every key is the text before a ``":``, and
  those keys are all different and each names a column of a type the JVM reads as
  Python does (``long``, ``double``, ``string``, ``boolean``; not ``_rescued``);
* each value starts as its column's type does (a quote or ``null`` in a string column;
  a digit, ``-`` or ``null`` in a number column, with no fraction or exponent in a
  ``long`` one and fewer than 16 digits if it is an integer in a ``double`` one;
  ``t``, ``f`` or ``n`` in a boolean one);
* ``from_json`` (no NaN, no single quotes: JSON as written) reads it without a corrupt
  record, and every ``double`` it gives is finite.

Anything else, valid or not, goes to the Python decoder, which decides as always (a
schema miss, a dead letter, a row).

Known difference (the model-based test with the switch on, one example of 50): Spark
plans the job differently (a union after the decode), and a Column step whose result no
later step reads, which Spark otherwise prunes unevaluated, can be evaluated. A row whose
value makes that step fail (an ANSI cast of ``'x'``) then fails its message there, where
without the switch it passes. Each message's decoding is the same; this is the plan's.

Off by default; ``spark.ackflow.jvmjson=true`` in the session's conf turns it on. Measured
on the 2-core machine (``docs/performance.md``, "JSON in the JVM"): Spark's ``from_json``
costs 4.8 µs of JVM CPU a 100-byte message with C1 (1.0-1.2 with C2, warmed), the checks
another 5-6, and the rows left to Python are found by a second pass over the checks;
the Python workers' reader (msgspec, a C reader) decodes the same message in about 1 µs.
The JVM path only pays where the executors' Python decodes slowly (no msgspec there: the
exact reader, about 5 µs) and their JVMs run C2.
"""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import from_arrow_schema

from ackflow.core.schema import RESCUED
from ackflow.spark.columns import BODY, ERR, HDR, ID, KEY, LIVE, SRC, STATUS, STEP

#: the Arrow types Spark's JSON reader reads as the Python decoder does, and how
_KINDS = {
    "int64": "long",
    "double": "double",
    "string": "string",
    "large_string": "string",
    "bool": "boolean",
}
_WS = "[ \\t\\r\\n]"
#: one flat object: no bracket, no backslash inside, JSON white space around (``\z``:
#: Java's ``$`` also matches before a last U+2028, U+2029 or U+0085, which Spark's reader
#: then ignores and Python's refuses)
_SHAPE = f"^{_WS}*\\{{[^{{}}\\[\\]\\\\]*\\}}{_WS}*\\z"
#: white space before a colon (then a key would not be the text before a '":')
_SPACED_COLON = f'"{_WS}+:'
#: the keys of a flat object without escapes: the text before each '":'
_KEYS = '"([^"]*)":'
#: what a value of each kind may not start as (after '"key":' and white space)
_WRONG_START = {
    "string": '[^ \\t\\r\\n"n]',
    "long": "(?:[^ \\t\\r\\n0-9n-]|-?[0-9]+[.eE])",
    # an integer of 16 digits or more may not be exactly a double (pyarrow refuses those)
    "double": "(?:[^ \\t\\r\\n0-9n-]|-?[0-9]{16,}(?![.eE0-9]))",
    "boolean": "[^ \\t\\r\\n tfn]",
}
_CORRUPT = "__af_corrupt"
_PARSED = "__af_parsed"
_KEYS_COL = "__af_keys"
_OPTIONS = {
    "mode": "PERMISSIVE",
    "columnNameOfCorruptRecord": _CORRUPT,
    "allowNonNumericNumbers": "false",
    "allowSingleQuotes": "false",
    "allowUnquotedFieldNames": "false",
    "allowComments": "false",
    "allowNumericLeadingZeros": "false",
    "allowBackslashEscapingAnyCharacter": "false",
    "allowUnquotedControlChars": "false",
}


def jvm_columns(schema: pa.Schema) -> dict[str, str]:
    """The columns of ``schema`` the JVM reads (name -> Spark type): those of the kinds
    in ``_KINDS`` whose names need no escape in a body (no quote, backslash or control
    character). ``_rescued`` is ackflow's own (a message with that key goes to Python)."""
    out: dict[str, str] = {}
    for f in schema:
        kind = _KINDS.get(str(f.type))
        if kind is None or f.name == RESCUED:
            continue
        if any(c in f.name for c in '"\\') or any(ord(c) < 0x20 for c in f.name):
            continue
        out[f.name] = kind
    return out


def applies(schema: pa.Schema, formats: Sequence[str]) -> bool:
    """Whether the JVM can take any message: some source is JSON, and some column is of
    a kind it reads."""
    return "json" in formats and bool(jvm_columns(schema))


def split(df: DataFrame, schema: pa.Schema, formats: Sequence[str]) -> tuple[DataFrame, DataFrame]:
    """``df`` (the input columns: id, key, body, source, headers) split into the rows
    the JVM decoded (``schema``'s columns in order, then id, key, status, step and
    error, as the Python decoder makes them) and the input rows it leaves to Python."""
    columns = jvm_columns(schema)
    text = F.col(BODY).cast("string")
    # the keys once per row (see the explode below)
    df = df.select(
        *df.columns, F.explode(F.array(F.regexp_extract_all(text, F.lit(_KEYS), 1))).alias(_KEYS_COL)
    )
    keys = F.col(_KEYS_COL)
    names = F.array(*[F.lit(c) for c in columns])
    json_sources = [i for i, f in enumerate(formats) if f == "json"]
    checks = [
        F.col(SRC).isin(json_sources),
        F.col(HDR).isNull(),
        F.expr(f"is_valid_utf8(`{BODY}`)"),
        text.rlike(_SHAPE),
        ~text.rlike(_SPACED_COLON),
        F.size(keys) == F.size(F.array_distinct(keys)),
        F.size(F.array_except(keys, names)) == 0,
    ]
    wrong = _wrong_values(columns)
    if wrong is not None:
        checks.append(~text.rlike(wrong))
    ddl = ", ".join([f"`{c}` {t}" for c, t in columns.items()] + [f"`{_CORRUPT}` string"])
    # Parsed once per row: an explode is a wall the optimizer does not see through (a
    # struct's fields read after a filter made it parse the body once per field, and
    # again in the filter: 95 us a message instead of a few). Null: a check failed.
    parsed = F.when(_all(checks), F.from_json(text, ddl, _OPTIONS))
    once = df.select(*df.columns, F.explode(F.array(parsed)).alias(_PARSED)).drop(_KEYS_COL)
    p = F.col(_PARSED)
    after = [p.isNotNull(), p[_CORRUPT].isNull()]
    for c, t in columns.items():
        if t == "double":
            v = p[c]
            after.append(v.isNull() | ~(F.isnan(v) | (F.abs(v) == F.lit(float("inf")))))
    ok = F.coalesce(_all(after), F.lit(False))
    types = {f.name: f.dataType for f in from_arrow_schema(pa.schema(list(schema))).fields}
    data = [(p[c] if c in columns else F.lit(None)).cast(types[c]).alias(c) for c in schema.names]
    decoded = once.where(ok).select(
        *data,
        F.col(ID),
        F.col(KEY),
        F.lit(LIVE).cast("int").alias(STATUS),
        F.lit(None).cast("string").alias(STEP),
        F.lit(None).cast("string").alias(ERR),
    )
    rest = once.where(~ok).drop(_PARSED)
    return decoded, rest


def _wrong_values(columns: dict[str, str]) -> str | None:
    """One pattern: a key of some kind's column followed by a value that cannot be of it."""
    parts = []
    for kind, start in _WRONG_START.items():
        names = [c for c, t in columns.items() if t == kind]
        if names:
            alternation = "|".join(_escaped(c) for c in names)
            parts.append(f'"(?:{alternation})":{_WS}*{start}')
    return "|".join(parts) or None


def _escaped(name: str) -> str:
    """``name`` as a Java regular expression matching it literally."""
    return "".join(c if c.isalnum() or c == "_" or ord(c) > 127 else "\\" + c for c in name)


def _all(checks: list[Column]) -> Column:
    out = checks[0]
    for c in checks[1:]:
        out = out & c
    return out
