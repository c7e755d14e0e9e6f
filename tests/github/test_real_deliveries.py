"""Real GitHub webhook payloads (octokit's recorded examples of 58 event types) through the real receiver.

Each delivery is POSTed to uvicorn on 127.0.0.1 with a real HMAC signature and its own GUID, then
``ledger ingest spool`` and ``ledger verify`` run as the commands a user types. What is checked: no
delivery is lost or merged into another (the identity rule of ``runledger.ingest.github_events``), a
redelivery adds nothing, the ledger verifies untouched and still catches a tampered row, every row
names its repository, and hostile bodies get a 4xx without losing the connection or anything accepted.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from starlette.applications import Starlette

from runledger.ingest.bus import SpoolSink
from runledger.ingest.github_backfill import backfill
from runledger.ingest.github_webhook import DeliveryLog, create_app, signature_of
from runledger.ledger.integrity import verify_ledger
from runledger.ledger.query import Reader
from tests.support.github import ROOT, FixtureGitHub, fixture_json, read_events, running_uvicorn

SECRET = b"real deliveries, real signatures"
LIMIT = 256 * 1024  # every octokit example fits; "huge" is just over it
REPO = "octo-org/hello-world"


@dataclass
class Receiver:
    url: str
    app: Starlette
    spool: Path
    client: httpx.Client  # one keep-alive connection, as GitHub's sender reuses one

    def deliver(self, event: str, payload: Any, delivery: str | None = None) -> httpx.Response:
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        return self.client.post("/webhook", content=body, headers=signed(body, event, delivery))

    def status(self) -> dict[str, Any]:
        return self.client.get("/healthz").json()


def signed(body: bytes, event: str, delivery: str | None = None) -> dict[str, str]:
    return {
        "Content-Type": "application/json",
        "User-Agent": "GitHub-Hookshot/044aadd",
        "X-GitHub-Event": event,
        "X-GitHub-Delivery": delivery or str(uuid.uuid4()),
        "X-GitHub-Hook-ID": "109948940",
        "X-Hub-Signature-256": signature_of(SECRET, body),
    }


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    spool = tmp_path / "spool"
    sink = SpoolSink(spool)
    deliveries = DeliveryLog(tmp_path / "deliveries.sqlite")
    app = create_app(SECRET, sink, max_body_bytes=LIMIT, delivery_log=deliveries)
    try:
        # trust_env=False: no proxy or CA settings from the environment for a 127.0.0.1 server.
        with running_uvicorn(app) as url, httpx.Client(base_url=url, timeout=30, trust_env=False) as client:
            yield Receiver(url, app, spool, client)
    finally:
        sink.close()
        deliveries.close()


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """A ``ledger`` command as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "runledger.cli.main", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )


def ingest_and_verify(spools: list[Path], ledger: Path) -> None:
    for spool in spools:
        done = cli("ingest", "spool", "--spool", str(spool), "--ledger", str(ledger))
        assert done.returncode == 0, done.stderr
    verified = cli("verify", "--ledger", str(ledger), "--keys", str(ledger.parent / "no-keys"))
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "FAILED" not in verified.stdout


def records(ledger: Path, sql: str, *params: Any) -> list[dict[str, Any]]:
    """The rows ``ledger query`` answers, at the ledger's newest snapshot."""
    reader = Reader(ledger)
    try:
        return reader.sql(sql, list(params)).records()
    finally:
        reader.close()


def delivery_guid(event: str, n: int) -> str:
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"octokit/{event}/{n}"))


def examples_of(octokit_examples: list[dict[str, Any]], event: str, action: str | None = None) -> list[Any]:
    [entry] = [e for e in octokit_examples if e["name"] == event]
    return [copy.deepcopy(p) for p in entry["examples"] if action is None or p.get("action") == action]


# ------------------------------------------------------------------------- every real delivery


def test_every_real_delivery_is_kept_and_the_ledger_verifies(
    octokit_examples: list[dict[str, Any]], receiver: Receiver, tmp_path: Path
) -> None:
    sent: dict[str, tuple[str, dict[str, Any]]] = {}  # GUID → (event, payload)
    events_of: dict[str, int] = {}  # GUID → events the receiver said it made
    bodies: set[str] = set()
    for entry in octokit_examples:
        for n, payload in enumerate(entry["examples"]):
            guid = delivery_guid(entry["name"], n)
            response = receiver.deliver(entry["name"], payload, guid)
            body = json.dumps(payload)
            if body in bodies:  # octokit repeats 5 examples byte for byte: a signed body replayed
                assert response.status_code == 409, (entry["name"], n, response.text)
                continue
            bodies.add(body)
            assert response.status_code == 202, (entry["name"], n, response.text)
            assert response.json()["status"] == "accepted"
            sent[guid] = (entry["name"], payload)
            events_of[guid] = response.json()["events"]
    assert len(octokit_examples) == 58 and len(sent) == 324
    assert min(events_of.values()) >= 1

    # GitHub redelivering the same GUIDs: answered as duplicates, nothing more on the spool.
    spooled = len(read_events(receiver.spool))
    for guid, (event, payload) in list(sent.items())[::7]:
        response = receiver.deliver(event, payload, guid)
        assert response.status_code == 200 and response.json()["status"] == "duplicate"
    assert len(read_events(receiver.spool)) == spooled == sum(events_of.values())

    ledger = tmp_path / "ledger"
    ingest_and_verify([receiver.spool], ledger)
    assert verify_ledger(ledger).ok  # and as a library call, with every problem listed if not

    # Every delivery is its own events in the log: counted per GUID, nothing merged, nothing lost.
    logged = records(ledger, "SELECT source, id FROM events")
    per_delivery = Counter(r["id"].split("/")[1] for r in logged)
    assert per_delivery == Counter(events_of)
    assert all(r["source"].startswith("github-webhook/") and r["id"].startswith("delivery/") for r in logged)

    # Every (event, action) of the examples is a row of github_all; pushes also list their commits.
    rows = records(ledger, "SELECT * FROM github_all")
    assert len(rows) == len(logged)
    seen = Counter((r["kind"].removeprefix("raw:"), r["action"]) for r in rows if r["kind"] != "commit")
    wanted = Counter((event, payload.get("action")) for event, payload in sent.values())
    assert seen == wanted
    assert sum(1 for r in rows if r["kind"] == "issues") == 29
    issue_actions = {r["action"] for r in records(ledger, "SELECT action FROM github WHERE kind = 'issues'")}
    assert {"opened", "labeled", "assigned", "edited", "milestoned", "pinned", "transferred"} <= issue_actions
    assert issue_actions == {p["action"] for p in examples_of(octokit_examples, "issues")}

    # The github view: one row per fact. octokit's variants of one delivery (the same issue, action,
    # second and label, with or without an organisation) are one fact seen several times.
    facts = records(ledger, "SELECT fact, observations, observed_via FROM github")
    assert sum(f["observations"] for f in facts) == len(rows)
    assert all(f["observed_via"] == ["webhook"] for f in facts)
    assert len({f["fact"] for f in facts}) == len(facts)

    # Every row names its repository when the payload does; org-level events name their organisation.
    by_delivery = {
        r["id"].split("/")[1]: r for r in records(ledger, "SELECT id, stream, stream_seq FROM events")
    }
    raw = {(r["stream"], r["stream_seq"]): r for r in rows if r["kind"].startswith("raw:")}
    checked = Counter[str]()
    for guid, (event, payload) in sent.items():
        where = by_delivery[guid]
        row = raw.get((where["stream"], where["stream_seq"]))
        if row is None:
            continue  # typed: its repo comes from the typed payload (checked below)
        repository = payload.get("repository") or {}
        organization = payload.get("organization") or {}
        assert row["repo"] == repository.get("full_name"), (event, row["repo"])
        assert row["org"] == organization.get("login"), (event, row["org"])
        checked["repo" if row["repo"] else "org" if row["org"] else "neither"] += 1
    # (octokit 7.6.1: 241 untyped deliveries kept, the 5 repeated bodies refused as replays; 22 name
    # neither, e.g. marketplace_purchase, sponsorship)
    assert checked == {"repo": 197, "org": 22, "neither": 22}
    assert all(r["repo"] for r in rows if not r["kind"].startswith("raw:"))
    assert records(ledger, "SELECT count(*) AS n FROM github_all WHERE repo = ''") == [{"n": 0}]


def test_verify_still_catches_a_tampered_github_row(
    octokit_examples: list[dict[str, Any]], receiver: Receiver, tmp_path: Path
) -> None:
    for event in ("ping", "issues", "installation"):  # a repository's, a typed and an org-level event
        for n, payload in enumerate(examples_of(octokit_examples, event)[:3]):
            assert receiver.deliver(event, payload, delivery_guid(event, n)).status_code == 202
    ledger = tmp_path / "ledger"
    ingest_and_verify([receiver.spool], ledger)
    for part in sorted((ledger / "data" / "main" / "github").rglob("*.parquet")):  # the lake's files
        table = pq.read_table(part)
        if table.num_rows == 0:
            continue
        body = table.column("body").to_pylist()
        body[0] = (body[0] or "") + " (edited)"
        table = table.set_column(table.schema.get_field_index("body"), "body", pa.array(body, pa.string()))
        pq.write_table(table, part)
        break
    report = verify_ledger(ledger)
    # The file is not the bytes its commit recorded, and the edited row is named by its delivery.
    assert [p.kind for p in report.problems] == ["modified", "table-mismatch"]
    assert part.name in report.problems[0].detail
    assert (report.problems[1].event_id or "").startswith("delivery/")


# ------------------------------------------------------------------------- one second, many facts


def test_actions_within_one_second_are_distinct_facts(
    octokit_examples: list[dict[str, Any]], receiver: Receiver, tmp_path: Path
) -> None:
    second = "2024-05-01T12:00:00Z"
    repository = examples_of(octokit_examples, "issues", "opened")[0]["repository"]

    def issue(action: str, like: str | None = None, **fields: Any) -> dict[str, Any]:
        # octokit records no issues/closed delivery: that one is its reopened twin, renamed.
        payload = examples_of(octokit_examples, "issues", like or action)[0] | {"action": action}
        payload["repository"] = repository
        payload["issue"] |= {"number": 77, "created_at": second, "updated_at": second} | fields
        return payload

    enhancement = issue("labeled")
    enhancement["label"] |= {"name": "enhancement"}
    edited = issue("edited", title="A better title")
    edited["changes"] = {"title": {"from": "Spelling error in the README file"}}
    sequence = [
        ("issues", issue("opened")),
        ("issues", issue("labeled")),
        ("issues", enhancement),
        ("issues", issue("assigned")),
        ("issues", edited),
        ("issues", issue("closed", "reopened", state="closed", closed_at=second)),
        ("issues", issue("reopened", state="open", closed_at=None)),
    ]
    # A pull request's head moving three times within the second (synchronize).
    for n, head in enumerate(["1" * 40, "2" * 40, "3" * 40]):
        payload = examples_of(octokit_examples, "pull_request", "synchronize")[0]
        payload["pull_request"]["updated_at"] = second
        payload["pull_request"]["head"]["sha"] = head
        payload |= {"before": "0" * 40 if n == 0 else str(n) * 40, "after": head}
        sequence.append(("pull_request", payload))
    # A review comment edited twice within the second, and its creation just before.
    created = examples_of(octokit_examples, "pull_request_review_comment", "created")[0]
    created["comment"] |= {"created_at": "2024-05-01T11:59:59Z", "updated_at": "2024-05-01T11:59:59Z"}
    sequence.append(("pull_request_review_comment", created))
    for body in ("Maybe you should use more emoji on this line. 🎉", "Definitely more emoji."):
        payload = examples_of(octokit_examples, "pull_request_review_comment", "edited")[0]
        payload["comment"] |= {"created_at": "2024-05-01T11:59:59Z", "updated_at": second, "body": body}
        sequence.append(("pull_request_review_comment", payload))
    for n, (event, payload) in enumerate(sequence):
        assert receiver.deliver(event, payload, f"00000000-0000-4000-8000-{n:012d}").status_code == 202

    ledger = tmp_path / "ledger"
    ingest_and_verify([receiver.spool], ledger)
    facts = records(ledger, "SELECT kind, action, fact, observations FROM github ORDER BY stream_seq")
    assert len(facts) == len(sequence) == 7 + 3 + 3
    assert all(f["observations"] == 1 for f in facts)
    assert [f["action"] for f in facts if f["kind"] == "issues"] == [
        "opened",
        "labeled",
        "labeled",
        "assigned",
        "edited",
        "closed",
        "reopened",
    ]
    issue_facts = [f["fact"] for f in facts if f["kind"] == "issues"]
    assert issue_facts[:4] == [
        f"issues/77/opened/{second}",
        f"issues/77/labeled/{second}/label:bug",
        f"issues/77/labeled/{second}/label:enhancement",
        f"issues/77/assigned/{second}/assignee:Codertocat",
    ]
    assert issue_facts[4].startswith(f"issues/77/edited/{second}/content:")
    assert issue_facts[5:] == [f"issues/77/closed/{second}", f"issues/77/reopened/{second}"]
    assert [f["fact"].rsplit("/", 1)[1] for f in facts if f["kind"] == "pull_request"] == [
        f"head:{c * 40}" for c in "123"
    ]
    comments = [f["fact"] for f in facts if f["kind"] == "pull_request_review_comment"]
    assert comments[0] == "review_comment/284312630/created/2024-05-01T11:59:59Z"
    assert [c.rsplit("/", 1)[0] for c in comments[1:]] == [f"review_comment/284312630/edited/{second}"] * 2
    assert comments[1] != comments[2]  # the two edits left different bodies


# ------------------------------------------------------------------------- two producers, one fact


def test_backfill_and_webhook_of_the_same_objects_are_one_row_per_fact(
    github_api_no_limits: FixtureGitHub, receiver: Receiver, tmp_path: Path
) -> None:
    issue = fixture_json("webhook_issues_edited.json")
    closed = dict(issue, action="closed")
    closed["issue"] = dict(
        issue["issue"],
        number=1,
        state="closed",
        closed_at="2024-03-01T10:00:00Z",
        updated_at="2024-03-01T10:00:00Z",
    )
    review_comment = fixture_json("webhook_pull_request_review_comment_created.json")
    edited = dict(review_comment, action="edited", comment=fixture_json("review_comments.json")[0])
    deliveries = [
        ("issues", closed),
        ("pull_request", fixture_json("webhook_pull_request_closed.json")),
        ("pull_request_review", fixture_json("webhook_pull_request_review_submitted.json")),
        ("issue_comment", fixture_json("webhook_issue_comment_created.json")),
        ("pull_request_review_comment", edited),
        ("push", fixture_json("webhook_push.json")),
    ]
    for n, (event, payload) in enumerate(deliveries):
        assert receiver.deliver(event, payload, f"b0000000-0000-4000-8000-{n:012d}").status_code == 202
    backfilled = tmp_path / "backfill-spool"
    for _ in range(2):  # a second backfill reads the same states again: the same ids, nothing new
        sink = SpoolSink(backfilled)
        backfill(
            REPO, sink, token=None, base_url=github_api_no_limits.base_url, seconds_between_requests=None
        )
        sink.close()
    assert len(read_events(backfilled)) == 24

    ledger = tmp_path / "ledger"
    ingest_and_verify([receiver.spool, backfilled], ledger)
    assert records(ledger, "SELECT count(*) AS n FROM events") == [{"n": 12 + 8}]  # 12 backfilled, 8 webhook
    both = records(
        ledger,
        "SELECT kind, fact, via, observations, observed_via FROM github WHERE observations > 1 ORDER BY fact",
    )
    assert [(r["fact"], r["via"], r["observations"], r["observed_via"]) for r in both] == [
        (fact, "webhook", 2, ["backfill", "webhook"])
        for fact in sorted(
            [
                "commit/553c2077f0edc3d5dc5d17262f6aa498e69d6f8e",
                "commit/e5bd3914e2e596debea16f433f57875b5b90bcd6",
                "issue_comment/1002/created/2024-03-02T12:00:00Z",
                "issues/1/closed/2024-03-01T10:00:00Z",
                "pull_request/2/merged/2024-03-02T11:00:00Z",
                "review/81/approved",
                next(r["fact"] for r in both if r["fact"].startswith("review_comment/2001/edited/")),
            ]
        )
    ]
    # Each fact once in github; every observation in github_all (and in the log).
    assert records(ledger, "SELECT count(*) AS n FROM github") == [{"n": 20 - 7}]
    assert records(ledger, "SELECT count(*) AS n FROM github_all") == [{"n": 20}]
    sources = records(ledger, "SELECT source, count(*) AS n FROM events GROUP BY source ORDER BY source")
    assert sources == [
        {"source": f"github-backfill/{REPO}", "n": 12},
        {"source": f"github-webhook/{REPO}", "n": 8},
    ]


# ------------------------------------------------------------------------- hostile bodies


def _client_port(response: httpx.Response) -> int:
    return response.extensions["network_stream"].get_extra_info("client_addr")[1]


HOSTILE: list[tuple[str, bytes, int, str]] = [
    ("5000-deep array", b"[" * 5000 + b"]" * 5000, 400, "too_deep"),
    ("5000-deep object", b'{"a":' * 5000 + b"1" + b"}" * 5000, 400, "too_deep"),
    ("63-deep object", b'{"a":' * 63 + b"1" + b"}" * 63, 400, "too_deep"),  # 65 deep in its event
    ("invalid UTF-8", b'{"zen": "\xff\xfe not text"}', 400, "bad_json"),
    ("lone surrogate", b'{"zen": "\\ud800"}', 400, "bad_json"),
    ("byte order mark", b'\xef\xbb\xbf{"zen": "Design for failure."}', 400, "bad_json"),
    ("NaN literal", b'{"zen": NaN}', 400, "bad_json"),
    ("Infinity literal", b'{"zen": -Infinity}', 400, "bad_json"),
    ("number out of range", b'{"zen": 1e400}', 400, "bad_json"),
    ("empty body", b"", 400, "bad_json"),
    ("not an object", b'["zen"]', 400, "bad_json"),
    ("truncated", b'{"zen": "Design', 400, "bad_json"),
    ("over the size limit", json.dumps({"zen": "x" * LIMIT}).encode(), 413, "too_large"),
]


def unique(ping: dict[str, Any], n: int) -> dict[str, Any]:
    return dict(ping, zen=f"{ping['zen']} ({n})")


def test_hostile_bodies_get_a_4xx_and_the_connection_and_the_server_carry_on(
    octokit_examples: list[dict[str, Any]], receiver: Receiver, tmp_path: Path
) -> None:
    ping = examples_of(octokit_examples, "ping")[0]
    first = receiver.deliver("ping", ping, "c0000000-0000-4000-8000-000000000000")
    assert first.status_code == 202
    port = _client_port(first)
    accepted = 1
    for name, body, status, reason in HOSTILE:
        response = receiver.deliver("ping", body)  # correctly signed: only the content is hostile
        assert response.status_code == status, (name, response.text)
        refusal = response.json()
        assert (refusal["status"], refusal["reason"]) == ("refused", reason), name
        assert refusal["detail"] and "\n" not in refusal["detail"], name
        # The same keep-alive connection answers a valid delivery right after (a body of its own:
        # the same signed body again under a new id would be refused as a replay).
        after = receiver.deliver("ping", unique(ping, accepted), f"c0000000-0000-4000-8000-{accepted:012d}")
        assert after.status_code == 202, (name, after.text)
        assert _client_port(response) == _client_port(after) == port, name
        accepted += 1

    # Over the limit without a Content-Length (chunked): refused as it arrives, the connection kept.
    huge = HOSTILE[-1][1]
    response = receiver.client.post(
        "/webhook",
        content=iter([huge[i : i + 8192] for i in range(0, len(huge), 8192)]),
        headers=signed(huge, "ping"),
    )
    assert response.status_code == 413 and response.json()["reason"] == "too_large"
    after = receiver.deliver("ping", unique(ping, accepted), f"c0000000-0000-4000-8000-{accepted:012d}")
    assert after.status_code == 202 and _client_port(after) == port
    accepted += 1

    # 62 levels (GitHub's own payloads nest fewer than 10) is still kept, whole, as github.raw: 64
    # levels in its event, the most the ledger's door takes.
    deep_ok = b'{"zen":"deep","hook_id":1,"a":' + b'{"a":' * 61 + b"1" + b"}" * 62  # a ping's shape
    assert receiver.deliver("ping", deep_ok, f"c0000000-0000-4000-8000-{accepted:012d}").status_code == 202
    accepted += 1

    status = receiver.status()
    assert status["status"] == "ok" and status["worker_alive"]
    assert status["counts"]["accepted"] == accepted
    assert status["refused"]["too_deep"] == 3 and status["refused"]["too_large"] == 2
    assert status["refused"]["bad_json"] == len(HOSTILE) - 4
    # Nothing accepted was lost: each accepted delivery is in the ledger, which verifies.
    assert len(read_events(receiver.spool)) == accepted
    ledger = tmp_path / "ledger"
    ingest_and_verify([receiver.spool], ledger)
    assert records(ledger, "SELECT count(*) AS n FROM github_all WHERE kind = 'raw:ping'") == [
        {"n": accepted}
    ]


def test_a_delivery_the_ledger_would_quarantine_is_refused_not_acknowledged(
    octokit_examples: list[dict[str, Any]], tmp_path: Path
) -> None:
    """GitHub sends up to 25 MB; the ledger's door takes events up to 8 MiB. A 202 must mean the event
    will be in the ledger, so a delivery between the two is a 413, decided off the event loop."""
    sink = SpoolSink(tmp_path / "spool")
    app = create_app(SECRET, sink, delivery_log=DeliveryLog(None))  # the default 25 MiB body limit
    ping = examples_of(octokit_examples, "ping")[0]
    big = json.dumps(ping | {"zen": "x" * (9 * 1024 * 1024)}).encode()
    try:
        with running_uvicorn(app) as url, httpx.Client(base_url=url, timeout=60, trust_env=False) as client:
            response = client.post("/webhook", content=big, headers=signed(big, "ping"))
            assert response.status_code == 413, response.text
            assert response.json()["reason"] == "too_large"
            assert "maximum event size" in response.json()["detail"]
            small = json.dumps(ping).encode()
            after = client.post("/webhook", content=small, headers=signed(small, "ping"))
            assert after.status_code == 202
            assert _client_port(after) == _client_port(response)
    finally:
        sink.close()
    assert len(read_events(tmp_path / "spool")) == 1
