"""Wide, sparse rows: ``conform`` looks at a row's own fields and ``rows_table`` places
them once, instead of looking every column up in every row. Both must answer exactly as
the column-by-column way does: the same table, the same rows failed with the same step
and error, in every mode, for any rows (drawn here with values that fit, values Arrow
would change, values Arrow cannot hold, new fields, reserved names and empty values)."""

from __future__ import annotations

import copy
import datetime as dt
import enum
import json
from decimal import Decimal
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ackflow.core.schema import EVOLVE, FREEZE, RESCUE, RESCUED
from ackflow.spark import columns, infer, rows
from ackflow.spark.columns import FAILED, LIVE, rows_table

TYPES = [
    pa.int64(),
    pa.int32(),
    pa.float64(),
    pa.float32(),
    pa.string(),
    pa.bool_(),
    pa.null(),
    pa.list_(pa.int64()),
    pa.struct([("a", pa.int64()), ("b", pa.string())]),
    pa.timestamp("us"),
    pa.dictionary(pa.int32(), pa.string()),
    pa.map_(pa.string(), pa.int64()),
    pa.decimal128(10, 2),
    pa.binary(),
    pa.date32(),
]
NAMES = [f"c{i}" for i in range(24)] + ["C0", "x y", "__af_id", "new", RESCUED]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2**31, 2**63 - 1, 2**63]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0.5, 1.0, 1e39, 1e-46, 3.0]),
    st.text(max_size=4),
    st.binary(max_size=3),
    st.just(Decimal("sNaN")),  # outside() raises on it: where it is asked matters
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.sampled_from(["a", "b", "z"]), inner, max_size=3),
    ),
    max_leaves=6,
)
schemas = st.lists(
    st.tuples(st.sampled_from(NAMES[:24]), st.sampled_from(TYPES)), min_size=1, max_size=24
).map(
    lambda cols: pa.schema(dict(cols).items())  # unique names
)
records = st.lists(st.dictionaries(st.sampled_from(NAMES), values, max_size=5), min_size=1, max_size=12)


@st.composite
def shaped(draw: Any) -> tuple[list[dict[str, Any]], pa.Schema]:
    """A schema and rows whose fields are mostly its columns (so that values meet types)."""
    schema = draw(schemas)
    names = st.sampled_from(schema.names) | st.sampled_from(NAMES)
    return draw(st.lists(st.dictionaries(names, values, max_size=5), min_size=1, max_size=12)), schema


def _run(rows_in: list[dict[str, Any]], schema: pa.Schema, mode: str | None, status_in: list[int]) -> Any:
    status = list(status_in)  # a row failed before holds nothing, as segment_rows gives it
    rs = [copy.deepcopy(r) if s == LIVE else {} for r, s in zip(rows_in, status, strict=False)]
    step: list[str | None] = [None if s == LIVE else "earlier" for s in status]
    err: list[str | None] = [None if s == LIVE else "failed before" for s in status]
    try:
        table = rows.conform(rs, schema, status, step, err, "record", mode, "seg")
    except Exception as e:  # noqa: BLE001 - compared as an outcome too
        return ("raised", type(e).__name__, str(e), status, step, err)
    return (table.schema, table.to_pylist(), status, step, err, rs)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    drawn=shaped(),
    mode=st.sampled_from([None, FREEZE, EVOLVE, RESCUE]),
    failed=st.lists(st.booleans(), min_size=12, max_size=12),
)
def test_conform_by_row_fields_answers_as_by_columns(drawn, mode, failed):
    records, schema = drawn
    if mode == RESCUE and RESCUED not in schema.names:
        schema = schema.append(pa.field(RESCUED, pa.string()))
    status = [FAILED if failed[i] else LIVE for i in range(len(records))]
    new = _run(records, schema, mode, status)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(rows, "BY_ROW_FIELDS", False)
        m.setattr(rows, "rows_table", lambda r, s: pa.Table.from_pylist(r, schema=s))
        old = _run(records, schema, mode, status)
    assert repr(new) == repr(old)  # repr: 1 and 1.0, 0.0 and -0.0 told apart


class Col(enum.StrEnum):
    C3 = "c3"


def test_a_field_is_named_as_its_column_is_whatever_the_type_of_the_rows_key():
    schema = pa.schema([(f"c{i}", pa.int64()) for i in range(12)])
    for key in ("c3", Col.C3):
        status, step, err = [LIVE], [None], [None]
        rows.conform([{key: 2.5}], schema, status, step, err, "record")
        assert status == [FAILED] and str(err[0]).startswith("field 'c3': a number with a fraction"), err


def test_the_first_column_that_does_not_fit_is_named_whatever_the_rows_order():
    schema = pa.schema([(f"c{i}", pa.int64()) for i in range(12)])
    # fewer fields than columns: looked at by its fields, in either order
    for row in ({"c9": 1.5, "c3": 2.5, "c5": 3}, {"c3": 2.5, "c9": 1.5, "c5": 3}):
        status, step, err = [LIVE], [None], [None]
        rows.conform([dict(row)], schema, status, step, err, "record")
        assert status == [FAILED] and "'c3'" in str(err[0]) and "2.5" in str(err[0]), err


wide_rows = st.lists(
    st.dictionaries(st.sampled_from([*NAMES, "outside"]), scalars, max_size=4), min_size=0, max_size=80
)


@settings(max_examples=300, deadline=None)
@given(rs=wide_rows, schema=schemas, n_extra=st.integers(0, 30))
def test_rows_table_is_from_pylist(rs, schema, n_extra):
    for k in range(n_extra):  # wide: many more columns than a row has fields
        schema = schema.append(pa.field(f"w{k}", pa.int64()))
    try:
        want: Any = pa.Table.from_pylist(rs, schema=schema)
    except Exception as e:  # noqa: BLE001 - the same failure is expected
        with pytest.raises(type(e)):
            rows_table(rs, schema)
        return
    got = rows_table(rs, schema)
    assert got.schema == want.schema and got.equals(want)
    assert repr(got.to_pylist()) == repr(want.to_pylist())


def test_rows_table_reads_a_dict_subclass_as_from_pylist_does():
    schema = pa.schema([(f"w{k}", pa.int64()) for k in range(40)])  # wide: the sparse way
    got = columns.rows_table([{"w3": 1}, {"w39": 2, "other": 3}], schema)
    assert got.column("w3").to_pylist() == [1, None] and got.column("w39").to_pylist() == [None, 2]

    class Doubled(dict):  # reads its values otherwise than its items say
        def __getitem__(self, k: str) -> Any:
            return 2 * dict.__getitem__(self, k)

    want = pa.Table.from_pylist([Doubled(w3=1)], schema=schema)
    assert want.column("w3").to_pylist() == [2]
    assert columns.rows_table([Doubled(w3=1)], schema).equals(want)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rs=st.lists(st.dictionaries(st.sampled_from([*NAMES, 1, ("t",)]), values, max_size=5), max_size=15))
def test_infer_schema_by_row_fields_answers_as_by_keys(rs):
    new = infer.infer_schema(copy.deepcopy(rs), "record")
    with pytest.MonkeyPatch.context() as m:
        m.setattr(infer, "BY_ROW_FIELDS", False)
        old = infer.infer_schema(copy.deepcopy(rs), "record")
    assert new == old and new.names == old.names and new.metadata == old.metadata


def test_infer_schema_keeps_the_order_keys_are_first_seen_and_types_of_sparse_keys():
    rs = [{"b": 1}, {"a": "x"}, {"b": None, "c": [1]}] + [{} for _ in range(50)] + [{"a": None}]
    assert infer.infer_schema(rs, "s") == pa.schema(
        [("b", pa.int64()), ("a", pa.string()), ("c", pa.list_(pa.int64()))]
    )
    assert infer.infer_schema([{"z": None}, {}], "s") == pa.schema([("z", pa.null())])


def test_a_column_name_twice_is_read_as_from_pylist_and_checked_column_by_column():
    schema = pa.schema([("a", pa.int64()), ("a", pa.float64())] + [(f"w{k}", pa.int64()) for k in range(10)])
    rs = [{"a": 1}, {"w1": 2}]
    assert rows_table(rs, schema).equals(pa.Table.from_pylist(rs, schema=schema))
    assert rows_table(rs, schema).column(0).to_pylist() == [1, None]
    status, step, err = [LIVE], [None], [None]
    rows.conform([{"a": 1.5}], schema, status, step, err, "record")  # the first "a" would cut 1.5
    assert status == [FAILED] and str(err[0]).startswith("field 'a': a number with a fraction"), err


class _NeedsADate(dt.tzinfo):  # a hand-written zone whose name needs the datetime
    def utcoffset(self, d: Any) -> dt.timedelta:
        return dt.timedelta(hours=1)

    def dst(self, d: Any) -> dt.timedelta:
        return dt.timedelta(0)

    def tzname(self, d: Any) -> str:
        return "CET" if d.month < 4 else "CEST"  # Arrow asks with None: AttributeError


def _outcome(rs: list[dict[str, Any]]) -> str:
    try:
        return repr(infer.infer_schema(rs, "s"))
    except Exception as e:  # noqa: BLE001 - compared
        return f"raised {type(e).__name__}: {e}"


def test_infer_schema_where_arrow_raises_reads_the_key_with_its_nones():
    """Arrow checks a mix of kinds every 100 values, Nones counted: which value it reaches
    before it raises depends on them (found by review; both orders)."""
    when = dt.datetime(2020, 1, 1, tzinfo=_NeedsADate())
    others = {f"a{i}": 1 for i in range(9)}  # wide rows
    first = [{"k": [1], **others}, {"k": 5}] + [{} for _ in range(98)] + [{"k": when}]
    later = [{"k": 1, **others}] + [{} for _ in range(60)] + [{"k": i} for i in range(30)]
    later += [{"k": [1]}] + [{"k": i} for i in range(68)] + [{"k": when}]
    for rs in (first, later):
        new = _outcome(rs)
        with pytest.MonkeyPatch.context() as m:
            m.setattr(infer, "BY_ROW_FIELDS", False)
            assert new == _outcome(rs)


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(20, 400), width=st.integers(9, 60))
def test_rows_table_spreads_sparse_columns_as_from_pylist_fills_them(seed, n, width):
    """Many rows, each with a few of many columns: columns a row in eight has or fewer are
    converted from their values alone and spread to their rows."""
    import random

    rnd = random.Random(seed)
    kinds = [pa.int64(), pa.string(), pa.float64(), pa.struct([("a", pa.int64())]), pa.list_(pa.string())]
    schema = pa.schema([(f"w{k}", rnd.choice(kinds)) for k in range(width)])
    make = {
        pa.int64(): lambda: rnd.choice([None, rnd.randint(-5, 5)]),
        pa.string(): lambda: rnd.choice([None, "", "x" * rnd.randint(0, 3)]),
        pa.float64(): lambda: rnd.choice([None, rnd.random(), -0.0]),
        pa.struct([("a", pa.int64())]): lambda: rnd.choice([None, {}, {"a": rnd.randint(0, 3)}, {"a": None}]),
        pa.list_(pa.string()): lambda: rnd.choice([None, [], ["a", None]]),
    }
    rs = []
    for _ in range(n):
        picked = rnd.sample(range(width), rnd.randint(0, 3))
        rs.append({f"w{k}": make[schema.field(k).type]() for k in picked})
    got, want = rows_table(rs, schema), pa.Table.from_pylist(rs, schema=schema)
    assert got.schema == want.schema and got.equals(want)
    assert repr(got.to_pylist()) == repr(want.to_pylist())


MAP = pa.map_(pa.string(), pa.int64())
MAPS = pa.schema(
    [("h", MAP), ("s", pa.struct([("m", MAP)])), ("l", pa.list_(MAP)), ("mm", pa.map_(pa.string(), MAP))]
)


@pytest.mark.parametrize("mode", [None, FREEZE, EVOLVE, RESCUE])
@pytest.mark.parametrize(
    "row",
    [{"h": [None]}, {"h": [None, ("a", 1)]}, {"s": {"m": [None]}}, {"l": [[None]]}, {"mm": {"a": [None]}}],
)
def test_a_null_entry_where_a_map_goes_fails_its_row_instead_of_aborting_arrow(mode, row):
    """pyarrow 26 aborts the process (a failed C++ check, not an exception) converting a
    list with a null entry into a map: JSON ``{"h": [null]}`` against a map column must
    fail or rescue its own row, and the row beside it must be written."""
    schema = MAPS.append(pa.field(RESCUED, pa.string())) if mode == RESCUE else MAPS
    rs = [dict(row), {"h": [("k", 1)]}]
    status, step, err = [LIVE, LIVE], [None, None], [None, None]
    table = rows.conform(rs, schema, status, step, err, "record", mode, "seg")
    assert status[1] == LIVE and table.column("h").to_pylist()[1] == [("k", 1)]
    if mode == RESCUE:
        assert status[0] == LIVE and json.loads(table.column(RESCUED)[0].as_py()) == json.loads(
            json.dumps(row)
        )
    else:
        assert status[0] == FAILED and "null entry" in str(err[0]), err
