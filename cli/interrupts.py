"""How a command ends after SIGINT/SIGTERM: exit 128 + N (130, 143) with one line, whatever the code
was doing (``runledger.signals``).

``InterruptibleGroup`` (the app's group) and ``InterruptibleCommand`` (a command run on its own,
``python -m runledger.cli.train_cmd``) parse and run the command inside ``signals.listening``: a signal is
recorded until acted on, ``Interrupted`` ends the command with its code, and a signal still pending
when the command returns (deferred and never honoured, or its raise swallowed by a library, or turned
by C code into an ordinary error) ends it the same way, never with 0 or a generic 1.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import typer
from typer.core import TyperCommand

from runledger import signals
from runledger.cli.output import DiskFullGroup, fail


def interrupted_exit(signum: int, note: str = "") -> typer.Exit:
    """The one line and exit code (128 + ``signum``) of a command a signal stopped."""
    line = f"interrupted by {signals.signal_name(signum)}" + (f"; {note}" if note else "")
    return fail(line, 128 + signum)


@contextmanager
def _ending_on_signals() -> Iterator[None]:
    """Turn ``Interrupted`` (and a plain Ctrl-C) into its exit; a pending signal outranks the
    command's own ending unless that already is a signal's code."""
    try:
        yield
    except signals.Interrupted as exc:
        signals.take()
        raise interrupted_exit(exc.signum) from None
    except KeyboardInterrupt:  # Python's own handler, put back by a library meanwhile
        signals.take()
        raise interrupted_exit(2) from None
    except typer.Exit as exc:
        signum = signals.take()
        if signum is not None and exc.exit_code < 128:
            raise interrupted_exit(signum) from None
        raise
    except Exception:
        signum = signals.take()
        if signum is not None:  # e.g. C code that turned the raise into a RuntimeError
            raise interrupted_exit(signum) from None
        raise
    signum = signals.take()
    if signum is not None:
        raise interrupted_exit(signum)


class _Interruptible:
    """Parsing and running inside the command's signal policy (a mixin for click's classes)."""

    def make_context(self, *args: Any, **kwargs: Any) -> Any:
        with _ending_on_signals():
            return super().make_context(*args, **kwargs)  # type: ignore[misc]

    def invoke(self, ctx: Any) -> Any:
        with signals.listening(), _ending_on_signals():
            return super().invoke(ctx)  # type: ignore[misc]


class InterruptibleGroup(_Interruptible, DiskFullGroup):
    """The app's group: ``DiskFullGroup`` whose commands end with 128 + N after a signal."""


class InterruptibleCommand(_Interruptible, TyperCommand):
    """One command run on its own, ending with 128 + N after a signal."""
