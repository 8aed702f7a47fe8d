"""The bounded in-flight window (law 3: backpressure, never nack-on-full)."""

from __future__ import annotations

from ackflow.core.errors import ConfigError


class InflightWindow:
    """Counts unsettled messages against ``max_inflight``.

    The engine pulls at most :attr:`credits` messages; when the window is full it
    stops pulling and keeps settling. Nothing is ever rejected because it is full:
    :meth:`take` refuses to go past the bound, and the caller simply pulls less.
    ``throttle_episodes`` counts the transitions into the full state.
    """

    def __init__(self, max_inflight: int) -> None:
        if max_inflight < 1:
            raise ConfigError(f"max_inflight must be at least 1, got {max_inflight}")
        self.max_inflight = max_inflight
        self.in_flight = 0
        self.throttle_episodes = 0

    @property
    def credits(self) -> int:
        return self.max_inflight - self.in_flight

    @property
    def throttled(self) -> bool:
        return self.in_flight >= self.max_inflight

    def take(self, n: int) -> None:
        """Account for ``n`` newly pulled messages."""
        if n < 0 or n > self.credits:
            raise ValueError(f"cannot take {n} credits, {self.credits} left")
        was_throttled = self.throttled
        self.in_flight += n
        if self.throttled and not was_throttled:
            self.throttle_episodes += 1

    def give_back(self, n: int) -> None:
        """Return ``n`` credits once those messages are settled."""
        if n < 0 or n > self.in_flight:
            raise ValueError(f"cannot return {n} credits, {self.in_flight} in flight")
        self.in_flight -= n
