"""SIGTERM/SIGINT handling: the one place a process of runledger's installs and removes handlers.

The client library's crash capture (``runledger.client``), the trainer's stop flag (``trainer.loop``),
the demo's deferral (``runledger.workflows.demo``) and the webhook receiver each decide *what* a signal
means; ``Handlers`` is *how* it is installed, always the same way: only in the main thread (Python
delivers signals there alone; elsewhere nothing is installed and the defaults stay), optionally
leaving an ignored signal ignored (``nohup``, a background job's SIGINT), and putting back exactly
the previous handlers, unless someone installed another one meanwhile.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

Handler = Callable[[int, FrameType | None], Any]


class Handlers:
    """``handler`` installed for ``signums`` until ``remove``; ``previous`` holds what it replaced."""

    def __init__(
        self, handler: Handler, signums: tuple[int, ...] = STOP_SIGNALS, *, keep_ignored: bool = False
    ) -> None:
        self.handler = handler
        self.previous: dict[int, Any] = {}
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in signums:
            if keep_ignored and signal.getsignal(signum) == signal.SIG_IGN:
                continue  # it would not end the process, so it is nothing to handle either
            self.previous[signum] = signal.signal(signum, handler)

    def previous_of(self, signum: int) -> Any:
        """What ``signum`` did before (the default when we never took it)."""
        return self.previous.get(signum, signal.SIG_DFL)

    def remove(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for signum, handler in self.previous.items():
                with contextlib.suppress(ValueError, TypeError):
                    if signal.getsignal(signum) == self.handler:
                        signal.signal(signum, handler)
        self.previous.clear()


@contextlib.contextmanager
def handling(
    handler: Handler, signums: tuple[int, ...] = STOP_SIGNALS, *, enabled: bool = True
) -> Iterator[Handlers | None]:
    """``handler`` for ``signums`` inside the block (nothing when not ``enabled``)."""
    if not enabled:
        yield None
        return
    handlers = Handlers(handler, signums)
    try:
        yield handlers
    finally:
        handlers.remove()


def act_as(previous: Any, signum: int, frame: FrameType | None) -> None:
    """Do what ``signum`` would have done with ``previous`` as its handler: call it (Python's SIGINT
    handler raises KeyboardInterrupt), or die of the signal by its default action."""
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
