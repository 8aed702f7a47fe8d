"""Spark's Python daemon, importing pyspark from its installed package.

Spark puts ``pyspark.zip`` and the py4j zip first on its Python workers' path. Python
cannot cache compiled code inside a zip, so every daemon compiled pyspark from source
(4.2 s on 2 cores, against 0.4 s from the installed package) and every worker it forks
compiled ``pyspark.worker`` again (0.45 s against 0.03 s). A driver pays the first at
its first job; a failed job replaces every worker its tasks used, so each bisection
step paid the second once per Python step and task.

Zips on the path cost again in every worker: pyspark's ``setup_spark_files`` calls
``importlib.invalidate_caches()``, which re-reads the directory of every zip on the path,
spark-core's jar (6 000 entries, no Python in it) among them: ~0.3 s a worker.

And every worker imported pyarrow, numpy, pandas and ackflow's task code after its fork
(~0.7 s of CPU a worker). Spark's daemon imports nothing before forking because pyarrow
and numpy start threads when imported (jemalloc's background thread, OpenBLAS's pool),
and forking a threaded process can leave a lock held forever in the child.

This daemon (``python -m ackflow_daemon``): takes the zips off the path when the
installed pyspark and py4j are the very versions inside them (and jars that hold no
Python); turns those import-time threads off (``JE_ARROW_MALLOC_CONF=
background_thread:false``, ``OPENBLAS_NUM_THREADS=1``, which Spark's ``OMP_NUM_THREADS=1``
already implies for workers), imports the workers' modules, and checks that the process
still has one thread: if not, it starts again without importing them
(``ACKFLOW_DAEMON_PRELOAD=0``). Each forked worker reseeds numpy's global random state
(Python's ``random`` does so itself). Then Spark's own daemon runs, unchanged.
``ackflow.session()`` selects it (``spark.python.daemon.module``) for local masters whose
workers run the driver's interpreter.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys
import zipfile

_ZIPPED = {"pyspark": "pyspark/version.py", "py4j": "py4j/version.py"}


def _zip_of(entry: str) -> str | None:
    """The package a Spark zip on the path holds (pyspark.zip, py4j-*-src.zip)."""
    name = os.path.basename(entry)
    if name == "pyspark.zip":
        return "pyspark"
    if name.startswith("py4j-") and name.endswith(".zip"):
        return "py4j"
    return None


def _same_version(entry: str, package: str, others: list[str]) -> bool:
    """Whether the package installed on ``others`` has the version file of the zip."""
    spec = importlib.machinery.PathFinder.find_spec(package, others)
    if spec is None or not spec.submodule_search_locations:
        return False
    installed = os.path.join(next(iter(spec.submodule_search_locations)), "version.py")
    try:
        with zipfile.ZipFile(entry) as z:
            zipped = z.read(_ZIPPED[package])
        with open(installed, "rb") as f:
            return f.read() == zipped
    except (OSError, KeyError, zipfile.BadZipFile):
        return False


# imported once in the daemon: what every Python worker of an ackflow job imports
PRELOAD = (
    "numpy",
    "pyarrow",
    "pyarrow.compute",
    "pyarrow.ipc",
    "pandas",
    "pyspark.worker",
    "pyspark.sql.pandas.serializers",
    "ackflow.spark.rows",
    "ackflow.spark.writer",
)


def threads() -> int:
    """Threads of this process (native ones too)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0  # cannot tell: treated as unsafe


def preload() -> None:
    """Import ``PRELOAD`` with the import-time threads turned off; forked workers
    reseed numpy's global random state."""
    os.environ.setdefault("JE_ARROW_MALLOC_CONF", "background_thread:false")
    if "OPENBLAS_NUM_THREADS" not in os.environ:
        os.environ["OPENBLAS_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
    # the daemon's stdout is Spark's channel (its port goes there first): anything an
    # import prints goes to stderr
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        for name in PRELOAD:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - a worker imports what it needs anyway
                continue
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        os.register_at_fork(after_in_child=lambda: numpy.random.seed())


def _holds_python(entry: str) -> bool:
    try:
        with zipfile.ZipFile(entry) as z:
            return any(n.endswith((".py", ".pyc")) for n in z.namelist())
    except (OSError, zipfile.BadZipFile):
        return True  # not ours to judge: leave it


def cleaned(path: list[str]) -> list[str]:
    """``path`` without the Spark zips whose very version is installed elsewhere on it,
    and without jars that hold no Python (Spark adds spark-core's jar, 6 000 entries)."""
    others = [p for p in path if _zip_of(p) is None and not p.endswith(".jar")]
    drop = set()
    for entry in path:
        package = _zip_of(entry)
        if package is not None and _same_version(entry, package, others):
            drop.add(entry)
        elif entry.endswith(".jar") and not _holds_python(entry):
            drop.add(entry)
    return [p for p in path if p not in drop]
