"""ackflow_daemon: Spark's Python daemon with pyspark from its installed package and the
workers' modules imported before the forks; and the driver's class-data archive."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pyspark
import pytest

from ackflow.spark.classes import ARCHIVE_ENV, build, java_options, use_archive
from ackflow_daemon import cleaned

LIB = os.path.join(os.path.dirname(pyspark.__file__), "python", "lib")
JARS = os.path.join(os.path.dirname(pyspark.__file__), "jars")


def spark_zips() -> list[str]:
    return sorted(os.path.join(LIB, n) for n in os.listdir(LIB) if n.endswith(".zip"))


def test_the_zips_of_the_installed_versions_and_jars_without_python_leave_the_path(tmp_path):
    core = next(os.path.join(JARS, n) for n in os.listdir(JARS) if n.startswith("spark-core"))
    with_python = str(tmp_path / "udfs.jar")
    with zipfile.ZipFile(with_python, "w") as z:
        z.writestr("mine/__init__.py", "")
    site = os.path.dirname(os.path.dirname(pyspark.__file__))
    path = [*spark_zips(), core, with_python, str(tmp_path), site]
    assert cleaned(path) == [with_python, str(tmp_path), site]


def test_a_zip_of_another_version_stays_first(tmp_path):
    other = tmp_path / "pyspark.zip"
    with zipfile.ZipFile(other, "w") as z:
        z.writestr("pyspark/__init__.py", "")
        z.writestr("pyspark/version.py", '__version__ = "3.5.0"\n')
    site = os.path.dirname(os.path.dirname(pyspark.__file__))
    assert cleaned([str(other), site]) == [str(other), site]
    assert cleaned([str(other)]) == [str(other)]  # nothing installed beside it


def test_preloading_leaves_one_thread_and_forked_workers_draw_different_numbers():
    code = (
        "import os, sys\n"
        "from ackflow_daemon import preload, threads\n"
        "preload()\n"
        "assert 'pyarrow' in sys.modules and 'ackflow.spark.rows' in sys.modules\n"
        "print(threads())\n"
        "import numpy\n"
        "for _ in range(2):\n"
        "    r, w = os.pipe()\n"
        "    if os.fork() == 0:\n"
        "        os.write(w, repr(numpy.random.random()).encode()); os._exit(0)\n"
        "    os.wait(); print(os.read(r, 100).decode())\n"
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("JE_ARROW_MALLOC_CONF", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")
    }
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    n, first, second = out.stdout.split()
    assert n == "1"
    assert first != second


@pytest.mark.spark
def test_workers_import_the_installed_pyspark(spark):
    import pyarrow as pa

    def where(batches):  # type: ignore[no-untyped-def]
        import pyspark as p

        for _ in batches:
            zips = [e for e in sys.path if e.endswith(".jar") or "pyspark.zip" in e or "py4j-" in e]
            yield pa.RecordBatch.from_pydict({"file": [p.__file__], "zips": [";".join(zips)]})

    df = spark.createDataFrame(pa.table({"x": [1]}))
    out = df.mapInArrow(where, "file string, zips string").toArrow().to_pylist()
    assert out and all(".zip" not in r["file"] for r in out), out
    assert all(r["zips"] == "" for r in out), out


def test_the_archive_is_used_only_when_it_exists(tmp_path, monkeypatch):
    archive = tmp_path / "a b.jsa"
    monkeypatch.setenv(ARCHIVE_ENV, str(archive))
    monkeypatch.setenv("SPARK_SUBMIT_OPTS", "-Dx=1")
    use_archive()
    assert os.environ["SPARK_SUBMIT_OPTS"] == "-Dx=1"
    archive.write_bytes(b"x")
    use_archive()
    assert os.environ["SPARK_SUBMIT_OPTS"] == f"-Dx=1 {java_options(str(archive))}"
    assert f"-XX:SharedArchiveFile='{archive}'" in os.environ["SPARK_SUBMIT_OPTS"]
    use_archive()  # once
    assert os.environ["SPARK_SUBMIT_OPTS"].count("SharedArchiveFile") == 1


def test_a_failed_build_leaves_no_archive(tmp_path, monkeypatch):
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "no-java"))
    monkeypatch.setenv("PATH", "/nonexistent")
    target = tmp_path / "x.jsa"
    with pytest.raises(RuntimeError, match="building the class archive failed"):
        build(str(target), timeout=120)
    assert list(tmp_path.iterdir()) == []


def test_a_daemon_left_with_threads_after_preloading_starts_again_without():
    """jemalloc's background thread kept on: the daemon must not fork from that process."""
    env = {**os.environ, "JE_ARROW_MALLOC_CONF": "background_thread:true"}
    env.pop("ACKFLOW_DAEMON_PRELOAD", None)
    done = subprocess.run(
        [sys.executable, "-m", "ackflow_daemon", "pyspark.worker"],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=120,
    )
    assert b"threads after preloading; starting again without preloading" in done.stderr
    assert done.stderr.count(b"starting again") == 1, done.stderr  # once, then it ran
    assert len(done.stdout) >= 4, done  # Spark's daemon started and told its port


def test_the_daemon_is_chosen_only_where_it_runs_here_on_this_interpreter():
    import importlib

    session_module = importlib.import_module("ackflow.spark.session")
    chosen = {"spark.python.daemon.module": "ackflow_daemon"}
    assert session_module._daemon("local[2]", sys.executable) == chosen
    assert session_module._daemon("spark://127.0.0.1:7077", sys.executable) == {}
    assert session_module._daemon("local[2]", "/usr/bin/python3-elsewhere") == {}
