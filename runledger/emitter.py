"""The background emitter: one producer source's events handed to the bus without the training
loop waiting on it. Shared by runledger's own trainer (``trainer.loop``) and the client
library (``runledger.init``): one emission path.

Standard library, msgspec and the bus only (no torch, no Megatron): a process that only logs
through ``runledger`` never imports them.

Bounds on the caller (the training thread):
  * ``submit`` of a metrics event never waits: a full queue drops it and counts it;
  * ``submit(critical=True)`` (a lifecycle event: start, checkpoint, crash, finish) waits for room
    at most ``critical_timeout_s``;
  * ``flush``/``close`` wait at most their ``timeout``.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import msgspec

from ingest.bus import EventSink
from schemas import make_event
from schemas.envelope import utc_now
from schemas.payloads import ProducerDropped
from schemas.signing import Sealer

log = logging.getLogger("runledger.emitter")

PayloadLike = msgspec.Struct | Callable[[], msgspec.Struct]


class _Flush:
    def __init__(self, sync: bool) -> None:
        self.sync = sync
        self.done = threading.Event()


_STOP = object()


class Emitter:
    """Hands events to a sink from a background thread.

    The loop calls ``submit``: it enqueues (payload or payload factory, step, time) and returns.
    Queue full: a metrics event is dropped and counted (``dropped``); a lifecycle event
    (``critical=True``) waits for space for at most ``critical_timeout_s`` (it is rare, and losing it
    would break the run's lineage). Sequence numbers are assigned at ``submit``, so a dropped event
    leaves a gap in ``seq`` that ingest records as an incident (``ledger.admission``); and
    the emitter says why with a ``runledger.producer.dropped`` event (count, first and last step),
    queued as soon as there is room again, or at ``close``.
    """

    def __init__(
        self,
        sink: EventSink,
        *,
        source: str,
        stream: str,
        run_id: str,
        attempt: int,
        queue_size: int = 4096,
        critical_timeout_s: float = 30.0,
        start_seq: int = 0,
    ) -> None:
        self.sink = sink
        self.source = source
        self.stream = stream
        self.run_id = run_id
        self.attempt = attempt
        self.critical_timeout_s = critical_timeout_s
        # seq numbers are taken with one atomic ``next`` (no read-then-increment a signal handler
        # could interrupt), and the lock is re-entrant: the client library records a crash from a
        # SIGTERM handler, which may run on the very thread that holds the lock in ``submit``.
        self._seq = itertools.count(start_seq)
        self.dropped = 0
        self._unreported: list[Any] = [0, None, None]  # drops not yet reported: count, first, last step
        self._seq_lock = threading.RLock()
        self.emitted = 0
        self.errors = 0
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(1, queue_size))
        self._thread = threading.Thread(target=self._run, name=f"emitter-{source}", daemon=True)
        self._closed = False
        self._thread.start()

    def submit(self, payload: PayloadLike, *, step: int | None, critical: bool = False) -> bool:
        """Enqueue one event; True if it was accepted."""
        if self._closed:
            return False
        if self._unreported[0]:
            with self._seq_lock:
                self._report_drops(wait=False)
        item = (payload, step, utc_now(), next(self._seq))
        try:
            if critical:
                self._queue.put(item, timeout=self.critical_timeout_s)
            else:
                self._queue.put_nowait(item)
        except queue.Full:
            with self._seq_lock:
                self.dropped += 1
                tally = self._unreported
                tally[0] += 1
                if step is not None:
                    tally[1] = step if tally[1] is None else min(tally[1], step)
                    tally[2] = step if tally[2] is None else max(tally[2], step)
            if critical:
                log.error("emitter queue full for %.0fs: lifecycle event lost", self.critical_timeout_s)
            return False
        return True

    def _report_drops(self, *, wait: bool) -> None:
        """Queue a ``producer.dropped`` event for the drops not yet reported (under ``_seq_lock``).
        Not waiting, it takes a seq only when the queue has room (if another thread fills it in
        between, that seq is one more gap, which ingest records like the others)."""
        count, first, last = self._unreported
        if not count or (not wait and self._queue.full()):
            return
        report = ProducerDropped(count=count, first_step=first, last_step=last)
        self._unreported = [0, None, None]
        try:
            if wait:
                self._queue.put((report, last, utc_now(), next(self._seq)), timeout=self.critical_timeout_s)
            else:
                self._queue.put_nowait((report, last, utc_now(), next(self._seq)))
        except queue.Full:
            with self._seq_lock:  # not reported after all: back into the tally
                tally = self._unreported
                tally[0] += count
                for index, value, pick in ((1, first, min), (2, last, max)):
                    if value is not None:
                        tally[index] = value if tally[index] is None else pick(tally[index], value)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                if isinstance(item, _Flush):
                    if item.sync:
                        self._guarded(self.sink.sync)
                    item.done.set()
                    continue
                payload, step, when, seq = item
                self._emit(payload() if callable(payload) else payload, step, when, seq)
            except Exception:  # a bad payload must not kill the thread
                self.errors += 1
                log.exception("emitter: could not emit an event")
            finally:
                self._queue.task_done()

    def _emit(self, payload: msgspec.Struct, step: int | None, when: datetime, seq: int) -> None:
        envelope = make_event(
            payload,
            source=self.source,
            stream=self.stream,
            seq=seq,
            run_id=self.run_id,
            attempt=self.attempt,
            step=step,
            time=when,
        )
        for attempt in range(3):
            try:
                self.sink.emit(envelope)
                break
            except Exception:
                if attempt == 2:
                    raise  # counted by _run; its seq is a gap that ingest records
                time.sleep(0.05 * (attempt + 1))
        self.emitted += 1

    def _guarded(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:
            self.errors += 1
            log.exception("emitter: sink call failed")

    def flush(self, *, sync: bool = True, timeout: float = 60.0) -> bool:
        """Wait until everything submitted so far was handed to the sink (and synced: durable)."""
        if self._closed or not self._thread.is_alive():
            return False
        marker = _Flush(sync)
        try:
            self._queue.put(marker, timeout=timeout)
        except queue.Full:
            return False
        return marker.done.wait(timeout)

    def close(self, timeout: float = 60.0) -> bool:
        """Flush, sync, stop the thread. The sink stays open (its owner closes it)."""
        if self._closed:
            return True
        with self._seq_lock:
            if self._unreported[0] and self._thread.is_alive():
                self._report_drops(wait=True)
        ok = self.flush(sync=True, timeout=timeout)
        self._closed = True
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            return False
        self._thread.join(timeout)
        return ok and not self._thread.is_alive()

    @property
    def pending(self) -> int:
        return self._queue.qsize()


def rank_spool(spool: str | os.PathLike[str] | None, rank: int) -> Path:
    """The spool a rank writes to: the given one for rank 0, ``<spool>.rank<N>`` beside it for the
    others (a spool has one writer)."""
    from ingest.bus import default_spool_dir

    base = Path(spool) if spool is not None else default_spool_dir()
    return base if rank == 0 else base.with_name(f"{base.name}.rank{rank}")


def open_rank_sink(
    spool: str | os.PathLike[str] | None, rank: int = 0, kafka_bootstrap: str | None = None
) -> EventSink:
    """This rank's sink: Kafka if configured (every rank produces), else its own spool. With
    ``RUNLEDGER_PRODUCER_KEY`` set, every event is signed with that key and chained per source."""
    from ingest.bus import open_sink

    return open_sink(rank_spool(spool, rank), kafka_bootstrap, sealer=Sealer.from_env(chain=True))
