"""The only package of ackflow that imports pyspark. Imported on first use
(ackflow/_lazy.py): a Python worker that loads ackflow.spark.rows does not import the
driver's compiler."""

from typing import TYPE_CHECKING

from ackflow._lazy import lazy
from ackflow.spark.session import session  # eager: the name is also a submodule's

if TYPE_CHECKING:
    from ackflow.spark.compile import CompiledFlow
    from ackflow.spark.job import JobFailed, JobResult, run_job

__getattr__, __dir__ = lazy(
    __name__,
    {
        "CompiledFlow": "ackflow.spark.compile:CompiledFlow",
        "JobFailed": "ackflow.spark.job:JobFailed",
        "JobResult": "ackflow.spark.job:JobResult",
        "run_job": "ackflow.spark.job:run_job",
    },
)

__all__ = ["CompiledFlow", "JobFailed", "JobResult", "run_job", "session"]
