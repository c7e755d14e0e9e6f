"""`ledger serve page`: the run's page, live. An index of runs, and a page per run that draws the
report's charts (``runledger.ledger.report``: the same data, downsampling and ECharts app) and then follows
the ledger: every event committed to the run's stream reaches the open page by Server-Sent Events.

How it follows the ledger cheaply: a commit is one record, ``_commits/<n>.json``, written by an
atomic rename (``runledger.ledger.store``), so one thread stats the *next* record's name every ``poll_s``
(0.25 s) and reads only records that exist: no listing, no query. A record names, per stream, the
leaves it appended (``appended``: first leaf index and count); their events are read from the
Parquet files the record lists (or, once a compaction moved them, with one query).

A ledger on DuckLake is followed by its snapshots instead: a writer on another host leaves no
record in this folder, so the catalog is asked for its newest snapshot (one connection and attach,
~25 ms) when this folder's next record appears, a SQLite catalog's files change, or every
``LAKE_POLL_S`` otherwise; a newer snapshot replaces the watch's reader (``Reader`` pinned there,
its ``head`` the record as of it) and the followed runs' new leaves are read through it.

The SSE ``id:`` of every message that carries an event is its leaf index (``stream_seq``) on the
run's stream, and the stream sends every leaf in order, so ids are contiguous: a browser that
reconnects sends ``Last-Event-ID`` and resumes at the next leaf, with no duplicate and no gap, even
across a restart of the server (nothing depends on the server's memory). Messages without an id
(``state``, ``record``, ``ledger``) say how things stand now and leave the browser's last id alone.

Safe in public: GET only, nothing from a request reaches SQL but a run id as a bound parameter;
every ledger text goes into the page as JSON read with ``textContent`` or as ``html.escape``d text,
under a Content-Security-Policy that runs only this server's own script files; at most
``max_clients`` event streams (then 503) and bounded buffers; a ledger that disappears or cannot
be read is announced (the open page marks itself stale, new pages answer 503), never shown as current.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import html
import json
import logging
import math
import os
import re
import threading
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from runledger.ledger.history import config_after, history_item
from runledger.ledger.lake import LAKE_MARKER, Catalog, LakeError, LakeFolder, open_snapshot
from runledger.ledger.log_checkpoint import parse_and_verify_checkpoint, parse_checkpoint
from runledger.ledger.monitor import DEFAULT_DEADLINE_S, MonitorError, check_quorum
from runledger.ledger.query import QueryError, Reader, RecordHead
from runledger.ledger.records import COMMITS, commit_record_path, read_commit_record
from runledger.ledger.remote import RemoteError, default_state_path, fetch_copy, verify_remote
from runledger.ledger.report import CURVES, MARKER_KINDS, asset, build_report, lineage_title, script_json
from runledger.ledger.run_search import (
    RunFilter,
    RunFilterError,
    check,
    parse_config_test,
    parse_status,
    parse_time,
    search_runs,
)
from runledger.ledger.stream_checkpoints import checkpoint_path
from runledger.ledger.witness import parse_cosignature_key, verify_cosignatures
from runledger.schemas import Envelope, decode_event
from runledger.schemas import catalogue as c

log = logging.getLogger(__name__)

DEFAULT_PORT = 8790
POLL_S = 0.25  # how often the next commit record's name is stat-ed
LAKE_POLL_S = 2.0  # a lake: how often its catalog is asked for a new snapshot with no sign of one here
PUBLISHED_POLL_S = 1.0  # how often a published copy's checkpoint is fetched (one small GET)
COPY_GRACE_S = 10.0  # a published copy's download may fail this long (a publish mid-upload) before it is said
MAX_CLIENTS = 200  # open event streams; the next one is answered 503
RECENT_EVENTS = 4096  # per followed run: the newest messages, so a page's catch-up needs no query
FOLLOWED_RUNS = 64  # runs whose messages are kept (least recently asked for dropped first)
PAGE_CACHE = 8  # rendered pages kept (runs)
PAGE_MAX_AGE_S = 30.0  # a kept page is served this long; its stream brings it up to date
CATCH_UP_CHUNK = 2000  # leaves read per query when a client resumes from far back
STATE_EVERY_S = 1.0  # the state panel's refresh, at most, per run
KEEPALIVE_S = 15.0  # a comment line on an idle stream, so proxies keep it open
HEADER_TIMEOUT_S = 5.0  # a connection that has not sent a whole request head by then is closed
RETRY_MS = 1000  # the browser's reconnect delay (SSE `retry:`)
# The event types drawn as markers: a marker kind is its type without "runledger." (the ledger's own
# types, "ledger.anomaly", keep theirs).
STATE_TYPES = frozenset(
    kind if kind.startswith("ledger.") else f"runledger.{kind}"
    for kind in MARKER_KINDS
    if not kind.startswith("github.")
)
RUN_ID = re.compile(
    r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
)  # runledger.schemas.envelope.RunId: nothing else is a run
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
ASSETS = {"echarts.min.js", "report.js", "live.js"}  # the only files /assets/ serves


class LedgerLost(Exception):
    """The ledger folder is gone or unreadable: nothing may be shown as current."""


@dataclass(frozen=True)
class Message:
    """One SSE message, encoded once and shared by every client."""

    seq: int
    text: str


def sse(event: str, data: Any, ident: int | None = None) -> str:
    """An SSE message; ``data`` as one line of JSON (JSON has no raw newline, so one ``data:`` line)."""
    head = f"id: {ident}\n" if ident is not None else ""
    return f"{head}event: {event}\ndata: {json.dumps(data, separators=(',', ':'), default=str)}\n\n"


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


# ---------------------------------------------------------------------------------------- witnesses
@dataclass(frozen=True)
class Witnesses:
    """The witness keys (C2SP cosignature/v1 vkeys) a page checks cosignatures against, and how
    many must verify (the quorum). The check is ``runledger.ledger.witness``'s; whether the quorum holds is
    ``runledger.ledger.monitor``'s (the same rule ``ledger verify --remote --witness`` applies)."""

    vkeys: tuple[str, ...] = ()
    quorum: int = 0

    @classmethod
    def of(cls, vkeys: list[str] | tuple[str, ...], quorum: int | None = None) -> Witnesses:
        """Checked keys; quorum defaults to all of them. ValueError (one line) on a bad key or quorum."""
        for vkey in vkeys:
            parse_cosignature_key(vkey)
        wanted = len(vkeys) if quorum is None else quorum
        if not 0 <= wanted <= len(vkeys):
            raise ValueError(f"--quorum {wanted}: give 0..{len(vkeys)} (the number of --witness keys)")
        return cls(tuple(vkeys), wanted)

    def check(self, checkpoint: str, log_names: set[str]) -> dict[str, Any]:
        """Which witnesses' cosignatures on ``checkpoint`` (a signed note) verify, and whether the
        quorum holds; ``log_names``: the signers that are the log itself (not cosignatures)."""
        signers = _signers(checkpoint)
        others = [name for name in signers if name not in log_names]
        keys = [parse_cosignature_key(vkey) for vkey in self.vkeys]
        good = verify_cosignatures(checkpoint, keys) if keys else []
        holds = True
        if self.quorum:
            try:
                check_quorum(checkpoint.encode(), self.vkeys, self.quorum)
            except MonitorError:
                holds = False
        out: dict[str, Any] = {
            "cosignatures": len(others),
            "witnesses": [{"name": k.name, "verified": k.name in good} for k in keys],
            "verified": good,
            "quorum": self.quorum,
            "quorum_met": holds,
        }
        return {**out, "summary": _cosigned_summary(out, others)}


def _signers(note: str) -> list[str]:
    """The names on a signed note's signature lines (at most 16: a page shows no more)."""
    _body, _, signatures = note.partition("\n\n")
    return [line.split(" ")[1] for line in signatures.splitlines() if line.startswith("— ")][:16]


def _cosigned_summary(check: dict[str, Any], others: list[str]) -> str:
    if not check["witnesses"]:
        count = len(others)
        return f"{count} cosignatures, not checked (no --witness keys given)" if count else "no cosignatures"
    good = check["verified"]
    verified = f"{len(good)} of {len(check['witnesses'])} witnesses verified ({', '.join(good) or 'none'})"
    if not check["quorum"]:
        return f"{verified}; no quorum required"
    if check["quorum_met"]:
        return f"quorum holds: {verified}, {check['quorum']} required"
    return f"LACKS QUORUM: {verified}, {check['quorum']} required"


# ---------------------------------------------------------------------------------------- events → messages
@dataclass
class RunFeed:
    """What the page needs of one run's new events: the config live so far (for old → new texts)."""

    run_id: str
    config: dict[str, Any] | None = None
    next_seq: int = 0  # the leaf the config above is folded up to
    recent: deque[Message] = field(default_factory=lambda: deque(maxlen=RECENT_EVENTS))

    def message(self, seq: int, canonical: str) -> Message:
        """The leaf ``seq`` of the run's stream as the page's message (every leaf is one, in order)."""
        decoded = decode_event(canonical.encode())
        env = getattr(decoded, "envelope", None)
        if env is None:  # stored events decode; kept numbered either way, so the ids stay contiguous
            return Message(seq, sse("other", {"seq": seq, "type": "undecodable"}, seq))
        kind, data = _event_message(env, self.config)
        if env.run_id == self.run_id:
            self.config = config_after(env, self.config)
        self.next_seq = seq + 1
        return Message(seq, sse(kind, {"seq": seq, **data}, seq))


def _event_message(env: Envelope, config: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
    base = {"type": env.type, "step": env.step, "attempt": env.attempt, "time": env.time.isoformat()}
    if env.type == c.STEP_METRICS:
        values = {name: _finite(getattr(env.data, name, None)) for name, _label in CURVES}
        return "step", {**base, "values": {k: v for k, v in values.items() if v is not None}}
    if env.type == c.MOE_ROUTER_STATS:
        rates = {int(s.layer): _finite(s.token_drop_rate) for s in env.data.layers}
        known = [v for v in rates.values() if v is not None]
        mean = sum(known) / len(known) if known else None
        return "router", {**base, "mean_drop": mean, "layers": rates}
    if env.type == c.LEDGER_INCIDENT:
        # Not a marker: a producer whose seq skips on every event makes one per event, and the page
        # would draw each; its reports and state show ingest's incidents folded per source.
        return "other", base
    if env.type in STATE_TYPES and env.step is not None:
        item = history_item(env, config)
        marker = {"kind": item.kind, "step": item.step, "attempt": item.attempt, "time": base["time"]}
        extra = _attempt_change(env)
        return "marker", {**base, "marker": {**marker, "text": item.text, "superseded": False}, **extra}
    return "other", base


def _attempt_change(env: Envelope) -> dict[str, Any]:
    """What a state event changes in the attempts timeline (``runledger.ledger.report.attempts_table``'s
    rows): a launch adds an attempt (a resume from step S supersedes the earlier attempts' steps
    after S), a crash or a finish says how an attempt ended."""
    d = env.data
    if env.type in (c.RUN_STARTED, c.RUN_RESUMED):
        start = int(getattr(d, "from_checkpoint_step", 0) or 0)
        commit = (d.git_commit or "unknown")[:12] + (" (dirty)" if d.git_dirty else "")
        launch = {
            "attempt": env.attempt,
            "kind": "start" if env.type == c.RUN_STARTED else "resume",
            "start_step": start,
            "end_step": start,
            "started_at": env.time.isoformat(),
            "ended_at": env.time.isoformat(),
            "ended": "no end recorded",
            "commit": commit,
            "host": d.host,
            "job": d.job_id,
            "superseded_after": None,
        }
        return {"launch": launch}
    if env.type == c.RUN_CRASHED:
        how = d.kind + (f": {d.exc_type}" if d.exc_type else "") + (f" {d.message}" if d.message else "")
        return {"ended": f"crashed ({how})"}
    if env.type == c.RUN_FINISHED:
        return {"ended": d.status}
    return {}


# ---------------------------------------------------------------------------------------- reading the ledger
def _events_of_files(
    root: Path, files: list[str], stream: str, lo: int, hi: int
) -> list[tuple[int, str]] | None:
    """Leaves ``lo..hi`` of ``stream`` from a commit's own events files (final or, before the
    rename, ``.tmp`` name); None when a file is gone (a compaction merged it): then ask DuckDB."""
    rows: list[tuple[int, str]] = []
    for rel in files:
        if not rel.startswith("events/"):
            continue
        for path in (root / rel, root / (rel + ".tmp"), root / rel):
            try:
                table = pq.read_table(
                    path,
                    columns=["stream_seq", "canonical"],
                    filters=[("stream", "=", stream), ("stream_seq", ">=", lo), ("stream_seq", "<=", hi)],
                )
            except FileNotFoundError:
                continue
            rows.extend(
                zip(
                    table.column("stream_seq").to_pylist(), table.column("canonical").to_pylist(), strict=True
                )
            )
            break
        else:
            return None
    rows.sort()
    return rows if len(rows) == hi - lo + 1 else None


def _events_of_query(reader: Reader, stream: str, lo: int, hi: int) -> list[tuple[int, str]]:
    rows = reader.sql(
        "SELECT stream_seq, canonical FROM events WHERE stream = ? AND stream_seq BETWEEN ? AND ? ORDER BY stream_seq",
        [stream, lo, hi],
    ).rows
    return [(int(seq), text) for seq, text in rows]


_CONFIG_TYPES = (c.RUN_STARTED, c.RUN_RESUMED, c.CONFIG_CHANGED)  # what ``config_after`` reads


def _config_before(reader: Reader, run_id: str, seq: int) -> dict[str, Any] | None:
    """The run's config as its leaves before ``seq`` left it (its launches and config changes only:
    a state event of another type, an incident of a flood among them, leaves the config as it was)."""
    rows = reader.sql(
        "SELECT canonical FROM state_events WHERE run_id = ? AND stream = ? AND stream_seq < ? "
        "AND type IN (?, ?, ?) ORDER BY stream_seq",
        [run_id, run_id, seq, *_CONFIG_TYPES],
    ).rows
    config: dict[str, Any] | None = None
    for (canonical,) in rows:
        env = getattr(decode_event(canonical.encode()), "envelope", None)
        if env is not None:
            config = config_after(env, config)
    return config


def record_of_stream(
    root: Path,
    ledger_id: str,
    stream: str,
    size: int,
    public_key: str | None,
    witnesses: Witnesses | None = None,
) -> dict[str, Any]:
    """The run stream's latest signed checkpoint, read from its one file (no pass over the log): its
    size against the stream's, whether its signature verifies (with a key), who signed it, and
    which of ``witnesses`` cosigned it (checked) and whether their quorum holds."""
    witnesses = witnesses or Witnesses()
    out: dict[str, Any] = {"stream": stream, "size": size, "signed_size": None, "root": None, "signers": []}
    path = checkpoint_path(root, stream)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {**out, "checkpoint": "not signed yet (ledger checkpoint signs the streams)"}
    except (OSError, UnicodeDecodeError) as exc:
        return {**out, "checkpoint": f"FAILS: cannot read {path.name}: {exc}"}
    body, _, _signatures = text.partition("\n\n")
    out["signers"] = _signers(text)
    try:
        if public_key is not None:
            cp = parse_and_verify_checkpoint(text, public_key, origin=f"runledger/{ledger_id}/{stream}")
            checked = "signature verified"
        else:
            cp = parse_checkpoint(body + "\n")
            checked = "signature not checked (no --public-key)"
    except ValueError as exc:
        return {**out, "checkpoint": f"FAILS: {exc}"}
    behind = size - cp.size
    when = "at the head" if behind == 0 else f"{behind:,} events behind the head"
    return {
        **out,
        "signed_size": cp.size,
        "root": cp.root.hex(),
        "checkpoint": f"signed at {cp.size:,} events, {when} ({checked})",
        "cosigned": _cosigned_if_any(witnesses.check(text, _log_names(out["signers"], public_key))),
    }


def _cosigned_if_any(check: dict[str, Any]) -> dict[str, Any] | None:
    """A stream's own checkpoint is signed by the ledger only (witnesses cosign the published log):
    its check is shown when it carries cosignatures, else nothing (no red "lacks quorum" for it)."""
    return check if check["cosignatures"] else None


def _log_names(signers: list[str], log_key: str | None) -> set[str]:
    """The signers that are the log itself: its key's name, or (no key given) the note's first signer."""
    if log_key is not None:
        return {log_key.split("+", 1)[0]}
    return set(signers[:1])


def published_of_ledger(root: Path, witnesses: Witnesses, log_key: str | None) -> dict[str, Any] | None:
    """The newest checkpoint ``ledger publish`` published from this ledger (its trusted state,
    ``_publish/<dest>/state.json``), with its cosignatures checked; None if never published."""
    newest: dict[str, Any] | None = None
    for state in sorted((root / "_publish").glob("*/state.json")):
        try:
            doc = json.loads(state.read_bytes())
        except (OSError, ValueError):
            continue
        text = doc.get("checkpoint") or ""
        if not text or (newest is not None and int(doc.get("size", 0)) <= newest["size"]):
            continue
        signers = _signers(text)
        newest = {
            "dest": str(doc.get("dest", "")),
            "size": int(doc.get("size", 0)),
            "signers": signers,
            "cosigned": witnesses.check(text, _log_names(signers, log_key)),
        }
    return newest


def _state_now(reader: Reader, run_id: str) -> dict[str, Any]:
    s = reader.state(run_id, lineage=False)  # the page follows this run id's own stream
    last = s.last_checkpoint or {}
    return {
        "step": s.step,
        "attempt": s.attempt,
        "git_commit": s.git_commit,
        "git_dirty": s.git_dirty,
        "config_hash": s.config_hash,
        "config": s.config,
        "last_checkpoint": {k: last.get(k) for k in ("step", "attempt", "path", "reason")} if last else None,
        "crashes": len(s.crashes),
        "config_changes": len(s.config_changes),
        "attempts": len(s.attempts),
    }


# ---------------------------------------------------------------------------------------- the watcher
class LedgerWatch:
    """Follows the ledger's commit records from a thread and tells the event loop when they move.

    ``heads``: each stream's size as of the newest commit read. Followed runs (those a page or
    stream asked for) get their new leaves turned into messages here, once for every client."""

    def __init__(
        self,
        root: Path,
        *,
        poll_s: float = POLL_S,
        public_key: str | None = None,
        witnesses: Witnesses | None = None,
    ) -> None:
        self.root = root
        self.poll_s = poll_s
        self.public_key = public_key
        self.witnesses = witnesses or Witnesses()
        self.published_stamp: tuple[tuple[str, int], ...] | None = None  # the publish states' mtimes
        self.published: dict[str, Any] | None = None  # the newest checkpoint published from here
        self.lost: str | None = None
        self.heads: dict[str, int] = {}
        self.commit = -1
        self.ledger_id = "ledger"
        self.feeds: OrderedDict[str, RunFeed] = OrderedDict()
        self.status: dict[str, dict[str, str]] = {}  # run → kind → latest no-id message (state, record)
        self.signed_at: dict[str, int | None] = {}  # run → its checkpoint file's mtime (ns) last read
        self.state_due: set[str] = set()  # runs whose state moved since it was last sent
        self.state_at: dict[str, float] = {}  # run → when its state was last made (monotonic)
        self.lock = threading.RLock()  # feeds, heads, the reader
        self.reader: Reader | None = None
        self.generation = 0  # bumped on every change: clients wait for it to move
        self.opened = 0  # times the ledger was (re)opened
        self.lake: LakeFolder | None = None  # the ledger's lake (None: part files)
        self.lake_stamp: tuple[Any, ...] | None = None  # what hinted at the lake's last move
        self.lake_asked = 0.0  # when the lake's catalog was last asked for its newest snapshot (monotonic)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -------------------------------------------------------------- lifecycle
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop, self._changed = loop, asyncio.Event()
        self._open()
        self._thread = threading.Thread(target=self._run, name="ledger-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _open(self) -> None:
        try:
            lake = LakeFolder.read(self.root)
            reader = Reader(self.root)
        except Exception as exc:  # LedgerError, OSError, a DuckDB error on a half-removed folder
            self._set_lost(f"the ledger at {self.root} cannot be opened: {exc}")
            return
        try:
            head = reader.head
        except QueryError as exc:
            reader.close()
            self._set_lost(f"the ledger at {self.root} cannot be opened: {exc}")
            return
        with self.lock:
            self.reader, self.lake = reader, lake
            self.ledger_id = head.ledger_id
            self.commit = head.commit
            self.heads = {s: h.size for s, h in head.streams.items()}
            self.lost = None
            self.opened += 1  # pages built over an earlier opening are not served again

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except Exception:  # a bad record must not stop the watch: logged, tried again next poll
                log.exception("live page: reading the ledger's commits failed")

    # -------------------------------------------------------------- polling
    def poll(self) -> bool:
        """Read every commit record that appeared since the last poll; True when anything moved."""
        problem = self._problem()
        if problem is not None:
            return self._set_lost(problem)
        if self.lost is not None or self.reader is None:
            self._open()
            if self.lost is None:
                self._notify()
            return self.lost is None
        moved = self._poll_lake() if self.lake is not None else self._poll_records()
        moved = self._signed_since() or moved
        moved = self._states_due() or moved
        if moved:
            self._notify()
        return moved

    def _poll_records(self) -> bool:
        """Part files: take every commit record written since the last poll, in order."""
        moved = False
        while True:
            path = commit_record_path(self.root, self.commit + 1)
            try:
                record = json.loads(path.read_bytes())
            except FileNotFoundError:
                break
            except (OSError, ValueError) as exc:
                return self._set_lost(f"commit record {path.name} cannot be read: {exc}")
            self._take(record)
            moved = True
        return moved

    def _poll_lake(self) -> bool:
        """A lake: when its catalog has a snapshot past the reader's, a reader pinned there replaces
        it and the followed runs' new leaves are read through it (commit records in this folder are
        only this host's: another host's commits are in the catalog alone)."""
        assert self.lake is not None and self.reader is not None
        if not self._lake_may_have_moved(self.lake):
            return False
        try:
            probe, newest = open_snapshot(self.lake.catalog, self.lake.data_path)
            probe.close()
            if newest == self.reader.snapshot:
                return False
            reader = Reader(self.root, snapshot=newest)
        except (LakeError, QueryError) as exc:
            return self._set_lost(self._unreadable(exc))
        try:
            head = reader.head
        except QueryError as exc:
            reader.close()
            return self._set_lost(self._unreadable(exc))
        return self._take_reader(reader, head)

    def _unreadable(self, exc: Exception) -> str:
        """Why the lake could not be read: its folder gone or unreadable when that is why (a catalog
        that cannot be opened because the folder moved away is the ledger gone, said as that)."""
        return self._problem() or f"the ledger at {self.root} cannot be read: {exc}"

    def _lake_may_have_moved(self, lake: LakeFolder) -> bool:
        """Whether to ask the catalog (a connection and an attach): when this folder's next commit
        record appeared (a writer here), a SQLite catalog's files changed, or ``LAKE_POLL_S`` passed
        (another host's commit, which leaves no sign here)."""
        stamp: list[Any] = [commit_record_path(self.root, self.commit + 1).exists()]
        file = Catalog.parse(lake.catalog).file
        if file is not None:
            for name in (str(file), f"{file}-wal"):
                with contextlib.suppress(OSError):
                    info = os.stat(name)
                    stamp.append((info.st_mtime_ns, info.st_size))
        now = time.monotonic()
        if tuple(stamp) == self.lake_stamp and now - self.lake_asked < LAKE_POLL_S:
            return False
        self.lake_stamp, self.lake_asked = tuple(stamp), now
        return True

    def _take_reader(self, reader: Reader, head: RecordHead) -> bool:
        """Answer from ``reader`` (a newer snapshot, whose record is ``head``) from now on; True
        when it holds a new commit."""
        with self.lock:
            old, self.reader = self.reader, reader
            if old is not None:
                old.close()
            if head.commit == self.commit:  # (a snapshot of the lake's maintenance: nothing new)
                return False
            before = self.heads
            self.heads = {s: h.size for s, h in head.streams.items()}
            self.commit = head.commit
            moved = [s for s, size in self.heads.items() if before.get(s) != size]
            for stream in moved:
                feed = self.feeds.get(stream)
                if feed is not None:
                    self._catch_feed_up(feed, reader, self.heads[stream] - 1)
                    self._refresh_status(stream, state=False)
                    self.state_due.add(stream)
            return True

    def _catch_feed_up(self, feed: RunFeed, reader: Reader, hi: int) -> None:
        """The feed's messages up to leaf ``hi``: at most its last ``RECENT_EVENTS`` (a client
        further behind is answered by a query); a stream that shrank (a ledger rebuilt) restarts."""
        lo = max(feed.next_seq, hi + 1 - RECENT_EVENTS)
        if lo != feed.next_seq or hi + 1 < feed.next_seq:
            lo = min(lo, hi + 1)
            feed.recent.clear()
            feed.config = _config_before(reader, feed.run_id, lo)
            feed.next_seq = lo
        if lo <= hi:
            for seq, canonical in _events_of_query(reader, feed.run_id, lo, hi):
                if seq == feed.next_seq:
                    feed.recent.append(feed.message(seq, canonical))

    def _states_due(self) -> bool:
        """Refresh the state (a fold: tens of ms on a long run) of the runs that moved, at most
        every ``STATE_EVERY_S`` per run, so a run committing ten times a second costs one a second."""
        now = time.monotonic()
        refreshed = False
        with self.lock:
            for run_id in list(self.state_due):
                if now - self.state_at.get(run_id, 0.0) < STATE_EVERY_S:
                    continue
                self.state_due.discard(run_id)
                self.state_at[run_id] = now
                if run_id in self.feeds:
                    self._refresh_status(run_id, state=True)
                    refreshed = True
        return refreshed

    def _signed_since(self) -> bool:
        """Whether a followed run's signed checkpoint file changed (``ledger checkpoint`` signs
        without a commit), or a publish of this ledger did (``ledger publish`` commits nothing
        either): one stat per followed run and per publish state."""
        changed = self._published_since()
        with self.lock:
            if changed:
                for run_id in self.feeds:
                    self._refresh_status(run_id, state=False)
            for run_id in list(self.feeds):
                try:
                    stamp = os.stat(checkpoint_path(self.root, run_id)).st_mtime_ns
                except OSError:
                    stamp = None
                if self.signed_at.get(run_id) != stamp:
                    self.signed_at[run_id] = stamp
                    self._refresh_status(run_id, state=False)
                    changed = True
        return changed

    def _published_since(self) -> bool:
        """Re-read the newest published checkpoint when a publish state file changed."""
        stamp: list[tuple[str, int]] = []
        for state in sorted((self.root / "_publish").glob("*/state.json")):
            with contextlib.suppress(OSError):
                stamp.append((state.parent.name, os.stat(state).st_mtime_ns))
        if tuple(stamp) == self.published_stamp:
            return False
        self.published_stamp = tuple(stamp)
        self.published = published_of_ledger(self.root, self.witnesses, None) if stamp else None
        return True

    def _problem(self) -> str | None:
        lake = self.lake is not None or (self.root / LAKE_MARKER).exists()
        marker = self.root / (LAKE_MARKER if lake else "LEDGER.json")
        try:
            os.stat(marker)
            if not lake:  # (a lake's records are in its catalog)
                os.stat(self.root / COMMITS)
            with open(marker, "rb") as handle:  # readable, not just present (permissions)
                handle.read(1)
        except FileNotFoundError:
            return f"the ledger at {self.root} is gone (no {marker.name})"
        except OSError as exc:
            return f"the ledger at {self.root} cannot be read: {exc.strerror or exc}"
        return None

    def _set_lost(self, why: str) -> bool:
        with self.lock:
            if self.lost == why:
                return False
            self.lost, self.reader = why, None
            self.feeds.clear()  # a ledger back from elsewhere is followed afresh
        log.warning("live page: %s", why)
        self._notify()
        return True

    def _take(self, record: dict[str, Any]) -> None:
        with self.lock:
            appended = record.get("appended") or {}
            for stream, added in appended.items():
                feed = self.feeds.get(stream)
                count = len(added.get("ids", []))
                if feed is None or not count:
                    continue
                if feed.next_seq != added["first"] and self.reader is not None:  # a ledger rebuilt under us
                    feed.recent.clear()
                    feed.config = _config_before(self.reader, stream, added["first"])
                    feed.next_seq = added["first"]
                self._extend(feed, record.get("files", []), added["first"], added["first"] + count - 1)
            self.heads = {s: int(h["size"]) for s, h in record.get("streams", {}).items()}
            self.commit = int(record["commit"])
            for stream in appended:
                if stream in self.feeds:
                    self._refresh_status(stream, state=False)
                    self.state_due.add(stream)

    def _extend(self, feed: RunFeed, files: list[str], lo: int, hi: int) -> None:
        rows = _events_of_files(self.root, files, feed.run_id, lo, hi)
        if rows is None and self.reader is not None:
            rows = _events_of_query(self.reader, feed.run_id, lo, hi)
        for seq, canonical in rows or []:
            if seq == feed.next_seq:
                feed.recent.append(feed.message(seq, canonical))

    def _refresh_status(self, run_id: str, *, state: bool) -> None:
        record = self.record(run_id, self.heads.get(run_id, 0))
        kinds = self.status.setdefault(run_id, {})
        kinds["record"] = sse("record", {"commit": self.commit, **record})
        if state and self.reader is not None:
            try:
                kinds["state"] = sse("state", {"commit": self.commit, **_state_now(self.reader, run_id)})
            except QueryError as exc:
                log.warning("live page: state of %s: %s", run_id, exc)

    def _notify(self) -> None:
        self.generation += 1
        if self._loop is not None and self._changed is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: the server is stopping
                self._loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        assert self._changed is not None
        self._changed.set()
        self._changed = asyncio.Event()

    async def changed(self, timeout_s: float) -> None:
        waiter = self._changed
        if waiter is None:
            await asyncio.sleep(timeout_s)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(waiter.wait(), timeout_s)

    # -------------------------------------------------------------- what clients ask
    def as_of(self) -> str:
        """What the pages answer from, in words."""
        return f"ledger commit {self.commit}"

    def record(self, run_id: str, size: int) -> dict[str, Any]:
        """The record panel: the run stream's latest signed checkpoint in this ledger, and the
        newest checkpoint published from it (``ledger publish``) with its cosignatures checked."""
        if self.published_stamp is None:
            self._published_since()
        out = record_of_stream(self.root, self.ledger_id, run_id, size, self.public_key, self.witnesses)
        return {**out, "published": self.published}

    def page_reader(self, commit: int) -> Reader:
        """A reader of its own for one page build, holding at least commit ``commit``."""
        _wait_for_files(self.root, commit)
        try:
            return Reader(self.root)
        except Exception as exc:
            raise LedgerLost(f"the ledger at {self.root} cannot be opened: {exc}") from None

    def follow(self, run_id: str) -> RunFeed:
        """The run's feed (created at the stream's head: the messages from now on are kept)."""
        with self.lock:
            feed = self.feeds.get(run_id)
            if feed is None:
                if self.reader is None:
                    raise LedgerLost(self.lost or "the ledger is not open")
                head = self.heads.get(run_id, 0)
                feed = RunFeed(run_id, _config_before(self.reader, run_id, head), head)
                self.feeds[run_id] = feed
                while len(self.feeds) > FOLLOWED_RUNS:
                    dropped, _ = self.feeds.popitem(last=False)
                    self.status.pop(dropped, None)
                    self.signed_at.pop(dropped, None)
                    self.state_at.pop(dropped, None)
                    self.state_due.discard(dropped)
                self._refresh_status(run_id, state=False)
                with contextlib.suppress(OSError):
                    self.signed_at[run_id] = os.stat(checkpoint_path(self.root, run_id)).st_mtime_ns
                self.signed_at.setdefault(run_id, None)
            self.feeds.move_to_end(run_id)
            return feed

    def messages(self, run_id: str, after: int) -> list[Message]:
        """The run's messages for leaves after ``after`` that the watch has seen, in order, from
        the feed's memory or (a client far behind, or after a restart) the ledger; at most a chunk."""
        with self.lock:
            feed = self.follow(run_id)
            head = self.heads.get(run_id, 0)
            if after + 1 >= head:
                return []
            recent = feed.recent
            if recent and recent[0].seq <= after + 1:
                return [m for m in recent if m.seq > after][:CATCH_UP_CHUNK]
            if self.reader is None:
                raise LedgerLost(self.lost or "the ledger is not open")
            hi = min(head - 1, after + CATCH_UP_CHUNK)
            past = RunFeed(run_id, _config_before(self.reader, run_id, after + 1), after + 1)
            rows = _events_of_query(self.reader, run_id, after + 1, hi)
            return [past.message(seq, canonical) for seq, canonical in rows]


# ---------------------------------------------------------------------------------------- a published copy
class PublishedWatch(LedgerWatch):
    """The watch over a published copy (``ledger publish``) at ``url``: the same interface the pages
    and streams use, answered from a verified local copy instead of a ledger folder.

    Each poll is one look of the monitor (``runledger.ledger.remote.verify_remote``: the checkpoint's signature,
    its consistency with the last one seen, the new entries and data files; nothing new costs one
    GET of ``/checkpoint``). Only a grown checkpoint that verifies refreshes the copy
    (``runledger.ledger.remote.fetch_copy``: the signed manifest's files, each against its SHA-256) and turns
    the new leaves of the followed runs into messages. A checkpoint that does not verify (a bad
    signature, a fork, a rollback, data that does not match) is shown as ``not verified: <reason>``
    and ends the updates for good: nothing later from that copy is shown as current. An unreachable
    copy is only "lost": it is tried again on the next poll.

    With ``witnesses`` and a quorum, a checkpoint is taken only with that many valid cosignatures
    (the monitor's rule): one short of it is not shown as current (the pages keep the last one that
    had its quorum, and say the newer one lacks it; with none yet, they say that and show nothing)
    and is looked at again on the next poll, since a witness may cosign late."""

    def __init__(
        self,
        url: str,
        log_key: str,
        cache: Path,
        *,
        poll_s: float = PUBLISHED_POLL_S,
        witnesses: Witnesses | None = None,
        deadline_s: float = DEFAULT_DEADLINE_S,
    ) -> None:
        super().__init__(cache, poll_s=poll_s, witnesses=witnesses)
        self.url, self.log_key, self.cache = url, log_key, cache
        self.deadline_s = deadline_s  # one look, and one download of the copy, each at most this long
        self.verified_state = default_state_path(url, under=cache)  # the monitor's last accepted checkpoint
        self.refused: str | None = None  # set once: a copy that failed verification is never followed again
        self.published: dict[str, Any] = {}  # the checkpoint the pages answer from
        self.copy_failing_since: float | None = None  # when the download began to fail (monotonic)
        self.short_of_quorum: str | None = None  # the newest checkpoint lacks the witnesses' quorum: why

    def _open(self) -> None:
        self._look()

    def poll(self) -> bool:
        if self.refused is not None:
            return False
        was_lost = self.lost is not None or self.reader is None
        moved = self._look()
        if moved or (was_lost and self.lost is None):
            self._notify()
        return moved

    def _look(self) -> bool:
        """One look at the copy; True when a new verified checkpoint was taken."""
        try:
            report = verify_remote(
                self.url,
                self.log_key,
                self.verified_state,
                witnesses=self.witnesses.vkeys,
                quorum=self.witnesses.quorum,
                deadline_s=self.deadline_s,
            )
        except MonitorError as exc:
            if exc.kind == "unreachable":
                return self._set_lost(f"the published copy at {self.url} is unreachable: {exc}")
            if exc.kind == "quorum":
                return self._lacks_quorum(str(exc))
            return self._refuse(str(exc))
        if self.short_of_quorum is not None:
            self.short_of_quorum = None
            self._refresh_all()
        if self.reader is not None and report.size == self.commit:
            return False
        try:
            copy = fetch_copy(self.url, self.log_key, self.cache, deadline_s=self.deadline_s)
        except RemoteError as exc:
            return self._copy_failed(exc)
        self.copy_failing_since = None
        checked = json.loads(self.verified_state.read_bytes())
        if (copy.checkpoint.size, base64.b64encode(copy.checkpoint.root).decode()) != (
            checked["size"],
            checked["root"],
        ):
            return False  # published again between the two reads: that one is verified on the next poll
        self._take_copy(copy.folder, checked)
        return True

    def _copy_failed(self, exc: RemoteError) -> bool:
        """The download after a verified look failed. A publish uploads the checkpoint last, so a
        look in the middle of one sees the old checkpoint beside the new manifest: tried again
        for ``COPY_GRACE_S`` (the verified copy before stays current), only then announced."""
        now = time.monotonic()
        if self.copy_failing_since is None:
            self.copy_failing_since = now
        if now - self.copy_failing_since < COPY_GRACE_S:
            log.info("live page: the copy at %s, tried again next poll: %s", self.url, exc)
            return False
        if str(exc).startswith("unreachable"):
            return self._set_lost(f"the published copy at {self.url} is {exc}")
        return self._refuse(str(exc))

    def _lacks_quorum(self, why: str) -> bool:
        """The copy's newest checkpoint has too few valid cosignatures: not shown as current."""
        said = f"the newest published checkpoint lacks the witnesses' quorum: {why}"
        if self.reader is None:  # nothing ever had its quorum: nothing to show
            return self._set_lost(f"{said}; nothing is shown until one has it")
        if said == self.short_of_quorum:
            return False
        self.short_of_quorum = said
        self._refresh_all()
        return True

    def _refresh_all(self) -> None:
        with self.lock:
            for run_id in self.feeds:
                self._refresh_status(run_id, state=False)

    def _refuse(self, why: str) -> bool:
        self.refused = f"not verified: {why}"
        return self._set_lost(self.refused)

    def _take_copy(self, folder: Path, checked: dict[str, Any]) -> None:
        reader = Reader(folder)
        rows = reader.sql("SELECT stream, max(stream_seq) + 1 FROM events GROUP BY stream").rows
        with self.lock:
            if self.reader is None:
                self.opened += 1  # pages built before a loss are not served again
            self.root, self.reader, self.lost = folder, reader, None
            self.heads = {str(stream): int(size) for stream, size in rows}
            self.commit, self.ledger_id = int(checked["size"]), str(checked["origin"])
            self.published = _published_checkpoint(str(checked["checkpoint"]), self.log_key, self.witnesses)
            for run_id, feed in self.feeds.items():
                hi = self.heads.get(run_id, 0) - 1
                if feed.next_seq <= hi:
                    for seq, canonical in _events_of_query(reader, run_id, feed.next_seq, hi):
                        if seq == feed.next_seq:
                            feed.recent.append(feed.message(seq, canonical))
                self._refresh_status(run_id, state=True)

    def as_of(self) -> str:
        cp = self.published
        return (
            f"the verified published checkpoint {cp.get('origin')} at {self.commit} log entries ({self.url})"
        )

    def record(self, run_id: str, size: int) -> dict[str, Any]:
        """The record panel: the published checkpoint these pages answer from, and its cosignatures."""
        cp = self.published
        if not cp:
            return {"stream": run_id, "size": size, "signers": [], "checkpoint": "no verified checkpoint yet"}
        return {
            "stream": run_id,
            "size": size,
            "url": self.url,
            "signed_size": cp["size"],
            "root": cp["root"],
            "signers": cp["signers"],
            "cosignatures": cp["cosignatures"],
            "cosigned": cp["cosigned"],
            "newer": self.short_of_quorum,
            "checkpoint": f"signed published checkpoint {cp['origin']} at {cp['size']:,} log entries "
            "(signature verified, consistent with every earlier one seen)",
        }

    def page_reader(self, commit: int) -> Reader:
        with self.lock:
            if self.reader is None:
                raise LedgerLost(self.lost or "the published copy is not verified yet")
            return Reader(self.root)


def _published_checkpoint(text: str, log_key: str, witnesses: Witnesses) -> dict[str, Any]:
    """Origin, size, root (hex) and signers of a verified checkpoint note, and its cosignatures
    (signature lines by any name but the log key's own) checked against ``witnesses``."""
    body, _, _signatures = text.partition("\n\n")
    cp = parse_checkpoint(body + "\n")
    signers = _signers(text)
    cosigned = witnesses.check(text, _log_names(signers, log_key))
    return {
        "origin": cp.origin,
        "size": cp.size,
        "root": cp.root.hex(),
        "signers": signers,
        "cosignatures": cosigned["cosignatures"],
        "cosigned": cosigned,
    }


# ---------------------------------------------------------------------------------------- pages
class PageCache:
    """Rendered pages by run. A page a little old is still exact: its stream starts at the leaf
    after the last one it holds and catches it up (curves, markers, heatmap, attempts and state
    all follow the stream). So a kept page is always answered at once, and one older than
    ``max_age_s`` is rebuilt in the background (stale while revalidating): only a run asked for
    the very first time (or warmed at start and not built yet) waits for a build, which costs
    what ``ledger report``'s does (seconds on the full reference run). One build per run at a time."""

    def __init__(self, size: int = PAGE_CACHE, max_age_s: float = PAGE_MAX_AGE_S) -> None:
        self.size, self.max_age_s = size, max_age_s
        self.pages: OrderedDict[tuple[str, int], tuple[float, str]] = OrderedDict()
        self.lock = threading.Lock()
        self.building: dict[tuple[str, int], threading.Lock] = {}
        self.rebuilding: set[tuple[str, int]] = set()
        self.builds = 0  # pages built (a test and the bench read it)
        self.build_s: list[float] = []  # how long each build took (the newest 32)

    def get(self, key: tuple[str, int], build: Callable[[], str]) -> str:
        with self.lock:
            hit = self.pages.get(key)
            if hit is not None:
                self.pages.move_to_end(key)
                if time.monotonic() - hit[0] >= self.max_age_s:
                    self._rebuild_later(key, build)
                return hit[1]
        return self._build(key, build, wait=True) or ""

    def warm(self, key: tuple[str, int], build: Callable[[], str]) -> None:
        """Build ``key``'s page now unless one is kept (the server's start, from its own thread:
        a visitor meanwhile waits for this build rather than starting another)."""
        with self.lock:
            if key in self.pages:
                return
        self._rebuild(key, build)

    def _rebuild_later(self, key: tuple[str, int], build: Callable[[], str]) -> None:
        if key in self.rebuilding:  # (called under self.lock)
            return
        self.rebuilding.add(key)
        threading.Thread(target=self._rebuild, args=(key, build), name="page-build", daemon=True).start()

    def _rebuild(self, key: tuple[str, int], build: Callable[[], str]) -> None:
        try:
            self._build(key, build, wait=False)
        except Exception as exc:  # a lost ledger, a run gone: the kept page ages out, the next GET says why
            log.info("live page: rebuilding the page of %s: %s", key[0], exc)
        finally:
            with self.lock:
                self.rebuilding.discard(key)

    def _build(self, key: tuple[str, int], build: Callable[[], str], *, wait: bool) -> str | None:
        with self.lock:
            one_build = self.building.setdefault(key, threading.Lock())
        with one_build:
            with self.lock:
                hit = self.pages.get(key)
                if hit is not None and (wait or time.monotonic() - hit[0] < self.max_age_s):
                    return hit[1]  # built by the one this waited for
            started = time.monotonic()
            page = build()
            with self.lock:
                self.builds += 1
                self.build_s = [*self.build_s[-31:], time.monotonic() - started]
                self.pages[key] = (started, page)
                self.pages.move_to_end(key)
                while len(self.pages) > self.size:
                    dropped, _ = self.pages.popitem(last=False)
                    self.building.pop(dropped, None)
            return page

    def clear(self) -> None:
        with self.lock:
            self.pages.clear()


def _report_style() -> str:
    """The report's stylesheet (report.html's <style>): one look for the report and these pages."""
    style = re.search(r"<style>(.*?)</style>", asset("report.html"), re.S)
    return style.group(1) if style else ""


def _template() -> str:
    return asset("live.html").replace("{{STYLE}}", _report_style())


def render_run_page(watch: LedgerWatch, run_id: str) -> str:
    """The run's page: the report's data for the run, and where its live stream starts (the leaf
    after the last one the watch had read when the page was built).

    The page's own reader answers after the watch's newest commit has its files in place, so the
    page holds every leaf up to ``after``; it may hold a few more (a commit landing meanwhile): the
    page's script skips points it already draws."""
    with watch.lock:
        if watch.reader is None:
            raise LedgerLost(watch.lost or "the ledger is not open")
        if run_id not in watch.heads:
            raise QueryError(f"unknown run {run_id!r} (see / for the runs of this ledger)")
        after = watch.follow(run_id).next_seq - 1
        commit, size = watch.commit, watch.heads.get(run_id, 0)
    reader = watch.page_reader(commit)
    try:  # (the page's own reader: its connection and spill folder go when the page is built)
        reader.require_run(run_id)
        report = build_report(reader, [run_id])
        state = _state_now(reader, run_id)
    finally:
        reader.close()
    report["title"] = f"runledger · {lineage_title(run_id, report['runs'][0]['lineage'])}"
    live = {
        "run_id": run_id,
        "after": after,
        "commit": commit,
        "events_url": f"/runs/{run_id}/events",
        "state": state,
        "record": watch.record(run_id, size),
        "curves": [{"name": name, "label": label} for name, label in CURVES],
    }
    parts = {"TITLE": html.escape(report["title"]), "DATA": script_json(report), "LIVE": script_json(live)}
    return re.sub(r"\{\{(TITLE|DATA|LIVE)\}\}", lambda m: parts[m.group(1)], _template())


def _wait_for_files(root: Path, commit: int, wait_s: float = 5.0) -> None:
    """Until commit ``commit``'s files have their final names (the writer renames them just after
    its commit point; a compaction may have merged them away since, which is in place too)."""
    if commit < 0:
        return
    try:
        files = read_commit_record(root, commit).get("files", [])
    except (OSError, ValueError):
        return
    deadline = time.monotonic() + wait_s
    while any((root / (rel + ".tmp")).exists() for rel in files) and time.monotonic() < deadline:
        time.sleep(0.01)


# The index's search: these URL parameters only, each parsed and typed by runledger.ledger.run_search
# (values reach SQL as parameters, never as text); at most INDEX_ROWS runs are listed.
INDEX_PARAMS = frozenset({"q", "tag", "status", "config", "since", "until", "sort", "desc"})
INDEX_ROWS = 500
# The index submits its search form to itself (a GET: it reads only); every other page submits nothing.
INDEX_CSP = CSP.replace("form-action 'none'", "form-action 'self'")


def index_filter(params: Mapping[str, str] | Any) -> RunFilter:
    """The index's search (``/?q=beta&status=running&config=moe.capacity_factor=1.25``) as a
    ``RunFilter``; ``RunFilterError`` (one line) for an unknown parameter or a bad value. ``params``:
    Starlette's query parameters (``getlist`` for the repeatable ``tag`` and ``config``)."""
    unknown = sorted(set(params.keys()) - INDEX_PARAMS)
    if unknown:
        raise RunFilterError(
            f"unknown search parameter {unknown[0]!r}; known: {', '.join(sorted(INDEX_PARAMS))}"
        )
    one = {key: (params.get(key) or "").strip() for key in INDEX_PARAMS}
    filt = RunFilter(
        pattern=one["q"] or None,
        tags=tuple(tag for tag in params.getlist("tag") if tag) if hasattr(params, "getlist") else (),
        status=parse_status(one["status"]) if one["status"] else None,
        config=tuple(parse_config_test(text) for text in _configs(params)),
        since=parse_time(one["since"]) if one["since"] else None,
        until=parse_time(one["until"]) if one["until"] else None,
        sort=one["sort"] or None,
        descending=one["desc"] in ("1", "true", "on"),
        limit=INDEX_ROWS,
    )
    check(filt)
    return filt


def _configs(params: Mapping[str, str] | Any) -> list[str]:
    """The ``config`` tests: each parameter, and each line or ``;``-separated part of one."""
    texts = params.getlist("config") if hasattr(params, "getlist") else [params.get("config") or ""]
    return [part.strip() for text in texts for part in re.split(r"[;\n]", text) if part.strip()]


def render_index(watch: LedgerWatch, filt: RunFilter | None = None) -> str:
    """The run index: the runs ``filt`` selects (default every run, newest first), with a search form."""
    filt = filt or RunFilter(descending=True, limit=INDEX_ROWS)
    with watch.lock:
        if watch.reader is None:
            raise LedgerLost(watch.lost or "the ledger is not open")
        runs = search_runs(watch.reader, filt).records()
        as_of = watch.as_of()
    rows = "".join(_index_row(r) for r in runs)
    shown = f"{len(runs)} runs" + (
        f" (the first {INDEX_ROWS}: narrow the search)" if len(runs) == INDEX_ROWS else ""
    )
    return _INDEX.format(
        style=_report_style(),
        as_of=html.escape(as_of),
        count=shown,
        search=_search_form(filt),
        rows=rows or "<tr><td colspan='9'>no runs match</td></tr>",
    )


def _index_row(r: Mapping[str, Any]) -> str:
    cells = [
        html.escape(str(r["name"] or "")),
        html.escape(str(r["status"])),
        html.escape(str(r["started_at"] or "")),
        html.escape(str(r["attempts"])),
        html.escape(str(r["last_step"] if r["last_step"] is not None else "")),
        html.escape(str(r["crashes"])),
        html.escape(str(r["tags"] or "")),
    ]
    link = html.escape(str(r["run_id"]), quote=True)
    commit = html.escape(str(r["git_commit"] or "")[:12])
    return (
        f"<tr><td><a href='/runs/{link}'>{html.escape(str(r['run_id']))}</a></td>"
        + "".join(f"<td>{cell}</td>" for cell in cells)
        + f"<td class='mono'>{commit}</td></tr>"
    )


def _search_form(filt: RunFilter) -> str:
    """The search form, holding the current search (every value escaped as an attribute)."""

    def box(name: str, value: str, hint: str) -> str:
        value_attr = html.escape(value, quote=True)
        return f"<label>{name} <input name='{name}' value='{value_attr}' placeholder='{hint}'></label> "

    configs = "; ".join(
        ".".join(t.path) + t.op + (t.value if isinstance(t.value, str) else json.dumps(t.value))
        for t in filt.config
    )
    options = "".join(
        f"<option{' selected' if filt.status == s else ''}>{s}</option>"
        for s in ("", "running", "finished", "crashed")
    )
    return (
        "<form method='get' action='/' id='search'>"
        + box("q", filt.pattern or "", "run id or name (glob)")
        + box("tag", filt.tags[0] if filt.tags else "", "tag")
        + f"<label>status <select name='status'>{options}</select></label> "
        + box("config", configs, "moe.capacity_factor=1.25")
        + box("since", filt.since.date().isoformat() if filt.since else "", "2026-06-01 or 30d")
        + box("until", filt.until.date().isoformat() if filt.until else "", "")
        + "<button type='submit'>search</button></form>"
    )


_INDEX = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,"><title>runledger · runs</title><style>{style}</style></head>
<body><header><h1>runledger · runs</h1><p>{count} · as of {as_of} · reload for newer runs;
each run's page is live</p>{search}</header>
<main><table id="runs"><thead><tr><th>run</th><th>name</th><th>status</th><th>started</th><th>attempts</th>
<th>last step</th><th>crashes</th><th>tags</th><th>commit</th></tr></thead><tbody>{rows}</tbody></table></main></body></html>
"""


# ---------------------------------------------------------------------------------------- the app
class LivePage:
    """The Starlette app's handlers over one watch; ``app`` is what uvicorn serves."""

    def __init__(
        self,
        root: Path,
        *,
        max_clients: int = MAX_CLIENTS,
        poll_s: float = POLL_S,
        public_key_path: Path | None = None,
        page_max_age_s: float = PAGE_MAX_AGE_S,
        watch: LedgerWatch | None = None,
        witnesses: Witnesses | None = None,
        warm: bool = True,
    ) -> None:
        key = public_key_path.read_text().strip() if public_key_path is not None else None
        self.watch = watch or LedgerWatch(root, poll_s=poll_s, public_key=key, witnesses=witnesses)
        self.max_clients = max_clients
        self.clients = 0
        self.pages = PageCache(max_age_s=page_max_age_s)
        self.warm = warm
        self.app = Starlette(
            routes=[
                Route("/", self.index),
                Route("/runs/{run_id}", self.run_page),
                Route("/runs/{run_id}/events", self.events),
                Route("/assets/{name}", self.asset),
                Route("/healthz", self.health),
            ],
            lifespan=self._lifespan,
        )

    @contextlib.asynccontextmanager
    async def _lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        self.watch.start(asyncio.get_running_loop())
        if self.warm:
            threading.Thread(target=self._warm, name="page-warm", daemon=True).start()
        try:
            yield
        finally:
            self.watch.stop()

    async def index(self, request: Request) -> Response:
        """The run index; its search parameters are parsed and typed first (400 and one line if not)."""
        try:
            filt = index_filter(request.query_params) if request.query_params else None
        except RunFilterError as exc:
            return _text(str(exc), 400)
        response = await self._page(lambda: render_index(self.watch, filt))
        if response.status_code == 200:
            response.headers["Content-Security-Policy"] = INDEX_CSP
        return response

    async def run_page(self, request: Request) -> Response:
        run_id = request.path_params["run_id"]
        if not RUN_ID.fullmatch(run_id):
            return _text(f"no run {run_id!r}: a run id is 1-128 of A-Z a-z 0-9 . _ - (see /)", 404)
        return await self._page(lambda: self.pages.get(*self._page_of(run_id)))

    def _page_of(self, run_id: str) -> tuple[tuple[str, int], Callable[[], str]]:
        """The run's key in the page cache (pages of an earlier opening of the ledger are never
        served again) and how its page is built."""
        return (run_id, self.watch.opened), lambda: render_run_page(self.watch, run_id)

    def _warm(self) -> None:
        """Build the pages of the newest runs (as many as are kept) in the background at start,
        so the first visitor of a long run does not wait for its build."""
        with self.watch.lock:
            reader = self.watch.reader
            if reader is None:
                return
            try:
                runs = [r[0] for r in reader.sql("SELECT run_id FROM runs ORDER BY started_at DESC").rows]
            except QueryError as exc:
                log.info("live page: no runs to warm: %s", exc)
                return
        for run_id in runs[: self.pages.size]:
            if RUN_ID.fullmatch(str(run_id)):
                self.pages.warm(*self._page_of(str(run_id)))

    async def _page(self, build: Callable[[], str]) -> Response:
        if self.watch.lost is not None:  # a cached page would show the past as current
            return _text(f"ledger unavailable: {self.watch.lost}; nothing served here would be current", 503)
        try:
            body = await run_in_threadpool(build)
        except LedgerLost as exc:
            return _text(f"ledger unavailable: {exc}; nothing served here would be current", 503)
        except QueryError as exc:
            return _text(str(exc), 404)
        return HTMLResponse(body, headers=_headers())

    async def asset(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name not in ASSETS:
            return _text("not found", 404)
        media = "text/javascript; charset=utf-8"
        return Response(asset(name), media_type=media, headers={"Cache-Control": "max-age=300", **_headers()})

    async def health(self, request: Request) -> Response:
        lost = self.watch.lost
        body = {
            "ok": lost is None,
            "commit": self.watch.commit,
            "clients": self.clients,
            "lost": lost,
            "pages_built": self.pages.builds,
            "page_build_s": self.pages.build_s[-1:],
        }
        return JSONResponse(body, status_code=200 if lost is None else 503)

    async def events(self, request: Request) -> Response:
        run_id = request.path_params["run_id"]
        start = _start_after(request)
        if isinstance(start, str):
            return _text(start, 400)
        if not RUN_ID.fullmatch(run_id):
            return _text(f"no run {run_id!r}", 404)
        if self.clients >= self.max_clients:
            return _text(f"too many live connections (at most {self.max_clients}); try again shortly", 503)
        if run_id not in self.watch.heads:
            if self.watch.lost is not None:  # never opened (a published copy that did not verify)
                return _text(f"ledger unavailable: {self.watch.lost}", 503)
            return _text(f"unknown run {run_id!r} (see / for the runs of this ledger)", 404)
        self.clients += 1  # counted from here (before any await): the response gives it back however it ends
        try:  # off the event loop: a run followed anew folds its config (one small query)
            await run_in_threadpool(self.watch.follow, run_id)
        except (LedgerLost, QueryError) as exc:
            self.clients -= 1
            return _text(f"ledger unavailable: {exc}", 503)
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **_headers()}
        return _CountedStream(
            self._stream(run_id, start), self._closed, media_type="text/event-stream", headers=headers
        )

    def _closed(self) -> None:
        self.clients -= 1

    async def _stream(self, run_id: str, after: int) -> AsyncIterator[str]:
        """Every leaf after ``after`` in order, then each new one as the watch sees it; status
        messages (no id) whenever they change."""
        sent_status: dict[str, str] = {}
        lost_said: str | None = None
        yield f"retry: {RETRY_MS}\n\n"
        while True:
            generation = self.watch.generation
            lost = self.watch.lost
            if lost != lost_said:
                yield sse("ledger", {"ok": lost is None, "message": lost or "the ledger is readable"})
                lost_said = lost
            for text in self._status_changes(run_id, sent_status):
                yield text
            batch: list[Message] = []
            if lost is None:
                try:
                    batch = await run_in_threadpool(self.watch.messages, run_id, after)
                except (LedgerLost, QueryError) as exc:
                    log.warning("live page: catching up %s: %s", run_id, exc)
            sent = after
            for message in batch:
                if message.seq != after + 1:
                    break  # never a gap: the rest comes on the next round
                yield message.text
                after = message.seq
            if after != sent:
                continue
            if self.watch.generation == generation:
                await self.watch.changed(min(KEEPALIVE_S, 4 * self.watch.poll_s) if lost else KEEPALIVE_S)
                if self.watch.generation == generation:
                    yield ": keepalive\n\n"

    def _status_changes(self, run_id: str, sent: dict[str, str]) -> Iterator[str]:
        # No lock on the event loop (the watch may hold it for a commit's reads): a dict copy is
        # atomic under the GIL, and the watch replaces messages, never edits one.
        now = dict(self.watch.status.get(run_id, {}))
        for kind, text in now.items():
            if sent.get(kind) != text:
                sent[kind] = text
                yield text


class _CountedStream(StreamingResponse):
    """A streaming response that gives its connection slot back however it ends (a client gone,
    a server stopping): the slot is taken by the handler, before the body ever starts."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], **kw: Any) -> None:
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _start_after(request: Request) -> int | str:
    """The last leaf the client holds: ``Last-Event-ID`` (a reconnect) wins over ``?after=`` (the page)."""
    raw = request.headers.get("last-event-id") or request.query_params.get("after") or "-1"
    try:
        value = int(raw)
    except ValueError:
        return f"bad Last-Event-ID / after {raw[:40]!r}: want a leaf index (integer >= -1)"
    if value < -1 or value >= 1 << 63:
        return f"bad Last-Event-ID / after {value}: want a leaf index (integer >= -1)"
    return value


def _headers() -> dict[str, str]:
    return {
        "Content-Security-Policy": CSP,
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
    }


def _text(message: str, status: int) -> Response:
    return PlainTextResponse(message + "\n", status_code=status, headers=_headers())


def create_app(root: str | Path, **options: Any) -> Starlette:
    """The live page's ASGI app over the ledger at ``root`` (``LivePage``'s options)."""
    return LivePage(Path(root), **options).app


def _guarded_protocol(header_timeout_s: float) -> type[Any]:
    """uvicorn's h11 protocol with the rules of HTTP/1.1 it does not keep by itself:

    - a deadline for each request head: uvicorn keeps a connection that sends nothing, or one header
      byte a second (slowloris), for ever (its keep-alive timer is re-armed by every byte). A
      connection without a whole request head within ``header_timeout_s`` of opening (or of its last
      response) is closed; a request being answered (an event stream included) is not bounded by it;
    - a request head with both Transfer-Encoding and Content-Length is refused (400, and a close:
      RFC 9112 §6.3; h11 would let the Transfer-Encoding win and read on, so a front end that took
      the Content-Length would see a smuggled request answered);
    - a malformed body of a request already in the app's hands gets uvicorn's 400 and a close, and
      the app's own answer is dropped (instead of an "Exception in ASGI application").

    The webhook receiver's ``runledger.ingest.github_webhook_limits`` keeps the same rules (the ledger may not
    import a source)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class SmugglingSafeConnection(h11.Connection):
        def next_event(self) -> Any:
            event = super().next_event()
            if isinstance(event, h11.Request):
                names = {name.lower() for name, _ in event.headers}
                if b"transfer-encoding" in names and b"content-length" in names:
                    raise h11.RemoteProtocolError("both Transfer-Encoding and Content-Length", 400)
            return event

    class GuardedH11(H11Protocol):
        _head_deadline: asyncio.TimerHandle | None = None

        def __init__(
            self, config: Any, server_state: Any, app_state: dict[str, Any], _loop: Any = None
        ) -> None:
            super().__init__(config, server_state, app_state, _loop)
            max_size = config.h11_max_incomplete_event_size
            self.conn = (
                SmugglingSafeConnection(h11.SERVER)
                if max_size is None
                else SmugglingSafeConnection(h11.SERVER, max_size)
            )

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_head_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_head_deadline()  # waiting for the next request head (keep-alive)

        def connection_lost(self, exc: Exception | None) -> None:
            super().connection_lost(exc)
            self._cancel_head_deadline()

        def send_400_response(self, msg: str) -> None:
            # A malformed body of a request in the app's hands: drop the app's answer (its cycle is
            # disconnected); uvicorn's 400, or just a close where the app's response has begun.
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()
                if cycle.response_started:
                    self.transport.close()
                    return
            super().send_400_response(msg)

        def _arm_head_deadline(self) -> None:
            self._cancel_head_deadline()
            self._head_deadline = self.loop.call_later(header_timeout_s, self._on_head_deadline)

        def _cancel_head_deadline(self) -> None:
            if self._head_deadline is not None:
                self._head_deadline.cancel()
                self._head_deadline = None

        def _on_head_deadline(self) -> None:
            self._head_deadline = None
            if self.transport.is_closing():
                return
            # Still no whole request head, or the tail of a body whose request was already answered.
            waiting = self.conn.their_state is h11.IDLE or (
                self.conn.our_state in (h11.DONE, h11.MUST_CLOSE) and self.conn.their_state is h11.SEND_BODY
            )
            if waiting:
                log.info(
                    "live page: closed a connection that sent no request within %.1f s", header_timeout_s
                )
                self.transport.close()

    return GuardedH11


def page_server(app: Starlette, host: str, port: int, *, header_timeout_s: float = HEADER_TIMEOUT_S) -> Any:
    """uvicorn (a ``uvicorn.Server``) for the page ``app``, as ``ledger serve page`` runs it: h11
    with a request-head deadline and smuggling-shaped requests refused (``_guarded_protocol``); open event streams never end by themselves, so a stop waits at
    most 2 s for them."""
    import uvicorn

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=2,
        http=_guarded_protocol(header_timeout_s),
    )
    return uvicorn.Server(config)


def serve(root: str | Path, host: str = "127.0.0.1", port: int = DEFAULT_PORT, **options: Any) -> None:
    """Serve the live page until interrupted (`ledger serve page`)."""
    started = time.monotonic()
    app = create_app(root, **options)
    log.info("live page over %s ready in %.2fs", root, time.monotonic() - started)
    _run(page_server(app, host, port))


def _run(server: Any) -> None:
    server.run()
    if not server.started:  # uvicorn said why (a port in use); exit as `uvicorn.run` does
        raise SystemExit(3)


def create_published_app(url: str, log_key: str, cache: str | Path, **options: Any) -> Starlette:
    """The live page's ASGI app over the published copy at ``url`` (verified with ``log_key``; its
    data files downloaded into ``cache``). ``poll_s``: how often its checkpoint is fetched;
    ``deadline_s``: how long one look (and one download) at the copy may take."""
    poll_s = float(options.pop("poll_s", PUBLISHED_POLL_S))
    witnesses = options.pop("witnesses", None)
    deadline_s = float(options.pop("deadline_s", DEFAULT_DEADLINE_S))
    watch = PublishedWatch(
        url, log_key, Path(cache), poll_s=poll_s, witnesses=witnesses, deadline_s=deadline_s
    )
    return LivePage(Path(cache), watch=watch, **options).app


def serve_published(
    url: str,
    log_key: str,
    cache: str | Path,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    **options: Any,
) -> None:
    """Serve the live page over a published copy until interrupted (`ledger serve page --remote`)."""
    app = create_published_app(url, log_key, cache, **options)
    _run(page_server(app, host, port))
