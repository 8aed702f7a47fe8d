"""Retry policy: when a failed message is redelivered, and when it is dead-lettered."""

from __future__ import annotations

from dataclasses import dataclass

from ackflow.core.errors import ConfigError


@dataclass(frozen=True)
class RetryPolicy:
    """Redeliver a failed message after an exponential backoff, up to ``max_deliveries``.

    After the ``max_deliveries``-th delivery has failed the message is dead-lettered.
    ``max_deliveries=1`` dead-letters on the first failure.

    >>> p = RetryPolicy(max_deliveries=3, backoff_s=0.5, max_backoff_s=10)
    >>> [p.delay_after(n) for n in (1, 2)]
    [0.5, 1.0]
    >>> p.exhausted(3)
    True
    """

    max_deliveries: int = 5
    backoff_s: float = 1.0
    max_backoff_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_deliveries < 1:
            raise ConfigError("max_deliveries must be at least 1")
        if self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ConfigError("backoff_s and max_backoff_s must not be negative")

    def exhausted(self, delivery_count: int) -> bool:
        """True when a message that failed on its ``delivery_count``-th delivery is done for."""
        return delivery_count >= self.max_deliveries

    def delay_after(self, delivery_count: int) -> float:
        """Seconds to wait before the next delivery after the ``delivery_count``-th failed."""
        exponent = max(delivery_count - 1, 0)
        return float(min(self.backoff_s * (2**exponent), self.max_backoff_s))


#: the first wait, and the longest, before a dead letter its route refused is written
#: again while its message is held (a give-back would make the broker drop it: a quorum
#: queue's message past its ``x-delivery-limit``)
DEAD_RETRY_S, DEAD_RETRY_MAX_S = 0.5, 30.0


def dead_letter_retry_after(tries: int) -> float:
    """Seconds before the ``tries + 1``-th write of a held dead letter."""
    return float(min(DEAD_RETRY_S * 2 ** max(tries - 1, 0), DEAD_RETRY_MAX_S))
