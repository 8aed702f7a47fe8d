"""Issue 30's proof on real data (not generated): records with sparse optional and
nested fields, from packages the project installs (see tests/realdata.py), land with
every field they had.

- ISO 639-3 (7,910 records, fields in 1 to 1,415 of them): in batches of 100 the old
  code dead-lettered 21 valid records ("not among the columns inferred from the first
  batch"); now none, and every field is read back.
- botocore's API operations (nested: http, input, output, a list of error objects;
  sparse at several depths), through Files and through the embedded queue, into Parquet,
  PostgreSQL and Delta, with a SIGKILL in the middle and a restart: every record in every
  sink with every field, the schema history shows each addition once, and Spark, polars
  and pyarrow read the Parquet output as one table.
"""

import json
import os
import signal
import subprocess
import sys

import pyarrow.dataset as pads
import pytest

import ackflow
from ackflow.core.schema import open_readonly
from ackflow.embedded import EmbeddedQueue
from ackflow.sinks import Parquet
from ackflow.sources import Files
from helpers import wait_until
from realdata import botocore_operations, iso_639_3, same

PIPELINE = os.path.join(os.path.dirname(__file__), "pipelines", "realdata_flow.py")


def write_jsonl(folder, name, records):
    tmp = folder / f".{name}.tmp"
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    os.rename(tmp, folder / name)


def parquet_rows(path):
    """The Parquet dataset as one table: pyarrow with the dataset's schema (the sink
    keeps it in ``_common_metadata``), and polars the same way (both must agree)."""
    import polars as pl
    import pyarrow.parquet as pq

    schema = pq.read_schema(f"{path}/_common_metadata")
    table = pads.dataset(str(path), schema=schema, format="parquet").to_table()
    rows = [{k: v for k, v in r.items() if k != "ackflow_key"} for r in table.to_pylist()]
    frame = pl.scan_parquet(
        f"{path}/**/*.parquet",
        schema=pl.read_parquet_schema(f"{path}/_common_metadata"),
        missing_columns="insert",
        cast_options=pl.ScanCastOptions(
            integer_cast=["upcast", "allow-float"], float_cast="upcast", missing_struct_fields="insert"
        ),
    ).collect()
    assert frame.height == len(rows), "polars and pyarrow disagree"
    return rows


def test_iso_639_3_sparse_fields_all_land(tmp_path):
    records = iso_639_3()
    assert len(records) == 7910
    folder = tmp_path / "in"
    folder.mkdir()
    write_jsonl(folder, "iso_639_3.jsonl", records)
    out = tmp_path / "out"
    report = ackflow.run(
        ackflow.Flow(Files(folder, scan_interval_s=0.1)).map(lambda r: r, name="record").to(Parquet(out)),
        executor="local",
        batch_size=100,
        max_inflight=400,
        until_idle=0.5,
    )
    assert report.dead_lettered == 0 and report.acked == 7910
    rows = {r["alpha_3"]: r for r in parquet_rows(out)}
    assert len(rows) == 7910
    assert all(same(r, rows[r["alpha_3"]]) for r in records)
    # every optional field is a column, added in the version that first needed it
    added = [c for v in open_readonly(str(out / "_ackflow")).history() for c in v["changes"]]
    names = [c.split(":")[0].lstrip("+") for c in added]
    assert sorted(names) == sorted({k for r in records for k in r})


def _run(cmd, env, kill_when=None):
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if kill_when is None:
        out, err = proc.communicate(timeout=300)
        return proc.returncode, out, err
    try:
        reached = wait_until(lambda: kill_when() or proc.poll() is not None, timeout=240, every=0.05)
        assert reached and proc.poll() is None, "the run ended before the kill"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        proc.stdout.close()
        proc.stderr.close()
    return -9, "", ""


def _committed_batches(path):
    try:
        return sum(1 for n in os.listdir(path) if n.startswith("batch="))
    except FileNotFoundError:
        return 0


@pytest.mark.slow
@pytest.mark.parametrize("source", ["files", "queue"])
def test_botocore_operations_evolve_through_a_sigkill_into_every_sink(
    spark, postgres, pg_table, tmp_path, source
):
    records = botocore_operations(40)
    assert len(records) > 1000
    env = {
        **os.environ,
        "AF_SOURCE": source,
        "AF_PARQUET": str(tmp_path / "parquet"),
        "AF_DSN": postgres.dsn,
        "AF_TABLE": pg_table,
        "AF_DELTA": str(tmp_path / "delta"),
    }
    if source == "files":
        folder = tmp_path / "in"
        folder.mkdir()
        for k in range(0, len(records), 300):  # several files, shapes drifting across them
            write_jsonl(folder, f"ops-{k:05d}.jsonl", records[k : k + 300])
        env["AF_IN"] = str(folder)
    else:
        db = str(tmp_path / "queue.db")
        EmbeddedQueue(db).publish(
            "records",
            [json.dumps(r).encode() for r in records],
            msg_ids=[f"{r['service']}/{r['name']}" for r in records],
        )
        env["AF_IN"] = db
    state = tmp_path / "parquet" / "_ackflow"  # beside the first sink with local state
    cmd = [
        sys.executable,
        "-m",
        "ackflow.cli",
        "run",
        f"{PIPELINE}:flow",
        "--master",
        "local[2]",
        "--json",
        "--batch-size",
        "100",
        "--max-inflight",
        "300",
        "--until-idle",
        "1.5",
    ]
    # 1. killed in the middle, after a few committed batches
    _run(cmd, env, kill_when=lambda: _committed_batches(tmp_path / "parquet") >= 3)
    # 2. to the end
    code, out, err = _run(cmd, env)
    assert code == 0, err[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert report["dead_lettered"] == 0, report["failures"]
    want = {(r["service"], r["name"]): r for r in records}

    def check(rows, where):
        got = {(r["service"], r["name"]): r for r in rows}
        assert len(rows) == len(got) == len(want), where  # once each
        lost = [k for k, r in want.items() if not same(r, got[k])]
        assert not lost, (where, lost[:3], got[lost[0]] if lost else None)

    check(parquet_rows(tmp_path / "parquet"), "parquet (pyarrow)")
    # Spark takes the schema from _common_metadata, and adds the batch=... folders as a
    # partition column
    check(
        [
            {k: v for k, v in r.items() if k not in ("ackflow_key", "batch")}
            for r in spark.read.parquet(str(tmp_path / "parquet")).toArrow().to_pylist()
        ],
        "parquet (Spark)",
    )
    from deltalake import DeltaTable

    check(
        [
            {k: v for k, v in r.items() if k != "ackflow_key"}
            for r in DeltaTable(str(tmp_path / "delta")).to_pyarrow_table().to_pylist()
        ],
        "delta",
    )
    import psycopg
    from psycopg.rows import dict_row

    with psycopg.connect(postgres.dsn, row_factory=dict_row) as c:
        pg = c.execute(f'SELECT * FROM "{pg_table}"').fetchall()
    check([{k: v for k, v in r.items() if k != "ackflow_key"} for r in pg], "postgres")
    # each addition once in the history, whatever the kill interrupted
    store = open_readonly(str(state))
    changes = [c for v in store.history() for c in v["changes"] if c.startswith("+")]
    store.close()
    assert len(changes) == len(set(changes)), changes
    assert any("responseCode" in c for c in changes)
