"""The webhook receiver, over HTTP: a real uvicorn on 127.0.0.1, restarted where a test needs it."""

from __future__ import annotations

import json
import logging
import random
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette

from runledger.ingest.bus import SpoolSink
from runledger.ingest.github_webhook import DeliveryLog, create_app, signature_of, verify_signature
from tests.support.github import fixture_json, read_events, running_uvicorn, spool_bytes

SECRET = b"It's a Secret to Everybody"
VECTOR = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"
LIMIT = 64 * 1024


@dataclass
class Receiver:
    url: str
    app: Starlette
    spool: Path

    def events(self) -> list[Any]:
        return read_events(self.spool)

    def status(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/metrics", headers={"Accept": "application/json"}).json()


@pytest.fixture
def receiver(spool_dir: Path, tmp_path: Path) -> Iterator[Receiver]:
    sink = SpoolSink(spool_dir)
    deliveries = DeliveryLog(tmp_path / "deliveries.sqlite")
    app = create_app(SECRET, sink, max_body_bytes=LIMIT, delivery_log=deliveries)
    try:
        with running_uvicorn(app) as url:
            yield Receiver(url, app, spool_dir)
    finally:
        sink.close()
        deliveries.close()


def headers_for(
    body: bytes, event: str, delivery: str | None = None, secret: bytes = SECRET
) -> dict[str, str]:
    return {
        "Content-Type": "application/json",
        "User-Agent": "GitHub-Hookshot/044aadd",
        "X-GitHub-Event": event,
        "X-GitHub-Delivery": delivery or str(uuid.uuid4()),
        "X-GitHub-Hook-ID": "109948940",
        "X-Hub-Signature-256": signature_of(secret, body),
    }


def post(url: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(f"{url}/webhook", content=body, headers=headers, timeout=10)


def fixture_body(name: str) -> bytes:
    return json.dumps(fixture_json(name)).encode()


def test_github_signature_test_vector() -> None:
    # GitHub's documented example (docs: "Validating webhook deliveries").
    assert signature_of(SECRET, b"Hello, World!") == VECTOR
    assert verify_signature(SECRET, b"Hello, World!", VECTOR)
    assert not verify_signature(SECRET, b"Hello, World!", "sha256=" + "0" * 64)
    assert not verify_signature(SECRET, b"Hello, World!", VECTOR.upper())
    assert not verify_signature(SECRET, b"Hello, World!", None)
    assert not verify_signature(SECRET, b"Hello, World!", VECTOR + "é")  # odd bytes: no crash


def test_vector_signature_is_accepted_over_http_and_its_body_refused_as_not_json(receiver: Receiver) -> None:
    headers = headers_for(b"Hello, World!", "push")
    assert headers["X-Hub-Signature-256"] == VECTOR
    response = post(receiver.url, b"Hello, World!", headers)
    assert response.status_code == 400  # the signature passed: only then is the body parsed
    assert response.json()["reason"] == "bad_json"
    assert receiver.events() == []


def test_wrong_secret_is_401_and_stores_nothing(receiver: Receiver) -> None:
    body = fixture_body("webhook_issues_edited.json")
    response = post(receiver.url, body, headers_for(body, "issues", secret=b"not the secret"))
    assert response.status_code == 401
    assert response.json()["reason"] == "signature_mismatch"
    assert receiver.events() == []


def test_missing_signature_header_is_401(receiver: Receiver) -> None:
    body = fixture_body("webhook_issues_edited.json")
    headers = headers_for(body, "issues")
    del headers["X-Hub-Signature-256"]
    response = post(receiver.url, body, headers)
    assert response.status_code == 401
    assert response.json()["reason"] == "signature_missing"
    assert receiver.events() == []


def test_truncated_body_fails_the_signature(receiver: Receiver) -> None:
    body = fixture_body("webhook_issues_edited.json")
    headers = headers_for(body, "issues")
    response = post(receiver.url, body[: len(body) // 2], headers)
    assert response.status_code == 401
    assert receiver.events() == []


def test_oversized_body_is_413_by_content_length_and_while_reading(receiver: Receiver) -> None:
    body = json.dumps({"zen": "x" * (LIMIT + 10)}).encode()
    response = post(receiver.url, body, headers_for(body, "ping"))
    assert response.status_code == 413

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit is enforced as bytes arrive
        for i in range(0, len(body), 4096):
            yield body[i : i + 4096]

    response = httpx.post(
        f"{receiver.url}/webhook", content=chunks(), headers=headers_for(body, "ping"), timeout=10
    )
    assert response.status_code == 413
    assert receiver.status()["refused"]["too_large"] == 2
    assert receiver.events() == []


def test_non_json_and_missing_event_headers_are_400(receiver: Receiver) -> None:
    body = b"<xml>not json</xml>"
    assert post(receiver.url, body, headers_for(body, "issues")).status_code == 400
    body = b"[1, 2, 3]"  # JSON, but not an object
    assert post(receiver.url, body, headers_for(body, "issues")).status_code == 400
    body = fixture_body("webhook_issues_edited.json")
    headers = headers_for(body, "issues")
    del headers["X-GitHub-Event"]
    response = post(receiver.url, body, headers)
    assert response.status_code == 400
    assert response.json()["reason"] == "headers_missing"
    assert receiver.events() == []


# (event, fixture, type, fact, subject): a webhook event's id names its delivery, its fact what it is.
TYPED = [
    (
        "issues",
        "webhook_issues_edited.json",
        "github.issues",
        "issues/3/edited/2024-03-03T09:30:00Z/content:",
        "issue/3",
    ),
    (
        "pull_request",
        "webhook_pull_request_closed.json",
        "github.pull_request",
        "pull_request/2/merged/2024-03-02T11:00:00Z",
        "pull/2",
    ),
    (
        "pull_request_review",
        "webhook_pull_request_review_submitted.json",
        "github.pull_request_review",
        "review/81/approved",
        "pull/2",
    ),
    (
        "issue_comment",
        "webhook_issue_comment_created.json",
        "github.issue_comment",
        "issue_comment/1002/created/2024-03-02T12:00:00Z",
        "issue/2",
    ),
    (
        "pull_request_review_comment",
        "webhook_pull_request_review_comment_created.json",
        "github.pull_request_review_comment",
        "review_comment/2001/created/2024-03-01T16:00:00Z",
        "pull/2",
    ),
]


@pytest.mark.parametrize(("event", "fixture", "type_", "fact", "subject"), TYPED)
def test_typed_events(
    receiver: Receiver, event: str, fixture: str, type_: str, fact: str, subject: str
) -> None:
    body = fixture_body(fixture)
    delivery = str(uuid.uuid4())
    response = post(receiver.url, body, headers_for(body, event, delivery))
    assert response.status_code == 202, response.text
    assert response.json()["status"] == "accepted"
    [stored] = receiver.events()
    envelope = stored.envelope
    assert (envelope.type, envelope.id, envelope.subject) == (type_, f"delivery/{delivery}/0", subject)
    assert (envelope.source, envelope.stream, envelope.seq) == (
        "github-webhook/octo-org/hello-world",
        "octo-org/hello-world",
        0,
    )
    if fact.endswith("content:"):  # an edit's fact ends with a hash of what the edit left
        assert envelope.data.fact.startswith(fact) and len(envelope.data.fact) == len(fact) + 16
    else:
        assert envelope.data.fact == fact
    assert envelope.data.via == "webhook"
    assert envelope.data.action == json.loads(body)["action"]


def test_pull_request_fields(receiver: Receiver) -> None:
    body = fixture_body("webhook_pull_request_closed.json")
    assert post(receiver.url, body, headers_for(body, "pull_request")).status_code == 202
    pr = receiver.events()[0].envelope.data
    assert pr.merged and pr.merge_commit_sha == "e5bd3914e2e596debea16f433f57875b5b90bcd6"
    assert pr.head_sha == "553c2077f0edc3d5dc5d17262f6aa498e69d6f8e" and pr.base_ref == "main"
    assert pr.labels == ["training"] and pr.changed_files_count == 2 and pr.changed_files is None
    assert pr.actor == "octocat" and pr.author == "octocat"


def test_push_becomes_a_push_and_its_commits(receiver: Receiver) -> None:
    body = fixture_body("webhook_push.json")
    assert post(receiver.url, body, headers_for(body, "push")).status_code == 202
    events = [e.envelope for e in receiver.events()]
    assert [e.type for e in events] == ["github.push", "github.commit", "github.commit"]
    push = events[0]
    delivery = push.id.split("/")[1]
    assert [e.id for e in events] == [f"delivery/{delivery}/{n}" for n in range(3)]  # one delivery, 3 events
    assert push.data.fact == (
        "push/refs/heads/main/6dcb09b5b57875f334f61aebed695e2e4193db5e/e5bd3914e2e596debea16f433f57875b5b90bcd6"
    )
    assert [e.data.fact for e in events[1:]] == [f"commit/{e.data.sha}" for e in events[1:]]
    assert push.subject == "ref/refs/heads/main"
    assert [c.sha for c in push.data.commits] == [e.data.sha for e in events[1:]]
    # The +01:00 timestamp of the first commit is the same instant as the REST committer date.
    assert events[1].time.isoformat() == "2024-02-28T09:00:00+00:00"


@pytest.mark.parametrize(
    ("event", "fixture"),
    [("workflow_run", "webhook_workflow_run_completed.json"), ("ping", "webhook_ping.json")],
)
def test_other_events_are_kept_raw(receiver: Receiver, event: str, fixture: str) -> None:
    body = fixture_body(fixture)
    delivery = str(uuid.uuid4())
    assert post(receiver.url, body, headers_for(body, event, delivery)).status_code == 202
    [stored] = receiver.events()
    assert stored.envelope.type == "github.raw"
    assert stored.envelope.id == f"delivery/{delivery}/0"
    assert stored.envelope.data.fact == f"raw/{event}/{delivery}"  # each delivery of it is its own fact
    assert stored.envelope.data.payload == json.loads(body)
    assert stored.envelope.data.event == event and stored.envelope.data.delivery == delivery


def test_malformed_typed_payload_is_kept_raw_not_dropped(receiver: Receiver) -> None:
    payload = fixture_json("webhook_issues_edited.json")
    del payload["issue"]["updated_at"]
    body = json.dumps(payload).encode()
    assert post(receiver.url, body, headers_for(body, "issues")).status_code == 202
    [stored] = receiver.events()
    assert stored.envelope.type == "github.raw" and stored.envelope.data.event == "issues"


def test_form_encoded_delivery_is_accepted(receiver: Receiver) -> None:
    body = str(httpx.QueryParams({"payload": json.dumps(fixture_json("webhook_ping.json"))})).encode()
    headers = headers_for(body, "ping") | {"Content-Type": "application/x-www-form-urlencoded"}
    assert post(receiver.url, body, headers).status_code == 202
    assert receiver.events()[0].envelope.data.payload["zen"] == "Design for failure."


def test_replayed_delivery_is_stored_once(receiver: Receiver) -> None:
    body = fixture_body("webhook_issues_edited.json")
    headers = headers_for(body, "issues", "72d3162e-cc78-11e3-81ab-4c9367dc0958")
    first = post(receiver.url, body, headers)
    again = post(receiver.url, body, headers)
    assert first.status_code == 202
    assert again.status_code == 200 and again.json()["status"] == "duplicate"
    assert len(receiver.events()) == 1
    # The same signed body under a second delivery id is a replay (GitHub signs the body only):
    # refused, nothing more stored (tests/github/test_webhook_doors.py has the other replays).
    replay = post(receiver.url, body, headers_for(body, "issues"))
    assert replay.status_code == 409 and replay.json()["reason"] == "replayed_body"
    assert len(receiver.events()) == 1
    assert receiver.status()["counts"]["duplicate"] == 1


def test_redelivery_after_a_restart_is_still_a_duplicate(tmp_path: Path) -> None:
    db = tmp_path / "deliveries.sqlite"
    body = fixture_body("webhook_issues_edited.json")
    headers = headers_for(body, "issues", "d0e1f2a3-0000-4000-8000-000000000001")
    for attempt, expected in enumerate([202, 200]):
        sink = SpoolSink(tmp_path / "spool")
        deliveries = DeliveryLog(db)
        with running_uvicorn(create_app(SECRET, sink, delivery_log=deliveries)) as url:
            response = post(url, body, headers)
            assert response.status_code == expected, (attempt, response.text)
        sink.close()
        deliveries.close()
    assert len(read_events(tmp_path / "spool")) == 1


def test_delivery_log_is_bounded(tmp_path: Path) -> None:
    log = DeliveryLog(tmp_path / "d.sqlite", max_entries=10)
    log.record([f"id-{i}" for i in range(25)])
    assert "id-24" in log and "id-15" in log and "id-14" not in log
    log.close()
    reopened = DeliveryLog(tmp_path / "d.sqlite", max_entries=10)
    assert len(reopened) == 10 and "id-15" in reopened and "id-14" not in reopened
    reopened.close()


def test_metrics_and_healthz_count_refusals_by_reason(receiver: Receiver) -> None:
    body = fixture_body("webhook_ping.json")
    post(receiver.url, body, headers_for(body, "ping", secret=b"wrong"))
    post(receiver.url, body, headers_for(body, "ping", secret=b"wrong"))
    headers = headers_for(body, "ping")
    del headers["X-Hub-Signature-256"]
    post(receiver.url, body, headers)
    assert post(receiver.url, body, headers_for(body, "ping")).status_code == 202
    status = receiver.status()
    assert status["refused"]["signature_mismatch"] == 2
    assert status["refused"]["signature_missing"] == 1
    assert status["counts"]["accepted"] == 1 and status["counts"]["events"] == 1
    health = httpx.get(f"{receiver.url}/healthz").json()
    assert health["status"] == "ok" and health["worker_alive"]


def test_secret_never_logged_or_stored(receiver: Receiver, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    body = fixture_body("webhook_issues_edited.json")
    post(receiver.url, body, headers_for(body, "issues", secret=b"wrong"))
    post(receiver.url, body, headers_for(body, "issues"))
    post(receiver.url, b"nope", headers_for(b"nope", "issues"))
    text = caplog.text + repr(receiver.app.state.receiver) + json.dumps(receiver.status())
    assert "refused" in caplog.text
    assert SECRET.decode() not in text
    assert SECRET not in spool_bytes(receiver.spool)


def _issue_delivery(i: int) -> tuple[bytes, dict[str, str]]:
    payload = fixture_json("webhook_issues_edited.json")
    payload["issue"] = dict(
        payload["issue"], number=1000 + i, updated_at=f"2024-04-01T{i // 60 % 24:02d}:{i % 60:02d}:00Z"
    )
    body = json.dumps(payload).encode()
    return body, headers_for(body, "issues", f"00000000-0000-4000-8000-{i:012d}")


def test_flood_of_concurrent_deliveries_loses_nothing_and_stores_each_once(receiver: Receiver) -> None:
    n, replays, clients = 500, 100, 32
    deliveries = [_issue_delivery(i) for i in range(n)]
    rng = random.Random(7)
    work = deliveries + [deliveries[rng.randrange(n)] for _ in range(replays)]
    rng.shuffle(work)

    local = threading.local()

    def send(item: tuple[bytes, dict[str, str]]) -> int:
        # One keep-alive client per thread: 32 concurrent clients, as GitHub's senders would be.
        client = getattr(local, "client", None)
        if client is None:
            client = local.client = httpx.Client(base_url=receiver.url, timeout=30)
        return client.post("/webhook", content=item[0], headers=item[1]).status_code

    with ThreadPoolExecutor(clients) as pool:
        statuses = list(pool.map(send, work))
    assert statuses.count(202) == n  # the first arrival of each delivery, whichever copy it was
    assert statuses.count(200) == replays
    events = receiver.events()
    assert len(events) == n
    assert len({e.envelope.id for e in events}) == n
    assert sorted(e.envelope.data.number for e in events) == [1000 + i for i in range(n)]
    status = receiver.status()
    assert status["counts"]["accepted"] == n and status["counts"]["duplicate"] == replays
