"""Several sources as one: a flow that reads from all of them."""

from __future__ import annotations

from collections.abc import Sequence

from ackflow.core.errors import ConfigError
from ackflow.core.ledger import Failure
from ackflow.core.settlement import Delivery, Settlement
from ackflow.sources.base import Source


class MergedSource(Source):
    """Pull from several sources in turn; settle each message at its own source.

    Every delivery is tagged with ``origin`` (the index of its source); the engine's
    lineage ids are unique across all of them. Each source keeps its own format and
    retry policy, and gets a share of the window (:func:`window_shares`): a busy source
    cannot use an idle one's share.
    """

    def __init__(self, *sources: Source) -> None:
        if len(sources) < 2 or not all(isinstance(s, Source) for s in sources):
            raise ConfigError("merge: give two or more sources")
        if any(isinstance(s, MergedSource) for s in sources):  # its origins would be lost
            raise ConfigError(
                "merge: a merged source cannot be merged again; give its "
                "sources directly (ackflow.merge flattens flows)"
            )
        names = [s.name for s in sources]
        if len(set(names)) != len(names):
            raise ConfigError(f"merge: source names must be unique, got {names}; pass name= to the sources")
        self.sources = sources
        self.format = sources[0].format
        self.name = "merge(" + ", ".join(names) + ")"
        self._turn = 0

    @property
    def formats(self) -> tuple[str, ...]:
        return tuple(s.format for s in self.sources)

    @property
    def header_fields(self) -> tuple[str | None, ...]:
        return tuple(s.headers_field for s in self.sources)

    def _split(self, deliveries: Sequence[Delivery]) -> dict[int, list[Delivery]]:
        out: dict[int, list[Delivery]] = {}
        for d in deliveries:
            out.setdefault(d.origin, []).append(d)
        return out

    def configure(self, *, max_inflight: int, error_sink: bool, keepalive_s: float = 30.0) -> None:
        """The window is the flow's (law 6): each source gets a share of ``max_inflight``
        (an even split, at least 1 each), so that what all of them may hold unacked at
        their brokers (a prefetch follows its share) never sums past the window."""
        for s, share in zip(self.sources, window_shares(max_inflight, len(self.sources)), strict=True):
            s.configure(max_inflight=share, error_sink=error_sink, keepalive_s=keepalive_s)

    def open(self) -> int:
        return sum(s.open() for s in self.sources)

    @property
    def connected(self) -> bool:
        return all(s.connected for s in self.sources)

    @property
    def retries_waiting(self) -> int:
        return sum(s.retries_waiting for s in self.sources)

    def status(self) -> dict[str, object]:
        out: dict[str, object] = {"kind": "merge"}
        for s in self.sources:
            for k, v in s.status().items():
                out[f"{s.name}: {k}"] = v
        return out

    def take_lost(self) -> list[Delivery]:
        return [d for s in self.sources for d in s.take_lost()]

    def pull(self, max_messages: int, timeout: float) -> list[Delivery]:
        n = len(self.sources)
        got: list[Delivery] = []
        order = [(self._turn + k) % n for k in range(n)]
        self._turn = (self._turn + 1) % n
        share = max(1, max_messages // n)
        for k, i in enumerate(order):
            room = max_messages - len(got)
            if room <= 0:
                break
            last = k == n - 1
            wait = timeout if last and not got else 0.0
            batch = self.sources[i].pull(room if last else min(room, share), wait)
            for d in batch:
                d.origin = i
            got.extend(batch)
        return got

    def ack(self, deliveries: Sequence[Delivery]) -> list[Delivery]:
        stale: list[Delivery] = []
        for i, ds in self._split(deliveries).items():
            stale.extend(self.sources[i].ack(ds) or ())
        return stale

    def fail(self, failures: Sequence[tuple[Delivery, Failure]]) -> list[Settlement]:
        states: dict[int, Settlement] = {}
        per: dict[int, list[tuple[Delivery, Failure]]] = {}
        for d, f in failures:
            per.setdefault(d.origin, []).append((d, f))
        for i, items in per.items():
            for (d, _), state in zip(items, self.sources[i].fail(items), strict=True):
                states[id(d)] = state
        return [states[id(d)] for d, _ in failures]

    def nack(self, failures: Sequence[tuple[Delivery, Failure]]) -> None:
        per: dict[int, list[tuple[Delivery, Failure]]] = {}
        for d, f in failures:
            per.setdefault(d.origin, []).append((d, f))
        for i, items in per.items():
            self.sources[i].nack(items)

    def exhausted(self, delivery: Delivery) -> bool:
        return self.sources[delivery.origin].exhausted(delivery)

    def release(self, deliveries: Sequence[Delivery]) -> None:
        for i, ds in self._split(deliveries).items():
            self.sources[i].release(ds)

    def take_unsent_acks(self) -> list[Delivery]:
        return [d for s in self.sources for d in s.take_unsent_acks()]

    @property
    def dead_letters_held(self) -> int:
        return sum(s.dead_letters_held for s in self.sources)

    def take_dead_lettered(self) -> list[tuple[Delivery, Failure]]:
        return [x for s in self.sources for x in s.take_dead_lettered()]

    def stop_consuming(self) -> list[Delivery]:
        out = []
        for i, s in enumerate(self.sources):
            for d in s.stop_consuming():
                d.origin = i
                out.append(d)
        return out

    def unreleasable(self, deliveries: Sequence[Delivery]) -> list[Delivery]:
        return [d for i, ds in self._split(deliveries).items() for d in self.sources[i].unreleasable(ds)]

    def keepalive(self, deliveries: Sequence[Delivery]) -> None:
        for i, ds in self._split(deliveries).items():
            self.sources[i].keepalive(ds)

    def close(self) -> None:
        for s in self.sources:
            s.close()


def window_shares(max_inflight: int, sources: int) -> list[int]:
    """``max_inflight`` split over ``sources``: as even as can be, summing to it exactly.

    >>> window_shares(100, 2), window_shares(10, 3)
    ([50, 50], [4, 3, 3])
    """
    if max_inflight < sources:
        raise ConfigError(
            f"merge: max_inflight ({max_inflight}) is smaller than the number "
            f"of merged sources ({sources}); each needs a share of the window "
            f"of at least 1: raise max_inflight to {sources} or more"
        )
    base, extra = divmod(max_inflight, sources)
    return [base + (1 if i < extra else 0) for i in range(sources)]
