"""The background emitter: one producer source's events handed to the bus without the training
loop waiting on it. Shared by runledger's own trainer (``runledger.trainer.loop``) and the client
library (``runledger.init``): one emission path.

Standard library, msgspec and the bus only (no torch, no Megatron): a process that only logs
through ``runledger`` never imports them.

Bounds on the caller (the training thread):
  * ``submit`` of a metrics event never waits while the bus takes events: a full queue drops it
    and counts it. While the bus is down (it refused an event: a full disk, Kafka away) a full queue
    makes metrics submits wait for room, at most ``outage_wait_s`` in all per outage, then they drop
    and count at once until the bus takes events again;
  * ``submit(critical=True)`` (a lifecycle event: start, checkpoint, crash, finish) waits for room
    at most ``critical_timeout_s``;
  * ``flush``/``close`` wait at most (about twice) their ``timeout``.

Every event that does not reach the bus is counted (``dropped``) and reported by a
``runledger.producer.dropped`` event (count, first and last step and seq, why) as soon as the bus
takes events again, or at ``close``. A bus still down at ``close``: given ``pending_dir`` (the
spool's folder), the report is kept in a pending file there, reserved full size at the start so that
a full disk does not refuse it (``runledger.ingest.spool.PendingSlot``); the next emitter on that spool hands
it to the bus, and the next ``ledger ingest spool`` records it, whichever comes first (the ledger
keeps one: the same source and id). Without ``pending_dir`` only the error line says the count.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import msgspec

from runledger.ingest.bus import EventSink
from runledger.ingest.spool import PendingSlot, pending_files, pending_path, remove_pending
from runledger.schemas import Envelope, encode_event, make_event
from runledger.schemas.envelope import utc_now
from runledger.schemas.payloads import ProducerDropped
from runledger.schemas.signing import Sealer

log = logging.getLogger("runledger.emitter")

PayloadLike = msgspec.Struct | Callable[[], msgspec.Struct]

HICCUP_RETRIES = 2  # a failing emit is retried this often (0.05 s, 0.1 s) before the bus counts as down
PROBE_MAX_S = 0.2  # while the bus is down, the held event is retried at most this far apart
ROOM_POLL_S = 0.005  # how often a waiting submit looks for room in the queue
MAX_REASONS = 3  # distinct reasons a drop report names


class _Flush:
    def __init__(self, sync: bool, final: bool = False) -> None:
        self.sync = sync
        self.final = final  # close's marker: report what is left, then the thread ends
        self.done = threading.Event()


class _Buffer:
    """The emitter's queue: a bounded deque that only the emitter's puts fill, each under its
    ``_seq_lock`` after a look at ``full``, and its one thread empties. No lock of its own (unlike
    ``queue.Queue``, whose two acquisitions per put made 16 logging threads convoy on the emitter's
    lock): ``deque.append`` and ``popleft`` are atomic, and an event wakes the thread when idle."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = max(1, maxsize)
        self._items: deque[Any] = deque()
        self._ready = threading.Event()  # set when items may be there; cleared by the idle thread

    def full(self) -> bool:
        return len(self._items) >= self.maxsize

    def put_nowait(self, item: Any) -> None:
        self._items.append(item)
        if not self._ready.is_set():
            self._ready.set()

    def get(self) -> Any:
        while True:
            try:
                return self._items.popleft()
            except IndexError:
                pass
            self._ready.clear()
            if not self._items:  # a put after the clear sets it again
                self._ready.wait()

    def qsize(self) -> int:
        return len(self._items)


@dataclass
class _Drops:
    """Dropped events not yet reported: how many, their steps and seq numbers, and why."""

    count: int = 0
    first_step: int | None = None
    last_step: int | None = None
    first_seq: int | None = None
    last_seq: int | None = None
    reasons: list[str] = field(default_factory=list)

    def add(self, step: int | None, seq: int | None, reason: str, count: int = 1) -> None:
        self.count += count
        self.first_step, self.last_step = _widen(self.first_step, self.last_step, step, step)
        self.first_seq, self.last_seq = _widen(self.first_seq, self.last_seq, seq, seq)
        if reason not in self.reasons and len(self.reasons) < MAX_REASONS:
            self.reasons.append(reason)

    def merge(self, report: ProducerDropped) -> None:
        """A report that did not reach the bus either: back into the tally."""
        self.count += report.count
        self.first_step, self.last_step = _widen(
            self.first_step, self.last_step, report.first_step, report.last_step
        )
        self.first_seq, self.last_seq = _widen(
            self.first_seq, self.last_seq, report.first_seq, report.last_seq
        )
        for reason in report.reason.split("; "):
            if reason not in self.reasons and len(self.reasons) < MAX_REASONS:
                self.reasons.append(reason)

    def report(self) -> ProducerDropped:
        return ProducerDropped(
            count=self.count,
            first_step=self.first_step,
            last_step=self.last_step,
            reason="; ".join(self.reasons) or "queue full",
            first_seq=self.first_seq,
            last_seq=self.last_seq,
        )


def _widen(
    lo: int | None, hi: int | None, new_lo: int | None, new_hi: int | None
) -> tuple[int | None, int | None]:
    lo = new_lo if lo is None else lo if new_lo is None else min(lo, new_lo)
    hi = new_hi if hi is None else hi if new_hi is None else max(hi, new_hi)
    return lo, hi


@dataclass
class _Outage:
    """The bus refused an event (after the hiccup retries): since when, why, drops before it."""

    since: float
    reason: str
    dropped_before: int


def _text(exc: BaseException) -> str:
    """An exception as one short line: ``OSError: [Errno 28] No space left on device``."""
    message = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {message[:200]}" if message else type(exc).__name__


class _EventIds:
    """Event ids as ``runledger.schemas.envelope.new_event_id`` writes them (the time to the
    microsecond, then 16 random hex digits), the random parts drawn from the OS ``BATCH`` at a time:
    an ``os.urandom`` call, a UUID and a clock read per event were ~10% of the emitter thread. A forked
    child draws its own (a pool inherited from the parent would repeat the parent's ids)."""

    BATCH = 512
    ID_BYTES = 8

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool = b""
        self._at = 0
        self._pid = -1

    def next(self, when: datetime) -> str:
        with self._lock:
            if self._at >= len(self._pool) or self._pid != os.getpid():
                self._pool, self._at, self._pid = os.urandom(self.BATCH * self.ID_BYTES), 0, os.getpid()
            random_part = self._pool[self._at : self._at + self.ID_BYTES]
            self._at += self.ID_BYTES
        return f"{when:%Y%m%dT%H%M%S%f}-{random_part.hex()}"


class Emitter:
    """Hands events to a sink from a background thread.

    The loop calls ``submit``: it takes the event's ``seq`` and enqueues (payload or payload factory,
    step, time, seq) under one lock, so events are numbered in the order they enter the queue, which
    is the order the one emitter thread hands them to the sink (and a sealing sink chains them):
    many threads logging to one run make no false gap or fork. Every event that does not reach the
    bus still used its seq (a chained source shows ingest the gap) and is counted (``dropped``):

    * queue full while the bus takes events (it is slow): a metrics event is dropped at once;
    * the bus refuses an event (``sink.emit`` or, during an outage, ``sink.sync`` raises): after
      ``HICCUP_RETRIES`` quick retries the bus is *down* (one warning line); the thread holds that
      event and retries it (at most ``PROBE_MAX_S`` apart) until the bus takes it, so nothing queued
      is lost to a passing outage; submits queue while there is room, then wait for room at most
      ``outage_wait_s`` in all per outage, then drop and count at once;
    * ``close`` while the bus is still down: what is left is tried once more and dropped.

    The drops are reported by a ``runledger.producer.dropped`` event (count, first and last step
    and seq, reasons), queued as soon as there is room and the bus takes events again, or at
    ``close``; a report the bus still refuses then is kept in ``pending_dir`` (``kept_in``) for the
    next ingest of that spool.
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
        outage_wait_s: float = 1.0,
        pending_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.sink = sink
        self.source = source
        self.stream = stream
        self.run_id = run_id
        self.attempt = attempt
        self.critical_timeout_s = critical_timeout_s
        self.outage_wait_s = outage_wait_s
        # seq numbers are taken with one atomic ``next`` under ``_seq_lock`` together with the put:
        # every put into the queue holds it (the thread's own only when free), so queue order is seq
        # order. Re-entrant: the client library records a crash from a SIGTERM handler, which may
        # run on the very thread that holds the lock in ``submit``.
        self._seq = itertools.count(start_seq)
        self._seq_lock = threading.RLock()
        self._tally_lock = threading.RLock()  # ``dropped`` and ``_drops``: submitters and the thread
        self.dropped = 0
        self._drops = _Drops()
        self._outage: _Outage | None = None  # set and cleared by the thread only
        self._wait_left_s = outage_wait_s  # what metrics submits may still wait in this outage
        self.emitted = 0
        self.errors = 0
        self._queue = _Buffer(queue_size)
        self._ids = _EventIds()
        self._closing = threading.Event()  # close ran out of time: stop holding refused events
        self._thread = threading.Thread(target=self._run, name=f"emitter-{source}", daemon=True)
        self._closed = False
        self.pending_dir = Path(pending_dir) if pending_dir is not None else None
        self.kept_in: Path | None = None  # where the report the bus refused at close waits for ingest
        self._slot = self._reserve_pending()
        self._thread.start()

    def _reserve_pending(self) -> PendingSlot | None:
        """The pending file, made now while the disk has room (None: no spool folder, or no room)."""
        if self.pending_dir is None:
            return None
        try:
            return PendingSlot.reserve(self.pending_dir, self.source)
        except OSError as exc:
            log.warning(
                "runledger: cannot reserve a file in %s for a drop count at exit (%s); it is tried "
                "again at exit if needed",
                self.pending_dir,
                _text(exc),
            )
            return None

    @property
    def bus_down(self) -> bool:
        """True while the bus refuses events (the thread holds one and retries it)."""
        return self._outage is not None

    # -- the caller's side ------------------------------------------------------------------------

    def submit(self, payload: PayloadLike, *, step: int | None, critical: bool = False) -> bool:
        """Enqueue one event; True if it was queued (it then reaches the bus, or is counted in
        ``dropped`` and reported); False if it was dropped (counted) or the emitter is closed."""
        when = utc_now()
        with self._seq_lock:
            if self._closed:
                return False
            if self._drops.count and self._outage is None:
                self._enqueue_report()
            if not self._queue.full():
                self._queue.put_nowait((payload, step, when, next(self._seq)))
                return True
        return self._submit_waiting(payload, step, when, critical)

    def _submit_waiting(self, payload: PayloadLike, step: int | None, when: datetime, critical: bool) -> bool:
        """The queue is full: wait for room (a lifecycle event ``critical_timeout_s``; a metrics
        event only while the bus is down, what is left of ``outage_wait_s``), else drop and count."""
        outage = self._outage
        wait_s = self.critical_timeout_s if critical else self._wait_left_s if outage is not None else 0.0
        started = time.monotonic()
        deadline = started + wait_s
        while True:
            with self._seq_lock:
                if self._closed:
                    return False
                if not self._queue.full():
                    self._queue.put_nowait((payload, step, when, next(self._seq)))
                    queued = True
                    break
                if time.monotonic() >= deadline:
                    outage = self._outage
                    reason = f"bus down ({outage.reason})" if outage is not None else "queue full"
                    self._drop(step, next(self._seq), reason)
                    queued = False
                    break
            time.sleep(min(ROOM_POLL_S, max(0.0, deadline - time.monotonic())))
        if not critical and self._outage is not None and wait_s:
            self._wait_left_s = max(0.0, self._wait_left_s - (time.monotonic() - started))
        if critical and not queued and self._outage is None:  # an outage has its own lines
            log.error("runledger emitter: no room in the queue for %.0fs: lifecycle event lost", wait_s)
        return queued

    def _drop(self, step: int | None, seq: int | None, reason: str) -> None:
        with self._tally_lock:
            self.dropped += 1
            self._drops.add(step, seq, reason)

    def _enqueue_report(self) -> None:
        """Queue a ``producer.dropped`` for the drops not yet reported, if there is room (under
        ``_seq_lock``: the report takes the next seq in queue order)."""
        if self._queue.full():
            return
        with self._tally_lock:
            drops, self._drops = self._drops, _Drops()
        if drops.count:
            self._queue.put_nowait((drops.report(), drops.last_step, utc_now(), next(self._seq)))

    def _put_marker(self, marker: _Flush, deadline: float) -> bool:
        """Put a flush marker behind everything queued (under ``_seq_lock``), waiting for room."""
        while True:
            with self._seq_lock:
                if not self._queue.full():
                    self._queue.put_nowait(marker)
                    return True
            if time.monotonic() >= deadline or not self._thread.is_alive():
                return False
            time.sleep(ROOM_POLL_S)

    # -- the thread's side ------------------------------------------------------------------------

    def _run(self) -> None:
        self._forward_kept_reports()
        while True:
            item = self._queue.get()
            try:
                if isinstance(item, _Flush):
                    if item.final:
                        self._final_report()
                    if item.sync:
                        self._sync_quietly()
                    item.done.set()
                    if item.final:
                        return
                    continue
                self._deliver(*item)
            except Exception:  # a bug here must not kill the thread
                self.errors += 1
                log.exception("emitter: could not emit an event")

    def _forward_kept_reports(self) -> None:
        """Reports earlier producers of this spool kept at their end (the bus was down then), onto
        the bus as they are (their own sealed events), each file removed once the bus synced it. A
        report the bus refuses stays for the next ingest of the spool; one the ingest records too
        is the same event (source and id): the ledger keeps it once."""
        emit_raw = getattr(self.sink, "emit_raw", None)
        if self.pending_dir is None or not callable(emit_raw):
            return
        try:
            for kept in pending_files(self.pending_dir):
                if kept.damaged is None:  # a damaged file is the ingest's to quarantine
                    emit_raw(kept.raw)
                    self.sink.sync()
                    remove_pending(kept.path)
                    log.info("runledger: a drop report kept in %s is on the bus now", kept.path)
        except Exception as exc:  # the bus is down again: what is left waits for the ingest
            log.info("runledger: kept drop reports stay for the next ingest (%s)", _text(exc))

    def _deliver(self, payload: PayloadLike, step: int | None, when: datetime, seq: int) -> None:
        try:
            built = payload() if callable(payload) else payload
            envelope = self._envelope(built, step, when, seq)
        except Exception as exc:  # a bad payload: its seq is a gap, so it is a drop like the others
            self.errors += 1
            if self.errors == 1:
                log.exception("runledger emitter: could not build an event (later ones are only counted)")
            self._drop(step, seq, f"could not build the event ({_text(exc)})")
            return
        if self._hand_over(envelope):
            return
        reason = f"bus down at close ({self._outage.reason if self._outage else 'refused'})"
        if isinstance(built, ProducerDropped):  # a report that did not get through: back in the tally
            with self._tally_lock:
                self._drops.merge(built)
        else:
            self._drop(step, seq, reason)

    def _envelope(
        self, payload: msgspec.Struct, step: int | None, when: datetime, seq: int, id: str | None = None
    ) -> Envelope:
        return make_event(
            payload,
            source=self.source,
            stream=self.stream,
            seq=seq,
            run_id=self.run_id,
            attempt=self.attempt,
            step=step,
            time=when,
            id=id or self._ids.next(when),
        )

    def _hand_over(self, envelope: Envelope) -> bool:
        """True once the sink took ``envelope`` (while the bus is down: took it and synced); False
        only when ``close`` ran out of time and the bus still refuses it. A retry hands the same
        envelope again: a copy that did get through is a duplicate the ledger drops."""
        tries, pause = 0, 0.01
        while True:
            try:
                self.sink.emit(envelope)
                if self._outage is not None:
                    self.sink.sync()  # the bus is back only once what it took is durable
            except Exception as exc:
                tries += 1
                if self._outage is None:
                    if tries <= HICCUP_RETRIES:
                        time.sleep(0.05 * tries)
                        continue
                    self._begin_outage(exc)
                if self._closing.is_set():
                    return False
                self._closing.wait(pause)
                pause = min(2 * pause, PROBE_MAX_S)
                continue
            self.emitted += 1
            if self._outage is not None:
                self._end_outage()
            return True

    def _begin_outage(self, exc: BaseException) -> None:
        self._wait_left_s = self.outage_wait_s
        self._outage = _Outage(time.monotonic(), _text(exc), self.dropped)
        log.warning(
            "runledger: the bus refused an event (%s); events wait for it, then are dropped and "
            "counted (run.dropped) and reported once it takes events again",
            self._outage.reason,
        )

    def _end_outage(self) -> None:
        outage, self._outage = self._outage, None
        assert outage is not None
        log.info(
            "runledger: the bus takes events again after %.1fs; %d events dropped meanwhile (reported)",
            time.monotonic() - outage.since,
            self.dropped - outage.dropped_before,
        )
        if self._seq_lock.acquire(blocking=False):  # else the next submit reports them
            try:
                if not self._closed:
                    self._enqueue_report()
            finally:
                self._seq_lock.release()

    def _final_report(self) -> None:
        """At close, behind everything else: report the drops not reported yet (closed: no submit
        takes a seq any more, so the report's is the last one). Its id is made of its seq, so the
        copy kept in the pending file and one that reached the bus after all are one event."""
        with self._tally_lock:
            drops, self._drops = self._drops, _Drops()
        if not drops.count:
            self._release_pending()
            return
        report = drops.report()
        seq = next(self._seq)
        envelope = self._envelope(report, drops.last_step, utc_now(), seq, id=f"dropped-at-close-{seq}")
        if self._hand_over(envelope):
            self._release_pending()
            return
        outage = self._outage
        why = outage.reason if outage else "refused"
        self.kept_in = self._keep_pending(envelope)
        if self.kept_in is None:
            log.error(
                "runledger: the bus is still down at close (%s): %d dropped events not reported in "
                "the ledger (run.dropped = %d)",
                why,
                report.count,
                self.dropped,
            )
            return
        log.error(
            "runledger: the bus is still down at close (%s): %d dropped events not reported on the bus; "
            "the report waits in %s for the next run on this spool or `ledger ingest spool` "
            "(run.dropped = %d)",
            why,
            report.count,
            self.kept_in,
            self.dropped,
        )

    def _release_pending(self) -> None:
        """Nothing left to report: the reserved file goes."""
        slot, self._slot = self._slot, None
        if slot is not None:
            try:
                slot.release()
            except OSError as exc:
                log.warning("runledger: could not remove %s: %s", slot.path, _text(exc))

    def _keep_pending(self, envelope: Envelope) -> Path | None:
        """The report the bus refused, as the bus would have taken it (sealed by the sink's sealer,
        if it signs), into the pending file; its path, or None without one (or when it fails)."""
        if self.pending_dir is None:
            return None
        slot, self._slot = self._slot, None
        if slot is None:  # not reserved at the start: a new file, which needs room
            slot = PendingSlot(pending_path(self.pending_dir, self.source), self.source)
        sealer = getattr(self.sink, "sealer", None)
        sealed = sealer.seal(envelope) if isinstance(sealer, Sealer) else envelope
        spool_next = getattr(getattr(self.sink, "writer", None), "next_index", None)
        try:
            slot.hold(encode_event(sealed), spool_next if isinstance(spool_next, int) else None)
        except OSError as exc:
            log.warning("runledger: could not keep the drop report in %s: %s", slot.path, _text(exc))
            return None
        return slot.path

    def _sync_quietly(self) -> None:
        try:
            self.sink.sync()
        except Exception as exc:
            self.errors += 1
            if self._outage is None:  # during an outage the one warning line has said it
                log.warning("runledger emitter: sink sync failed: %s", _text(exc))

    # -- flush and close --------------------------------------------------------------------------

    def flush(self, *, sync: bool = True, timeout: float = 60.0) -> bool:
        """Wait until everything submitted so far was handed to the sink (and synced: durable)."""
        if self._closed or not self._thread.is_alive():
            return False
        marker = _Flush(sync)
        if not self._put_marker(marker, time.monotonic() + timeout):
            return False
        return marker.done.wait(timeout)

    def close(self, timeout: float = 60.0) -> bool:
        """Report what was dropped, flush, sync, stop the thread; the sink stays open (its owner
        closes it). Waits ``timeout`` for the bus; if it is still down then, what is left is dropped
        and counted (at most about one more ``timeout``). True if the thread finished."""
        with self._seq_lock:
            if self._closed:
                return True
            self._closed = True
        if not self._thread.is_alive():
            return False
        final = _Flush(sync=True, final=True)
        deadline = time.monotonic() + timeout
        if not self._put_marker(final, deadline):
            self._closing.set()  # the bus is down and the queue full: drop what is left, now
            if not self._put_marker(final, time.monotonic() + timeout):
                return False
        if not final.done.wait(max(0.0, deadline - time.monotonic())):
            self._closing.set()
            if not final.done.wait(timeout):
                return False
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def pending(self) -> int:
        return self._queue.qsize()


def rank_spool(spool: str | os.PathLike[str] | None, rank: int) -> Path:
    """The spool a rank writes to: the given one for rank 0, ``<spool>.rank<N>`` beside it for the
    others (a spool has one writer)."""
    from runledger.ingest.bus import default_spool_dir

    base = Path(spool) if spool is not None else default_spool_dir()
    return base if rank == 0 else base.with_name(f"{base.name}.rank{rank}")


def open_rank_sink(
    spool: str | os.PathLike[str] | None, rank: int = 0, kafka_bootstrap: str | None = None
) -> EventSink:
    """This rank's sink: Kafka if configured (every rank produces), else its own spool. With
    ``RUNLEDGER_PRODUCER_KEY`` set, every event is signed with that key and chained per source."""
    from runledger.ingest.bus import open_sink

    return open_sink(rank_spool(spool, rank), kafka_bootstrap, sealer=Sealer.from_env(chain=True))
