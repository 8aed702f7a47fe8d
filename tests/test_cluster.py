"""The same flow on a loopback Spark standalone cluster and on local[2]: same results,
same settlements. An executor killed mid-run leads to retries or nacks, never loss."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pyarrow.parquet as pq
import pytest

from ackflow.embedded import EmbeddedQueue
from cluster import Cluster
from helpers import wait_until

pytestmark = [pytest.mark.spark, pytest.mark.slow]

FLOW = textwrap.dedent("""
    import os, time
    import ackflow
    from ackflow.sources import EmbeddedQueue
    from ackflow.sinks import Parquet

    DB, OUT = os.environ["FLOW_DB"], os.environ["FLOW_OUT"]
    DELAY = float(os.environ.get("FLOW_DELAY", "0"))

    def parse(r):
        if r["qty"] < 0:
            raise ValueError(f"order {r['id']} has qty {r['qty']}")
        time.sleep(DELAY)
        return r

    def items(r):
        return [{"id": r["id"], "sku": f"sku-{(r['id'] + k) % 7}", "qty": r["qty"]}
                for k in range(1 + r["id"] % 3)]

    source = EmbeddedQueue(DB, "in", policy=ackflow.RetryPolicy(max_deliveries=int(
        os.environ.get("FLOW_DELIVERIES", "1")), backoff_s=0.2))
    flow = (ackflow.Flow(source)
            .map(parse, name="parse")
            .flat_map(items, name="items")
            .group_by(*os.environ.get("FLOW_GROUP", "sku").split(","))
            .agg("sum(qty) AS qty", "count(*) AS n", name="per_sku")
            .to(Parquet(OUT)))
""")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(str(tmp_path_factory.mktemp("spark-cluster"))).start()
    yield c
    c.stop()


def publish(db, n, poison_every=50):
    rows = [{"id": i, "qty": -1 if i % poison_every == 7 else 1 + i % 5} for i in range(n)]
    EmbeddedQueue(db).publish(
        "in", [json.dumps(r).encode() for r in rows], msg_ids=[f"o{i}" for i in range(n)]
    )
    return rows


def run_flow(tmp_path, tag, master, n=600, extra_env=None, args=(), wait=True):
    work = tmp_path / tag
    work.mkdir()
    (work / "flow.py").write_text(FLOW)
    db, out = str(work / "q.db"), str(work / "out")
    rows = publish(db, n)
    env = {**os.environ, "FLOW_DB": db, "FLOW_OUT": out, **(extra_env or {})}
    cmd = [sys.executable, "-m", "ackflow.cli", "run", "flow.py:flow", "--master", master, "--json", *args]
    if not wait:
        return (
            subprocess.Popen(
                cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            ),
            db,
            out,
            rows,
        )
    r = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), db, out, rows


def outcome(db, out):
    q = EmbeddedQueue(db)
    dead = {d.msg_id: (d.step, d.error) for d in q.dead_letters("in")}
    left = q.stats("in")
    q.close()
    table = pq.read_table(out)
    per_sku: dict[str, int] = {}
    for sku, qty in zip(table.column("sku").to_pylist(), table.column("qty").to_pylist(), strict=True):
        per_sku[sku] = per_sku.get(sku, 0) + qty
    return dead, left, per_sku


def test_cluster_and_local_give_the_same_results_and_settlements(tmp_path, cluster):
    args = ("--until-idle", "2", "--batch-size", "200", "--max-inflight", "600")
    local, db_l, out_l, rows = run_flow(tmp_path, "local", "local[2]", args=args)
    remote, db_c, out_c, _ = run_flow(tmp_path, "cluster", cluster.master_url, args=args)
    for key in ("acked", "nacked", "dead_lettered"):
        assert local[key] == remote[key], key
    assert local["acked"] == sum(1 for r in rows if r["qty"] >= 0)
    dead_l, _left_l, sums_l = outcome(db_l, out_l)
    dead_c, left_c, sums_c = outcome(db_c, out_c)
    assert dead_l == dead_c and set(dead_c) == {f"o{r['id']}" for r in rows if r["qty"] < 0}
    assert all(step == "parse" for step, _ in dead_c.values())
    assert sums_l == sums_c
    expected: dict[str, int] = {}
    for r in rows:
        if r["qty"] >= 0:
            for k in range(1 + r["id"] % 3):
                sku = f"sku-{(r['id'] + k) % 7}"
                expected[sku] = expected.get(sku, 0) + r["qty"]
    assert sums_c == expected
    assert left_c["ready"] + left_c["leased"] + left_c["delayed"] == 0


def test_a_killed_executor_means_retries_or_nacks_never_loss(tmp_path, cluster):
    env = {"FLOW_DELAY": "0.01", "FLOW_DELIVERIES": "5", "FLOW_GROUP": "id,sku"}
    proc, db, out, rows = run_flow(
        tmp_path,
        "kill",
        cluster.master_url,
        n=1500,
        extra_env=env,
        wait=False,
        args=("--until-idle", "8", "--batch-size", "150", "--max-inflight", "450"),
    )

    def acked():
        q = EmbeddedQueue(db)
        try:
            return q.stats("in")["acked_total"]
        finally:
            q.close()

    try:
        assert wait_until(lambda: acked() > 0 and cluster.executor_pids(), timeout=240, every=0.2)
        killed = cluster.executor_pids()
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert killed and proc.returncode == 0, err[-3000:]
    dead, left, _ = outcome(db, out)
    table = pq.read_table(out, columns=["id"])
    written = set(table.column("id").to_pylist())
    valid = {r["id"] for r in rows if r["qty"] >= 0}
    assert valid <= written  # nothing lost
    assert set(dead) == {f"o{r['id']}" for r in rows if r["qty"] < 0}
    assert left["ready"] + left["leased"] + left["delayed"] == 0


def test_a_function_executors_cannot_import_fails_at_start_naming_its_step(tmp_path, cluster):
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "secret_steps.py").write_text("def tag(r):\n    return {**r, 'tag': 1}\n")
    work = tmp_path / "work"
    work.mkdir()
    db = str(work / "q.db")
    publish(db, 3)
    (work / "flow.py").write_text(
        textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(hidden)!r})  # importable here, on the driver only
        import secret_steps
        import ackflow
        from ackflow.sources import EmbeddedQueue
        from ackflow.sinks import Memory

        flow = ackflow.Flow(EmbeddedQueue({db!r}, "in")).map(secret_steps.tag, name="tagging") \\
            .to(Memory())
    """)
    )
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "ackflow.cli",
            "run",
            "flow.py:flow",
            "--master",
            cluster.master_url,
            "--until-idle",
            "1",
        ],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "step 'tagging': the executors cannot load it" in r.stderr
    assert "secret_steps" in r.stderr
    q = EmbeddedQueue(db)
    assert q.stats("in")["delivered_total"] == 0  # failed before pulling anything


def test_the_files_to_delta_example_runs_on_the_cluster(tmp_path, cluster):
    """``examples/files_to_delta.py --master spark://...``: the example a user copies
    runs unchanged on a standalone cluster (its functions travel to the executors, the
    Delta writes happen there) and lands what it lands on local[2]."""
    from deltalake import DeltaTable

    src, table = tmp_path / "in", tmp_path / "table"
    script = os.path.join(os.path.dirname(__file__), "..", "examples", "files_to_delta.py")
    r = subprocess.run(
        [
            sys.executable,
            script,
            str(src),
            str(table),
            "--sample",
            "2",
            "--until-idle",
            "2",
            "--master",
            cluster.master_url,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "acked             392" in r.stdout and "check: 8" in r.stdout, r.stdout
    rows = DeltaTable(str(table)).to_pyarrow_table().to_pylist()
    assert len(rows) == 392 and all(row["kind"] in ("view", "click", "buy") for row in rows)
    assert len(os.listdir(src / "done")) == 4
