"""``runledger.signals``: how every part of runledger installs SIGTERM/SIGINT handlers."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from runledger import signals
from runledger.crashes import NonFinite, SignalStop, cause_of


def test_handlers_are_installed_and_the_previous_ones_put_back() -> None:
    before = signal.getsignal(signal.SIGTERM)
    seen: list[int] = []
    with signals.handling(lambda signum, frame: seen.append(signum)) as installed:
        assert installed is not None and signal.SIGTERM in installed.previous
        os.kill(os.getpid(), signal.SIGTERM)
    assert seen == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) == before


def test_an_ignored_signal_stays_ignored_when_asked() -> None:
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        handlers = signals.Handlers(lambda s, f: None, keep_ignored=True)
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        assert signal.SIGINT not in handlers.previous and signal.SIGTERM in handlers.previous
        handlers.remove()
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_handler_installed_meanwhile_is_left_alone() -> None:
    mine = signals.Handlers(lambda s, f: None, (signal.SIGUSR1,))

    def other(signum: int, frame: object) -> None: ...

    signal.signal(signal.SIGUSR1, other)
    try:
        mine.remove()
        assert signal.getsignal(signal.SIGUSR1) is other
    finally:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)


def test_outside_the_main_thread_nothing_is_installed() -> None:
    found: list[dict[int, object]] = []
    worker = threading.Thread(target=lambda: found.append(signals.Handlers(lambda s, f: None).previous))
    worker.start()
    worker.join(10)
    assert found == [{}]


def test_act_as_calls_the_previous_handler() -> None:
    with pytest.raises(KeyboardInterrupt):
        signals.act_as(signal.default_int_handler, signal.SIGINT, None)
    signals.act_as(signal.SIG_IGN, signal.SIGTERM, None)  # ignored: nothing happens


@pytest.mark.parametrize(
    ("exc", "cause"),
    [
        (SignalStop(15), ("signal", 15)),
        (KeyboardInterrupt(), ("signal", signal.SIGINT)),
        (NonFinite("nan loss"), ("nonfinite_loss", None)),
        (MemoryError(), ("oom", None)),
        (type("OutOfMemoryError", (RuntimeError,), {})("CUDA out of memory"), ("oom", None)),
        (ValueError("x"), ("exception", None)),
    ],
)
def test_one_classification_of_an_attempts_end(exc: BaseException, cause: tuple[str, int | None]) -> None:
    assert cause_of(exc) == cause


def test_a_signal_duckdb_turned_into_its_own_error_is_still_told() -> None:
    """DuckDB catches the handler's raise inside a query and answers RuntimeError("Query
    interrupted"): the signal recorded by the policy is what ``taken_for`` names (the demo's
    phases rely on it); an ordinary error with no signal behind it is no signal's doing."""
    import duckdb

    with signals.listening():
        con = duckdb.connect()
        timer = threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGTERM))
        timer.start()
        try:
            with pytest.raises(BaseException) as caught:  # either kind: the point of the test
                con.execute("SELECT count(*) FROM range(20000000000) t(x) WHERE x % 7 = 3").fetchall()
        finally:
            timer.join()
            con.close()
        assert signals.taken_for(caught.value) == signal.SIGTERM
        assert signals.taken_for(RuntimeError("an ordinary error")) is None
