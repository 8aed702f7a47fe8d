"""The ledger: receipts → outcomes. Example cases and a property test (no Spark)."""

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from ackflow.core.ledger import NO_RECEIPT, RECEIPT_SCHEMA, Failure, compact_receipts, settle_receipts


def receipts(rows):
    return pa.Table.from_pylist(
        [dict(zip(RECEIPT_SCHEMA.names, r, strict=True)) for r in rows], schema=RECEIPT_SCHEMA
    )


def test_ack_needs_every_emitted_row_written():
    r = receipts([(1, "s", 3, 3, None, None), (2, "s", 3, 2, None, None)])
    out = settle_receipts([1, 2], r)
    assert out.acked == [1]
    assert out.failed[2].step == "s" and "fewer rows" in out.failed[2].error


def test_filtered_message_is_acked_and_missing_receipt_is_not():
    out = settle_receipts([7, 8], receipts([(7, "s", 0, 0, None, None)]))
    assert out.acked == [7]
    assert out.failed == {8: NO_RECEIPT}


def test_an_error_wins_over_written_rows():
    r = receipts([(1, "s", 2, 2, None, None), (1, "s", 1, 0, "items", "KeyError: 'sku'")])
    out = settle_receipts([1], r)
    assert out.acked == []
    assert (out.failed[1].step, out.failed[1].error) == ("items", "KeyError: 'sku'")


def test_receipts_for_unknown_ids_prove_nothing():
    out = settle_receipts([1], receipts([(2, "s", 1, 1, None, None)]))
    assert out.acked == [] and out.failed == {1: NO_RECEIPT}


row = st.tuples(
    st.integers(1, 6),  # id
    st.integers(0, 3),  # emitted
    st.booleans(),  # all written?
    st.one_of(st.none(), st.sampled_from(["parse", "items"])),  # error step
)


@settings(max_examples=300, deadline=None)
@given(st.lists(row, max_size=30), st.sets(st.integers(1, 8), min_size=1))
def test_property_ack_iff_all_rows_written_without_error(rows, expected):
    table = receipts(
        [
            (i, "s", e, e if ok else max(e - 1, 0), step, None if step is None else "boom")
            for i, e, ok, step in rows
        ]
    )
    for t in (table, compact_receipts(table)):  # partial sums must not change the verdict
        out = settle_receipts(sorted(expected), t)
        assert set(out.acked) | set(out.failed) == expected
        assert not set(out.acked) & set(out.failed)
        for mid in expected:
            mine = [r for r in rows if r[0] == mid]
            should_ack = bool(mine) and all(step is None and (ok or e == 0) for _, e, ok, step in mine)
            assert (mid in out.acked) == should_ack, (mid, mine)


def _r(mid, sink, emitted, written, step=None, err=None):
    return {"id": mid, "sink": sink, "emitted": emitted, "written": written, "err_step": step, "err": err}


def test_the_first_failure_along_the_plan_is_kept_not_the_smallest_or_largest_text():
    """Three rows of message 1 fail in three places. Plan order: m_first, z_later, then the
    sink a_sink. min() of the text would say a_sink, max() z_later: both wrong."""
    order = ["decode", "m_first", "z_later", "a_sink"]
    rows = [
        _r(1, "a_sink", 1, 0, "a_sink", "refused"),
        _r(1, "a_sink", 0, 0, "z_later", "late"),
        _r(1, "a_sink", 0, 0, "m_first", "the cause"),
    ]
    for perm in (rows, rows[::-1], rows[1:] + rows[:1]):
        table = pa.Table.from_pylist(perm, schema=RECEIPT_SCHEMA)
        assert settle_receipts([1], table, order=order).failed[1] == Failure("m_first", "the cause")
        compact = compact_receipts(table, order)  # inside tasks: the same rule
        assert compact.to_pylist()[0]["err_step"] == "m_first"
        assert settle_receipts([1], compact, order=order).failed[1].error == "the cause"


def test_a_sink_over_reporting_rows_fails_the_message_never_acks_it():
    table = pa.Table.from_pylist([_r(1, "s", 1, 2), _r(2, "s", 1, 1)], schema=RECEIPT_SCHEMA)
    out = settle_receipts([1, 2], table)
    assert out.acked == [2] and out.over_reported == [1]
    assert "more rows written than were emitted" in out.failed[1].error


def test_compacting_one_row_per_message_gives_what_grouping_gives():
    """The shortcut for unique ids (a map's rows) keeps grouping's every rule: an error
    without a step ranks as '?', a step without an error is no failure, and error text
    with the separator in it is kept whole."""
    from ackflow.core.ledger import _SEP, _compact_grouped

    rows = [
        _r(1, "s", 1, 1),
        _r(2, "s", 1, 0, "s", "refused"),
        _r(3, "s", 0, 0, None, "odd"),
        _r(4, "s", 1, 1, "parse", None),
        _r(5, "s", 0, 0, "parse", f"a{_SEP}b{_SEP}c"),
        _r(6, "s", 3, 2, "decode", ""),
    ]
    table = pa.Table.from_pylist(rows, schema=RECEIPT_SCHEMA)
    order = ["decode", "parse", "s"]
    assert compact_receipts(table, order).to_pylist() == _compact_grouped(table, order).to_pylist()
    twice = pa.Table.from_pylist(rows + rows[:1], schema=RECEIPT_SCHEMA)  # id 1 twice: grouped
    assert compact_receipts(twice, order).num_rows == len(rows)
