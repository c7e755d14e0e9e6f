"""Payload types of GitHub events (from webhooks or a PyGithub backfill).

Their stream is the repository (``owner/name``; an organisation's login for org-level webhooks). Each
producer has its own ``source`` and ids: the webhook receiver ``github-webhook/owner/name`` with ids
``delivery/<X-GitHub-Delivery>/<n>`` (one delivery, one or more events), a backfill
``github-backfill/owner/name`` with ids naming the observed object state (``issue/N/<updated_at>``…).
What an event is *about* is its payload's ``fact``: a key naming the GitHub fact independently of the
producer, so the same fact seen by both is two observations of one fact (the ``github`` view shows it
once). ``seq`` is always 0: deliveries arrive unordered and are redelivered, so no producer keeps a
gap-free counter; order GitHub events by ``time`` then ``id``. The identity rules live in
``runledger.ingest.github_events`` (and, as a table, in docs/github_wandb.md).
"""

from __future__ import annotations

from typing import Any

import msgspec

from runledger.schemas.payloads import Payload


class GitHubIssue(Payload, kw_only=True):
    action: str
    repo: str
    number: int
    title: str = ""
    state: str = ""
    author: str | None = None
    actor: str | None = None
    labels: list[str] = []
    body: str | None = None
    url: str | None = None
    created_at: str | None = None
    updated_at: str | None = None
    closed_at: str | None = None
    via: str | None = None  # "webhook" or "backfill": which producer saw it
    fact: str | None = None  # what it is, whoever saw it (runledger.ingest.github_events)


class GitHubPullRequest(Payload, kw_only=True):
    action: str
    repo: str
    number: int
    title: str = ""
    state: str = ""
    author: str | None = None
    actor: str | None = None
    merged: bool = False
    merge_commit_sha: str | None = None
    head_sha: str | None = None
    base_sha: str | None = None
    head_ref: str | None = None
    base_ref: str | None = None
    labels: list[str] = []
    changed_files: list[str] | None = None
    body: str | None = None
    url: str | None = None
    created_at: str | None = None
    updated_at: str | None = None
    merged_at: str | None = None
    closed_at: str | None = None
    draft: bool | None = None
    changed_files_count: int | None = None  # webhooks carry only the count, not the names
    via: str | None = None  # "webhook" or "backfill": which producer saw it
    fact: str | None = None  # what it is, whoever saw it (runledger.ingest.github_events)


class GitHubReview(Payload, kw_only=True):
    action: str
    repo: str
    pr_number: int
    review_id: int
    state: str = ""
    author: str | None = None
    body: str | None = None
    commit_id: str | None = None
    submitted_at: str | None = None
    url: str | None = None
    via: str | None = None  # "webhook" or "backfill": which producer saw it
    fact: str | None = None  # what it is, whoever saw it (runledger.ingest.github_events)


class GitHubComment(Payload, kw_only=True):
    action: str
    repo: str
    number: int  # the issue or pull request the comment is on
    comment_id: int
    kind: str = "issue_comment"  # or "review_comment"
    author: str | None = None
    body: str = ""
    path: str | None = None
    commit_id: str | None = None
    url: str | None = None
    created_at: str | None = None
    updated_at: str | None = None
    in_reply_to: int | None = None  # the review comment this one answers
    via: str | None = None  # "webhook" or "backfill": which producer saw it
    fact: str | None = None  # what it is, whoever saw it (runledger.ingest.github_events)


class PushedCommit(msgspec.Struct, kw_only=True):
    sha: str
    message: str = ""
    author: str | None = None
    timestamp: str | None = None


class GitHubPush(Payload, kw_only=True):
    repo: str
    ref: str
    before: str
    after: str
    pusher: str | None = None
    commits: list[PushedCommit] = []
    created: bool = False
    deleted: bool = False
    forced: bool = False
    pushed_at: str | None = None
    via: str | None = None  # "webhook" or "backfill": which producer saw it
    fact: str | None = None  # what it is, whoever saw it (runledger.ingest.github_events)


class GitHubCommit(Payload, kw_only=True):
    repo: str
    sha: str
    message: str = ""
    author: str | None = None
    committed_at: str | None = None
    parents: list[str] = []
    url: str | None = None
    via: str | None = None  # "webhook" or "backfill": which producer saw it
    fact: str | None = None  # what it is, whoever saw it (runledger.ingest.github_events)


class GitHubRaw(Payload, kw_only=True):
    """Any other GitHub event: kept whole, never dropped."""

    event: str
    action: str | None = None
    payload: dict[str, Any]
    delivery: str | None = None  # X-GitHub-Delivery of the webhook that brought it
    fact: str | None = None  # raw/<event>/<delivery>: each delivery of an untyped event is its own fact
