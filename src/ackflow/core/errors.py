"""Named errors. Each says what failed and, where it can, what to do about it."""


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
