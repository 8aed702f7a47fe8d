"""The Python workers' row check against many columns (issue 32): ``conform`` of a batch
whose rows have a few fields each out of many optional columns, by the row's fields
(ackflow's way) and column by column (the way before 0.6.10, ``BY_ROW_FIELDS`` off and
Arrow's ``from_pylist``), and the columns inferred from such rows (``infer_schema``, run on
a sample of every batch while columns are inferred) by each row's fields and key by key:
``.venv/bin/python -m benchmarks.wide_rows [--out X.json]``.

No Spark: the function a task runs on each batch, timed alone (best of five, µs a row).
Each row is a benchmark message (``id, sku, qty, price, pad``) plus one optional field
``f<k>`` of ``columns - 5``; the columns are given (mode None) or inferred (``evolve``).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import pyarrow as pa

from ackflow.core.schema import EVOLVE
from ackflow.spark import infer, rows
from benchmarks.phases import body

ROWS = 25_000


def batch(columns: int) -> tuple[list[dict[str, Any]], pa.Schema]:
    optional = columns - 5
    made = [json.loads(body(i)[:-1] + f',"f{i % optional}":{i}}}'.encode()) for i in range(ROWS)]
    fields = [("id", pa.int64()), ("sku", pa.string()), ("qty", pa.int64()), ("price", pa.float64())]
    fields += [("pad", pa.string())] + [(f"f{k}", pa.int64()) for k in range(optional)]
    return made, pa.schema(fields)


def _from_pylist(rows: list[dict[str, Any]], schema: pa.Schema) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=schema)


def best_us(made: list[dict[str, Any]], schema: pa.Schema, mode: str | None, by_fields: bool) -> float:
    rows.BY_ROW_FIELDS = by_fields
    table = rows.rows_table
    if not by_fields:
        rows.rows_table = _from_pylist
    try:
        best = float("inf")
        for _ in range(5):
            copy = [dict(r) for r in made]
            n = len(copy)
            t = time.perf_counter()
            rows.conform(copy, schema, [rows.LIVE] * n, [None] * n, [None] * n, "record", mode, "s")
            best = min(best, time.perf_counter() - t)
        return best / n * 1e6
    finally:
        rows.BY_ROW_FIELDS, rows.rows_table = True, table


def infer_us(made: list[dict[str, Any]], by_fields: bool) -> float:
    infer.BY_ROW_FIELDS = by_fields
    try:
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            infer.infer_schema(made, "record")
            best = min(best, time.perf_counter() - t)
        return best / len(made) * 1e6
    finally:
        infer.BY_ROW_FIELDS = True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--columns", default="6,25,100,400", help="comma-separated column counts")
    p.add_argument("--out", help="write the results as JSON here")
    a = p.parse_args()
    results = []
    print(f"{'columns':>8} {'check':>7} {'by columns µs/row':>18} {'by fields µs/row':>17} {'ratio':>6}")
    for columns in (int(c) for c in a.columns.split(",")):
        made, schema = batch(columns)
        for mode in (None, EVOLVE):
            old = best_us(made, schema, mode, False)
            new = best_us(made, schema, mode, True)
            results.append({"columns": columns, "mode": mode, "by_columns_us": old, "by_fields_us": new})
            print(f"{columns:>8} {mode or 'given':>7} {old:>18.2f} {new:>17.2f} {old / new:>6.2f}")
        old, new = infer_us(made, False), infer_us(made, True)
        results.append({"columns": columns, "infer": True, "by_columns_us": old, "by_fields_us": new})
        print(f"{columns:>8} {'infer':>7} {old:>18.2f} {new:>17.2f} {old / new:>6.2f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"rows": ROWS, "results": results}, f, indent=1)
    print(json.dumps({"rows": ROWS, "results": results}))


if __name__ == "__main__":
    main()
