"""The driver loop, batches and their bisection."""

from ackflow.engine.loop import Engine, run
from ackflow.engine.report import RunReport

__all__ = ["Engine", "RunReport", "run"]
