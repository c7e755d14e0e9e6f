"""GitHub JSON (a webhook payload or a REST object) → envelopes. The ONE place GitHub identities are made.

THE IDENTITY RULE. The same GitHub fact seen by the webhook receiver and by a backfill is two
observations by two producers, not a conflict: each producer has its own ``source`` and its own ids,
the ledger keeps both, and every event's payload carries a ``fact`` key naming *what* it observed,
independently of who observed it. The ``github`` view shows one row per fact; ``github_all`` and
``events`` keep every observation.

  producer  source                       id
  webhook   github-webhook/{stream}      delivery/{X-GitHub-Delivery}/{n}  (n: 0, 1… within the delivery)
  backfill  github-backfill/{owner/repo} the observed object state, e.g. issue/{number}/{updated_at}

A redelivery of the same GUID is the same event (the receiver answers it ``duplicate``; the ledger's
(source, id) dedupe is the second line). Facts, per kind (``U`` = the object's ``updated_at``):

  github.issues        issues/{N}/opened/{created_at}, issues/{N}/closed/{closed_at}, issues/{N}/deleted,
                       issues/{N}/{action}/{U}[/{detail}] — detail: label:{name} (labeled, unlabeled),
                       assignee:{login}, milestone:{number}, to:{repo}#{number} (transferred),
                       content:{hash of title+body} (edited); else, if the payload lacks it, the delivery.
                       A backfill snapshot is ``opened`` when never updated since created, ``closed``
                       when its last update was the close, else issues/{N}/snapshot/{U}.
  github.pull_request  the same with pull_request/{N}/…, plus merged/{merged_at} (closed+merged, and any
                       snapshot of a merged PR), head:{sha} (synchronize), reviewer:{login} or
                       team:{slug} (review_requested/_removed), content:{hash of title+body+base}.
  github.pull_request_review  review/{id}/{state} (submitted, dismissed, snapshot);
                       review/{id}/{state}/{action}/body:{hash} otherwise (edited).
  github.issue_comment / github.pull_request_review_comment
                       {issue_comment|review_comment}/{id}/created/{created_at},
                       …/edited/{U}/body:{hash of body}, …/deleted. A snapshot is ``created`` when
                       updated_at = created_at, else the edit that left it (same key as the webhook's).
  github.push          push/{ref}/{before}/{after}       (webhook only)
  github.commit        commit/{sha}                      (backfill REST object = a push's listed commit)
  github.raw           raw/{event}/{delivery}            (webhook only: each delivery its own fact)

A delivery id that is not GUID-like (only a library caller can pass one) appears as ``sha256:<hex>``
of it; without any delivery id, ids are ``payload/{sha256 of event and payload}/{n}``.

Timestamps in ids and facts are normalised to UTC ``YYYY-MM-DDTHH:MM:SSZ``; hashes are the first 16 hex
digits of the SHA-256 of the value's canonical JSON. Envelope fields: ``stream`` = ``owner/repo`` (as
GitHub spells it: ``repository.full_name``; an org-level webhook: the organisation's login), ``time`` =
the object's own update/submit time, ``subject`` = ``issue/N``, ``pull/N``, ``ref/<ref>`` or
``commit/<sha>``, ``seq`` = 0 (see runledger.schemas.github).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import msgspec

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

# Deliveries arrive unordered and are redelivered: no GitHub producer keeps a per-source counter.
GITHUB_SEQ = 0
SNAPSHOT = "snapshot"  # the action of an object read by a backfill: its state, not a change
WEBHOOK = "webhook"
BACKFILL = "backfill"
REPO_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9-]{0,38})/[A-Za-z0-9._-]{1,100}$")
TYPED_EVENTS = frozenset(
    {"issues", "issue_comment", "pull_request", "pull_request_review", "pull_request_review_comment", "push"}
)

JSON = Mapping[str, Any]


class GitHubMappingError(ValueError):
    """The JSON lacks what a typed event needs; the webhook then keeps it as ``github.raw``."""


def valid_repo(repo: str) -> bool:
    return bool(REPO_RE.match(repo)) and not repo.endswith((".git", "/.", "/.."))


def source_of(stream: str, via: str = BACKFILL) -> str:
    """The source of one producer's GitHub events: ``github-webhook/…`` or ``github-backfill/…``."""
    if via not in (WEBHOOK, BACKFILL):
        raise ValueError(f"unknown GitHub producer {via!r}")
    return f"github-{via}/{stream}"


def parse_time(value: Any) -> datetime:
    """GitHub's ISO-8601 text (``Z`` or an offset) or epoch seconds → aware UTC datetime."""
    if isinstance(value, bool) or value is None:
        raise GitHubMappingError(f"not a timestamp: {value!r}")
    if isinstance(value, int | float):
        try:
            return datetime.fromtimestamp(value, UTC)
        except (OverflowError, OSError, ValueError) as exc:
            raise GitHubMappingError(f"not a timestamp: {value!r}") from exc
    text = str(value)
    if _SHORT_YEAR.match(text):  # years before 1000 as strftime("%Y") writes them: "999-01-01…"
        text = text.zfill(len(text) + 4 - text.index("-"))
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError as exc:
        raise GitHubMappingError(f"not a timestamp: {value!r}") from exc
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)  # GitHub's naive times are UTC
    return parsed.astimezone(UTC)


_SHORT_YEAR = re.compile(r"^\d{1,3}-")


def id_time(value: Any) -> str:
    """UTC ``YYYY-MM-DDTHH:MM:SSZ`` (four year digits on every platform, unlike strftime's ``%Y``)."""
    t = parse_time(value)
    return f"{t.year:04d}-{t.month:02d}-{t.day:02d}T{t.hour:02d}:{t.minute:02d}:{t.second:02d}Z"


def content_hash(value: Any) -> str:
    """16 hex digits of the SHA-256 of a JSON value's canonical bytes (a fact's content qualifier)."""
    return sha256_hex(canonical_bytes(value))[:16]


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
    payload: gh.Payload,
    *,
    repo: str,
    id: str,
    time: datetime,
    subject: str,
    via: str,
    type: str | None = None,
) -> Envelope:
    return make_event(
        payload,
        source=source_of(repo, via),
        stream=repo,
        seq=GITHUB_SEQ,
        id=id,
        time=time,
        subject=subject,
        type=type,
    )


# ------------------------------------------------------------------------------------- facts


def _same_second(a: Any, b: Any) -> bool:
    return a is not None and b is not None and id_time(a) == id_time(b)


def _action_detail(kind: str, action: str, obj: JSON, payload: JSON | None) -> str | None:
    """What tells two deliveries of the same action on one object in one second apart.

    "" when the action needs nothing more than its time; None when the payload lacks what it needs
    (the caller then falls back on the delivery id).
    """
    payload = payload or {}
    if action in ("labeled", "unlabeled"):
        label = payload.get("label")
        name = label.get("name") if isinstance(label, Mapping) else None
        return f"/label:{name}" if name is not None else None
    if action in ("assigned", "unassigned"):
        login = _login(payload.get("assignee"))
        return f"/assignee:{login}" if login is not None else None
    if action in ("milestoned", "demilestoned"):
        milestone = payload.get("milestone") or obj.get("milestone")
        number = milestone.get("number") if isinstance(milestone, Mapping) else None
        return f"/milestone:{number}" if number is not None else None
    if action in ("review_requested", "review_request_removed"):
        reviewer = _login(payload.get("requested_reviewer"))
        if reviewer is not None:
            return f"/reviewer:{reviewer}"
        team = payload.get("requested_team")
        slug = (team.get("slug") or team.get("name")) if isinstance(team, Mapping) else None
        return f"/team:{slug}" if slug is not None else None
    if action == "synchronize":
        head = obj.get("head")
        sha = payload.get("after") or (head.get("sha") if isinstance(head, Mapping) else None)
        return f"/head:{sha}" if sha else None
    if action == "edited":
        content: dict[str, Any] = {"title": obj.get("title"), "body": obj.get("body")}
        if kind == "pull_request":
            base = obj.get("base")
            content["base"] = base.get("ref") if isinstance(base, Mapping) else None
        return f"/content:{content_hash(content)}"
    if action == "transferred":
        changes = payload.get("changes")
        if not isinstance(changes, Mapping):
            return None
        repo = changes.get("new_repository")
        issue = changes.get("new_issue")
        full_name = repo.get("full_name") if isinstance(repo, Mapping) else None
        number = issue.get("number") if isinstance(issue, Mapping) else None
        return f"/to:{full_name}#{number}" if full_name is not None else None
    return ""


def lifecycle_fact(
    kind: str, number: int, action: str, obj: JSON, payload: JSON | None = None, delivery: str | None = None
) -> str:
    """The fact of an issue (``kind="issues"``) or pull request (``"pull_request"``) event."""
    base = f"{kind}/{number}"
    updated = obj.get("updated_at")
    if kind == "pull_request" and obj.get("merged_at") and action in (SNAPSHOT, "closed"):
        return f"{base}/merged/{id_time(obj['merged_at'])}"  # a PR merges once: its merge is one fact
    if action == SNAPSHOT:
        if obj.get("state") == "closed" and _same_second(obj.get("closed_at"), updated):
            return f"{base}/closed/{id_time(updated)}"
        if _same_second(obj.get("created_at"), updated):
            return f"{base}/opened/{id_time(updated)}"
        return f"{base}/{SNAPSHOT}/{id_time(_need(obj, 'updated_at'))}"
    if action == "opened":
        return f"{base}/opened/{id_time(obj.get('created_at') or _need(obj, 'updated_at'))}"
    if action == "closed":
        return f"{base}/closed/{id_time(obj.get('closed_at') or _need(obj, 'updated_at'))}"
    if action == "deleted":
        return f"{base}/deleted"
    detail = _action_detail(kind, action, obj, payload)
    if detail is None:
        detail = f"/delivery:{delivery_key(delivery)}" if delivery else ""
    return f"{base}/{action}/{id_time(_need(obj, 'updated_at'))}{detail}"


def comment_fact(kind: str, comment: JSON, action: str) -> str:
    """``kind`` is ``issue_comment`` or ``review_comment``. A REST snapshot gets the key of the webhook
    action that left the comment as it is: ``created`` if never edited, else that edit."""
    comment_id = int(_need(comment, "id"))
    base = f"{kind}/{comment_id}"
    created = comment.get("created_at")
    updated = comment.get("updated_at") or created
    if action == "deleted":
        return f"{base}/deleted"
    if action == "created" or (action == SNAPSHOT and (updated is None or _same_second(created, updated))):
        return f"{base}/created/{id_time(created or _need(comment, 'updated_at'))}"
    if action in ("edited", SNAPSHOT):
        return f"{base}/edited/{id_time(updated)}/body:{content_hash(comment.get('body'))}"
    return f"{base}/{action}/{id_time(updated)}"


def review_fact(review_id: int, state: str, action: str, body: Any) -> str:
    if action in (SNAPSHOT, "submitted", "dismissed"):
        return f"review/{review_id}/{state or 'unknown'}"
    return f"review/{review_id}/{state or 'unknown'}/{action}/body:{content_hash(body)}"


# ------------------------------------------------------------------------------------ events


def issue_event(
    repo: str,
    issue: JSON,
    *,
    action: str = SNAPSHOT,
    actor: str | None = None,
    via: str = BACKFILL,
    payload: JSON | None = None,
    delivery: str | None = None,
) -> Envelope:
    """An issue; ``payload`` is the whole webhook payload (a label, an assignee… qualify the fact)."""
    number = int(_need(issue, "number"))
    updated = _need(issue, "updated_at")
    data = gh.GitHubIssue(
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
        fact=lifecycle_fact("issues", number, action, issue, payload, delivery),
    )
    return _event(
        data,
        repo=repo,
        id=f"issue/{number}/{id_time(updated)}{_deleted(action)}",
        time=parse_time(updated),
        subject=f"issue/{number}",
        via=via,
    )


def pull_event(
    repo: str,
    pr: JSON,
    *,
    action: str = SNAPSHOT,
    actor: str | None = None,
    changed_files: list[str] | None = None,
    via: str = BACKFILL,
    payload: JSON | None = None,
    delivery: str | None = None,
) -> Envelope:
    number = int(_need(pr, "number"))
    updated = _need(pr, "updated_at")
    head = pr.get("head") or {}
    base = pr.get("base") or {}
    count = pr.get("changed_files")
    data = gh.GitHubPullRequest(
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
        fact=lifecycle_fact("pull_request", number, action, pr, payload, delivery),
    )
    return _event(
        data,
        repo=repo,
        id=f"pull/{number}/{id_time(updated)}{_deleted(action)}",
        time=parse_time(updated),
        subject=f"pull/{number}",
        via=via,
    )


def review_event(
    repo: str,
    pr_number: int,
    review: JSON,
    *,
    fallback_time: Any,
    action: str = SNAPSHOT,
    via: str = BACKFILL,
) -> Envelope:
    """A review; ``fallback_time`` (the PR's ``updated_at``) dates a review not yet submitted."""
    review_id = int(_need(review, "id"))
    submitted = review.get("submitted_at")
    # REST spells states in upper case (APPROVED), webhooks in lower case (approved).
    state = str(review.get("state") or "").lower()
    data = gh.GitHubReview(
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
        fact=review_fact(review_id, state, action, review.get("body")),
    )
    stamp = id_time(submitted) if submitted else "pending"
    return _event(
        data,
        repo=repo,
        id=f"review/{review_id}/{stamp}/{state or 'unknown'}",
        time=parse_time(submitted if submitted else fallback_time),
        subject=f"pull/{int(pr_number)}",
        via=via,
    )


def comment_event(
    repo: str,
    comment: JSON,
    *,
    kind: str,
    number: int | None = None,
    action: str = SNAPSHOT,
    via: str = BACKFILL,
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
    data = gh.GitHubComment(
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
        in_reply_to=int(reply) if isinstance(reply, int) and not isinstance(reply, bool) else None,
        via=via,
        fact=comment_fact(kind, comment, action),
    )
    # Issue comments live on issue/N even when N is a PR (GitHub numbers both alike).
    prefix = "issue" if kind == "issue_comment" else "pull"
    return _event(
        data,
        repo=repo,
        id=f"comment/{comment_id}/{id_time(updated)}{_deleted(action)}",
        time=parse_time(updated),
        subject=f"{prefix}/{int(number)}",
        type=GITHUB_ISSUE_COMMENT if kind == "issue_comment" else GITHUB_REVIEW_COMMENT,
        via=via,
    )


def commit_event(repo: str, commit: JSON, *, via: str = BACKFILL) -> Envelope:
    """A REST commit object (``GET /repos/{o}/{r}/commits``)."""
    sha = str(_need(commit, "sha"))
    inner = commit.get("commit") or {}
    committer = inner.get("committer") or {}
    author = commit.get("author")
    committed = committer.get("date") or (inner.get("author") or {}).get("date")
    data = gh.GitHubCommit(
        repo=repo,
        sha=sha,
        message=str(inner.get("message") or ""),
        author=_login(author) or (inner.get("author") or {}).get("name"),
        committed_at=committed,
        parents=[str(p["sha"]) for p in commit.get("parents") or [] if isinstance(p, Mapping) and "sha" in p],
        url=commit.get("html_url"),
        via=via,
        fact=f"commit/{sha}",
    )
    if committed is None:
        raise GitHubMappingError(f"commit {sha} has no date")
    return _event(
        data, repo=repo, id=f"commit/{sha}", time=parse_time(committed), subject=f"commit/{sha}", via=via
    )


def _pushed_commit_event(repo: str, commit: JSON) -> Envelope:
    # Push payloads carry a commit's author/committer by name and no parents; the REST object a
    # backfill sees is the same fact (commit/{sha}), observed by the other producer.
    sha = str(_need(commit, "id"))
    stamp = _need(commit, "timestamp")
    author = commit.get("author") or {}
    data = gh.GitHubCommit(
        repo=repo,
        sha=sha,
        message=str(commit.get("message") or ""),
        author=author.get("username") or author.get("name"),
        committed_at=stamp,
        url=commit.get("url"),
        via=WEBHOOK,
        fact=f"commit/{sha}",
    )
    return _event(
        data, repo=repo, id=f"commit/{sha}", time=parse_time(stamp), subject=f"commit/{sha}", via=WEBHOOK
    )


def push_events(repo: str, push: JSON, *, received_at: datetime) -> list[Envelope]:
    """A push and one ``github.commit`` per commit it lists."""
    ref = str(_need(push, "ref"))
    after = str(_need(push, "after"))
    before = str(push.get("before") or "")
    repository = push.get("repository") or {}
    pushed_at = repository.get("pushed_at")  # epoch seconds in push payloads
    head = push.get("head_commit") or {}
    when = (
        parse_time(pushed_at)
        if pushed_at is not None
        else (parse_time(head["timestamp"]) if head.get("timestamp") else received_at)
    )
    commits = [c for c in push.get("commits") or [] if isinstance(c, Mapping)]
    data = gh.GitHubPush(
        repo=repo,
        ref=ref,
        before=before,
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
        pushed_at=id_time(when),
        via=WEBHOOK,
        fact=f"push/{ref}/{before}/{after}",
    )
    out = [_event(data, repo=repo, id=f"push/{ref}/{after}", time=when, subject=f"ref/{ref}", via=WEBHOOK)]
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


_DELIVERY_RE = re.compile(r"[A-Za-z0-9-]{1,128}")


def delivery_key(delivery: str) -> str:
    """How a delivery id appears in ids and facts: itself when GUID-like (the receiver lets only those
    in), else ``sha256:<hex>`` of it, so that an odd one from a library caller stays one path segment."""
    if _DELIVERY_RE.fullmatch(delivery):
        return delivery
    return f"sha256:{sha256_hex(delivery.encode('utf-8', 'surrogatepass'))}"


def _payload_digest(event: str, payload: JSON) -> str:
    return sha256_hex(canonical_bytes({"event": event, "payload": dict(payload)}))


def raw_event(event: str, payload: JSON, *, received_at: datetime, delivery: str | None = None) -> Envelope:
    """Any webhook kept whole: its own fact, ``raw/{event}/{delivery}`` (no delivery: the payload's hash)."""
    stream = stream_of(payload)
    action = payload.get("action")
    key = delivery_key(delivery) if delivery else f"sha256:{_payload_digest(event, payload)}"
    return _event(
        gh.GitHubRaw(
            event=event,
            action=str(action) if action is not None else None,
            payload=dict(payload),
            delivery=delivery,
            fact=f"raw/{event}/{key}",
        ),
        repo=stream,
        id=f"raw/{event}/{key}",
        time=received_at,
        subject=event,
        type=GITHUB_RAW,
        via=WEBHOOK,
    )


def webhook_events(
    event: str, payload: JSON, *, received_at: datetime, delivery: str | None = None
) -> list[Envelope]:
    """The envelopes one webhook delivery becomes. Never empty: what cannot be typed is kept raw.

    Their source is ``github-webhook/{stream}`` and their ids ``delivery/{delivery}/{n}``; without a
    delivery id (a library call, not the receiver) ``payload/{sha256 of event and payload}/{n}``.
    """
    envelopes: list[Envelope] | None = None
    if event in TYPED_EVENTS and isinstance(payload.get("repository"), Mapping):
        try:
            envelopes = _typed_webhook(event, payload, received_at=received_at, delivery=delivery)
        except (GitHubMappingError, KeyError, TypeError, ValueError, AttributeError, OverflowError):
            envelopes = None  # an unexpected shape is still kept, whole, as github.raw
    if envelopes is None:
        envelopes = [raw_event(event, payload, received_at=received_at, delivery=delivery)]
    prefix = (
        f"delivery/{delivery_key(delivery)}" if delivery else f"payload/{_payload_digest(event, payload)}"
    )
    return [
        msgspec.structs.replace(envelope, source=source_of(envelope.stream, WEBHOOK), id=f"{prefix}/{n}")
        for n, envelope in enumerate(envelopes)
    ]


def _typed_webhook(
    event: str, payload: JSON, *, received_at: datetime, delivery: str | None
) -> list[Envelope]:
    repo = stream_of(payload)
    action = str(payload.get("action") or "")
    actor = _login(payload.get("sender"))
    if event == "issues":
        issue = _need(payload, "issue")
        return [
            issue_event(
                repo, issue, action=action, actor=actor, via=WEBHOOK, payload=payload, delivery=delivery
            )
        ]
    if event == "pull_request":
        pr = _need(payload, "pull_request")
        return [
            pull_event(repo, pr, action=action, actor=actor, via=WEBHOOK, payload=payload, delivery=delivery)
        ]
    if event == "pull_request_review":
        pr = _need(payload, "pull_request")
        return [
            review_event(
                repo,
                int(_need(pr, "number")),
                _need(payload, "review"),
                fallback_time=pr.get("updated_at") or received_at.isoformat(),
                action=action,
                via=WEBHOOK,
            )
        ]
    if event == "issue_comment":
        number = int(_need(_need(payload, "issue"), "number"))
        comment = _need(payload, "comment")
        return [comment_event(repo, comment, kind="issue_comment", number=number, action=action, via=WEBHOOK)]
    if event == "pull_request_review_comment":
        number = int(_need(_need(payload, "pull_request"), "number"))
        comment = _need(payload, "comment")
        return [
            comment_event(repo, comment, kind="review_comment", number=number, action=action, via=WEBHOOK)
        ]
    if event == "push":
        return push_events(repo, payload, received_at=received_at)
    raise GitHubMappingError(f"no typed mapping for {event!r}")


# Event type → the backfill cursor kind whose listing produces it (see runledger.ingest.github_backfill).
CURSOR_KIND_OF_TYPE: dict[str, str] = {
    GITHUB_ISSUE: "issues",
    GITHUB_PULL_REQUEST: "issues",
    GITHUB_ISSUE_COMMENT: "issue_comments",
    GITHUB_REVIEW_COMMENT: "review_comments",
    GITHUB_COMMIT: "commits",
}


# --- the event name against the payload's shape ------------------------------------------------
# GitHub signs only the body: X-GitHub-Event travels beside it, unsigned, so a captured body can be
# re-sent under another event name. Each event GitHub documents has top-level keys of its own; a
# body that lacks the keys of the event it is labelled as, or carries keys that name a sibling event
# (an issue_comment body labelled ``issues``), is not that event. Derived from GitHub's payload
# documentation and checked against octokit's recorded deliveries (all 58 event types pass; of the
# 15,000 relabellings between them, all but repository_vulnerability_alert → dependabot_alert are
# caught). Event names not listed are not checked (kept raw, as before).
EVENT_SHAPES: dict[str, tuple[str, ...]] = {
    "branch_protection_rule": ("rule",),
    "check_run": ("check_run",),
    "check_suite": ("check_suite",),
    "code_scanning_alert": ("alert", "commit_oid"),
    "commit_comment": ("comment",),
    "create": ("ref", "ref_type", "master_branch"),
    "delete": ("ref", "ref_type"),
    "dependabot_alert": ("alert",),
    "deploy_key": ("key",),
    "deployment": ("deployment",),
    "deployment_status": ("deployment_status", "deployment"),
    "discussion": ("discussion",),
    "discussion_comment": ("discussion", "comment"),
    "fork": ("forkee",),
    "gollum": ("pages",),
    "issue_comment": ("issue", "comment"),
    "issues": ("issue", "action"),
    "label": ("label", "action"),
    "marketplace_purchase": ("marketplace_purchase",),
    "member": ("member",),
    "membership": ("member", "team"),
    "merge_group": ("merge_group",),
    "meta": ("hook_id", "hook"),
    "milestone": ("milestone",),
    "org_block": ("blocked_user",),
    "package": ("package",),
    "page_build": ("build",),
    "ping": ("zen", "hook_id"),
    "project": ("project",),
    "project_card": ("project_card",),
    "project_column": ("project_column",),
    "projects_v2_item": ("projects_v2_item",),
    "pull_request": ("pull_request", "action", "number"),
    "pull_request_review": ("pull_request", "review"),
    "pull_request_review_comment": ("pull_request", "comment"),
    "pull_request_review_thread": ("pull_request", "thread"),
    "push": ("ref", "before", "after"),
    "release": ("release",),
    "security_advisory": ("security_advisory",),
    "sponsorship": ("sponsorship",),
    "star": ("action", "starred_at"),
    "status": ("sha", "state", "context"),
    "team": ("team", "action"),
    "team_add": ("team",),
    "workflow_dispatch": ("workflow", "ref"),
    "workflow_job": ("workflow_job",),
    "workflow_run": ("workflow_run",),
}
# Keys an event's payload never has at the top level, though a sibling event's does.
EVENT_NEVER: dict[str, tuple[str, ...]] = {
    "check_run": ("deployment_status",),
    "commit_comment": ("issue", "discussion", "pull_request"),
    "create": ("before", "after"),
    "delete": ("master_branch", "description"),
    "dependabot_alert": ("commit_oid",),
    "deployment": ("deployment_status", "workflow_job"),
    "discussion": ("comment",),
    "issues": ("comment",),
    "label": ("issue", "pull_request", "discussion"),
    "member": ("scope",),
    "meta": ("zen",),
    "milestone": ("issue",),
    "pull_request": ("review", "comment", "thread"),
    "pull_request_review": ("comment", "thread"),
    "pull_request_review_comment": ("thread", "review"),
    "push": ("ref_type",),
    "team": ("member",),
    "team_add": ("action",),
    "workflow_run": ("deployment", "deployment_status", "reviewers"),
}


def event_shape_problem(event: str, payload: JSON) -> str | None:
    """Why ``payload`` cannot be a GitHub ``event`` delivery (one line), or None when it can be."""
    missing = [key for key in EVENT_SHAPES.get(event, ()) if key not in payload]
    if missing:
        return f"a {event} payload has {', '.join(missing)}; this one does not"
    foreign = [key for key in EVENT_NEVER.get(event, ()) if key in payload]
    if foreign:
        return f"a {event} payload has no {', '.join(foreign)}; this one does (another event's body?)"
    return None
