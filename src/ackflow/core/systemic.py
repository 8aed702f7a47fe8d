"""Poison or systemic? A failure every message hits is not the messages' fault.

Bisection isolates bad messages; it cannot tell a bad message from a failure that every
message meets the same way (a sink that is down or refuses a type, a missing
permission, a full disk, a bug). Dead-lettering on such a failure would turn good data
into dead letters. The rule (docs/concepts/failures.md, "Systemic failures are not poison"):

* Only failures of a write or a job *as a whole* are candidates (a sink's write that
  raised for a partition, a commit, a job each of whose probed messages fails it alone
  the same way, a lost lineage): a failure a step attributes to a row is that row's.
* A failure's *signature* is its step and its error text with what varies from one
  write to the next taken out (paths, numbers, ids: :func:`signature`). A step *works*
  in a batch if the batch gives proof of it: rows written by that sink, or, for any
  other step, rows written by any sink.
* A candidate that is not (yet) systemic, in a batch without proof that its step works,
  is *suspect*: it is given back, without spending a delivery, up to ``suspect_backs``
  (2) times per message, then failed as usual (so a lone poison message is still
  dead-lettered, two give-backs later).
* A sink's write that failed with an error that is not a row's data
  (:func:`~ackflow.core.errors.of_row_data`: a connection, a timeout) in a batch where
  the sink wrote other rows (its database went away mid-job, or one executor cannot
  reach it) is a *partial outage* of that signature: its messages (those whose identity
  is the same at each delivery) are given back, no delivery spent, until it has lasted
  ``stop_after_s``; so are they in a batch where the sink wrote nothing while it is on
  (until ``after`` messages fail so without the sink writing: a full outage, below). It
  ends with a batch in which the sink wrote rows and none failed so (sporadic failures
  never add up), or after ``stop_after_s`` without it. Once it has lasted
  ``stop_after_s`` over ``after`` messages it is systemic (the run stops); over fewer,
  they fail as their own (a row that breaks the connection itself).
* When ``after`` distinct messages (3 by default) have failed with one signature, and
  its step has not worked since the first of them, the failure is **systemic**: those
  messages, and every later one failing the same way, are given back to their source
  (released: no delivery spent, never dead-lettered); the engine stops pulling for a
  backoff that doubles from ``backoff_s`` up to ``max_backoff_s`` and shows the episode
  on the status page and in metrics.
* As soon as the step works again the episode ends (the messages flow, and a message
  that is really bad is dead-lettered as before). If the episode lasts ``stop_after_s``,
  the run stops with :class:`~ackflow.core.errors.SystemicFailure`, naming the step and
  the error.

A stream in which, for ``stop_after_s``, every message fails identically cannot be
told from a broken pipeline: the run stops and says so rather than dead-letter it.

>>> t = [0.0]
>>> d = SystemicDetector(sinks={"sink"}, after=3, stop_after_s=60, clock=lambda: t[0])
>>> d.judge([("m1", "sink", "write failed: disk full")], working=set())
set()
>>> d.judge([("m1", "sink", "write failed: disk full")], working=set())
set()
>>> d.suspects
{'m1'}
>>> sorted(d.judge([("m2", "sink", "write failed: disk full"),
...                 ("m3", "sink", "write failed: disk full")], working=set()))
['m2', 'm3']
>>> d.episode is not None, d.backoff_s()
(True, 1.0)
>>> t[0] = 61.0; d.overdue()
True
>>> _ = d.judge([], working={"sink"}); d.episode is None
True
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field

from ackflow.core.errors import WHOLE_WRITE, ConfigError, of_row_data
from ackflow.core.secrets import redact

_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
_PATH = re.compile(r"(?:[\w.~-]*/)+[\w.~-]*")
_HEX = re.compile(r"\b[0-9a-fA-F]{8,}\b")
_NUM = re.compile(r"\d+")
_ADDRESS = re.compile(r"\b0x[0-9a-fA-F]+\b")


def signature(error: str) -> str:
    """``error`` without what changes between two writes failing the same way: uuids,
    paths, long hex ids, numbers (a staging folder per batch, a file per partition, a
    row in a detail).

    >>> signature("write failed: PermissionError: [Errno 13] '/t/_staging/b-0007/part-1a2b3c4d.parquet'")
    "write failed: PermissionError: [Errno #] '<path>'"
    """
    text = _ADDRESS.sub("<address>", _UUID.sub("<id>", error))
    text = _PATH.sub("<path>", text)
    text = _HEX.sub("<id>", text)
    return _NUM.sub("#", text)


#: the step of failures with no better name (a Spark job, the ledger): any acked
#: message proves it works
ANY_STEP = "*"


@dataclass
class Episode:
    """A systemic failure in progress: where, what, since when, how many given back."""

    step: str
    error: str
    since: float  # the detector's clock
    started_at: float  # wall clock (for the page and the report)
    messages: int = 0  # deliveries given back during the episode
    batches: int = 0
    detail: str = ""  # the longest error text seen (a traceback, when one came back)
    partial: bool = False  # a partial outage: the sink wrote other rows meanwhile

    def as_json(self) -> dict[str, object]:
        return {
            "step": self.step,
            "error": self.error,
            "since": self.started_at,
            "messages": self.messages,
            "batches": self.batches,
            "partial": self.partial,
        }


@dataclass
class _Streak:
    keys: set[Hashable] = field(default_factory=set)


@dataclass
class _Outage:
    """A partial outage: a sink's write failing as a sink does while it writes others."""

    since: float
    last: float
    keys: set[Hashable] = field(default_factory=set)  # distinct messages met (up to ``after``)
    given: int = 0  # deliveries given back in it


class SystemicDetector:
    """Decides which failures are systemic (see the module docstring). Not thread-safe:
    the engine's thread owns it."""

    def __init__(
        self,
        *,
        sinks: Iterable[str] = (),
        after: int = 3,
        stop_after_s: float = 300.0,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        suspect_backs: int = 2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(after, int) or isinstance(after, bool) or (after < 2 and after != 0):
            raise ConfigError(f"systemic_after must be an integer >= 2 (or 0: off), got {after!r}")
        for name, value in (
            ("systemic_stop_after_s", stop_after_s),
            ("systemic backoff_s", backoff_s),
            ("max_backoff_s", max_backoff_s),
        ):
            if not (isinstance(value, int | float) and value == value and 0 <= value < float("inf")):
                raise ConfigError(f"{name} must be a finite number >= 0, got {value!r}")
        self.after = after
        self.sinks = frozenset(sinks)
        self.stop_after_s = float(stop_after_s)
        self._backoff = float(backoff_s)
        self._max_backoff = float(max_backoff_s)
        self._clock = clock
        self._streaks: dict[tuple[str, str], _Streak] = {}
        self._outages: dict[tuple[str, str], _Outage] = {}  # partial outages by signature
        self.episode: Episode | None = None
        self.episodes = 0  # episodes begun in this run
        self.given_back = 0  # deliveries given back as systemic in this run
        self._strikes = 0  # batches of the current episode (for the backoff)
        self.suspect_backs = suspect_backs
        self._backs: dict[Hashable, int] = {}  # message -> suspect give-backs so far
        #: the keys of the last :meth:`judge` to give back as suspects
        self.suspects: set[Hashable] = set()
        #: the sinks of the last :meth:`judge` in a partial outage (a part of them)
        self.partial: set[str] = set()

    def judge(
        self,
        failures: Iterable[tuple[Hashable, str, str]],
        *,
        working: set[str],
        detail: Callable[[str, str], str] | None = None,
        stable: Callable[[Hashable], bool] | None = None,
    ) -> set[Hashable]:
        """``failures``: (key, step, error) of one batch's failed messages (before any is
        settled); ``working``: the steps the batch proved work (sink names that wrote rows,
        and :data:`ANY_STEP` if any sink wrote rows). Returns the keys judged systemic; the
        keys to give back as suspects are then in :attr:`suspects`. ``stable(key)``: the
        key is the same at every delivery of its message (a message without an id may get
        a new one each time): only those are given back for a sink that went away while
        it wrote (nothing else bounds how often; the others are failed as before)."""
        self.suspects = set()
        self.partial = set()
        if not self.after:  # off: every failure is the message's own
            return set()
        self._evidence(working)
        by_sig: dict[tuple[str, str], list[Hashable]] = {}
        raw: dict[tuple[str, str], tuple[str, str]] = {}
        for key, step, error in failures:
            sig = (step, signature(error))
            by_sig.setdefault(sig, []).append(key)
            raw.setdefault(sig, (step, error))
        systemic: set[Hashable] = set()
        self.suspects = set()
        self._outages_end(by_sig, working)
        for sig, keys in by_sig.items():
            gone = self._went_away(*raw[sig])
            back = [k for k in keys if stable is None or stable(k)]
            if gone and self._works(sig[0], working):
                # the sink wrote rows in this batch, then failed as a sink does: a partial outage
                outage = self._outage(sig, keys)
                if self._clock() - outage.since < self.stop_after_s:
                    self.suspects.update(back)  # given back while it lasts
                    outage.given += len(back)
                    self.partial.add(sig[0])
                elif len(outage.keys) >= self.after:  # it lasted: systemic, the run stops
                    systemic.update(keys)
                    text = detail(*raw[sig]) if detail else ""
                    self._enter(raw[sig], outage.given + len(keys), text, since=outage.since, partial=True)
                # else: one or two messages failing so for that long: their own (a row
                # that breaks the connection itself)
                continue
            if self._works(sig[0], working):
                continue  # the step worked in this very batch: these messages are the cause
            if gone and sig in self._outages:  # a partial outage on, and no row written
                # now (a batch of one partition): given back as in the outage, while the
                # streak below tells a full outage (an episode with its backoff)
                streak = self._streaks.setdefault(sig, _Streak())
                streak.keys.update(keys[: self.after - len(streak.keys)])
                if len(streak.keys) < self.after:
                    self._outage(sig, keys).given += len(back)
                    self.suspects.update(back)
                    self.partial.add(sig[0])
                    continue
            streak = self._streaks.setdefault(sig, _Streak())
            if len(streak.keys) < self.after:
                streak.keys.update(keys[: self.after])
            if len(streak.keys) >= self.after:
                systemic.update(keys)
                self._enter(raw[sig], len(keys), detail(*raw[sig]) if detail else "")
                continue
            self._suspect(keys)  # not yet shown by enough messages: suspect, a few times
        if len(self._backs) > 100_000:  # bounded: forget the oldest
            for key in list(self._backs)[:50_000]:
                del self._backs[key]
        if len(self._streaks) > 10_000:  # bounded: forget the oldest signatures
            for sig in list(self._streaks)[:5_000]:
                del self._streaks[sig]
        if len(self._outages) > 10_000:
            for sig in list(self._outages)[:5_000]:
                del self._outages[sig]
        self.given_back += len(systemic)
        return systemic

    def _suspect(self, keys: Iterable[Hashable]) -> None:
        for key in keys:
            n = self._backs.get(key, 0)
            if n < self.suspect_backs:
                self._backs[key] = n + 1
                self.suspects.add(key)

    def _outage(self, sig: tuple[str, str], keys: list[Hashable]) -> _Outage:
        """The partial outage of ``sig``, begun now if there is none (or it was quiet for
        ``stop_after_s``), with ``keys`` counted (up to ``after``)."""
        now = self._clock()
        outage = self._outages.get(sig)
        if outage is None or now - outage.last > self.stop_after_s:
            outage = self._outages[sig] = _Outage(now, now)
        outage.last = now
        outage.keys.update(keys[: max(0, self.after - len(outage.keys))])
        return outage

    def _outages_end(self, by_sig: dict[tuple[str, str], list[Hashable]], working: set[str]) -> None:
        """A partial outage ends with a batch in which its sink wrote rows and none failed
        so: sporadic failures between good batches never add up to a stop."""
        for sig in [s for s in self._outages if s[0] in working and s not in by_sig]:
            del self._outages[sig]

    def _went_away(self, step: str, error: str) -> bool:
        """A sink's write that failed, as a whole, with an error that is not a row's data
        (a connection, a timeout: its database going away mid-job)."""
        return step in self.sinks and error.startswith(WHOLE_WRITE) and not of_row_data(error)

    def _works(self, step: str, working: set[str]) -> bool:
        """A failing step works if the batch proved it: that sink wrote rows, or (a step
        that is not a sink) any sink wrote rows (a message acked because it was filtered
        out proves nothing about a later step)."""
        return step in working or (step not in self.sinks and ANY_STEP in working)

    def _evidence(self, working: set[str]) -> None:
        if not working:
            return
        for sig in [s for s in self._streaks if self._works(s[0], working)]:
            del self._streaks[sig]
        if self.episode is not None and self._works(self.episode.step, working):
            self.episode = None
            self._strikes = 0

    def _enter(
        self, sig: tuple[str, str], n: int, detail: str, since: float | None = None, partial: bool = False
    ) -> None:
        if self.episode is None or (partial and self.episode.step != sig[0]):
            began = self._clock() if since is None else since
            wall = time.time() - (self._clock() - began)
            self.episode = Episode(sig[0], redact(sig[1]), began, wall, partial=partial)
            self.episodes += 1
        self.episode.messages += n
        self.episode.batches += 1
        if len(detail) > len(self.episode.detail):
            self.episode.detail = redact(detail)
        self._strikes += 1

    @property
    def strikes(self) -> int:
        """Batches of the current episode so far."""
        return self._strikes

    def backoff_s(self, strikes: int | None = None) -> float:
        """How long to stop pulling after the ``strikes``-th batch of an episode (the
        current one's by default)."""
        n = self._strikes if strikes is None else strikes
        if n < 1:
            return 0.0
        return min(self._backoff * 2.0 ** (n - 1), self._max_backoff)

    def overdue(self) -> bool:
        """True once the current episode has lasted ``stop_after_s``."""
        return self.episode is not None and self._clock() - self.episode.since >= self.stop_after_s
