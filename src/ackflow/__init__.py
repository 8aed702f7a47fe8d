"""ackflow: acknowledged streaming pipelines on Apache Spark.

A message taken from a source is acked only when every row derived from it was
durably written; otherwise it is nacked, dead-lettered, or left to redelivery.
"""

from typing import TYPE_CHECKING

from ackflow._lazy import lazy
from ackflow.core.errors import AckflowError, AlreadySettled, ConfigError, FlowError
from ackflow.core.policy import RetryPolicy

if TYPE_CHECKING:  # imported on first use (ackflow/_lazy.py): Spark's workers skip them
    from ackflow.engine import RunReport, run
    from ackflow.flow import Flow, branch, merge

__getattr__, __dir__ = lazy(
    __name__,
    {
        "RunReport": "ackflow.engine:RunReport",
        "run": "ackflow.engine:run",
        "Flow": "ackflow.flow:Flow",
        "branch": "ackflow.flow:branch",
        "merge": "ackflow.flow:merge",
        # submodules the eager imports used to load as a side effect: ``ackflow.sinks.X``
        **{
            m: f"ackflow.{m}"
            for m in (
                "core",
                "embedded",
                "engine",
                "faults",
                "flow",
                "observe",
                "sinks",
                "sources",
                "spark",
                "testing",
            )
        },
    },
)


def session(master: str | None = None, conf: dict[str, object] | None = None) -> object:
    """The SparkSession ackflow runs on (created with ackflow's defaults if needed).

    Create it before building Column expressions with ``pyspark.sql.functions``.
    """
    from ackflow.spark.session import session as _session

    return _session(master, conf)


__version__ = "0.6.17"

__all__ = [
    "AckflowError",
    "AlreadySettled",
    "ConfigError",
    "Flow",
    "FlowError",
    "RetryPolicy",
    "RunReport",
    "branch",
    "merge",
    "run",
    "session",
]
