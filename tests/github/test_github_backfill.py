"""The backfill: the real PyGithub against recorded GitHub responses served on 127.0.0.1."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from runledger.ingest.bus import SpoolSink
from runledger.ingest.github_backfill import (
    BackfillError,
    JsonCursorStore,
    MemoryCursorStore,
    _AscendingCursor,
    backfill,
    cursor_from_events,
    cursor_from_spool,
)
from runledger.ingest.github_events import content_hash, webhook_events
from tests.support.github import FixtureGitHub, fixture_json, read_events, spool_bytes
from tests.support.sinks import ListSink

REPO = "octo-org/hello-world"
TOKEN = "ghp_R3c0rdedT0kenN0tRealButSecret0123456789"


def run(api: FixtureGitHub, sink: Any, **kwargs: Any) -> Any:
    kwargs.setdefault("token", TOKEN)
    kwargs.setdefault("per_page", 2)
    kwargs.setdefault("seconds_between_requests", None)
    return backfill(REPO, sink, base_url=api.base_url, **kwargs)


def by_type(events: list[Any]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for e in events:
        out.setdefault(e.type, []).append(e)
    return out


def test_backfill_reads_everything_through_pygithub_with_paging(
    github_api_no_limits: FixtureGitHub, spool_dir: Path
) -> None:
    github_api = github_api_no_limits
    sink = SpoolSink(spool_dir)
    stats = run(github_api, sink, cursor_store=MemoryCursorStore())
    sink.close()
    events = [e.envelope for e in read_events(spool_dir)]
    types = by_type(events)
    assert {k: len(v) for k, v in types.items()} == {
        "github.issues": 2,
        "github.pull_request": 2,
        "github.pull_request_review": 2,
        "github.issue_comment": 2,
        "github.pull_request_review_comment": 1,
        "github.commit": 3,
    }
    assert (stats.issues, stats.pulls, stats.reviews, stats.commits, stats.events) == (2, 2, 2, 3, 12)
    assert all(e.source == f"github-backfill/{REPO}" and e.stream == REPO and e.seq == 0 for e in events)
    assert all(e.data.via == "backfill" for e in events)
    # What each snapshot attests (the identity rule): its facts, named as a webhook would name them.
    assert sorted(e.data.fact for e in events) == [
        "commit/553c2077f0edc3d5dc5d17262f6aa498e69d6f8e",
        "commit/6dcb09b5b57875f334f61aebed695e2e4193db5e",
        "commit/e5bd3914e2e596debea16f433f57875b5b90bcd6",
        "issue_comment/1001/edited/2024-02-28T08:05:00Z/body:"
        + content_hash(fixture_json("issue_comments.json")[0]["body"]),
        "issue_comment/1002/created/2024-03-02T12:00:00Z",
        "issues/1/closed/2024-03-01T10:00:00Z",  # closed, untouched since: the close's fact
        "issues/3/snapshot/2024-03-03T09:30:00Z",  # open and edited: a state only a backfill names
        "pull_request/2/merged/2024-03-02T11:00:00Z",
        "pull_request/4/snapshot/2024-03-04T08:00:00Z",
        "review/80/commented",
        "review/81/approved",
        "review_comment/2001/edited/2024-03-01T16:02:00Z/body:"
        + content_hash(fixture_json("review_comments.json")[0]["body"]),
    ]

    # Link-header paging: page 2 of the issue listing was followed.
    pages = [
        s.query.get("page", "1") for s in github_api.requests_to(f"/repos/{REPO}/issues") if s.status == 200
    ]
    assert pages == ["1", "2"]
    listing = github_api.requests_to(f"/repos/{REPO}/issues")[0].query
    assert listing | {"per_page": "2"} == {
        "state": "all",
        "sort": "updated",
        "direction": "asc",
        "per_page": "2",
    }
    assert all(s.headers.get("Authorization") == f"token {TOKEN}" for s in github_api.seen)

    pulls = {e.data.number: e.data for e in types["github.pull_request"]}
    assert pulls[2].merged and pulls[2].merge_commit_sha == "e5bd3914e2e596debea16f433f57875b5b90bcd6"
    assert (pulls[2].head_sha, pulls[2].base_sha) == (
        "553c2077f0edc3d5dc5d17262f6aa498e69d6f8e",
        "6dcb09b5b57875f334f61aebed695e2e4193db5e",
    )
    assert pulls[2].changed_files == ["trainer/optim.py", "tests/test_optim.py"]
    assert pulls[2].labels == ["training"] and pulls[2].state == "closed"
    assert not pulls[4].merged and pulls[4].draft and pulls[4].changed_files == ["trainer/configs/base.toml"]
    assert [e.data.state for e in types["github.pull_request_review"]] == ["commented", "approved"]
    assert [e.data.number for e in types["github.issue_comment"]] == [1, 2]
    review_comment = types["github.pull_request_review_comment"][0].data
    assert (review_comment.number, review_comment.path, review_comment.kind) == (
        2,
        "trainer/optim.py",
        "review_comment",
    )
    commits = types["github.commit"]
    assert [c.time.isoformat()[:10] for c in commits] == [
        "2024-01-15",
        "2024-02-28",
        "2024-03-02",
    ]  # oldest first
    assert commits[-1].data.parents == [
        "6dcb09b5b57875f334f61aebed695e2e4193db5e",
        "553c2077f0edc3d5dc5d17262f6aa498e69d6f8e",
    ]


def test_rate_limit_responses_are_waited_out_and_retried(github_api: FixtureGitHub) -> None:
    stats = run(github_api, ListSink())
    assert stats.rate_limit_waits == 2

    def gap_after_refusal(path: str, status: int) -> float:
        seen = github_api.requests_to(path)
        refused = next(i for i, s in enumerate(seen) if s.status == status)
        return seen[refused + 1].at - seen[refused].at

    # 403 + X-RateLimit-Remaining: 0 + X-RateLimit-Reset one second ahead; then 429 + Retry-After: 1.
    assert gap_after_refusal(f"/repos/{REPO}/issues", 403) >= 0.95
    assert gap_after_refusal(f"/repos/{REPO}/issues/comments", 429) >= 0.95


def test_rate_limit_wait_over_the_cap_is_an_error_not_a_hang(github_api: FixtureGitHub) -> None:
    with pytest.raises(BackfillError, match="rate limit"):
        run(github_api, ListSink(), max_rate_limit_wait_s=0.5)


def test_resume_from_the_json_cursor(github_api_no_limits: FixtureGitHub, tmp_path: Path) -> None:
    api = github_api_no_limits
    store = JsonCursorStore(tmp_path / "cursors.json")
    first = ListSink()
    run(api, first, cursor_store=store)
    saved = json.loads((tmp_path / "cursors.json").read_text())
    assert saved["repos"][REPO] == {
        "issues": "2024-03-04T08:00:00Z",
        "issue_comments": "2024-03-02T12:00:00Z",
        "review_comments": "2024-03-01T16:02:00Z",
        "commits": "2024-03-02T11:00:00Z",
    }
    api.seen.clear()
    second = ListSink()
    stats = run(api, second, cursor_store=JsonCursorStore(tmp_path / "cursors.json"))
    sinces = {s.path.rsplit(REPO, 1)[1]: s.query.get("since") for s in api.seen if "since" in s.query}
    assert sinces == {
        "/issues": "2024-03-04T08:00:00Z",
        "/issues/comments": "2024-03-02T12:00:00Z",
        "/pulls/comments": "2024-03-01T16:02:00Z",
        "/commits": "2024-03-02T11:00:00Z",
    }
    # Only the boundary objects come again (since is inclusive), with the ids they had: no new events.
    assert stats.events == 4 and {e.id for e in second.events} <= {e.id for e in first.events}
    assert stats.pulls == 1 and stats.issues == 0


def test_explicit_since_overrides_the_cursor(github_api_no_limits: FixtureGitHub) -> None:
    store = MemoryCursorStore({REPO: {"issues": datetime(2030, 1, 1, tzinfo=UTC)}})
    sink = ListSink()
    run(
        github_api_no_limits,
        sink,
        cursor_store=store,
        since=datetime(2024, 3, 3, tzinfo=UTC),
        kinds=["issues"],
    )
    assert [(e.type, e.data.number) for e in sink.events] == [
        ("github.issues", 3),
        ("github.pull_request", 4),
    ]


def test_cursor_is_derivable_from_the_events_already_emitted(
    github_api_no_limits: FixtureGitHub, spool_dir: Path
) -> None:
    store = MemoryCursorStore()
    sink = SpoolSink(spool_dir)
    run(github_api_no_limits, sink, cursor_store=store)
    # A webhook event newer than everything must not move the backfill's cursor (the webhook may have
    # been down before it).
    late = dict(fixture_json("webhook_issues_edited.json"))
    late["issue"] = dict(late["issue"], number=99, updated_at="2031-01-01T00:00:00Z")
    for envelope in webhook_events("issues", late, received_at=datetime.now(UTC)):
        sink.emit(envelope)
    sink.close()
    derived = cursor_from_spool(spool_dir, REPO)
    assert derived == {kind: store.get(REPO, kind) for kind in derived}
    assert set(derived) == {"issues", "issue_comments", "review_comments", "commits"}
    assert cursor_from_spool(spool_dir, "someone/else") == {}
    assert cursor_from_spool(spool_dir.parent / "absent", REPO) == {}


def test_an_object_updated_while_paging_holds_the_cursor_back() -> None:
    t = [datetime(2024, 1, d, tzinfo=UTC) for d in range(1, 8)]
    plain = _AscendingCursor(None)
    for key, when in [(1, t[0]), (2, t[1]), (3, t[2])]:
        plain.observe(key, when)
    assert plain.value == t[2]
    shifted = _AscendingCursor(t[0])
    # Issue 2 was updated after we read page 1: it reappears at the end, and whatever sat first on
    # page 2 slid onto page 1 unseen. Resume from where issue 2 was first seen, not from the end.
    for key, when in [(1, t[1]), (2, t[2]), (4, t[4]), (2, t[6])]:
        shifted.observe(key, when)
    assert shifted.value == t[2]
    assert _AscendingCursor(t[3]).value == t[3]


def test_token_never_in_the_spool_the_cursor_file_or_the_logs(
    github_api: FixtureGitHub, spool_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, capfd: Any
) -> None:
    caplog.set_level(logging.DEBUG)  # PyGithub, urllib3 and ours at their most verbose
    logging.getLogger("github").setLevel(logging.DEBUG)
    sink = SpoolSink(spool_dir)
    run(github_api, sink, cursor_store=JsonCursorStore(tmp_path / "cursors.json"))
    sink.close()
    assert any("GET" in r.getMessage() for r in caplog.records)  # the debug log did record requests
    captured = capfd.readouterr()
    for text in (caplog.text, captured.out, captured.err, (tmp_path / "cursors.json").read_text()):
        assert TOKEN not in text
    assert TOKEN.encode() not in spool_bytes(spool_dir)


def test_user_errors(github_api_no_limits: FixtureGitHub) -> None:
    with pytest.raises(BackfillError, match="not a repository name") as bad:
        backfill("not-a-repo", ListSink(), token=None, base_url=github_api_no_limits.base_url)
    assert bad.value.code == 2
    with pytest.raises(BackfillError, match="not found") as missing:
        backfill("octo-org/nope", ListSink(), token=None, base_url=github_api_no_limits.base_url)
    assert missing.value.code == 2


def test_webhook_and_backfill_observe_the_same_facts(github_api_no_limits: FixtureGitHub) -> None:
    """The identity rule: each producer has its own source and ids; a fact seen by both has one key.

    (Before it, both producers shared ``github:owner/repo`` and content ids, so the ledger kept only
    the first observation and dropped same-second webhook actions as duplicates.)
    """
    sink = ListSink()
    run(github_api_no_limits, sink)
    backfilled = {e.data.fact: e for e in sink.events}
    issue = fixture_json("webhook_issues_edited.json")
    # Issue 1 as the close left it (the backfill read it closed and untouched since), and review
    # comment 2001's edit at 16:02 (the backfill read it edited): deliveries of what the REST objects say.
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
        ("issues", issue),  # an edit: the backfill saw the issue after it, as an unattributed state
        ("pull_request", fixture_json("webhook_pull_request_closed.json")),
        ("pull_request_review", fixture_json("webhook_pull_request_review_submitted.json")),
        ("issue_comment", fixture_json("webhook_issue_comment_created.json")),
        ("pull_request_review_comment", review_comment),  # its creation: the REST object shows a later edit
        ("pull_request_review_comment", edited),
        ("push", fixture_json("webhook_push.json")),
    ]
    now = datetime.now(UTC)
    agreed: list[str] = []
    webhook_only: list[str] = []
    for n, (event, payload) in enumerate(deliveries):
        for envelope in webhook_events(event, payload, received_at=now, delivery=f"d-{n}"):
            assert envelope.source == f"github-webhook/{REPO}" and envelope.id.startswith(f"delivery/d-{n}/")
            twin = backfilled.get(envelope.data.fact)
            if twin is None:
                webhook_only.append(envelope.data.fact)
                continue
            assert twin.source == f"github-backfill/{REPO}" and twin.id != envelope.id
            assert (twin.type, twin.subject) == (envelope.type, envelope.subject)
            agreed.append(envelope.data.fact)
    assert agreed == [
        "issues/1/closed/2024-03-01T10:00:00Z",
        "pull_request/2/merged/2024-03-02T11:00:00Z",
        "review/81/approved",
        "issue_comment/1002/created/2024-03-02T12:00:00Z",
        backfilled_fact(backfilled, "review_comment/2001/edited/"),
        "commit/553c2077f0edc3d5dc5d17262f6aa498e69d6f8e",
        "commit/e5bd3914e2e596debea16f433f57875b5b90bcd6",
    ]
    assert [fact.rsplit("/", 1)[0] if "content:" in fact else fact for fact in webhook_only] == [
        "issues/3/edited/2024-03-03T09:30:00Z",
        "review_comment/2001/created/2024-03-01T16:00:00Z",
        "push/refs/heads/main/6dcb09b5b57875f334f61aebed695e2e4193db5e/e5bd3914e2e596debea16f433f57875b5b90bcd6",
    ]


def backfilled_fact(facts: dict[str, Any], prefix: str) -> str:
    [fact] = [f for f in facts if f.startswith(prefix)]
    return fact


def test_cursor_from_events_ignores_other_repositories_and_webhook_events() -> None:
    now = datetime.now(UTC)
    events = webhook_events("issues", fixture_json("webhook_issues_edited.json"), received_at=now)
    assert cursor_from_events(events, REPO) == {}
