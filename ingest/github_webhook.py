"""The GitHub webhook receiver: a Starlette app that verifies, deduplicates and hands deliveries to the bus.

``POST /webhook`` (configure GitHub with content type ``application/json``; the form encoding is
accepted too). Each request is checked in this order, and a refusal stores nothing:

  1. ``Content-Length`` over ``max_body_bytes``                        → 413 (before reading)
  2. no ``X-Hub-Signature-256`` header                                → 401
  3. body longer than ``max_body_bytes`` while reading (chunked)      → 413
  4. signature ≠ ``sha256=`` + hex HMAC-SHA256(secret, raw body)      → 401 (``hmac.compare_digest``)
  5. ``X-GitHub-Event`` / ``X-GitHub-Delivery`` missing or malformed  → 400
  6. delivery id seen before (a redelivery or a replay)               → 200 ``{"status": "duplicate"}``
  7. body not a JSON object: empty, a byte order mark, invalid UTF-8,
     NaN/Infinity, a number out of range, not an object              → 400 ``bad_json``
  8. JSON nested deeper than ``max_depth`` (62) levels                → 400 ``too_deep``
  9. an event the ledger's door would quarantine (``decode_event``):
     over its maximum event size (8 MiB)                             → 413 ``too_large``
     anything else it refuses, or a mapping failure                  → 422 ``unprocessable``
 10. accepted                                                         → 202

Every refusal is ``{"status": "refused", "reason": …, "detail": one line}`` with a 4xx status (a 503
says only that the receiver itself cannot store right now: queue full, sink failing, shutting down).
Bad input never gets a 5xx, and the connection stays usable (keep-alive) after any refusal.

An accepted delivery is mapped to envelopes (``ingest.github_events``: typed for issues,
issue_comment, pull_request, pull_request_review, pull_request_review_comment and push; anything else,
``ping`` included, is kept whole as ``github.raw``) and queued to ONE worker thread that owns the
sink (the spool writer is single-threaded). The worker emits, syncs, and only then records the
delivery id, so 202 normally means "durable": the handler waits for that acknowledgement up to
``ack_timeout_s`` (well inside GitHub's 10 s) and answers 202 ``queued`` if it takes longer.

Delivery ids are remembered in a bounded SQLite file beside the spool, so a redelivery after a
restart is still answered ``duplicate``; the ledger's (source, id) dedupe is the second line (an
event's id is ``delivery/<X-GitHub-Delivery>/<n>``, see ``ingest.github_events``).
Refusals are counted by reason (``GET /metrics``, ``GET /healthz``) and logged; the secret is never
logged.

Every event carries ``attested: "github-hmac-sha256 hook:<X-GitHub-Hook-ID>"`` (``hmac_attestation``;
without a usable hook id header, just ``github-hmac-sha256``): only deliveries whose HMAC verified
become events, so the check travels on with the event instead of ending at the edge. Given the
receiver's producer key (``serve``'s ``producer_key_file``, default the file named by
``RUNLEDGER_PRODUCER_KEY``), its sink signs every event with it, as the trainer's does
(``open_sink(sealer=)``, ``schemas.signing``; no hash chain: GitHub events have no
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

from ingest.bus import EventSink, default_spool_dir, open_sink
from ingest.github_events import webhook_events
from schemas import Envelope, Quarantined, decode_event, encode_event
from schemas.codec import MAX_DEPTH
from schemas.signing import HMAC_CHECKED, Sealer

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
REFUSAL_REASONS = (
    "too_large",
    "signature_missing",
    "signature_mismatch",
    "headers_missing",
    "bad_json",
    "too_deep",
    "unprocessable",
    "queue_full",
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


class DeliveryLog:
    """The most recent ``max_entries`` delivery ids, in memory and (if ``path``) in SQLite."""

    def __init__(self, path: str | Path | None = None, *, max_entries: int = DEFAULT_MAX_DELIVERIES) -> None:
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._recent: OrderedDict[str, None] = OrderedDict()
        self._db: sqlite3.Connection | None = None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            # Written by the worker thread, opened here: the lock serialises every use.
            self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS deliveries ("
                "n INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, at TEXT NOT NULL)"
            )
            rows = self._db.execute(
                "SELECT id FROM deliveries ORDER BY n DESC LIMIT ?", (max_entries,)
            ).fetchall()
            for (delivery,) in reversed(rows):
                self._recent[delivery] = None

    def __contains__(self, delivery: str) -> bool:
        with self._lock:
            return delivery in self._recent

    def __len__(self) -> int:
        with self._lock:
            return len(self._recent)

    def record(self, deliveries: list[str]) -> None:
        if not deliveries:
            return
        now = datetime.now(UTC).isoformat()
        with self._lock:
            for delivery in deliveries:
                self._recent[delivery] = None
                self._recent.move_to_end(delivery)
            while len(self._recent) > self.max_entries:
                self._recent.popitem(last=False)
            if self._db is not None:
                with self._db:  # one transaction per batch
                    self._db.execute("BEGIN")
                    self._db.executemany(
                        "INSERT OR IGNORE INTO deliveries (id, at) VALUES (?, ?)",
                        [(d, now) for d in deliveries],
                    )
                    self._db.execute(
                        "DELETE FROM deliveries WHERE n <= (SELECT MAX(n) FROM deliveries) - ?",
                        (self.max_entries,),
                    )

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None


@dataclass
class _Item:
    delivery: str
    envelopes: list[Envelope]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[str | None]


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
        ack_timeout_s: float = 5.0,
        max_queue: int = 10_000,
        max_depth: int = DEFAULT_MAX_DEPTH,
    ) -> None:
        if not secret:
            raise ValueError("webhook secret must not be empty")
        self._secret = secret
        self.sink = sink  # signs what it emits when it has a sealer (``open_sink(sealer=)``)
        self.max_body_bytes = max_body_bytes
        self.max_depth = max_depth
        self.deliveries = delivery_log if delivery_log is not None else DeliveryLog(None)
        self.ack_timeout_s = ack_timeout_s
        self.metrics = Metrics()
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_queue)
        self._inflight: set[str] = set()
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
            self.deliveries.record([item.delivery for item in emitted])
        except Exception:  # the ledger's content-id dedupe still catches a redelivery
            log.exception("could not record delivery ids")
        self.metrics.add("events", sum(len(item.envelopes) for item in emitted))
        for item in emitted:
            self._finish(item, None)

    def _finish(self, item: _Item, error: str | None) -> None:
        with self._inflight_lock:
            self._inflight.discard(item.delivery)
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
        return JSONResponse({"status": "refused", "reason": reason, "detail": line}, status_code=status)

    async def _read_body(self, request: Request) -> bytes | None:
        """The raw body, or None once it exceeds the limit (the rest is not read)."""
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
        return b"".join(chunks)

    async def handle(self, request: Request) -> Response:
        self.metrics.add("received")
        try:
            return await self._handle(request)
        except ClientDisconnect:
            return Response(status_code=400)
        except Exception:  # a bug here must not turn a delivery into a 500 and a dropped connection
            delivery = request.headers.get("x-github-delivery")
            log.exception("delivery %.64r could not be handled", delivery)
            self._forget(delivery or "")
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
        try:
            body = await self._read_body(request)
        except ClientDisconnect:
            return Response(status_code=400)
        if body is None:
            return self._refuse(
                413, "too_large", delivery, request, f"body over the {self.max_body_bytes}-byte limit"
            )
        if not verify_signature(self._secret, body, signature):
            return self._refuse(401, "signature_mismatch", delivery, request)
        event = headers.get("x-github-event")
        if not delivery or not event or not DELIVERY_RE.match(delivery) or not EVENT_RE.match(event):
            return self._refuse(400, "headers_missing", delivery, request)
        if self._closed:
            return self._refuse(503, "shutting_down", delivery, request)
        with self._inflight_lock:
            duplicate = delivery in self._inflight or delivery in self.deliveries
            if not duplicate:
                self._inflight.add(delivery)
        if duplicate:
            self.metrics.add("duplicate")
            log.info("duplicate delivery %s (%s) ignored", delivery, event)
            return JSONResponse({"status": "duplicate", "delivery": delivery}, status_code=200)
        return await self._accept(request, body, event, delivery)

    async def _accept(self, request: Request, body: bytes, event: str, delivery: str) -> Response:
        prepare = functools.partial(
            delivery_events,
            event,
            body,
            request.headers.get("content-type", ""),
            delivery=delivery,
            received_at=datetime.now(UTC),
            max_depth=self.max_depth,
            # Only deliveries whose HMAC verified get here, so each of their events may say so.
            attested=hmac_attestation(request.headers.get("x-github-hook-id")),
        )
        try:
            envelopes = await asyncio.to_thread(prepare) if len(body) > _INLINE_BODY_BYTES else prepare()
        except BadBody as bad:
            self._forget(delivery)
            return self._refuse(bad.status, bad.reason, delivery, request, bad.detail)
        except Exception:
            log.exception("delivery %s (%s) could not be mapped to events", delivery, event)
            self._forget(delivery)
            return self._refuse(
                422, "unprocessable", delivery, request, "payload could not be turned into events"
            )
        loop = asyncio.get_running_loop()
        future: asyncio.Future[str | None] = loop.create_future()
        try:
            self._queue.put_nowait(_Item(delivery, envelopes, loop, future))
        except queue.Full:
            self._forget(delivery)
            return self._refuse(503, "queue_full", delivery, request)
        try:
            error = await asyncio.wait_for(asyncio.shield(future), self.ack_timeout_s)
        except TimeoutError:
            error, status = None, "queued"  # still queued: the worker emits it, just not yet
        else:
            status = "accepted"
        if error is not None:
            return self._refuse(503, error, delivery, request)
        self.metrics.add("accepted")
        return JSONResponse(
            {"status": status, "delivery": delivery, "event": event, "events": len(envelopes)},
            status_code=202,
        )

    def _forget(self, delivery: str) -> None:
        with self._inflight_lock:
            self._inflight.discard(delivery)

    def status(self) -> dict[str, Any]:
        return {
            "status": "ok" if self.worker_alive and not self._closed else "degraded",
            "worker_alive": self.worker_alive,
            "queue_depth": self._queue.qsize(),
            "deliveries_remembered": len(self.deliveries),
            "max_body_bytes": self.max_body_bytes,
            **self.metrics.snapshot(),
        }


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


# The ledger door's reason code (schemas.codec) → this receiver's answer.
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
    ack_timeout_s: float = 5.0,
    max_queue: int = 10_000,
    path: str = "/webhook",
    max_depth: int = DEFAULT_MAX_DEPTH,
) -> Starlette:
    """The receiver as an ASGI app. ``app.state.receiver`` is its ``WebhookReceiver``."""
    receiver = WebhookReceiver(
        secret,
        sink,
        max_body_bytes=max_body_bytes,
        delivery_log=delivery_log,
        ack_timeout_s=ack_timeout_s,
        max_queue=max_queue,
        max_depth=max_depth,
    )

    async def webhook(request: Request) -> Response:
        return await receiver.handle(request)

    async def metrics(request: Request) -> Response:
        return JSONResponse(receiver.status())

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        # Drain on shutdown so that what was acknowledged (or queued) reaches the sink.
        await asyncio.to_thread(receiver.close)

    app = Starlette(
        routes=[
            Route(path, webhook, methods=["POST"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/healthz", metrics, methods=["GET"]),
        ],
        lifespan=lifespan,
    )
    app.state.receiver = receiver
    return app


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
    # Headers (and so signatures) never reach uvicorn's access log: it logs the request line only.
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on", access_log=True)
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
) -> None:
    """Run the receiver with uvicorn until interrupted. Events go to ``open_sink(spool_dir)``, signed
    with the producer key in ``producer_key_file`` (default: the file ``RUNLEDGER_PRODUCER_KEY``
    names; neither: unsigned)."""
    secret = read_secret(secret_file)
    spool = Path(spool_dir) if spool_dir is not None else default_spool_dir()
    sealer = receiver_sealer(producer_key_file)
    deliveries = DeliveryLog(delivery_db if delivery_db is not None else default_delivery_db(spool))
    sink = open_sink(spool, sealer=sealer)
    app = create_app(secret, sink, max_body_bytes=max_body_bytes, delivery_log=deliveries)
    started = time.monotonic()
    try:
        build_server(app, host, port, log_level=log_level).run()
    finally:
        app.state.receiver.close()
        sink.close()
        deliveries.close()
        log.info("webhook receiver stopped after %.0f s: %s", time.monotonic() - started, app.state.receiver)
