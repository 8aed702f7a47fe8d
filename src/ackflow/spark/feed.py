"""A batch's messages handed to local executors through a file, not through the JVM.

``spark.createDataFrame(arrow_table)`` turns every message into a JVM row on the driver,
ships the rows inside the tasks, and the first ``mapInArrow`` turns them back into Arrow
for its Python worker: measured, that was most of the JVM's CPU per message (JFR of the
benchmark: ``LocalTableScanExec.unsafeRows``, ``ArrowFieldWriter.write``). On a local
master the Python workers share the driver's disk, so the driver writes the batch as an
Arrow IPC file (one record batch per partition) and the job starts from
``spark.range(partitions)``: the first Python function reads its partition's record
batch from the file itself. The bytes never enter the JVM; what comes out of that
function is the same as before, so nothing after it changes.

A file lives as long as its batch's job (:meth:`Feeds.release`); the directory is the
process's own (it holds a lock file the process keeps locked), and the directories of
processes that died without cleaning up (SIGKILL) are removed by the next one to start.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import uuid
import weakref
from collections.abc import Callable, Iterator

import pyarrow as pa

from ackflow.core.durable import try_lock
from ackflow.spark.session import switched_on

Fn = Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]
PREFIX = "ackflow-feed-"
LOCK = "owner.lock"


def fed(path: str, fn: Fn, max_rows: int = 10_000) -> Fn:
    """``fn`` over the record batches of ``path`` named by its input (partition indices),
    in pieces of at most ``max_rows`` (what Spark hands a ``mapInArrow`` function:
    ``spark.sql.execution.arrow.maxRecordsPerBatch``; a whole partition at once could
    outgrow a worker's memory where the DataFrame's pieces did not)."""

    def run(indices: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        def batches() -> Iterator[pa.RecordBatch]:
            with pa.OSFile(path, "rb") as f:  # read, not mapped: fn may keep a batch
                reader = pa.ipc.open_file(f)
                for b in indices:
                    for i in b.column(0).to_pylist():
                        batch = reader.get_batch(i)
                        for start in range(0, batch.num_rows, max_rows):
                            yield batch.slice(start, max_rows)

        return fn(batches())

    return run


class Feeds:
    """The input files of one process's batches. The directory holds a lock file this
    process keeps locked (``flock``) while it lives: a directory whose lock can be taken
    belongs to a dead process, whatever its pid means here (containers sharing the
    temporary folder do not share pids; the kernel's locks they do share)."""

    def __init__(self) -> None:
        sweep_dead()
        self.dir = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")
        self._files: dict[str, list[str]] = {}
        self._lock = threading.Lock()
        self._held = try_lock(os.path.join(self.dir, LOCK))
        weakref.finalize(self, _remove, self.dir, self._held)

    def write(self, table: pa.Table, batch_id: str) -> tuple[str, int]:
        """Write ``table`` (chunked one record batch per partition); its path and how many
        record batches it holds. The directory is made again if it went (a cleaner of
        the temporary folder); a file half written is removed (OSError goes to the
        caller, who sends the batch the other way)."""
        batches = [b for b in table.to_batches() if b.num_rows]

        def arrow(paths: list[str]) -> None:
            paths.append(os.path.join(self.dir, f"{uuid.uuid4().hex}.arrow"))
            with pa.OSFile(paths[-1], "wb") as f, pa.ipc.new_file(f, table.schema) as w:
                for b in batches:
                    w.write_batch(b)

        return self._kept(batch_id, arrow)[0], len(batches)

    def write_parquet(self, table: pa.Table, batch_id: str) -> list[str]:
        """Write ``table`` as Parquet files, one per record batch (a partition each), for
        Spark's own reader (the JVM decodes them: see spark/jvm_decode.py); their paths.
        Errors as in :meth:`write`."""
        import pyarrow.parquet as pq

        stem = os.path.join(self.dir, uuid.uuid4().hex)

        def parquet(paths: list[str]) -> None:
            for i, b in enumerate(b for b in table.to_batches() if b.num_rows):
                paths.append(f"{stem}-{i}.parquet")
                pq.write_table(pa.Table.from_batches([b]), paths[-1], compression="none")

        return self._kept(batch_id, parquet)

    def _kept(self, batch_id: str, write: Callable[[list[str]], None]) -> list[str]:
        """The files ``write`` makes (it adds each path to the list before writing it),
        kept until :meth:`release` of ``batch_id``. The directory is made again if it
        went; if ``write`` fails, what it began is removed and the error goes on."""
        os.makedirs(self.dir, exist_ok=True)
        paths: list[str] = []
        try:
            write(paths)
        except BaseException:
            for p in paths:
                with contextlib.suppress(OSError):
                    os.remove(p)
            raise
        with self._lock:
            self._files.setdefault(batch_id, []).extend(paths)
        return paths

    def release(self, batch_id: str) -> None:
        with self._lock:
            paths = self._files.pop(batch_id, [])
        for p in paths:
            with contextlib.suppress(FileNotFoundError):
                os.remove(p)


def sweep_dead() -> None:
    """Remove the feed directories of processes that are gone: those whose lock file
    can be locked (its owner would hold it)."""
    root = tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            folder = os.path.join(root, name)
            if not name.startswith(PREFIX) or not os.path.isfile(os.path.join(folder, LOCK)):
                continue
            fd = try_lock(os.path.join(folder, LOCK))
            if fd is None:  # its owner lives
                continue
            try:
                shutil.rmtree(folder, ignore_errors=True)
            finally:
                os.close(fd)


def _remove(folder: str, fd: int | None) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)


def feed_enabled(spark: object) -> bool:
    """On unless the session says ``spark.ackflow.feed=false`` (then the messages go
    through ``createDataFrame`` as on a cluster)."""
    return switched_on(spark, "feed")
