"""The only package of ackflow that imports pyspark."""

from ackflow.spark.compile import CompiledFlow
from ackflow.spark.job import JobFailed, JobResult, run_job
from ackflow.spark.session import session

__all__ = ["CompiledFlow", "JobFailed", "JobResult", "run_job", "session"]
