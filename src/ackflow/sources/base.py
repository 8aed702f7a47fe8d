"""What every source provides to the engine.

A source runs on the driver, in the engine's thread: every method is called from
the one thread that owns the connection. The engine settles each delivery exactly
once, through :meth:`Source.ack`, :meth:`Source.fail` or :meth:`Source.release`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from ackflow.core.errors import ConfigError
from ackflow.core.ledger import Failure
from ackflow.core.policy import RetryPolicy
from ackflow.core.settlement import Delivery, Settlement

FORMATS = ("json", "json_nan_as_null", "text", "bytes")


class Source(ABC):
    """Base class of sources. Subclass it to connect ackflow to a new system.

    ``format`` says how a message body becomes the first row a flow sees:
    ``"json"`` (a JSON object: its fields; strict: ``NaN``/``Infinity`` fail the
    message), ``"json_nan_as_null"`` (the same, but ``NaN``, ``Infinity`` and
    ``-Infinity`` read as null, at any depth, for producers that write them such as
    pandas or Python's ``json.dumps``; ``1e999`` still fails), ``"text"``
    (``{"body": str}``, UTF-8) or ``"bytes"`` (``{"body": bytes}``).
    """

    name: str = "source"

    policy: RetryPolicy = RetryPolicy()

    def __init__(self, *, format: str = "json", name: str | None = None) -> None:
        if format not in FORMATS:
            raise ConfigError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
        self.format = format
        if name is not None:
            self.name = name

    #: If set, the message's headers (a dict of strings) are added to the first row
    #: under this name, e.g. to carry them to a sink (``headers_column=``).
    headers_field: str | None = None

    @property
    def formats(self) -> tuple[str, ...]:
        """The format of each origin (one, unless several sources are merged)."""
        return (self.format,)

    @property
    def header_fields(self) -> tuple[str | None, ...]:
        """The ``headers_field`` of each origin."""
        return (self.headers_field,)

    def configure(  # noqa: B027 - a hook with nothing to do by default
        self, *, max_inflight: int, error_sink: bool, keepalive_s: float = 30.0
    ) -> None:
        """Called by the engine before :meth:`open`: the in-flight window (a broker's
        prefetch should follow it), whether the flow writes dead letters to its own
        error sink (then the source only acks them), and how often the engine extends
        leases (:meth:`keepalive`); a source whose leases would expire sooner refuses
        here with a :class:`ConfigError`."""

    def open(self) -> int:
        """Connect. Return how many deliveries of a dead consumer were given back."""
        return 0

    @property
    def connected(self) -> bool:
        """False while the source is reconnecting to its broker (an idle run does not
        end then: the broker still holds messages)."""
        return True

    @property
    def retries_waiting(self) -> int:
        """Failed deliveries this source holds for a retry after their backoff (they
        come back by themselves): an ``until_idle`` run is not idle while there are any.
        From memory only; called often, from the engine's thread. Default: none."""
        return 0

    def take_lost(self) -> list[Delivery]:
        """Deliveries this source can no longer settle (their channel or lease died; the
        broker delivers them again). The engine stops tracking them and counts them as
        ``redelivered``. Called often, from the engine's thread."""
        return []

    @abstractmethod
    def pull(self, max_messages: int, timeout: float) -> list[Delivery]:
        """Return up to ``max_messages`` deliveries, waiting at most ``timeout`` s."""

    @abstractmethod
    def ack(self, deliveries: Sequence[Delivery]) -> Sequence[Delivery] | None:
        """Acknowledge: every row derived from these was durably written.

        Return the deliveries that could not be acked because their receipt is stale
        (the channel or lease they came on is gone; the broker delivers them again),
        or None if all were acked."""

    @abstractmethod
    def fail(self, failures: Sequence[tuple[Delivery, Failure]]) -> list[Settlement]:
        """Settle failed deliveries by the retry policy: ``NACKED`` or ``DEAD_LETTERED``
        (``RELEASED`` for a stale receipt that can no longer be settled)."""

    @abstractmethod
    def nack(self, failures: Sequence[tuple[Delivery, Failure]]) -> None:
        """Redeliver later (after the policy's backoff), whatever the delivery count."""

    def by_policy(
        self, failures: Sequence[tuple[Delivery, Failure]]
    ) -> tuple[list[Settlement], list[tuple[Delivery, Failure]], list[tuple[Delivery, Failure]]]:
        """Sort failures by the retry policy: the settlement of each (in order), the
        failures to retry (``NACKED``) and those given up (``DEAD_LETTERED``)."""
        states: list[Settlement] = []
        retry: list[tuple[Delivery, Failure]] = []
        dead: list[tuple[Delivery, Failure]] = []
        for d, f in failures:
            if self.exhausted(d):
                dead.append((d, f))
                states.append(Settlement.DEAD_LETTERED)
            else:
                retry.append((d, f))
                states.append(Settlement.NACKED)
        return states, retry, dead

    def exhausted(self, delivery: Delivery) -> bool:
        """True when the retry policy gives this delivery up if it fails now."""
        return self.policy.exhausted(delivery.delivery_count)

    @abstractmethod
    def release(self, deliveries: Sequence[Delivery]) -> None:
        """Give back deliveries that were not processed (shutdown), for redelivery."""

    def unacked(self, delivery: Delivery) -> int:
        """How many messages of ``delivery``, which the last :meth:`ack` returned as stale
        (or the last :meth:`take_unsent_acks` returned), were not acked (the source
        delivers them again): all of them, unless a block's others were acked. Default:
        ``delivery.messages``."""
        return delivery.messages

    def use_blocks(self, on: bool) -> bool:
        """Called by the engine before :meth:`open`: ``on`` when the flow may take
        *blocks* (deliveries of several messages, ``Delivery.messages > 1``: its rows
        keep each message's identity, and no step keeps state by delivery). Return
        whether this source will pull blocks. Default: it never does."""
        return False

    def split(self, blocks: Sequence[Delivery]) -> None:
        """Blocks that failed (one of their messages, or the whole batch): take them
        back and deliver their messages again one by one, each counting its first
        delivery (a block's try is spent by none of them). The engine settles the blocks
        ``RELEASED`` and counts their messages in the report's ``split``. Only a source
        that pulls blocks is asked."""
        raise NotImplementedError(f"source {self.name!r} pulls no blocks")

    def take_unsent_acks(self) -> list[Delivery]:
        """Deliveries the engine acked whose ack never reached the broker (held, then the
        channel died): the broker delivers them again, so they are no acks of this run
        (the engine takes them back out of the report). Default: none."""
        return []

    @property
    def dead_letters_held(self) -> int:
        """Failures whose dead letter the source's route refused and that it holds to
        publish again (see :meth:`take_dead_lettered`): a stop's drain waits for them
        until its timeout. Default: none."""
        return 0

    def take_dead_lettered(self) -> list[tuple[Delivery, Failure]]:
        """Failures :meth:`fail` answered ``NACKED`` (their dead-letter route refused
        them) that the source dead-lettered since, holding them meanwhile (a give-back
        would have made the broker drop them): the engine counts them as dead letters
        instead of nacks. Default: none."""
        return []

    def stop_consuming(self) -> list[Delivery]:
        """Stop receiving (the run is ending: called before the first release) and
        return the deliveries received but not pulled yet, for the engine to settle
        (release). Default: nothing to stop."""
        return []

    def unreleasable(self, deliveries: Sequence[Delivery]) -> list[Delivery]:
        """The deliveries that a :meth:`release` would not give back: the broker counts
        a give-back as a delivery and would drop (or dead-letter) them, e.g. a quorum
        queue's message at its ``x-delivery-limit``. The engine dead-letters those
        knowingly (step ``release``) instead of releasing them. Default: none."""
        return []

    # -- the status page (optional) ---------------------------------------------------

    def status(self) -> dict[str, object]:
        """Facts about the source for the status page, from memory only (no I/O): e.g.
        ``committed_offset``, ``lag``, ``retries_waiting``. Called from the engine's
        thread a few times a second while the page is served; values are numbers,
        strings or booleans, and nothing secret (a URL's password is redacted)."""
        return {}

    def probe(self) -> dict[str, object] | None:
        """Facts that cost I/O (a backlog count, say), or None. Called from the status
        page's thread (never the engine's) at most every few seconds while a browser
        watches: it must use its own connection."""
        return None

    #: True when :meth:`replay_dead_letters` can give dead letters another try.
    replays_dead_letters: bool = False

    def dead_letter_ref(self, delivery: Delivery) -> object | None:
        """What :meth:`replay_dead_letters` needs to replay ``delivery``, which the last
        :meth:`fail` call dead-lettered (None: it cannot be replayed)."""
        return None

    def replay_dead_letters(self, refs: Sequence[object]) -> tuple[int, dict[object, str]]:
        """Move the given dead letters back to the source for another try; return how
        many moved and, for each ref kept as a dead letter, why. A dead letter is never
        destroyed by a replay. Called from the status page's thread: it must use its
        own connection."""
        raise NotImplementedError(f"source {self.name!r} cannot replay dead letters")

    def keepalive(self, deliveries: Sequence[Delivery]) -> None:  # noqa: B027
        """Called now and then with the in-flight deliveries, to extend their leases."""

    def close(self) -> None:  # noqa: B027
        """Disconnect. Unsettled deliveries are left to the broker's redelivery."""


class BlockSize:
    """How many messages a source's next block may hold (engine/blocks.py): ``start`` at
    first, halved for each block that was split (its good messages cost a second pass),
    doubled once four times as many messages were acked without a split, between 1 (no
    blocks) and ``most``. Messages that fail often thus come in small blocks, or alone,
    and a run that starts on poison-dense input does not split its first, largest blocks.

    >>> b = BlockSize(4096, start=64); b.split(2); b.now
    16
    >>> b.acked(64); b.now
    32
    """

    def __init__(self, most: int, start: int = 64) -> None:
        self.most = most
        self.now = min(start, most)
        self._credit = 0

    def split(self, blocks: int = 1) -> None:
        self.now = max(1, self.now >> min(blocks, 16))
        self._credit = 0

    def acked(self, messages: int) -> None:
        if self.now < self.most:
            self._credit += messages
            if self._credit >= 4 * self.now:
                self.now, self._credit = min(self.most, self.now * 2), 0
