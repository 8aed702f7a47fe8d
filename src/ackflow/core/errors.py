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


#: the errors a sink's write raises for one row's data (a value it cannot take), by the
#: name of the error's class or of any class it derives from (so a ``class
#: BadRecord(ValueError)`` and psycopg's ``StringDataRightTruncation(DataError)`` are,
#: without importing the libraries that define them). Any other (a connection, a
#: timeout, an OS error, a database's ``OperationalError`` or ``AdminShutdown``) may be
#: the sink's infrastructure: a partition whose write raised one is not run again in
#: halves, and a write that failed so while the sink wrote other rows is given back,
#: not failed
_ROW_DATA_CLASS = re.compile(
    r"ValueError|TypeError|KeyError|IndexError|OverflowError|ArithmeticError|ZeroDivisionError|"
    r"\w*DecodeError|\w*EncodeError|UnicodeError|ArrowInvalid|ArrowTypeError|DataError|"
    r"IntegrityError|\w*Violation|\w*OutOfRange|ValidationError|InvalidOperation"
)

#: bases that make an error the infrastructure's whatever else it derives from (found by
#: review: ``ssl.SSLCertVerificationError`` and ``io.UnsupportedOperation`` derive from
#: ValueError too, psycopg's ``ProtocolViolation`` is an ``OperationalError``, urllib3's
#: ``DecodeError`` an ``HTTPError``)
_INFRASTRUCTURE_CLASS = re.compile(
    r"OSError|OperationalError|InterfaceError|InternalError|HTTPError|AMQPError|KafkaException|"
    r"ConnectionError|TimeoutError|SSLError"
)

#: how a task's receipt starts the error of a sink write that raised for its whole
#: partition (not a row's own failure): ``write failed: <error>``
WHOLE_WRITE = "write failed: "

#: what a write's text says after ``write failed: `` when it raised for a row's data
ROW_DATA_MARK = "[a row's data] "

# ``write failed: [branch 'b': ][a row's data] ...``: the executor classified the error
_ROW_DATA_TEXT = re.compile("^" + re.escape(WHOLE_WRITE) + r"(branch '[^']*': )?" + re.escape(ROW_DATA_MARK))


def row_data(exc: BaseException) -> bool:
    """Whether ``exc`` is an error of a row's data: by its class and the classes it
    derives from (``_ROW_DATA_CLASS``), unless one of them is the infrastructure's
    (``_INFRASTRUCTURE_CLASS``), which wins.

    >>> class BadRecord(ValueError): ...
    >>> row_data(BadRecord("qty < 0")), row_data(ConnectionError("gone")), row_data(OSError(36, "x"))
    (True, False, False)
    >>> import io, ssl
    >>> row_data(io.UnsupportedOperation("x")), row_data(ssl.SSLCertVerificationError("x"))
    (False, False)
    """
    names = [c.__name__ for c in type(exc).__mro__]
    if any(_INFRASTRUCTURE_CLASS.fullmatch(n) for n in names):
        return False
    return any(_ROW_DATA_CLASS.fullmatch(n) for n in names)


def whole_write(exc: BaseException, branch: str | None = None, at: bool = True) -> str:
    """The text of a partition's write that raised ``exc``: ``write failed: ``, the
    branch of a broadcast, the row's-data mark (:func:`row_data`), what raised and, with
    ``at``, where (:func:`where`).

    >>> whole_write(KeyError("sku"), at=False), whole_write(TimeoutError(), branch="pg", at=False)
    ("write failed: [a row's data] KeyError: 'sku'", "write failed: branch 'pg': TimeoutError")
    """
    own = f"branch {branch!r}: " if branch is not None else ""
    mark = ROW_DATA_MARK if row_data(exc) else ""
    return f"{WHOLE_WRITE}{own}{mark}{describe(exc)}{where(exc) if at else ''}"


def of_row_data(error: str) -> bool:
    """Whether a failed write's text (:func:`whole_write`) names an error of a row's data.

    >>> of_row_data(whole_write(ValueError("qty < 0"))), of_row_data("write failed: ValueError: x")
    (True, False)
    """
    return _ROW_DATA_TEXT.match(error) is not None


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

    def __init__(
        self, step: str, cause: str, *, messages: int, seconds: float, detail: str = "", partial: bool = False
    ) -> None:
        what = (
            "part of the writes fail here the same way while the others land (a partial outage)"
            if partial
            else "every message fails here the same way"
        )
        super().__init__(step, f"{what}, for {seconds:.0f} s ({messages} deliveries given back): {cause}")
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
