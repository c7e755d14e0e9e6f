"""The GitHub webhook receiver: a Starlette app that verifies, deduplicates and hands deliveries to the bus.

``POST /webhook`` (configure GitHub with content type ``application/json``; the form encoding is
accepted too). Each request is checked in this order, and a refusal stores nothing:

  1. ``Content-Length`` over ``max_body_bytes``                        → 413 (before reading)
  2. no ``X-Hub-Signature-256`` header                                → 401 (before reading)
  3. the body would take the bytes of bodies being read, not yet
     verified, over ``max_unverified_bytes`` (by ``Content-Length``
     before reading, or as chunks arrive)                            → 503 ``busy`` (Retry-After)
  4. body not read within ``body_timeout_s``                          → 408 ``read_timeout``
  5. body longer than ``max_body_bytes`` while reading (chunked)      → 413
  6. signature ≠ ``sha256=`` + hex HMAC-SHA256(secret, raw body)      → 401 (``hmac.compare_digest``)
  7. ``X-GitHub-Event`` / ``X-GitHub-Delivery`` missing or malformed  → 400
  8. delivery id seen before with the same body, event and hook id
     (a redelivery)                                                  → 200 ``{"status": "duplicate"}``
  9. a replay: the same signed body under another delivery id, event
     name or hook id, or a known delivery id with another body       → 409 ``replayed_body``
 10. body not a JSON object: empty, a byte order mark, invalid UTF-8,
     NaN/Infinity, a number out of range, not an object              → 400 ``bad_json``
 11. JSON nested deeper than ``max_depth`` (62) levels                → 400 ``too_deep``
 12. the payload lacks the keys of the event it is labelled as, or
     has a sibling event's (``github_events.event_shape_problem``)   → 400 ``event_mismatch``
 13. an event the ledger's door would quarantine (``decode_event``):
     over its maximum event size (8 MiB)                             → 413 ``too_large``
     anything else it refuses, or a mapping failure                  → 422 ``unprocessable``
 14. on disk (emitted and fsynced) within ``ack_timeout_s``            → 202 ``accepted``
     not on disk in time (a slow or frozen disk)                     → 503 ``not_durable`` (Retry-After)

Every refusal is ``{"status": "refused", "reason": …, "detail": one line}`` with a 4xx status; a 503
(always with ``Retry-After``) says only that the receiver itself cannot keep it right now (queue full,
disk slow, sink failing, too many bodies being read, shutting down): the sender should redeliver.
Bad input never gets a 5xx, and the connection stays usable (keep-alive) after any refusal.

**202 means durable.** An accepted delivery is mapped to envelopes (``runledger.ingest.github_events``: typed
for issues, issue_comment, pull_request, pull_request_review, pull_request_review_comment and push;
anything else, ``ping`` included, is kept whole as ``github.raw``) and queued to ONE worker thread that
owns the sink (the spool writer is single-threaded). The worker emits, syncs (fsync), records the
delivery id, and only then acknowledges; the handler waits for that up to ``ack_timeout_s`` (well
inside GitHub's 10 s) and otherwise answers 503 — never 2xx for what is not on disk, since GitHub does
not redeliver a 2xx. The delivery stays queued: a redelivery of it waits for the same write (and is
answered ``duplicate`` once it is on disk, 503 while it is not).

**Connections.** ``build_server`` runs uvicorn with ``github_webhook_limits.guarded_h11``: at most
``max_connections`` open (the longest-idle one is closed to make room; 503 when all are busy) and
``header_timeout_s`` for a request head, so idle or trickling sockets cannot keep deliveries out.

**Replays.** GitHub signs only the body, not the headers beside it. Delivery ids *and* the SHA-256 of
each accepted body (with the event name and hook id it came under) are remembered in a bounded SQLite
file beside the spool (``DeliveryLog``, the last ``max_entries`` deliveries, kept across restarts):
a redelivery is answered ``duplicate``, a body re-sent under a new id, event or hook is refused
(409); the event name is checked against the payload's shape. The ledger's (source, id) dedupe is the
line behind (an event's id is ``delivery/<X-GitHub-Delivery>/<n>``, see ``runledger.ingest.github_events``).
What the HMAC attests and what it cannot: docs/security.md.

Refusals are counted by reason: ``GET /metrics`` (Prometheus text format; JSON with ``Accept:
application/json``) and ``GET /healthz`` (JSON); they are logged; the secret is never logged.

Every event carries ``attested: "github-hmac-sha256 hook:<X-GitHub-Hook-ID>"`` (``hmac_attestation``;
without a usable hook id header, just ``github-hmac-sha256``): only deliveries whose HMAC verified
become events, so the check travels on with the event instead of ending at the edge. Given the
receiver's producer key (``serve``'s ``producer_key_file``, default the file named by
``RUNLEDGER_PRODUCER_KEY``), its sink signs every event with it, as the trainer's does
(``open_sink(sealer=)``, ``runledger.schemas.signing``; no hash chain: GitHub events have no
per-source sequence), and the attestation is part of the signed bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import hmac
import logging
import queue
import re
import sqlite3
import threading
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from runledger.ingest.bus import EventSink, default_spool_dir, open_sink
from runledger.ingest.github_events import event_shape_problem, webhook_events
from runledger.ingest.github_webhook_limits import (
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_UNVERIFIED_BYTES,
    ConnectionLimits,
    UnverifiedBudget,
    guarded_h11,
)
from runledger.schemas import Envelope, Quarantined, decode_event, encode_event
from runledger.schemas.codec import MAX_DEPTH
from runledger.schemas.signing import HMAC_CHECKED, Sealer

log = logging.getLogger("runledger.github_webhook")

# GitHub caps webhook payloads at 25 MB; anything larger cannot be from GitHub.
DEFAULT_MAX_BODY_BYTES = 25 * 1024 * 1024
DEFAULT_MAX_DELIVERIES = 100_000
# GitHub's payloads nest fewer than 10 levels. The ledger's door quarantines events nested deeper than
# MAX_DEPTH, and a github.raw event holds the payload two levels down (envelope → data → payload).
DEFAULT_MAX_DEPTH = MAX_DEPTH - 2
# Bodies above this are decoded and mapped off the event loop, so one big delivery stalls no other.
_INLINE_BODY_BYTES = 256 * 1024
DELIVERY_RE = re.compile(r"^[A-Za-z0-9-]{1,128}$")
EVENT_RE = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
DEFAULT_ACK_TIMEOUT_S = 5.0  # GitHub waits 10 s for an answer
DEFAULT_BODY_TIMEOUT_S = 10.0
RETRY_AFTER_S = 5  # what a 503 asks the sender to wait before redelivering
REFUSAL_REASONS = (
    "too_large",
    "signature_missing",
    "signature_mismatch",
    "headers_missing",
    "busy",
    "read_timeout",
    "replayed_body",
    "bad_json",
    "too_deep",
    "event_mismatch",
    "unprocessable",
    "queue_full",
    "not_durable",
    "sink_error",
    "shutting_down",
)


def signature_of(secret: bytes, body: bytes) -> str:
    """The ``X-Hub-Signature-256`` value GitHub sends for ``body``."""
    return "sha256=" + hmac.new(secret, body, hashlib.sha256).hexdigest()


def verify_signature(secret: bytes, body: bytes, header: str | None) -> bool:
    if not header:
        return False
    # Header text arrives latin-1 decoded; compare bytes so odd characters cannot raise.
    return hmac.compare_digest(header.encode("latin-1", "replace"), signature_of(secret, body).encode())


def read_secret(path: str | Path) -> bytes:
    """The webhook secret from a file; one trailing newline (as editors write it) is not part of it."""
    secret = Path(path).read_bytes().rstrip(b"\r\n")
    if not secret:
        raise ValueError(f"secret file {path} is empty")
    return secret


def default_delivery_db(spool_dir: str | Path) -> Path:
    spool = Path(spool_dir)
    return spool.parent / f"{spool.name}.github-deliveries.sqlite"


@dataclass(frozen=True)
class BodySeen:
    """A signed body as it was first accepted: its SHA-256, and the headers it came under (the
    headers GitHub does not sign)."""

    digest: str
    delivery: str
    event: str
    hook: str = ""

    def replayed_by(self, other: BodySeen) -> str | None:
        """Why ``other`` (the same body or the same delivery id) is a replay of this one; None when it
        is a redelivery (same body, id, event and hook)."""
        if other.digest != self.digest:
            return f"delivery {other.delivery} was accepted before with another body"
        for name, mine, theirs in (
            ("delivery id", self.delivery, other.delivery),
            ("event", self.event, other.event),
            ("hook id", self.hook, other.hook),
        ):
            if mine != theirs:
                return (
                    f"this body was accepted before as delivery {self.delivery} ({self.event}); "
                    f"re-sent under another {name}"
                )
        return None


class DeliveryLog:
    """The most recent ``max_entries`` delivery ids and the bodies they carried (``BodySeen``), in
    memory and (if ``path``) in SQLite: a redelivery is answered ``duplicate``, a signed body re-sent
    under another delivery id, event or hook id is refused as a replay, across restarts too."""

    def __init__(self, path: str | Path | None = None, *, max_entries: int = DEFAULT_MAX_DELIVERIES) -> None:
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._recent: OrderedDict[str, None] = OrderedDict()
        self._bodies: OrderedDict[str, BodySeen] = OrderedDict()  # digest -> first acceptance
        self._body_of: dict[str, str] = {}  # delivery -> digest
        self._db: sqlite3.Connection | None = None
        if path is not None:
            self._open(Path(path))

    def _open(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Written by the worker thread, opened here: the lock serialises every use.
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # recorded = on disk: the window survives a crash
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS deliveries ("
            "n INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, at TEXT NOT NULL)"
        )
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS bodies (n INTEGER PRIMARY KEY AUTOINCREMENT, digest TEXT UNIQUE "
            "NOT NULL, delivery TEXT NOT NULL, event TEXT NOT NULL, hook TEXT NOT NULL)"
        )
        limit = (self.max_entries,)
        ids = self._db.execute("SELECT id FROM deliveries ORDER BY n DESC LIMIT ?", limit).fetchall()
        for (delivery,) in reversed(ids):
            self._recent[delivery] = None
        rows = self._db.execute(
            "SELECT digest, delivery, event, hook FROM bodies ORDER BY n DESC LIMIT ?", limit
        ).fetchall()
        for row in reversed(rows):
            self._remember(BodySeen(*row))

    def __contains__(self, delivery: str) -> bool:
        with self._lock:
            return delivery in self._recent

    def __len__(self) -> int:
        with self._lock:
            return len(self._recent)

    def body(self, digest: str) -> BodySeen | None:
        """How a body with this SHA-256 was first accepted, if it is in the window."""
        with self._lock:
            return self._bodies.get(digest)

    def body_of(self, delivery: str) -> BodySeen | None:
        """The body a remembered delivery id carried, if it is in the window."""
        with self._lock:
            digest = self._body_of.get(delivery)
            return self._bodies.get(digest) if digest is not None else None

    def _remember(self, seen: BodySeen) -> None:
        if seen.digest in self._bodies:
            return  # the first acceptance is the one a replay is compared with
        self._bodies[seen.digest] = seen
        self._body_of[seen.delivery] = seen.digest
        while len(self._bodies) > self.max_entries:
            _, old = self._bodies.popitem(last=False)
            self._body_of.pop(old.delivery, None)

    def record(self, deliveries: list[str], bodies: list[BodySeen] | None = None) -> None:
        if not deliveries:
            return
        now = datetime.now(UTC).isoformat()
        with self._lock:
            for delivery in deliveries:
                self._recent[delivery] = None
                self._recent.move_to_end(delivery)
            while len(self._recent) > self.max_entries:
                self._recent.popitem(last=False)
            for seen in bodies or []:
                self._remember(seen)
            if self._db is not None:
                self._write(deliveries, bodies or [], now)

    def _write(self, deliveries: list[str], bodies: list[BodySeen], now: str) -> None:
        assert self._db is not None
        with self._db:  # one transaction per batch
            self._db.execute("BEGIN")
            self._db.executemany(
                "INSERT OR IGNORE INTO deliveries (id, at) VALUES (?, ?)", [(d, now) for d in deliveries]
            )
            self._db.executemany(
                "INSERT OR IGNORE INTO bodies (digest, delivery, event, hook) VALUES (?, ?, ?, ?)",
                [(b.digest, b.delivery, b.event, b.hook) for b in bodies],
            )
            for table in ("deliveries", "bodies"):
                self._db.execute(
                    f"DELETE FROM {table} WHERE n <= (SELECT MAX(n) FROM {table}) - ?", (self.max_entries,)
                )

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None


@dataclass
class _Item:
    seen: BodySeen
    envelopes: list[Envelope]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[str | None]  # resolved by the worker: None (on disk) or the error
    refusal: tuple[int, str, str | None] | None = None  # (status, reason, detail): refused before queued

    @property
    def delivery(self) -> str:
        return self.seen.delivery


_STOP = object()


@dataclass
class Metrics:
    counts: dict[str, int] = field(
        default_factory=lambda: {"received": 0, "accepted": 0, "duplicate": 0, "events": 0}
    )
    refused: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REFUSAL_REASONS, 0))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + n

    def refuse(self, reason: str) -> None:
        with self.lock:
            self.refused[reason] = self.refused.get(reason, 0) + 1

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {"counts": dict(self.counts), "refused": dict(self.refused)}


class WebhookReceiver:
    """Owns the sink on one worker thread; the ASGI handlers only validate and queue."""

    def __init__(
        self,
        secret: bytes,
        sink: EventSink,
        *,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        delivery_log: DeliveryLog | None = None,
        ack_timeout_s: float = DEFAULT_ACK_TIMEOUT_S,
        max_queue: int = 10_000,
        max_depth: int = DEFAULT_MAX_DEPTH,
        body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
        max_unverified_bytes: int = DEFAULT_MAX_UNVERIFIED_BYTES,
        connection_limits: ConnectionLimits | None = None,
    ) -> None:
        if not secret:
            raise ValueError("webhook secret must not be empty")
        if max_unverified_bytes < max_body_bytes:
            raise ValueError("the unverified-bytes budget must hold at least one body of the largest size")
        self._secret = secret
        self.sink = sink  # signs what it emits when it has a sealer (``open_sink(sealer=)``)
        self.max_body_bytes = max_body_bytes
        self.max_depth = max_depth
        self.deliveries = delivery_log if delivery_log is not None else DeliveryLog(None)
        self.ack_timeout_s = ack_timeout_s
        self.body_timeout_s = body_timeout_s
        self.budget = UnverifiedBudget(max_unverified_bytes)
        # Applied by ``build_server`` (uvicorn's protocol), kept here so /metrics can show them.
        self.connection_limits = connection_limits or ConnectionLimits()
        self.metrics = Metrics()
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_queue)
        self._inflight: dict[str, _Item] = {}  # delivery id -> its item, until durable or failed
        self._inflight_bodies: dict[str, BodySeen] = {}  # body digest -> how it is being accepted
        self._inflight_lock = threading.Lock()
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="github-webhook-sink", daemon=True)
        self._worker.start()

    def __repr__(self) -> str:  # keeps the secret out of any accidental repr in logs
        return f"WebhookReceiver(max_body_bytes={self.max_body_bytes}, queued={self._queue.qsize()})"

    # -- the worker: the only thread that touches the sink -------------------------------------
    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is _STOP:
                return
            batch: list[_Item] = [first]
            stop = False
            while len(batch) < 512:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is _STOP:
                    stop = True
                    break
                batch.append(nxt)
            self._emit_batch(batch)
            if stop:
                return

    def _emit_batch(self, batch: list[_Item]) -> None:
        emitted: list[_Item] = []
        for item in batch:
            try:
                for envelope in item.envelopes:
                    self.sink.emit(envelope)
            except Exception:
                log.exception("sink refused delivery %s", item.delivery)
                self._finish(item, "sink_error")
                continue
            emitted.append(item)
        if not emitted:
            return
        try:
            self.sink.sync()  # group commit: one fsync acknowledges the whole batch
        except Exception:
            log.exception("sink sync failed; %d deliveries not acknowledged", len(emitted))
            for item in emitted:
                self._finish(item, "sink_error")
            return
        try:
            self.deliveries.record([item.delivery for item in emitted], [item.seen for item in emitted])
        except Exception:  # the ledger's content-id dedupe still catches a redelivery
            log.exception("could not record delivery ids")
        self.metrics.add("events", sum(len(item.envelopes) for item in emitted))
        for item in emitted:
            self._finish(item, None)

    def _finish(self, item: _Item, error: str | None) -> None:
        self._forget(item.seen)
        with contextlib.suppress(RuntimeError):  # the loop may already be closed at shutdown
            item.loop.call_soon_threadsafe(_resolve, item.future, error)

    def close(self, timeout: float = 30.0) -> None:
        """Emit what is queued, then stop the worker. The sink stays open (its owner closes it)."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._worker.join(timeout)

    @property
    def worker_alive(self) -> bool:
        return self._worker.is_alive()

    # -- the ASGI side -----------------------------------------------------------------------
    def _refuse(
        self, status: int, reason: str, delivery: str | None, request: Request, detail: str | None = None
    ) -> JSONResponse:
        self.metrics.refuse(reason)
        client = request.client.host if request.client else "-"
        line = _one_line(detail or _REFUSAL_DETAILS.get(reason, reason))
        log.warning("refused delivery %.64r from %s: %s (%s)", delivery or "-", client, reason, line)
        # A 503 is the receiver's own trouble: the sender should come back.
        headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
        return JSONResponse(
            {"status": "refused", "reason": reason, "detail": line}, status_code=status, headers=headers
        )

    async def _read_body(self, request: Request, held: _Held) -> bytes | None:
        """The raw body, or None once it exceeds the limit (the rest is not read). Each chunk beyond
        what ``held`` reserved is reserved first (``_OverBudget`` when the budget is spent)."""
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            if not held.cover(size):
                raise _OverBudget
            chunks.append(chunk)
        return b"".join(chunks)

    async def _verified_body(
        self, request: Request, declared: int | None, signature: str, delivery: str | None
    ) -> bytes | Response:
        """The body, read within the unverified-bytes budget and ``body_timeout_s``, its HMAC checked;
        else the refusal. Nothing of it is held once this returns a refusal."""
        too_large = f"body over the {self.max_body_bytes}-byte limit"
        held = _Held(self.budget)
        if not held.cover(declared or 0):
            return self._refuse(503, "busy", delivery, request)
        try:
            body = await asyncio.wait_for(self._read_body(request, held), self.body_timeout_s)
        except TimeoutError:
            return self._refuse(408, "read_timeout", delivery, request)
        except _OverBudget:
            return self._refuse(503, "busy", delivery, request)
        finally:
            held.release()  # verified or refused, the body no longer counts as unverified
        if body is None:
            return self._refuse(413, "too_large", delivery, request, too_large)
        if not verify_signature(self._secret, body, signature):
            return self._refuse(401, "signature_mismatch", delivery, request)
        return body

    async def handle(self, request: Request) -> Response:
        self.metrics.add("received")
        try:
            return await self._handle(request)
        except ClientDisconnect:
            return Response(status_code=400)
        except Exception:  # a bug here must not turn a delivery into a 500 and a dropped connection
            delivery = request.headers.get("x-github-delivery")
            log.exception("delivery %.64r could not be handled", delivery)
            return self._refuse(
                422, "unprocessable", delivery, request, "the delivery could not be processed"
            )

    async def _handle(self, request: Request) -> Response:
        headers = request.headers
        delivery = headers.get("x-github-delivery")
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return self._refuse(
                413, "too_large", delivery, request, f"body over the {self.max_body_bytes}-byte limit"
            )
        signature = headers.get("x-hub-signature-256")
        if not signature:
            return self._refuse(401, "signature_missing", delivery, request)
        body = await self._verified_body(request, int(length) if length else None, signature, delivery)
        if isinstance(body, Response):
            return body
        event = headers.get("x-github-event")
        if not delivery or not event or not DELIVERY_RE.match(delivery) or not EVENT_RE.match(event):
            return self._refuse(400, "headers_missing", delivery, request)
        if self._closed:
            return self._refuse(503, "shutting_down", delivery, request)
        hook = headers.get("x-github-hook-id", "")[:64]
        seen = BodySeen(hashlib.sha256(body).hexdigest(), delivery, event, hook)
        return await self._admit(request, body, seen)

    def _claim(self, seen: BodySeen) -> tuple[str, Any]:
        """What ``seen`` is: ("new", its item, now in flight), ("pending", the in-flight item of its
        delivery id), ("duplicate", None), or ("replay", why)."""
        loop = asyncio.get_running_loop()
        with self._inflight_lock:
            pending = self._inflight.get(seen.delivery)
            if pending is not None:
                why = pending.seen.replayed_by(seen)
                return ("replay", why) if why else ("pending", pending)
            prior = self._inflight_bodies.get(seen.digest) or self.deliveries.body(seen.digest)
            if prior is None and seen.delivery in self.deliveries:
                prior = self.deliveries.body_of(seen.delivery)
                if prior is None:  # remembered from before bodies were: a redelivery
                    return "duplicate", None
            if prior is not None:
                why = prior.replayed_by(seen)
                return ("replay", why) if why else ("duplicate", None)
            item = _Item(seen, [], loop, loop.create_future())
            self._inflight_bodies[seen.digest] = seen
            self._inflight[seen.delivery] = item
            return "new", item

    def _forget(self, seen: BodySeen) -> None:
        with self._inflight_lock:
            item = self._inflight.get(seen.delivery)
            if item is not None and item.seen == seen:
                del self._inflight[seen.delivery]
            if self._inflight_bodies.get(seen.digest) == seen:
                del self._inflight_bodies[seen.digest]

    def _give_up(
        self, item: _Item, request: Request, status: int, reason: str, detail: str | None = None
    ) -> JSONResponse:
        """``item`` will not be stored: out of flight, and a redelivery waiting on it gets the same answer."""
        item.refusal = (status, reason, detail)
        self._forget(item.seen)
        _resolve(item.future, reason)
        return self._refuse(status, reason, item.delivery, request, detail)

    async def _admit(self, request: Request, body: bytes, seen: BodySeen) -> Response:
        kind, what = self._claim(seen)
        if kind == "replay":
            log.info("replayed body refused: delivery %s (%s): %s", seen.delivery, seen.event, what)
            return self._refuse(409, "replayed_body", seen.delivery, request, what)
        if kind == "pending":  # a redelivery of one not yet on disk: its answer is that write's
            return await self._answer_when_durable(request, what, duplicate=True)
        if kind == "duplicate":
            self.metrics.add("duplicate")
            log.info("duplicate delivery %s (%s) ignored", seen.delivery, seen.event)
            return JSONResponse({"status": "duplicate", "delivery": seen.delivery}, status_code=200)
        item: _Item = what
        try:
            item.envelopes = await self._prepare(request, body, seen)
        except BadBody as bad:
            return self._give_up(item, request, bad.status, bad.reason, bad.detail)
        except Exception:
            log.exception("delivery %s (%s) could not be mapped to events", seen.delivery, seen.event)
            detail = "payload could not be turned into events"
            return self._give_up(item, request, 422, "unprocessable", detail)
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            return self._give_up(item, request, 503, "queue_full")
        return await self._answer_when_durable(request, item, duplicate=False)

    async def _prepare(self, request: Request, body: bytes, seen: BodySeen) -> list[Envelope]:
        prepare = functools.partial(
            delivery_events,
            seen.event,
            body,
            request.headers.get("content-type", ""),
            delivery=seen.delivery,
            received_at=datetime.now(UTC),
            max_depth=self.max_depth,
            # Only deliveries whose HMAC verified get here, so each of their events may say so.
            attested=hmac_attestation(request.headers.get("x-github-hook-id")),
        )
        return await asyncio.to_thread(prepare) if len(body) > _INLINE_BODY_BYTES else prepare()

    async def _answer_when_durable(self, request: Request, item: _Item, *, duplicate: bool) -> Response:
        """202 (or, for a redelivery, 200 ``duplicate``) once ``item`` is on disk; 503 when it is not
        within ``ack_timeout_s`` (it stays queued: a redelivery waits for the same write)."""
        seen = item.seen
        try:
            error = await asyncio.wait_for(asyncio.shield(item.future), self.ack_timeout_s)
        except TimeoutError:
            detail = f"not on disk within {self.ack_timeout_s:g} s (slow disk?); redeliver later"
            return self._refuse(503, "not_durable", seen.delivery, request, detail)
        if item.refusal is not None:  # a redelivery of one refused while it waited: the same answer
            return self._refuse(item.refusal[0], item.refusal[1], seen.delivery, request, item.refusal[2])
        if error is not None:
            return self._refuse(503, error, seen.delivery, request)
        if duplicate:
            self.metrics.add("duplicate")
            return JSONResponse({"status": "duplicate", "delivery": seen.delivery}, status_code=200)
        self.metrics.add("accepted")
        return JSONResponse(
            {
                "status": "accepted",
                "delivery": seen.delivery,
                "event": seen.event,
                "events": len(item.envelopes),
            },
            status_code=202,
        )

    def status(self) -> dict[str, Any]:
        return {
            "status": "ok" if self.worker_alive and not self._closed else "degraded",
            "worker_alive": self.worker_alive,
            "queue_depth": self._queue.qsize(),
            "deliveries_remembered": len(self.deliveries),
            "max_body_bytes": self.max_body_bytes,
            "unverified_bytes": self.budget.snapshot(),
            "connections": self.connection_limits.stats.snapshot(),
            **self.metrics.snapshot(),
        }


class _OverBudget(Exception):
    """A chunked body would take the unverified bytes over their budget."""


class _Held:
    """The share of the unverified-bytes budget one body holds while it is read."""

    def __init__(self, budget: UnverifiedBudget) -> None:
        self.budget = budget
        self.n = 0

    def cover(self, size: int) -> bool:
        """Hold at least ``size`` bytes; False (nothing more held) when the budget cannot."""
        if size <= self.n:
            return True
        if not self.budget.reserve(size - self.n):
            return False
        self.n = size
        return True

    def release(self) -> None:
        self.budget.release(self.n)
        self.n = 0


def _resolve(future: asyncio.Future[str | None], error: str | None) -> None:
    if not future.done():
        future.set_result(error)


class BadBody(ValueError):
    """A signed body runledger cannot keep: ``status`` (4xx) and ``reason`` are the refusal's."""

    def __init__(self, reason: str, detail: str, status: int = 400) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        self.status = status


_REFUSAL_DETAILS = {
    "busy": "too many bodies being read before their signature is checked; redeliver later",
    "read_timeout": "the body did not arrive in time",
    "signature_missing": "no X-Hub-Signature-256 header",
    "signature_mismatch": "X-Hub-Signature-256 does not match the body",
    "headers_missing": "X-GitHub-Event / X-GitHub-Delivery missing or malformed",
    "queue_full": "too many deliveries waiting; redeliver later",
    "sink_error": "the delivery could not be stored; redeliver later",
    "shutting_down": "the receiver is shutting down; redeliver later",
}


def _one_line(text: str, width: int = 200) -> str:
    return " ".join(str(text).split())[:width]


def _nesting_exceeds(value: Any, limit: int) -> bool:
    """Whether a decoded JSON value nests containers deeper than ``limit`` levels (no recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values() if isinstance(v, dict | list))
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item if isinstance(v, dict | list))
    return False


def decode_body(body: bytes, content_type: str, *, max_depth: int = DEFAULT_MAX_DEPTH) -> dict[str, Any]:
    """A delivery's JSON object (``application/json`` or GitHub's form encoding), or ``BadBody``."""
    if content_type.split(";")[0].strip().lower() == "application/x-www-form-urlencoded":
        try:
            form = urllib.parse.parse_qs(body.decode("utf-8"), strict_parsing=True)
            body = form["payload"][0].encode()
        except UnicodeDecodeError:
            raise BadBody("bad_json", "form body is not UTF-8") from None
        except (ValueError, KeyError, IndexError):
            raise BadBody("bad_json", "form body has no payload field") from None
    if not body.strip():
        raise BadBody("bad_json", "empty body")
    if body.startswith(b"\xef\xbb\xbf"):
        raise BadBody("bad_json", "body starts with a byte order mark (JSON text must not)")
    try:
        payload = msgspec.json.decode(body)
    except RecursionError:
        raise BadBody("too_deep", f"JSON nested deeper than {max_depth} levels") from None
    except msgspec.DecodeError as exc:
        raise BadBody("bad_json", f"not JSON: {_one_line(str(exc), 120)}") from None
    if not isinstance(payload, dict):
        raise BadBody("bad_json", f"JSON {type(payload).__name__} is not an object")
    if _nesting_exceeds(payload, max_depth):
        raise BadBody("too_deep", f"JSON nested deeper than {max_depth} levels")
    return payload


# The ledger door's reason code (runledger.schemas.codec) → this receiver's answer.
_DOOR_REFUSALS = {"too-large": (413, "too_large"), "too-deep": (400, "too_deep")}


_HOOK_ID_RE = re.compile(r"[0-9]{1,20}")  # GitHub's X-GitHub-Hook-ID: the webhook's numeric id


def hmac_attestation(hook_id: str | None) -> str:
    """``attested`` of a delivery whose X-Hub-Signature-256 verified: ``github-hmac-sha256``, and
    ``hook:<id>`` when the X-GitHub-Hook-ID header is a hook id (anything else is left out)."""
    if hook_id is not None and _HOOK_ID_RE.fullmatch(hook_id):
        return f"{HMAC_CHECKED} hook:{hook_id}"
    return HMAC_CHECKED


def delivery_events(
    event: str,
    body: bytes,
    content_type: str,
    *,
    delivery: str,
    received_at: datetime,
    max_depth: int = DEFAULT_MAX_DEPTH,
    attested: str | None = None,
) -> list[Envelope]:
    """The events one signed delivery becomes, each checked at the ledger's door (``decode_event``)
    before anything is acknowledged: what this receiver accepts, the ledger accepts. ``BadBody`` else.
    ``attested``: what the receiver checked (``hmac_attestation``), set on every event."""
    payload = decode_body(body, content_type, max_depth=max_depth)
    mismatch = event_shape_problem(event, payload)
    if mismatch is not None:  # the event name is not signed: the body must be what it is labelled as
        raise BadBody("event_mismatch", f"X-GitHub-Event {event}: {mismatch}")
    envelopes = webhook_events(event, payload, received_at=received_at, delivery=delivery)
    if attested is not None:
        envelopes = [msgspec.structs.replace(envelope, attested=attested) for envelope in envelopes]
    for envelope in envelopes:
        checked = decode_event(encode_event(envelope))
        if isinstance(checked, Quarantined):
            status, reason = _DOOR_REFUSALS.get(getattr(checked, "code", ""), (422, "unprocessable"))
            raise BadBody(
                reason, f"the ledger would not accept its event: {_one_line(checked.reason, 150)}", status
            )
    return envelopes


def create_app(
    secret: bytes,
    sink: EventSink,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    delivery_log: DeliveryLog | None = None,
    ack_timeout_s: float = DEFAULT_ACK_TIMEOUT_S,
    max_queue: int = 10_000,
    path: str = "/webhook",
    max_depth: int = DEFAULT_MAX_DEPTH,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    max_unverified_bytes: int = DEFAULT_MAX_UNVERIFIED_BYTES,
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
) -> Starlette:
    """The receiver as an ASGI app. ``app.state.receiver`` is its ``WebhookReceiver``. The connection
    limits (``header_timeout_s``, ``max_connections``) hold when it is served by ``build_server``."""
    receiver = WebhookReceiver(
        secret,
        sink,
        max_body_bytes=max_body_bytes,
        delivery_log=delivery_log,
        ack_timeout_s=ack_timeout_s,
        max_queue=max_queue,
        max_depth=max_depth,
        body_timeout_s=body_timeout_s,
        max_unverified_bytes=max_unverified_bytes,
        connection_limits=ConnectionLimits(
            header_timeout_s=header_timeout_s, max_connections=max_connections
        ),
    )

    async def webhook(request: Request) -> Response:
        return await receiver.handle(request)

    async def health(request: Request) -> Response:
        return JSONResponse(receiver.status())

    async def metrics(request: Request) -> Response:
        # Prometheus scrapes text; the JSON (also at /healthz) for whoever asks for it by name.
        if "application/json" in request.headers.get("accept", ""):
            return JSONResponse(receiver.status())
        return Response(prometheus_text(receiver.status()), media_type=PROMETHEUS_CONTENT_TYPE)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        # Drain on shutdown so that what was acknowledged (or queued) reaches the sink.
        await asyncio.to_thread(receiver.close)

    app = Starlette(
        routes=[
            Route(path, webhook, methods=["POST"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/healthz", health, methods=["GET"]),
        ],
        lifespan=lifespan,
    )
    app.state.receiver = receiver
    return app


# --- /metrics in Prometheus' text exposition format (version 0.0.4) ----------------------------
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_PREFIX = "runledger_webhook_"


def _family(name: str, kind: str, help_text: str, samples: list[tuple[dict[str, str], float]]) -> list[str]:
    lines = [f"# HELP {_PREFIX}{name} {help_text}", f"# TYPE {_PREFIX}{name} {kind}"]
    for labels, value in samples:
        # Label values here are fixed names (reasons, outcomes): no escaping needed.
        text = ",".join(f'{k}="{v}"' for k, v in labels.items())
        lines.append(f"{_PREFIX}{name}{{{text}}} {value:g}" if text else f"{_PREFIX}{name} {value:g}")
    return lines


def prometheus_text(status: dict[str, Any]) -> str:
    """The receiver's ``status()`` as Prometheus text: counters ``*_total``, the rest gauges."""
    counts, refused = status["counts"], status["refused"]
    connections, unverified = status["connections"], status["unverified_bytes"]
    outcomes = [({"outcome": k}, float(v)) for k, v in sorted(counts.items()) if k != "events"]
    closed = [
        ({"why": why}, float(connections[why])) for why in ("header_timeouts", "evicted_idle", "refused_full")
    ]
    lines = [
        *_family("requests_total", "counter", "Webhook requests by outcome.", outcomes),
        *_family(
            "events_total", "counter", "Events written to the bus.", [({}, float(counts.get("events", 0)))]
        ),
        *_family(
            "refused_total",
            "counter",
            "Deliveries refused, by reason.",
            [({"reason": k}, float(v)) for k, v in sorted(refused.items())],
        ),
        *_family(
            "queue_depth", "gauge", "Deliveries waiting for the sink.", [({}, float(status["queue_depth"]))]
        ),
        *_family(
            "worker_up", "gauge", "1 while the sink's worker runs.", [({}, float(status["worker_alive"]))]
        ),
        *_family(
            "deliveries_remembered",
            "gauge",
            "Delivery ids in the duplicate and replay window.",
            [({}, float(status["deliveries_remembered"]))],
        ),
        *_family("connections_open", "gauge", "Open HTTP connections.", [({}, float(connections["open"]))]),
        *_family(
            "connections_total",
            "counter",
            "HTTP connections accepted.",
            [({}, float(connections["opened_total"]))],
        ),
        *_family("connections_closed_total", "counter", "Connections the receiver closed, by why.", closed),
        *_family(
            "unverified_body_bytes",
            "gauge",
            "Bytes of bodies being read before their signature is checked.",
            [({}, float(unverified["held"]))],
        ),
        *_family(
            "unverified_body_bytes_limit",
            "gauge",
            "The budget for unverified body bytes.",
            [({}, float(unverified["max"]))],
        ),
    ]
    return "\n".join(lines) + "\n"


class _Server(uvicorn.Server):
    def handle_exit(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)
        # SIGTERM/SIGINT is how this receiver is meant to stop: after the graceful shutdown, return
        # (exit 0, our sink closed) instead of uvicorn re-raising the signal at the end of run().
        captured = getattr(self, "_captured_signals", None)
        if isinstance(captured, list):
            captured.clear()


def build_server(
    app: Starlette, host: str = "127.0.0.1", port: int = 8787, *, log_level: str = "info"
) -> uvicorn.Server:
    """uvicorn for the receiver ``app``: its connection limits (``guarded_h11``) applied."""
    receiver: WebhookReceiver = app.state.receiver
    # Headers (and so signatures) never reach uvicorn's access log: it logs the request line only.
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        access_log=True,
        http=guarded_h11(receiver.connection_limits),
        backlog=max(128, receiver.connection_limits.max_connections),
    )
    return _Server(config)


def receiver_sealer(producer_key_file: str | Path | None = None) -> Sealer | None:
    """The receiver's sealer: GitHub events keep no chain (``seq`` is 0). Raises OSError for an
    unreadable file and ValueError (``CheckpointError``) for one that holds no private key."""
    if producer_key_file is not None:
        return Sealer.from_file(producer_key_file, chain=False)
    return Sealer.from_env(chain=False)


def serve(
    host: str,
    port: int,
    secret_file: str | Path,
    spool_dir: str | Path | None = None,
    *,
    delivery_db: str | Path | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    log_level: str = "info",
    producer_key_file: str | Path | None = None,
    **limits: Any,
) -> None:
    """Run the receiver with uvicorn until interrupted. Events go to ``open_sink(spool_dir)``, signed
    with the producer key in ``producer_key_file`` (default: the file ``RUNLEDGER_PRODUCER_KEY``
    names; neither: unsigned). ``limits``: ``create_app``'s (``ack_timeout_s``, ``body_timeout_s``,
    ``max_unverified_bytes``, ``header_timeout_s``, ``max_connections``)."""
    secret = read_secret(secret_file)
    spool = Path(spool_dir) if spool_dir is not None else default_spool_dir()
    sealer = receiver_sealer(producer_key_file)
    deliveries = DeliveryLog(delivery_db if delivery_db is not None else default_delivery_db(spool))
    sink = open_sink(spool, sealer=sealer)
    app = create_app(secret, sink, max_body_bytes=max_body_bytes, delivery_log=deliveries, **limits)
    started = time.monotonic()
    try:
        build_server(app, host, port, log_level=log_level).run()
    finally:
        app.state.receiver.close()
        sink.close()
        deliveries.close()
        log.info("webhook receiver stopped after %.0f s: %s", time.monotonic() - started, app.state.receiver)
