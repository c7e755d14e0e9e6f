"""The webhook receiver's doors, attacked over real sockets on 127.0.0.1 (uvicorn as ``build_server``
runs it): 202 only for what is on disk, idle and trickling connections and unverified bodies held to
bounds, replayed bodies refused, and /metrics in Prometheus' text format."""

from __future__ import annotations

import contextlib
import json
import re
import select
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette

from runledger.ingest.bus import SpoolSink
from runledger.ingest.github_webhook import DeliveryLog, build_server, create_app, signature_of
from runledger.schemas import Envelope
from tests.support.github import fixture_json, read_events

SECRET = b"doors hold"
HOOK = "109948940"


class SlowDisk:
    """The real spool, whose fsync waits until ``release`` is set: a disk that is frozen or slow."""

    def __init__(self, spool: Path) -> None:
        self.spool = SpoolSink(spool)
        self.release = threading.Event()

    def emit(self, envelope: Envelope) -> None:
        self.spool.emit(envelope)

    def sync(self) -> None:
        self.release.wait(30)
        self.spool.sync()

    def close(self) -> None:
        self.release.set()
        self.spool.close()


@dataclass
class Served:
    url: str
    port: int
    app: Starlette

    def health(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/healthz", timeout=10, trust_env=False).json()


@contextlib.contextmanager
def serving(app: Starlette) -> Iterator[Served]:
    """The receiver under uvicorn exactly as ``ledger serve webhooks`` builds it (port 0)."""
    server = build_server(app, "127.0.0.1", 0, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(1000):  # bounded: 10 s
        if server.started or not thread.is_alive():
            break
        time.sleep(0.01)
    assert server.started, "uvicorn did not start"
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield Served(f"http://127.0.0.1:{port}", port, app)
    finally:
        server.should_exit = True
        thread.join(15)


def receiver(tmp_path: Path, sink: Any = None, **options: Any) -> tuple[Starlette, Path, DeliveryLog]:
    spool = tmp_path / "spool"
    deliveries = DeliveryLog(tmp_path / "deliveries.sqlite")
    app = create_app(SECRET, sink or SpoolSink(spool), delivery_log=deliveries, **options)
    return app, spool, deliveries


def headers_for(body: bytes, event: str, delivery: str | None = None, hook: str = HOOK) -> dict[str, str]:
    return {
        "Content-Type": "application/json",
        "X-GitHub-Event": event,
        "X-GitHub-Delivery": delivery or str(uuid.uuid4()),
        "X-GitHub-Hook-ID": hook,
        "X-Hub-Signature-256": signature_of(SECRET, body),
    }


def post(url: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(f"{url}/webhook", content=body, headers=headers, timeout=10, trust_env=False)


def body_of(name: str) -> bytes:
    return json.dumps(fixture_json(name)).encode()


def request_head(length: int, headers: dict[str, str]) -> bytes:
    lines = ["POST /webhook HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {length}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def closed_by_server(sock: socket.socket, within_s: float) -> bool:
    """Whether the server closes ``sock`` (EOF or reset) within ``within_s`` (bounded wait)."""
    sock.settimeout(within_s)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except OSError:
        return True
    return True


def read_response(sock: socket.socket) -> bytes:
    """One whole HTTP response (head and its Content-Length of body) from ``sock``."""
    sock.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed after {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: *(\d+)", head)[1])  # type: ignore[index]
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed mid-body"
        rest += chunk
    return head + b"\r\n\r\n" + rest


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


# ------------------------------------------------------------------ 202 only for what is durable


def test_a_delivery_not_on_disk_in_time_is_answered_503_and_never_202(tmp_path: Path) -> None:
    disk = SlowDisk(tmp_path / "spool")
    app, spool, deliveries = receiver(tmp_path, disk, ack_timeout_s=0.5)
    body = body_of("webhook_issues_edited.json")
    headers = headers_for(body, "issues")
    try:
        with serving(app) as served:
            first = post(served.url, body, headers)
            assert first.status_code == 503, first.text  # not 202 "queued": GitHub would not redeliver
            assert first.json()["reason"] == "not_durable" and int(first.headers["Retry-After"]) > 0
            # GitHub's redelivery while the write is still stuck: not "duplicate", which is a 2xx.
            again = post(served.url, body, headers)
            assert again.status_code == 503 and again.json()["reason"] == "not_durable"
            disk.release.set()  # the disk thaws: the queued delivery is written once
            for _ in range(500):  # bounded: 10 s
                if served.health()["counts"]["events"] == 1:
                    break
                time.sleep(0.02)
            later = post(served.url, body, headers)
            assert later.status_code == 200 and later.json()["status"] == "duplicate"
            assert served.health()["counts"]["accepted"] == 0  # no 202 was ever given
    finally:
        disk.close()
        deliveries.close()
    assert len(read_events(spool)) == 1


# ------------------------------------------------------------------ connections and bodies, bounded


def test_idle_connections_are_capped_and_do_not_keep_a_signed_delivery_out(tmp_path: Path) -> None:
    app, spool, deliveries = receiver(tmp_path, max_connections=20, header_timeout_s=60)
    idle: list[socket.socket] = []
    try:
        with serving(app) as served:
            for _ in range(200):
                idle.append(socket.create_connection(("127.0.0.1", served.port), timeout=10))
            # The server keeps at most 20: the longest idle make room for the newer ones.
            deadline = time.monotonic() + 10
            open_ = list(idle)
            while len(open_) > 20 and time.monotonic() < deadline:
                readable, _, _ = select.select(open_, [], [], 0.2)
                open_ = [s for s in open_ if s not in readable or not _eof(s)]
            assert len(open_) <= 20, f"{len(open_)} idle connections still held by the server"
            body = body_of("webhook_issues_edited.json")
            response = post(served.url, body, headers_for(body, "issues"))
            assert response.status_code == 202, response.text
            assert served.health()["connections"]["evicted_idle"] >= 180
    finally:
        for sock in idle:
            sock.close()
        app.state.receiver.sink.close()
        deliveries.close()
    assert len(read_events(spool)) == 1


def _eof(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except OSError:
        return True


def test_a_connection_that_trickles_its_request_head_is_closed(tmp_path: Path) -> None:
    app, _, deliveries = receiver(tmp_path, header_timeout_s=0.5)
    try:
        with serving(app) as served:
            sock = socket.create_connection(("127.0.0.1", served.port), timeout=10)
            silent = socket.create_connection(("127.0.0.1", served.port), timeout=10)
            head = request_head(10, {"X-GitHub-Event": "ping"})
            closed = False
            for i in range(100):  # one byte every 50 ms: never a whole head; bounded at 5 s
                try:
                    sock.sendall(head[i : i + 1])
                except OSError:
                    closed = True
                    break
                readable, _, _ = select.select([sock], [], [], 0.05)
                if readable and _eof(sock):
                    closed = True
                    break
            assert closed, "a trickling request head kept its connection for 5 s"
            assert closed_by_server(silent, 5.0), "a connection that sent nothing was kept"
            assert served.health()["connections"]["header_timeouts"] >= 2
            sock.close()
            silent.close()
    finally:
        app.state.receiver.sink.close()
        deliveries.close()


def test_a_body_that_does_not_arrive_in_time_is_408_and_stores_nothing(tmp_path: Path) -> None:
    app, spool, deliveries = receiver(tmp_path, body_timeout_s=0.5, header_timeout_s=60)
    body = body_of("webhook_ping.json")
    try:
        with serving(app) as served:
            with socket.create_connection(("127.0.0.1", served.port), timeout=10) as sock:
                sock.sendall(request_head(len(body), headers_for(body, "ping")) + body[:10])  # then stalls
                answer = read_response(sock)
            assert answer.startswith(b"HTTP/1.1 408") and b"read_timeout" in answer
    finally:
        app.state.receiver.sink.close()
        deliveries.close()
    assert read_events(spool) == []


def test_bodies_not_yet_verified_are_held_to_a_budget(tmp_path: Path) -> None:
    mib = 1024 * 1024
    app, spool, deliveries = receiver(
        tmp_path, max_body_bytes=12 * mib, max_unverified_bytes=24 * mib, body_timeout_s=120
    )
    bad_signature = headers_for(b"something else", "ping")
    socks: list[socket.socket] = []
    try:
        with serving(app) as served:
            # Six forged 12 MiB deliveries at once, each half sent: only two fit the 24 MiB budget.
            for _ in range(6):
                sock = socket.create_connection(("127.0.0.1", served.port), timeout=10)
                sock.sendall(request_head(12 * mib, bad_signature) + b" " * mib)
                socks.append(sock)
            answers: dict[int, bytes] = {}
            deadline = time.monotonic() + 10
            while len(answers) < 4 and time.monotonic() < deadline:
                readable, _, _ = select.select([s for s in socks if s.fileno() not in answers], [], [], 0.2)
                for sock in readable:
                    answers[sock.fileno()] = read_response(sock)
            assert len(answers) == 4, f"{len(answers)} of 4 over-budget bodies refused before being read"
            assert all(a.startswith(b"HTTP/1.1 503") and b'"busy"' in a for a in answers.values())
            assert served.health()["unverified_bytes"]["held"] <= 24 * mib
            for sock in socks:  # the two being read: finished, their forged signature refused
                if sock.fileno() not in answers:
                    sock.sendall(b" " * (11 * mib))
                    assert read_response(sock).startswith(b"HTTP/1.1 401")
            assert served.health()["unverified_bytes"]["held"] == 0
            for sock in socks:
                sock.close()
    finally:
        for sock in socks:
            sock.close()
        app.state.receiver.sink.close()
        deliveries.close()
    assert read_events(spool) == []


def test_a_huge_unsigned_body_is_refused_before_it_is_read(tmp_path: Path) -> None:
    mib = 1024 * 1024
    app, spool, deliveries = receiver(
        tmp_path, max_body_bytes=512 * mib, max_unverified_bytes=512 * mib, header_timeout_s=120
    )
    try:
        with serving(app) as served:
            assert post(served.url, b"{}", {"X-GitHub-Event": "ping"}).status_code == 401  # warm up
            before = rss_bytes()
            sock = socket.create_connection(("127.0.0.1", served.port), timeout=10)
            sock.sendall(request_head(256 * mib, {"X-GitHub-Event": "ping", "X-GitHub-Delivery": "d-1"}))
            answer = read_response(sock)
            assert answer.startswith(b"HTTP/1.1 401") and b"signature_missing" in answer
            chunk = b" " * mib
            with contextlib.suppress(OSError):  # the server may close a refused body's connection
                for _ in range(128):
                    sock.sendall(chunk)
            grown = rss_bytes() - before
            sock.close()
            assert grown < 32 * mib, f"RSS grew by {grown / mib:.0f} MiB for a refused 128 MiB body"
            huge = request_head(2 * 1024 * mib, {"X-GitHub-Event": "ping", "X-Hub-Signature-256": "sha256=0"})
            with socket.create_connection(("127.0.0.1", served.port), timeout=10) as over:
                over.sendall(huge)
                assert read_response(over).startswith(b"HTTP/1.1 413")
    finally:
        app.state.receiver.sink.close()
        deliveries.close()
    assert read_events(spool) == []


# ------------------------------------------------------------------ replayed bodies


def test_a_signed_body_replayed_under_another_id_event_or_hook_is_refused(tmp_path: Path) -> None:
    app, spool, deliveries = receiver(tmp_path)
    body = body_of("webhook_issues_edited.json")
    delivery = str(uuid.uuid4())
    with serving(app) as served:
        assert post(served.url, body, headers_for(body, "issues", delivery)).status_code == 202
        assert post(served.url, body, headers_for(body, "issues", delivery)).status_code == 200  # redelivery
        replays = [
            headers_for(body, "issues"),  # a new delivery id
            headers_for(body, "push"),  # relabelled: a new id and event name
            headers_for(body, "push", delivery),  # the same id, another event name
            headers_for(body, "issues", delivery, hook="4242"),  # the same id, another hook
        ]
        for headers in replays:
            response = post(served.url, body, headers)
            assert response.status_code == 409, (headers, response.text)
            assert response.json()["reason"] == "replayed_body"
            assert delivery in response.json()["detail"]
        assert served.health()["refused"]["replayed_body"] == len(replays)
    app.state.receiver.sink.close()
    deliveries.close()
    # After a restart the window is still there (the SQLite file beside the spool).
    app, _, deliveries = receiver(tmp_path)
    with serving(app) as served:
        response = post(served.url, body, headers_for(body, "issues"))
        assert response.status_code == 409 and response.json()["reason"] == "replayed_body"
    app.state.receiver.sink.close()
    deliveries.close()
    [stored] = read_events(spool)
    assert stored.envelope.id == f"delivery/{delivery}/0"


@pytest.mark.parametrize(
    ("fixture", "label"),
    [
        ("webhook_issue_comment_created.json", "issues"),  # a comment's body as an issue event
        ("webhook_issues_edited.json", "push"),  # an issue as a push: it would become a new raw fact
        ("webhook_ping.json", "pull_request"),
        ("webhook_pull_request_review_submitted.json", "pull_request"),
    ],
)
def test_a_body_labelled_as_another_event_is_refused(tmp_path: Path, fixture: str, label: str) -> None:
    app, spool, deliveries = receiver(tmp_path)
    body = body_of(fixture)
    with serving(app) as served:
        response = post(served.url, body, headers_for(body, label))
        assert response.status_code == 400, response.text
        assert response.json()["reason"] == "event_mismatch" and label in response.json()["detail"]
    app.state.receiver.sink.close()
    deliveries.close()
    assert read_events(spool) == []


# ------------------------------------------------------------------ /metrics


SAMPLE = re.compile(
    r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?P<labels>[a-zA-Z_][a-zA-Z0-9_]*="[^"\\\n]*"'
    r'(,[a-zA-Z_][a-zA-Z0-9_]*="[^"\\\n]*")*)\})? (?P<value>-?[0-9.e+]+|NaN|[+-]Inf)$'
)


def parse_exposition(text: str) -> dict[str, float]:
    """Prometheus text format 0.0.4, strictly: every sample's family typed before it, nothing else."""
    typed: dict[str, str] = {}
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge") and name not in typed
            typed[name] = kind
            continue
        if line.startswith("# HELP "):
            continue
        match = SAMPLE.match(line)
        assert match, f"not a sample line: {line!r}"
        assert match["name"] in typed, f"{match['name']} has no TYPE line before it"
        if typed[match["name"]] == "counter":
            assert match["name"].endswith("_total")
        key = match["name"] + (f"{{{match['labels']}}}" if match["labels"] else "")
        samples[key] = float(match["value"])
    return samples


def test_metrics_speak_prometheus_text_and_json_on_request(tmp_path: Path) -> None:
    app, _, deliveries = receiver(tmp_path)
    body = body_of("webhook_ping.json")
    with serving(app) as served:
        post(served.url, body, headers_for(body, "ping") | {"X-Hub-Signature-256": "sha256=" + "0" * 64})
        assert post(served.url, body, headers_for(body, "ping")).status_code == 202
        response = httpx.get(f"{served.url}/metrics", timeout=10, trust_env=False)
        assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
        samples = parse_exposition(response.text)
        assert samples['runledger_webhook_refused_total{reason="signature_mismatch"}'] == 1
        assert samples['runledger_webhook_requests_total{outcome="accepted"}'] == 1
        assert samples["runledger_webhook_events_total"] == 1
        assert samples["runledger_webhook_worker_up"] == 1
        assert samples["runledger_webhook_connections_open"] >= 1
        as_json = httpx.get(f"{served.url}/metrics", headers={"Accept": "application/json"}, timeout=10)
        assert as_json.json()["refused"]["signature_mismatch"] == 1
    app.state.receiver.sink.close()
    deliveries.close()
