"""How an attempt's end by exception or signal becomes a crash record: one classification for every
producer (the client library's ``with run:``, its ``sys.excepthook`` and signal hooks, and runledger's
own trainer), so that one exception is the same kind of crash whoever records it.

``crashed`` builds the record (type, message, traceback, signal, exit code) from the kind.
"""

from __future__ import annotations

import signal
import traceback
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # the catalogue (msgspec) is loaded by the crash that needs it, not by every import
    from runledger.schemas.payloads import RunCrashed

CrashKind = Literal["exception", "nonfinite_loss", "signal", "oom"]


class NonFinite(RuntimeError):
    """A non-finite loss stopped the run (the client's ``NonFiniteError``, the trainer's ``NonFiniteLoss``)."""


class SignalStop(BaseException):
    """Raised by a second SIGTERM/SIGINT: stop now, without waiting for the step boundary."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


def is_oom(exc: BaseException) -> bool:
    """Out of host memory, or a device's (``torch.OutOfMemoryError``, named so torch stays unimported)."""
    return isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"


def cause_of(exc: BaseException) -> tuple[CrashKind, int | None]:
    """(kind, signal number) of the crash that ``exc`` ends an attempt with."""
    if isinstance(exc, SignalStop):
        return "signal", exc.signum
    if isinstance(exc, KeyboardInterrupt):
        return "signal", signal.SIGINT
    if isinstance(exc, NonFinite):
        return "nonfinite_loss", None
    if is_oom(exc):
        return "oom", None
    return "exception", None


def crashed(
    kind: CrashKind,
    exc: BaseException | None,
    *,
    signum: int | None,
    message: str | None,
    rank: int,
    host: str,
    last_step: int | None,
) -> RunCrashed:
    """One rank's crash: the exception (type, message, traceback) or signal, and the exit code a
    process ends with for it (1, or 128 + the signal's number)."""
    from runledger.schemas.payloads import RunCrashed

    return RunCrashed(
        kind=kind,
        exc_type=type(exc).__qualname__ if exc is not None else None,
        message=message or (str(exc) if exc is not None else ""),
        traceback="".join(traceback.format_exception(exc)) if exc is not None else None,
        signal=signum,
        exit_code=128 + signum if signum is not None else 1,
        rank=rank,
        host=host,
        last_step=last_step,
    )
