"""End to end: backfill + webhook + trainer events → spools → ledger → the code views joining them."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ingest.bus import SpoolSink
from runledger.ingest.github_backfill import backfill
from runledger.ingest.github_webhook import DeliveryLog, create_app, signature_of
from runledger.ingest.spool_ingester import ingest_spool
from runledger.ledger.query import Reader
from runledger.ledger.store import Ledger
from runledger.schemas import config_hash, make_event
from runledger.schemas import payloads as p
from tests.support.github import FixtureGitHub, fixture_json, running_uvicorn

C1 = "6dcb09b5b57875f334f61aebed695e2e4193db5e"  # initial commit
C2 = "553c2077f0edc3d5dc5d17262f6aa498e69d6f8e"  # PR #2's head
C3 = "e5bd3914e2e596debea16f433f57875b5b90bcd6"  # PR #2's merge commit
RUN = "moe-7b-2024-02"


def trainer_events(spool: Path) -> None:
    config = {"lr": 3e-4, "clip": None}
    clipped = {"lr": 3e-4, "clip": 1.0}  # attempt 2 runs PR #2's code with clipping switched on
    common = {"source": f"trainer/{RUN}/rank0", "stream": RUN, "run_id": RUN}
    launch = {"git_branch": "main", "host": "node-1"}
    first = make_event(
        # The trainer spells the repository its own way and records an abbreviated SHA.
        p.RunStarted(
            **launch,
            config=config,
            config_hash=config_hash(config),
            git_commit=C1[:7],
            repository="Octo-Org/Hello-World",
        ),
        **common,
        attempt=1,
        seq=0,
        id=f"{RUN}-0",
        time=datetime(2024, 2, 20, tzinfo=UTC),
    )
    second = make_event(
        p.RunResumed(
            **launch,
            config=clipped,
            config_hash=config_hash(clipped),
            git_commit=C3,
            repository="octo-org/hello-world",
            from_checkpoint_step=100,
            previous_attempt=1,
        ),
        **common,
        attempt=2,
        step=100,
        seq=1,
        id=f"{RUN}-1",
        time=datetime(2024, 3, 5, tzinfo=UTC),
    )
    lowered = {"lr": 1e-4, "clip": 1.0}
    third = make_event(
        p.ConfigChanged(
            patch=[p.PatchOp(op="replace", path="/lr", value=1e-4)],
            previous_hash=config_hash(clipped),
            config_hash=config_hash(lowered),
            cause=p.ChangeCause(kind="commit", actor="octocat", commit=C3[:10]),
        ),
        **common,
        attempt=2,
        step=8000,
        seq=2,
        id=f"{RUN}-2",
        time=datetime(2024, 3, 6, tzinfo=UTC),
    )
    sink = SpoolSink(spool)
    for envelope in (first, second, third):
        sink.emit(envelope)
    sink.close()


def webhook_deliveries(spool: Path, tmp_path: Path) -> None:
    secret = b"hook secret"
    sink = SpoolSink(spool)
    with running_uvicorn(create_app(secret, sink, delivery_log=DeliveryLog(tmp_path / "d.sqlite"))) as url:
        for i, (event, name) in enumerate(
            [
                ("push", "webhook_push.json"),
                ("pull_request", "webhook_pull_request_closed.json"),
                ("issues", "webhook_issues_edited.json"),
            ]
        ):
            body = json.dumps(fixture_json(name)).encode()
            headers = {
                "X-GitHub-Event": event,
                "X-GitHub-Delivery": f"00000000-0000-4000-8000-{i:012d}",
                "X-Hub-Signature-256": signature_of(secret, body),
            }
            assert httpx.post(f"{url}/webhook", content=body, headers=headers).status_code == 202
    sink.close()


def rows(reader: Reader, sql: str, *params: Any) -> list[dict[str, Any]]:
    """The rows ``ledger query`` answers (the code views are among its names)."""
    return reader.sql(sql, list(params)).records()


def test_code_views_join_github_to_attempts(github_api_no_limits: FixtureGitHub, tmp_path: Path) -> None:
    backfill_spool, hook_spool, trainer_spool = tmp_path / "bf", tmp_path / "hook", tmp_path / "trainer"
    sink = SpoolSink(backfill_spool)
    backfill(
        "octo-org/hello-world",
        sink,
        token=None,
        base_url=github_api_no_limits.base_url,
        seconds_between_requests=None,
    )
    sink.close()
    webhook_deliveries(hook_spool, tmp_path)
    trainer_events(trainer_spool)
    ledger = Ledger.create(tmp_path / "ledger")
    for spool in (backfill_spool, hook_spool, trainer_spool):
        ingest_spool(ledger, spool)
    con = Reader(tmp_path / "ledger")

    # The merged PR and commit C3 came by webhook AND by backfill: two observations (each producer's
    # own event, both kept in the log and in github_all), one fact in the github view. (Before the
    # identity rule the ledger kept only the first observation, as one event.)
    for fact in ("pull_request/2/merged/2024-03-02T11:00:00Z", f"commit/{C3}"):
        kept = rows(con, "SELECT via, stream_seq FROM github_all WHERE fact = ? ORDER BY via", fact)
        assert [r["via"] for r in kept] == ["backfill", "webhook"], fact
        sources = rows(
            con,
            "SELECT e.source FROM events e JOIN github_all g USING (stream, stream_seq) WHERE g.fact = ? "
            "ORDER BY e.source",
            fact,
        )
        assert [r["source"] for r in sources] == [
            "github-backfill/octo-org/hello-world",
            "github-webhook/octo-org/hello-world",
        ]
        shown = rows(con, "SELECT via, observations, observed_via FROM github WHERE fact = ?", fact)
        assert shown == [{"via": "webhook", "observations": 2, "observed_via": ["backfill", "webhook"]}]
    # The issue edit (webhook) and the issue as the backfill read it later are two facts: a REST
    # object does not say which action left it so.
    issue_facts = rows(con, "SELECT fact, via FROM github WHERE kind = 'issues' AND number = 3 ORDER BY fact")
    assert [(r["fact"].split("/")[2], r["via"]) for r in issue_facts] == [
        ("edited", "webhook"),
        ("snapshot", "backfill"),
    ]
    # Every observation is an event (12 backfilled + 5 from the 3 deliveries + 3 trainer events); the
    # github view has one row per fact: the PR's merge and commits C2 and C3 were seen by both.
    assert rows(con, "SELECT count(*) AS n FROM github") == [{"n": 12 + 5 - 3}]
    assert rows(con, "SELECT count(*) AS n FROM github_all") == [{"n": 17}]
    assert rows(con, "SELECT count(*) AS n FROM events") == [{"n": 20}]

    commits = rows(
        con,
        "SELECT attempt, commit_sha, commit_title, pr_number, pr_relation FROM attempt_commits "
        "WHERE run_id = ? ORDER BY attempt",
        RUN,
    )
    assert commits == [
        {
            "attempt": 1,
            "commit_sha": C1,
            "commit_title": "Initial training loop",
            "pr_number": None,
            "pr_relation": None,
        },
        {
            "attempt": 2,
            "commit_sha": C3,
            "commit_title": "Merge pull request #2 from octo-org/clip-grads",
            "pr_number": 2,
            "pr_relation": "merge_commit",
        },
    ]

    landed = rows(
        con,
        "SELECT attempt, next_attempt, kind, number, ref, sha, on_run_branch, time "
        "FROM code_landed_between_attempts WHERE run_id = ? ORDER BY time",
        RUN,
    )
    assert [(r["attempt"], r["next_attempt"], r["kind"], r["number"], r["sha"]) for r in landed] == [
        (1, 2, "pull_request", 2, C3),
        (1, 2, "push", None, C3),
    ]
    assert all(r["on_run_branch"] for r in landed)
    assert landed[0]["time"] == datetime(2024, 3, 2, 11, tzinfo=UTC)
    assert [(r["kind"], r["number"]) for r in rows(con, "SELECT * FROM code_between(?, 1, 2)", RUN)] == [
        ("pull_request", 2),
        ("push", None),
    ]

    introduced = rows(
        con, "SELECT sha, number, relation FROM commit_introduced_by WHERE sha IN (?, ?) ORDER BY sha", C2, C3
    )
    assert introduced == [
        {"sha": C2, "number": 2, "relation": "head"},
        {"sha": C3, "number": 2, "relation": "merge_commit"},
    ]
    prs = rows(con, "SELECT number, state, merged_at FROM github_pull_requests ORDER BY number")
    assert [(r["number"], r["state"], r["merged_at"] is not None) for r in prs] == [
        (2, "closed", True),
        (4, "open", False),
    ]

    # `ledger history` tells the same story in order: the merge, the attempt that ran it, the change.
    story = [(i.kind, i.text) for i in Reader(tmp_path / "ledger").history(RUN)]
    texts = [text for _kind, text in story]
    merged = texts.index("PR #2 merged (e5bd391) by octocat: Clip gradients before the optimizer step")
    resumed = next(i for i, (kind, _text) in enumerate(story) if kind == "run.resumed")
    assert story[0] == (
        "run.started",
        "run started at commit 6dcb09b “Initial training loop”, host node-1, world size 1, "
        f"config {config_hash({'lr': 3e-4, 'clip': None})[:12]}",
    )
    assert merged < resumed
    assert texts[resumed] == (
        "attempt 2 resumed from checkpoint step 100 at commit e5bd391 “Merge pull request #2 from "
        "octo-org/clip-grads” (PR #2 merged: Clip gradients before the optimizer step) on node-1; "
        "config vs attempt 1: clip null → 1.0"
    )
    assert story[-1] == (
        "config.changed",
        "config changed at step 8,000: lr 0.0003 → 0.0001 (commit e5bd391 (PR #2) by octocat)",
    )
    assert "comment on #1 by octocat: Reproduced: the grad norm is 1e4 just before the spike." in texts

    # `ledger blame`: the live value, the change behind it, its commit, PR and person.
    reader = Reader(tmp_path / "ledger")
    lr = reader.blame(RUN, "lr", step=8000)
    assert (lr["value"], lr["set_by"]["kind"], lr["set_by"]["step"]) == (1e-4, "config.changed", 8000)
    assert (lr["commit"], lr["person"]) == (C3, "octocat")
    assert [(pr["number"], pr["relation"], pr["merged"]) for pr in lr["pull_requests"]] == [
        (2, "merge_commit", True)
    ]
    clip = reader.blame(RUN, "clip", step=150)
    assert (clip["value"], clip["set_by"]["kind"], clip["set_by"]["attempt"]) == (1.0, "resume", 2)
    assert clip["commit_title"] == "Merge pull request #2 from octo-org/clip-grads"
    before = reader.blame(RUN, "lr", step=50)
    assert (before["value"], before["commit"], before["pull_requests"]) == (3e-4, C1, [])
    shown = CliRunner().invoke(
        app, ["blame", RUN, "lr", "--step", "8000", "--ledger", str(tmp_path / "ledger")]
    )
    assert shown.exit_code == 0, shown.output
    # Like git, a short hash by default (`--full` for the whole one).
    assert f"code: {C3[:7]} “Merge pull request #2 from octo-org/clip-grads”" in shown.output
    assert "person: octocat" in shown.output
    assert "#2 'Clip gradients before the optimizer step'" in shown.output
