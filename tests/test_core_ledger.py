"""The ledger: receipts → outcomes. Example cases and a property test (no Spark)."""

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from ackflow.core.ledger import NO_RECEIPT, RECEIPT_SCHEMA, compact_receipts, settle_receipts


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
    table = receipts([
        (i, "s", e, e if ok else max(e - 1, 0), step, None if step is None else "boom")
        for i, e, ok, step in rows
    ])
    for t in (table, compact_receipts(table)):  # partial sums must not change the verdict
        out = settle_receipts(sorted(expected), t)
        assert set(out.acked) | set(out.failed) == expected
        assert not set(out.acked) & set(out.failed)
        for mid in expected:
            mine = [r for r in rows if r[0] == mid]
            should_ack = bool(mine) and all(
                step is None and (ok or e == 0) for _, e, ok, step in mine
            )
            assert (mid in out.acked) == should_ack, (mid, mine)
