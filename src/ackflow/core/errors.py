"""Named errors. Each says what failed and, where it can, what to do about it."""

import re


def describe(exc: BaseException) -> str:
    """``Type: first line of the message`` (an exception's text can run to many lines).

    >>> describe(ValueError("bad\\nmore"))
    'ValueError: bad'
    """
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def where(exc: BaseException) -> str:
    """`` (at file.py:123 in function)``: where ``exc`` was raised, or ``""``."""
    import os
    import traceback

    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ else []
    if not frames:
        return ""
    f = frames[-1]
    return f" (at {os.path.basename(f.filename)}:{f.lineno} in {f.name})"


#: the errors a sink's write raises for one row's data (a value it cannot take), as
#: ``write failed: [branch 'b': ]<Type>[: ...]`` names them (a type's name, not its
#: class: the text is what the executor sends). Any other (a connection, a timeout, an
#: OS error, a database's ``OperationalError`` or ``AdminShutdown``) may be the sink's
#: infrastructure: a partition whose write raised one is not run again in halves, and
#: a write that failed so while the sink wrote other rows is given back, not failed
_ROW_DATA = re.compile(
    r"^write failed: (branch '[^']*': )?(ValueError|TypeError|KeyError|IndexError|OverflowError|"
    r"ZeroDivisionError|\w*DecodeError|\w*EncodeError|UnicodeError|ArrowInvalid|ArrowTypeError|"
    r"DataError|IntegrityError|\w*Violation|\w*OutOfRange|ValidationError|InvalidOperation)"
    r"(: | \(at |$)"
)


def of_row_data(error: str) -> bool:
    """Whether a failed write's text names an error of a row's data.

    >>> of_row_data("write failed: ValueError: qty < 0"), of_row_data("write failed: AdminShutdown: x")
    (True, False)
    >>> of_row_data("write failed: ValueError (at s.py:3 in w)"), of_row_data("write failed: ValueErrors: x")
    (True, False)
    >>> of_row_data("write failed: branch 'pg': UniqueViolation: duplicate key value")
    True
    """
    return _ROW_DATA.match(error) is not None


class AckflowError(Exception):
    """Base class of every error ackflow raises on purpose."""


class ConfigError(AckflowError):
    """A setting or argument is wrong; raised at start, before anything is pulled."""


class FlowError(AckflowError):
    """A step of a flow cannot be compiled or run as a whole (not a per-row failure).

    The message names the step so the user knows where to look.
    """

    def __init__(self, step: str, cause: str) -> None:
        super().__init__(f"step {step!r}: {cause}")
        self.step = step
        self.cause = cause


class AlreadySettled(AckflowError):
    """A delivery was settled a second time. Always a bug in the caller: never ignored."""


class ColumnsRefused(FlowError):
    """A sink's table cannot take some of the flow's columns (``columns``: name → why).

    When those columns were inferred from outside data, the run does not stop: the
    rows holding a value in them fail alone, with the reason, and the sink is prepared
    without them. A column the flow configured stops the run, like any FlowError.
    ``retype`` (name -> the table's type): columns the sink can still take value by
    value in the table's type, when they come from the data (a first batch's ``1.5``
    must not make every later integer fail)."""

    def __init__(
        self, step: str, cause: str, columns: dict[str, str], retype: dict[str, object] | None = None
    ) -> None:
        super().__init__(step, cause)
        self.columns = columns
        self.retype = retype or {}


class SystemicFailure(FlowError):
    """Every message failed the same way at one step for longer than the run allows
    (``systemic_stop_after_s``): not the messages' fault (a sink down, a type it
    refuses, a permission, a bug). The messages were given back, none dead-lettered.
    ``detail`` holds the longest error text seen (a traceback where one came back)."""

    def __init__(self, step: str, cause: str, *, messages: int, seconds: float, detail: str = "") -> None:
        super().__init__(
            step,
            f"every message fails here the same way, for {seconds:.0f} s "
            f"({messages} deliveries given back): {cause}",
        )
        self.messages = messages
        self.seconds = seconds
        self.detail = detail


class StoreAway(ConnectionError):
    """A durable store a step depends on (a window's or dedupe's state in PostgreSQL)
    did not answer mid-run: not the data's fault. The batch fails as a whole (given
    back, never dead-lettered, a systemic failure that stops the run only if it
    persists); the store reconnects when asked again."""

    def __init__(self, step: str, why: str) -> None:
        super().__init__(f"step {step!r}: {why}")
        self.step, self.why = step, why


class SourceGone(AckflowError):
    """A source's queue or stream was deleted (or its consumer cancelled by the broker)
    and did not come back within the source's ``gone_timeout_s``: the run stops. What was
    in flight was settled or given back first; the message names the queue or stream."""
