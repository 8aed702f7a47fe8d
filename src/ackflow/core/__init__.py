"""The part of ackflow that needs no Spark: settlement, the ledger, the window, retry policy.

Everything here is plain Python, strictly typed and tested in milliseconds.
"""

from ackflow.core.errors import AckflowError, AlreadySettled, ConfigError, FlowError
from ackflow.core.ledger import Failure, Outcomes, settle_receipts
from ackflow.core.policy import RetryPolicy
from ackflow.core.settlement import Delivery, Settlement
from ackflow.core.window import InflightWindow

__all__ = [
    "AckflowError",
    "AlreadySettled",
    "ConfigError",
    "Delivery",
    "Failure",
    "FlowError",
    "InflightWindow",
    "Outcomes",
    "RetryPolicy",
    "Settlement",
    "settle_receipts",
]
