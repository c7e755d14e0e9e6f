"""What the webhook receiver's connections may cost: a cap on open connections, a deadline for a
request's headers, and a budget for the bytes of bodies not yet verified.

uvicorn bounds none of these by itself: a connection that sends nothing (or one header byte a
second) is kept for ever, so enough idle sockets use up the file descriptors and new deliveries wait
(GitHub gives up after 10 s). ``guarded_h11`` is uvicorn's own h11 protocol with two rules added:

- **header deadline**: a connection that has not sent a whole request head within
  ``header_timeout_s`` of opening (or of its last response, on keep-alive), or is still sending the
  body of a request already answered, is closed;
- **connection cap**: when a new connection would make more than ``max_connections``, the oldest
  connection that is waiting for a request (idle) is closed to make room; when every one is busy
  with a request, the newcomer gets ``503`` with ``Retry-After`` and is closed.

Two rules of HTTP/1.1 that h11 (as uvicorn drives it) does not keep are added too (``SmugglingSafe``):

- a request head carrying both ``Transfer-Encoding`` and ``Content-Length`` is refused with ``400``
  and its connection closed (RFC 9112 §6.3: such a request may be a smuggling attempt, and the
  connection must not be reused after it; h11 lets the Transfer-Encoding win and reads the next
  request from what a front end would have taken for this one's body);
- a malformed message that arrives while its request is already in the app's hands (a bad chunk
  size in a body) gets uvicorn's ``400`` and a close, and the app's own answer is dropped, instead
  of the app writing a response h11 can no longer send (an "Exception in ASGI application").

``UnverifiedBudget`` is the receiver's: the bytes of bodies being read before their signature is
checked, together, stay under a bound (a body that would cross it is refused with 503 before it is
read, by its ``Content-Length``, or as its chunks arrive).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from typing import Any

import h11
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

log = logging.getLogger("runledger.github_webhook")

DEFAULT_HEADER_TIMEOUT_S = 5.0
DEFAULT_MAX_CONNECTIONS = 256
DEFAULT_MAX_UNVERIFIED_BYTES = 64 * 1024 * 1024


@dataclass
class ConnectionStats:
    """Counters the guarded protocol keeps (shown by the receiver's ``/metrics``)."""

    open: int = 0
    header_timeouts: int = 0
    evicted: int = 0
    refused: int = 0
    opened_total: int = 0

    def snapshot(self) -> dict[str, int]:
        return {
            "open": self.open,
            "opened_total": self.opened_total,
            "header_timeouts": self.header_timeouts,
            "evicted_idle": self.evicted,
            "refused_full": self.refused,
        }


@dataclass
class ConnectionLimits:
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    stats: ConnectionStats = field(default_factory=ConnectionStats)


_FULL_BODY = json.dumps(
    {"status": "refused", "reason": "too_many_connections", "detail": "too many open connections; retry"}
).encode()
_FULL_RESPONSE = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
    b"connection: close\r\ncontent-length: " + str(len(_FULL_BODY)).encode() + b"\r\n\r\n" + _FULL_BODY
)


class SmugglingSafeConnection(h11.Connection):
    """h11's server side, refusing a request head that carries both Transfer-Encoding and
    Content-Length (uvicorn answers the ``RemoteProtocolError`` with 400 and closes)."""

    def next_event(self) -> Any:
        event = super().next_event()
        if isinstance(event, h11.Request):
            names = {name.lower() for name, _ in event.headers}
            if b"transfer-encoding" in names and b"content-length" in names:
                raise h11.RemoteProtocolError("both Transfer-Encoding and Content-Length", 400)
        return event


def smuggling_safe_connection(config: Config) -> SmugglingSafeConnection:
    """The h11 connection uvicorn would make for ``config``, as a ``SmugglingSafeConnection``."""
    max_size = config.h11_max_incomplete_event_size
    if max_size is None:
        return SmugglingSafeConnection(h11.SERVER)
    return SmugglingSafeConnection(h11.SERVER, max_size)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline and a connection cap (``limits``), refusing
    smuggling-shaped requests (``SmugglingSafeConnection``)."""

    limits: ConnectionLimits = ConnectionLimits()

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.conn = smuggling_safe_connection(config)

    def send_400_response(self, msg: str) -> None:
        # A malformed body of a request already in the app's hands: the app's answer is dropped
        # (its cycle is disconnected), uvicorn's 400 goes out, or just a close where the app's
        # response has already begun.
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()
            if cycle.response_started:
                self.transport.close()
                return
        super().send_400_response(msg)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        stats = self.limits.stats
        stats.opened_total += 1
        self._waiting_since = self.loop.time()
        self._deadline: asyncio.TimerHandle | None = None
        if len(self.connections) > self.limits.max_connections and not self._make_room():
            stats.refused += 1
            self.transport.write(_FULL_RESPONSE)
            self.transport.close()
            return
        stats.open = len(self.connections)
        self._arm_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._cancel_deadline()
        self.limits.stats.open = len(self.connections)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # Waiting for the next request head (keep-alive), or for the rest of a body already refused.
        self._waiting_since = self.loop.time()
        self._arm_deadline()

    # -- the rules ---------------------------------------------------------------------------
    def waiting_for_request(self) -> bool:
        """No request in the app's hands: awaiting a (whole) request head, or the tail of a body
        whose request was already answered."""
        if self.transport is None or self.transport.is_closing():
            return False
        if self.conn.their_state is h11.IDLE:
            return True
        return self.conn.our_state in (h11.DONE, h11.MUST_CLOSE) and self.conn.their_state is h11.SEND_BODY

    def _make_room(self) -> bool:
        """Close the connection that has waited longest for a request; False when none waits."""
        idle = [
            c
            for c in self.connections
            if c is not self and isinstance(c, GuardedH11Protocol) and c.waiting_for_request()
        ]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c._waiting_since)
        self.limits.stats.evicted += 1
        oldest.close_idle()
        return True

    def close_idle(self) -> None:
        self._cancel_deadline()
        if not self.transport.is_closing():
            self.transport.close()

    def _arm_deadline(self) -> None:
        self._cancel_deadline()
        self._deadline = self.loop.call_later(self.limits.header_timeout_s, self._on_deadline)

    def _cancel_deadline(self) -> None:
        deadline = getattr(self, "_deadline", None)
        if deadline is not None:
            deadline.cancel()
            self._deadline = None

    def _on_deadline(self) -> None:
        self._deadline = None
        # A request in the app's hands is bounded there (body read time, acknowledgement time);
        # its response re-arms this deadline.
        if self.waiting_for_request():
            self.limits.stats.header_timeouts += 1
            log.info("closed a connection that sent no request within %.1f s", self.limits.header_timeout_s)
            self.close_idle()


def guarded_h11(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """A protocol class for ``uvicorn.Config(http=…)`` that holds connections to ``limits``."""
    return type("GuardedH11", (GuardedH11Protocol,), {"limits": limits})


class UnverifiedBudget:
    """Bytes of bodies being read before their signature is checked, all requests together (the
    event loop's thread only: no lock)."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_UNVERIFIED_BYTES) -> None:
        self.max_bytes = max_bytes
        self.held = 0
        self.peak = 0

    def reserve(self, n: int) -> bool:
        if self.held + n > self.max_bytes:
            return False
        self.held += n
        self.peak = max(self.peak, self.held)
        return True

    def release(self, n: int) -> None:
        self.held = max(0, self.held - n)

    def snapshot(self) -> dict[str, Any]:
        return {"held": self.held, "peak": self.peak, "max": self.max_bytes}
