"""SIGTERM/SIGINT handling: the one place a process of runledger's installs and removes handlers.

The command line's policy (``StopPolicy``: installed before the command's first slow import, it
records a signal and raises ``Interrupted`` at once or, where the code ``deferred`` it, at its next
safe point), the client library's crash capture (``runledger.client``), the trainer's stop flag
(``runledger.trainer.loop``: it takes over a signal the policy recorded) and the webhook receiver each decide
*what* a signal means; ``Handlers`` is *how* it is installed, always the same way: only in the main
thread (Python delivers signals there alone; elsewhere nothing is installed and the defaults stay),
optionally leaving an ignored signal ignored (``nohup``, a background job's SIGINT), and putting
back exactly the previous handlers, unless someone installed another one meanwhile.
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


# --- the command's policy: one answer to SIGINT/SIGTERM from the command's first moment ----------


def signal_name(signum: int | None) -> str:
    """``SIGINT``; ``a signal`` for None; ``signal 99`` for a number no signal has."""
    if signum is None:
        return "a signal"
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class Interrupted(KeyboardInterrupt):
    """A stop signal acted on: what unwinds a command so that it ends with ``exit_code`` (128 + the
    signal's number: 130 for Ctrl-C, 143 for SIGTERM). A KeyboardInterrupt, so that code which
    cleans up after Ctrl-C does the same after SIGTERM."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal_name(signum)}")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopPolicy:
    """The process's handler of SIGINT/SIGTERM, installed by the command line before its first slow
    import (``install``), also over an inherited ignore (issue 42: a script's background job got
    SIGINT ignored until the trainer took it, so an early Ctrl-C was lost).

    While the command starts (``starting``) a signal exits at once with 128 + N: nothing was done.
    Inside a command (``listening``) every signal is recorded until someone acts on it (``take``), so
    that a raise swallowed by a library's bare ``except`` is still honoured later; it raises
    ``Interrupted`` at once, unless the code ``deferred`` it: then the first signal is only recorded,
    for the code's next safe point, and a second one raises (the user insists). Outside a command it
    raises ``Interrupted`` and records nothing (a test process that imported the CLI)."""

    def __init__(self) -> None:
        self.signum: int | None = None  # the first signal not acted on yet
        self.count = 0  # signals since the last ``take``
        self.listening = 0  # open ``listening`` blocks
        self.deferring = 0  # open ``deferred`` blocks
        self.starting = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.starting:
            _say(f"error: interrupted by {signal_name(signum)} while starting; nothing was done\n")
            raise SystemExit(128 + signum)
        if self.listening:
            self.note(signum)
            if self.deferring and self.count == 1:
                return  # honoured at the deferring code's next safe point
        raise Interrupted(signum)

    def note(self, signum: int) -> None:
        """Record ``signum`` (inside a command only: outside, nobody would act on it)."""
        if self.listening:
            self.count += 1
            if self.signum is None:
                self.signum = signum

    def take(self) -> int | None:
        """The signal to act on now (None: none came), forgotten here: the caller acts on it."""
        signum, self.signum, self.count = self.signum, None, 0
        return signum


def _say(line: str) -> None:
    """One line on stderr from a signal handler: straight to the descriptor, so that it cannot
    re-enter a print the handler interrupted."""
    with contextlib.suppress(OSError):
        os.write(2, line.encode())


_policy: StopPolicy | None = None  # the process's (``install``)
_scoped: StopPolicy | None = None  # one ``listening`` installed for its block (no process policy)
_handlers: Handlers | None = None  # the process policy's: installed once, never removed


def install(*, starting: bool = False) -> StopPolicy:
    """The process's ``StopPolicy``, installed as the SIGINT/SIGTERM handler on the first call (in
    the main thread; an inherited ignore is replaced: the command honours both). ``starting``: the
    command is still importing; ``started`` ends that."""
    global _policy, _handlers
    if _policy is None:
        _policy = StopPolicy()
        _handlers = Handlers(_policy, STOP_SIGNALS)
    _policy.starting = starting
    return _policy


def started() -> None:
    """Not starting any more: a signal no longer exits on the spot (``listening`` does this too,
    when the command's body begins)."""
    if _policy is not None:
        _policy.starting = False


@contextlib.contextmanager
def listening() -> Iterator[StopPolicy]:
    """A command's body: signals are recorded until acted on. Uses the process's policy; without
    one (a library caller) installs one for the block, and a signal still pending at its end then
    does what the handler it replaced would have done."""
    global _scoped
    policy, scoped = _policy or _scoped, None
    if policy is None:
        policy = _scoped = StopPolicy()
        scoped = Handlers(policy, STOP_SIGNALS)
    policy.starting = False
    if policy.listening == 0:
        policy.take()  # a command starts with nothing pending
    policy.listening += 1
    try:
        yield policy
    finally:
        policy.listening -= 1
        if scoped is not None:
            scoped.remove()
            _scoped = None
            pending = policy.take()
            if pending is not None:
                act_as(scoped.previous_of(pending), pending, None)


def _listening_policy() -> StopPolicy | None:
    policy = _policy or _scoped
    return policy if policy is not None and policy.listening else None


@contextlib.contextmanager
def deferred(*, enabled: bool = True) -> Iterator[None]:
    """Inside a command: the first signal in the block is recorded, not raised, and honoured at the
    caller's next safe point (``take``, ``check``); a second one raises ``Interrupted``. Outside a
    command (or not ``enabled``) nothing changes."""
    policy = _listening_policy() if enabled else None
    if policy is None:
        yield
        return
    policy.deferring += 1
    try:
        yield
    finally:
        policy.deferring -= 1


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Inside a ``deferred`` block, a window of slow work that writes nothing (an import, a read):
    a signal raises ``Interrupted`` at once, and one recorded before raises on entry."""
    policy = _listening_policy()
    if policy is None:
        yield
        return
    saved, policy.deferring = policy.deferring, 0
    try:
        check()
        yield
    finally:
        policy.deferring = saved


def note(signum: int) -> None:
    """A signal another handler (the trainer's stop flag) got but leaves to the command to act on."""
    policy = _listening_policy()
    if policy is not None:
        policy.note(signum)


def pending() -> int | None:
    """The signal recorded and not acted on yet (None: none, or not inside a command)."""
    policy = _listening_policy()
    return policy.signum if policy is not None else None


def take() -> int | None:
    """``pending()``, forgotten: the caller acts on it."""
    policy = _listening_policy()
    return policy.take() if policy is not None else None


def taken_for(exc: BaseException) -> int | None:
    """The signal behind ``exc``, taken (the caller acts on it): ``Interrupted``'s own, or one recorded
    while C code (DuckDB, Arrow) turned the handler's raise into an ordinary error. None: ``exc`` is
    not a signal's doing."""
    signum = take()
    if isinstance(exc, Interrupted):
        return exc.signum
    return signum


def check() -> None:
    """A safe point: raise ``Interrupted`` for a recorded signal."""
    signum = take()
    if signum is not None:
        raise Interrupted(signum)
