"""Run Spark's Python daemon with pyspark imported from its installed package and the
modules every worker needs imported once, before the forks (ackflow_daemon/__init__.py)."""

import os
import sys

from ackflow_daemon import cleaned, preload, threads

sys.path[:] = cleaned(sys.path)
for _entry in [e for e in sys.path_importer_cache if e not in sys.path]:
    del sys.path_importer_cache[_entry]  # invalidate_caches() walks these, not sys.path

# without /proc the thread count cannot be checked: nothing is preloaded then
if os.environ.get("ACKFLOW_DAEMON_PRELOAD", "1") == "1" and threads() == 1:
    preload()
    if threads() != 1:  # forking a threaded process is unsafe: start again without
        print(
            f"ackflow_daemon: {threads()} threads after preloading; starting again without preloading",
            file=sys.stderr,
            flush=True,
        )
        os.environ["ACKFLOW_DAEMON_PRELOAD"] = "0"
        os.execv(sys.executable, [sys.executable, "-m", "ackflow_daemon", *sys.argv[1:]])

from pyspark.daemon import manager  # noqa: E402 - after the path is set

manager()
