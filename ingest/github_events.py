"""GitHub JSON (a webhook payload or a REST object) → envelopes. The ONE place GitHub event ids are made.

Both producers (``runledger.ingest.github_webhook`` and ``runledger.ingest.github_backfill``) call these functions, so the
same update of the same object gets the same (source, id) whichever way it arrives, and the ledger
keeps it once. Ids are derived from content, never from the delivery:

  github.issues                      issue/{number}/{updated_at}
  github.pull_request                pull/{number}/{updated_at}
  github.pull_request_review         review/{review_id}/{submitted_at or "pending"}/{state}
  github.issue_comment               comment/{comment_id}/{updated_at}
  github.pull_request_review_comment comment/{comment_id}/{updated_at}
  github.push                        push/{ref}/{after}
  github.commit                      commit/{sha}
  github.raw                         raw/{event}/{sha256 of the payload's canonical bytes}

Timestamps inside ids are normalised to UTC ``YYYY-MM-DDTHH:MM:SSZ`` (REST and webhooks agree on the
form today; normalising keeps that true if one of them starts sending an offset). A review id also
carries its state because dismissing a review keeps its ``submitted_at``. A ``deleted`` action gets
``/deleted`` appended: deleting does not change ``updated_at``, and only webhooks ever see deletions.

An id names the object's state at ``updated_at``: two webhook actions that leave the same
``updated_at`` (rare; GitHub bumps it on almost every change) collapse into the first one.

Envelope fields: ``stream`` = ``owner/repo`` (as GitHub spells it: ``repository.full_name``),
``source`` = ``github:owner/repo``, ``time`` = the object's own update/submit time, ``subject`` =
``issue/N``, ``pull/N``, ``ref/<ref>`` or ``commit/<sha>``, ``seq`` = 0 (see schemas.github).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from runledger.schemas import Envelope, make_event
from runledger.schemas import github as gh
from runledger.schemas.canonical import canonical_bytes, sha256_hex
from runledger.schemas.catalogue import (
    GITHUB_COMMIT,
    GITHUB_ISSUE,
    GITHUB_ISSUE_COMMENT,
    GITHUB_PULL_REQUEST,
    GITHUB_RAW,
    GITHUB_REVIEW_COMMENT,
)

# Two producers share a source, so no per-source counter can be gap-free: GitHub events carry 0.
GITHUB_SEQ = 0
SNAPSHOT = "snapshot"  # the action of an object read by a backfill: its state, not a change
REPO_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9-]{0,38})/[A-Za-z0-9._-]{1,100}$")
TYPED_EVENTS = frozenset(
    {"issues", "issue_comment", "pull_request", "pull_request_review", "pull_request_review_comment", "push"}
)

JSON = Mapping[str, Any]


class GitHubMappingError(ValueError):
    """The JSON lacks what a typed event needs; the webhook then keeps it as ``github.raw``."""


def valid_repo(repo: str) -> bool:
    return bool(REPO_RE.match(repo)) and not repo.endswith((".git", "/.", "/.."))


def source_of(repo: str) -> str:
    return f"github:{repo}"


def parse_time(value: Any) -> datetime:
    """GitHub's ISO-8601 text (``Z`` or an offset) or epoch seconds → aware UTC datetime."""
    if isinstance(value, bool) or value is None:
        raise GitHubMappingError(f"not a timestamp: {value!r}")
    if isinstance(value, int | float):
        return datetime.fromtimestamp(value, UTC)
    try:
        parsed = datetime.fromisoformat(str(value))
    except ValueError as exc:
        raise GitHubMappingError(f"not a timestamp: {value!r}") from exc
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)  # GitHub's naive times are UTC
    return parsed.astimezone(UTC)


def id_time(value: Any) -> str:
    return parse_time(value).strftime("%Y-%m-%dT%H:%M:%SZ")


def _login(obj: Any) -> str | None:
    if isinstance(obj, Mapping):
        login = obj.get("login") or obj.get("name")
        return str(login) if login is not None else None
    return None


def _labels(obj: JSON) -> list[str]:
    return [str(label["name"]) for label in obj.get("labels") or [] if isinstance(label, Mapping)]


def _need(obj: Any, key: str) -> Any:
    if not isinstance(obj, Mapping) or obj.get(key) is None:
        raise GitHubMappingError(f"missing {key!r}")
    return obj[key]


def _number_from_url(url: Any) -> int:
    # REST comments name their issue/PR only by URL (…/issues/12, …/pulls/7).
    match = re.search(r"/(?:issues|pulls)/(\d+)$", str(url or ""))
    if match is None:
        raise GitHubMappingError(f"no issue/pull number in {url!r}")
    return int(match.group(1))


def _deleted(action: str) -> str:
    return "/deleted" if action == "deleted" else ""


def _event(
    payload: gh.Payload, *, repo: str, id: str, time: datetime, subject: str, type: str | None = None
) -> Envelope:
    return make_event(
        payload,
        source=source_of(repo),
        stream=repo,
        seq=GITHUB_SEQ,
        id=id,
        time=time,
        subject=subject,
        type=type,
    )


def issue_event(
    repo: str, issue: JSON, *, action: str = SNAPSHOT, actor: str | None = None, via: str = "backfill"
) -> Envelope:
    number = int(_need(issue, "number"))
    updated = _need(issue, "updated_at")
    payload = gh.GitHubIssue(
        action=action,
        repo=repo,
        number=number,
        title=str(issue.get("title") or ""),
        state=str(issue.get("state") or ""),
        author=_login(issue.get("user")),
        actor=actor,
        labels=_labels(issue),
        body=issue.get("body"),
        url=issue.get("html_url"),
        created_at=issue.get("created_at"),
        updated_at=updated,
        closed_at=issue.get("closed_at"),
        via=via,
    )
    return _event(
        payload,
        repo=repo,
        id=f"issue/{number}/{id_time(updated)}{_deleted(action)}",
        time=parse_time(updated),
        subject=f"issue/{number}",
    )


def pull_event(
    repo: str,
    pr: JSON,
    *,
    action: str = SNAPSHOT,
    actor: str | None = None,
    changed_files: list[str] | None = None,
    via: str = "backfill",
) -> Envelope:
    number = int(_need(pr, "number"))
    updated = _need(pr, "updated_at")
    head = pr.get("head") or {}
    base = pr.get("base") or {}
    count = pr.get("changed_files")
    payload = gh.GitHubPullRequest(
        action=action,
        repo=repo,
        number=number,
        title=str(pr.get("title") or ""),
        state=str(pr.get("state") or ""),
        author=_login(pr.get("user")),
        actor=actor,
        merged=bool(pr.get("merged") or pr.get("merged_at")),
        merge_commit_sha=pr.get("merge_commit_sha"),
        head_sha=head.get("sha"),
        base_sha=base.get("sha"),
        head_ref=head.get("ref"),
        base_ref=base.get("ref"),
        labels=_labels(pr),
        changed_files=changed_files,
        body=pr.get("body"),
        url=pr.get("html_url"),
        created_at=pr.get("created_at"),
        updated_at=updated,
        merged_at=pr.get("merged_at"),
        closed_at=pr.get("closed_at"),
        draft=pr.get("draft"),
        changed_files_count=count if isinstance(count, int) and not isinstance(count, bool) else None,
        via=via,
    )
    return _event(
        payload,
        repo=repo,
        id=f"pull/{number}/{id_time(updated)}{_deleted(action)}",
        time=parse_time(updated),
        subject=f"pull/{number}",
    )


def review_event(
    repo: str,
    pr_number: int,
    review: JSON,
    *,
    fallback_time: Any,
    action: str = SNAPSHOT,
    via: str = "backfill",
) -> Envelope:
    """A review; ``fallback_time`` (the PR's ``updated_at``) dates a review not yet submitted."""
    review_id = int(_need(review, "id"))
    submitted = review.get("submitted_at")
    # REST spells states in upper case (APPROVED), webhooks in lower case (approved).
    state = str(review.get("state") or "").lower()
    payload = gh.GitHubReview(
        action=action,
        repo=repo,
        pr_number=int(pr_number),
        review_id=review_id,
        state=state,
        author=_login(review.get("user")),
        body=review.get("body"),
        commit_id=review.get("commit_id"),
        submitted_at=submitted,
        url=review.get("html_url"),
        via=via,
    )
    stamp = id_time(submitted) if submitted else "pending"
    return _event(
        payload,
        repo=repo,
        id=f"review/{review_id}/{stamp}/{state or 'unknown'}",
        time=parse_time(submitted if submitted else fallback_time),
        subject=f"pull/{int(pr_number)}",
    )


def comment_event(
    repo: str,
    comment: JSON,
    *,
    kind: str,
    number: int | None = None,
    action: str = SNAPSHOT,
    via: str = "backfill",
) -> Envelope:
    """An issue comment (``kind="issue_comment"``) or a PR diff comment (``kind="review_comment"``)."""
    if kind not in ("issue_comment", "review_comment"):
        raise ValueError(f"unknown comment kind {kind!r}")
    comment_id = int(_need(comment, "id"))
    updated = comment.get("updated_at") or _need(comment, "created_at")
    if number is None:
        url = comment.get("issue_url") if kind == "issue_comment" else comment.get("pull_request_url")
        number = _number_from_url(url)
    reply = comment.get("in_reply_to_id")
    payload = gh.GitHubComment(
        action=action,
        repo=repo,
        number=int(number),
        comment_id=comment_id,
        kind=kind,
        author=_login(comment.get("user")),
        body=str(comment.get("body") or ""),
        path=comment.get("path"),
        commit_id=comment.get("commit_id"),
        url=comment.get("html_url"),
        created_at=comment.get("created_at"),
        updated_at=updated,
        in_reply_to=int(reply) if isinstance(reply, int) else None,
        via=via,
    )
    # Issue comments live on issue/N even when N is a PR (GitHub numbers both alike).
    prefix = "issue" if kind == "issue_comment" else "pull"
    return _event(
        payload,
        repo=repo,
        id=f"comment/{comment_id}/{id_time(updated)}{_deleted(action)}",
        time=parse_time(updated),
        subject=f"{prefix}/{int(number)}",
        type=GITHUB_ISSUE_COMMENT if kind == "issue_comment" else GITHUB_REVIEW_COMMENT,
    )


def commit_event(repo: str, commit: JSON, *, via: str = "backfill") -> Envelope:
    """A REST commit object (``GET /repos/{o}/{r}/commits``)."""
    sha = str(_need(commit, "sha"))
    inner = commit.get("commit") or {}
    committer = inner.get("committer") or {}
    author = commit.get("author")
    committed = committer.get("date") or (inner.get("author") or {}).get("date")
    payload = gh.GitHubCommit(
        repo=repo,
        sha=sha,
        message=str(inner.get("message") or ""),
        author=_login(author) or (inner.get("author") or {}).get("name"),
        committed_at=committed,
        parents=[str(p["sha"]) for p in commit.get("parents") or [] if isinstance(p, Mapping) and "sha" in p],
        url=commit.get("html_url"),
        via=via,
    )
    if committed is None:
        raise GitHubMappingError(f"commit {sha} has no date")
    return _event(payload, repo=repo, id=f"commit/{sha}", time=parse_time(committed), subject=f"commit/{sha}")


def _pushed_commit_event(repo: str, commit: JSON) -> Envelope:
    # Push payloads carry a commit's author/committer by name and no parents; the REST object a
    # backfill sees has the same id (commit/{sha}), so whichever arrives first is kept.
    sha = str(_need(commit, "id"))
    stamp = _need(commit, "timestamp")
    author = commit.get("author") or {}
    payload = gh.GitHubCommit(
        repo=repo,
        sha=sha,
        message=str(commit.get("message") or ""),
        author=author.get("username") or author.get("name"),
        committed_at=stamp,
        url=commit.get("url"),
        via="webhook",
    )
    return _event(payload, repo=repo, id=f"commit/{sha}", time=parse_time(stamp), subject=f"commit/{sha}")


def push_events(repo: str, push: JSON, *, received_at: datetime) -> list[Envelope]:
    """A push and one ``github.commit`` per commit it lists."""
    ref = str(_need(push, "ref"))
    after = str(_need(push, "after"))
    repository = push.get("repository") or {}
    pushed_at = repository.get("pushed_at")  # epoch seconds in push payloads
    head = push.get("head_commit") or {}
    when = (
        parse_time(pushed_at)
        if pushed_at is not None
        else (parse_time(head["timestamp"]) if head.get("timestamp") else received_at)
    )
    commits = [c for c in push.get("commits") or [] if isinstance(c, Mapping)]
    payload = gh.GitHubPush(
        repo=repo,
        ref=ref,
        before=str(push.get("before") or ""),
        after=after,
        pusher=_login(push.get("pusher")),
        commits=[
            gh.PushedCommit(
                sha=str(c.get("id")),
                message=str(c.get("message") or ""),
                author=(c.get("author") or {}).get("username") or (c.get("author") or {}).get("name"),
                timestamp=c.get("timestamp"),
            )
            for c in commits
        ],
        created=bool(push.get("created")),
        deleted=bool(push.get("deleted")),
        forced=bool(push.get("forced")),
        pushed_at=when.strftime("%Y-%m-%dT%H:%M:%SZ"),
        via="webhook",
    )
    out = [_event(payload, repo=repo, id=f"push/{ref}/{after}", time=when, subject=f"ref/{ref}")]
    out.extend(_pushed_commit_event(repo, c) for c in commits if c.get("id") and c.get("timestamp"))
    return out


def stream_of(payload: JSON) -> str:
    """The stream a webhook payload belongs to: its repository, else its organisation, else "github"."""
    repository = payload.get("repository")
    if isinstance(repository, Mapping) and repository.get("full_name"):
        return str(repository["full_name"])
    organization = payload.get("organization")
    if isinstance(organization, Mapping) and organization.get("login"):
        return str(organization["login"])
    return "github"


def raw_event(event: str, payload: JSON, *, received_at: datetime, delivery: str | None = None) -> Envelope:
    """Any webhook kept whole. Its id hashes the payload so a redelivery is the same event."""
    stream = stream_of(payload)
    action = payload.get("action")
    digest = sha256_hex(canonical_bytes(dict(payload)))
    return _event(
        gh.GitHubRaw(
            event=event,
            action=str(action) if action is not None else None,
            payload=dict(payload),
            delivery=delivery,
        ),
        repo=stream,
        id=f"raw/{event}/{digest}",
        time=received_at,
        subject=event,
        type=GITHUB_RAW,
    )


def webhook_events(
    event: str, payload: JSON, *, received_at: datetime, delivery: str | None = None
) -> list[Envelope]:
    """The envelopes one webhook delivery becomes. Never empty: what cannot be typed is kept raw."""
    if event in TYPED_EVENTS and isinstance(payload.get("repository"), Mapping):
        try:
            return _typed_webhook(event, payload, received_at=received_at)
        except (GitHubMappingError, KeyError, TypeError, ValueError):
            pass  # an unexpected shape is still kept, whole, as github.raw
    return [raw_event(event, payload, received_at=received_at, delivery=delivery)]


def _typed_webhook(event: str, payload: JSON, *, received_at: datetime) -> list[Envelope]:
    repo = stream_of(payload)
    action = str(payload.get("action") or "")
    actor = _login(payload.get("sender"))
    if event == "issues":
        return [issue_event(repo, _need(payload, "issue"), action=action, actor=actor, via="webhook")]
    if event == "pull_request":
        return [pull_event(repo, _need(payload, "pull_request"), action=action, actor=actor, via="webhook")]
    if event == "pull_request_review":
        pr = _need(payload, "pull_request")
        return [
            review_event(
                repo,
                int(_need(pr, "number")),
                _need(payload, "review"),
                fallback_time=pr.get("updated_at") or received_at.isoformat(),
                action=action,
                via="webhook",
            )
        ]
    if event == "issue_comment":
        number = int(_need(_need(payload, "issue"), "number"))
        comment = _need(payload, "comment")
        return [
            comment_event(repo, comment, kind="issue_comment", number=number, action=action, via="webhook")
        ]
    if event == "pull_request_review_comment":
        number = int(_need(_need(payload, "pull_request"), "number"))
        comment = _need(payload, "comment")
        return [
            comment_event(repo, comment, kind="review_comment", number=number, action=action, via="webhook")
        ]
    if event == "push":
        return push_events(repo, payload, received_at=received_at)
    raise GitHubMappingError(f"no typed mapping for {event!r}")


# Event type → the backfill cursor kind whose listing produces it (see ingest.github_backfill).
CURSOR_KIND_OF_TYPE: dict[str, str] = {
    GITHUB_ISSUE: "issues",
    GITHUB_PULL_REQUEST: "issues",
    GITHUB_ISSUE_COMMENT: "issue_comments",
    GITHUB_REVIEW_COMMENT: "review_comments",
    GITHUB_COMMIT: "commits",
}
