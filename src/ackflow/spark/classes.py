"""A class-data archive for the driver's JVM: Spark starts about 5 s sooner.

A Spark driver loads some 15 000 classes before its first batch; on 2 cores that is
most of its start-up. Java 17 can dump the classes a run loaded into an archive
(``-XX:ArchiveClassesAtExit``) and map it at the next start
(``-XX:SharedArchiveFile``). Measured here: session 9.0 s -> 4.9 s, first Arrow job
5.5 s -> 2.9 s.

Build one (53-88 s measured on 2 cores; it runs a small Spark workload and keeps what
it loaded)::

    python -m ackflow.spark.classes ~/.cache/ackflow/spark-classes.jsa
    export ACKFLOW_CLASS_ARCHIVE=~/.cache/ackflow/spark-classes.jsa

``ackflow.session()`` then starts the driver's JVM from it. The archive is tied to the
JVM and to Spark's class path: after an upgrade the JVM ignores it (and starts as
slowly as before) until it is built again. It only changes how fast classes load.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

ARCHIVE_ENV = "ACKFLOW_CLASS_ARCHIVE"
# CDS warnings (a stale archive) go to the JVM's stdout, which is the driver's
_QUIET = "-Xlog:cds=off -Xlog:cds+dynamic=off"


def java_options(path: str) -> str:
    """The JVM options that start a driver from the archive at ``path``."""
    return f"-XX:SharedArchiveFile={shlex.quote(path)} {_QUIET}"


def use_archive() -> None:
    """Add the archive named by ``ACKFLOW_CLASS_ARCHIVE`` (if it exists) to the options
    of the driver's JVM; called before the JVM starts, a no-op after."""
    path = os.environ.get(ARCHIVE_ENV)
    opts = os.environ.get("SPARK_SUBMIT_OPTS", "")
    if not path or not os.path.isfile(path) or "SharedArchiveFile" in opts:
        return
    os.environ["SPARK_SUBMIT_OPTS"] = f"{opts} {java_options(path)}".strip()


def build(path: str, timeout: float = 300) -> str:
    """Build the archive at ``path``: a child process runs a small Spark workload with
    ``-XX:ArchiveClassesAtExit`` on a temporary file, and only a JVM that exited
    cleanly has its archive moved into place (a torn archive would crash the JVMs
    that map it). Returns ``path``."""
    path = os.path.abspath(os.path.expanduser(path))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    # a child of its own: not attached to a JVM this process may run (PYSPARK_GATEWAY_*),
    # and not started from another archive
    env = {k: v for k, v in os.environ.items() if k != ARCHIVE_ENV and not k.startswith("PYSPARK_GATEWAY_")}
    opts = " ".join(
        o
        for o in shlex.split(env.get("SPARK_SUBMIT_OPTS", ""))
        if "SharedArchiveFile" not in o and not o.startswith("-Xlog:cds")
    )
    env["SPARK_SUBMIT_OPTS"] = (
        f"{shlex.join(shlex.split(opts))} -XX:ArchiveClassesAtExit={shlex.quote(tmp)} {_QUIET}"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-m", "ackflow.spark.classes", "--workload"],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if done.returncode != 0 or not os.path.isfile(tmp) or os.path.getsize(tmp) == 0:
            tail = (done.stderr or "").strip().splitlines()[-1:] or ["no archive written"]
            raise RuntimeError(f"building the class archive failed: {tail[0]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _workload() -> None:
    """What a batch does, in small: Arrow in and out, Python steps, SQL, a shuffle, a
    broadcast join, a failing cast, Parquet. Then the JVM is made to exit (its stdin
    closed) and waited for, so that it writes the archive before this process ends."""
    import tempfile

    import pyarrow as pa
    from pyspark import SparkContext
    from pyspark.sql import functions as F

    from ackflow.spark.session import session

    spark = session("local[2]")

    def same(batches):  # type: ignore[no-untyped-def]
        yield from batches

    df = spark.createDataFrame(pa.table({"k": ["a", "b", "c", "x"], "n": [1, 2, 3, 4]}))
    df = df.mapInArrow(same, df.schema).withColumn("m", F.col("n") * 2)
    other = spark.createDataFrame(pa.table({"k": ["a", "b"], "tag": ["t", "u"]}))
    joined = df.join(F.broadcast(other), "k", "left")
    joined.groupBy("tag").agg(F.sum("m").alias("s")).toArrow()
    try:
        df.select(F.col("k").cast("bigint")).collect()  # ANSI: fails on "a"
    except Exception:  # noqa: BLE001 - the failure path is part of the workload
        pass
    spark.sparkContext.parallelize([1, 2], 2).map(lambda x: x).collect()
    with tempfile.TemporaryDirectory() as d:
        joined.write.parquet(os.path.join(d, "t"))
    gateway = SparkContext._gateway
    spark.stop()
    proc = getattr(gateway, "proc", None)
    if proc is not None:
        proc.stdin.close()  # the gateway server exits on EOF: System.exit dumps the archive
        if proc.wait(timeout=120) != 0:
            raise SystemExit("the JVM did not exit cleanly")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["--workload"]:
        _workload()
        return 0
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m ackflow.spark.classes ARCHIVE_PATH", file=sys.stderr)
        return 2
    try:
        path = build(args[0])
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        print(f"ackflow: {e}", file=sys.stderr)
        return 1
    print(f"built {path}; start drivers from it with: export {ARCHIVE_ENV}={path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
