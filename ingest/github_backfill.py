"""Backfill a repository's history from GitHub's REST API (through PyGithub) onto the bus.

What is read, per repository ``owner/name`` (the ``full_name`` GitHub returns names the stream):

  kind             listing                                              events
  issues           GET /repos/{r}/issues?state=all&sort=updated&         github.issues (issues),
                   direction=asc&since=…  (issues AND pull requests)     github.pull_request (GET /pulls/{n}
                                                                         and its files),
                                                                         github.pull_request_review
  issue_comments   GET /repos/{r}/issues/comments?sort=updated&…&since=  github.issue_comment
  review_comments  GET /repos/{r}/pulls/comments?sort=updated&…&since=   github.pull_request_review_comment
  commits          GET /repos/{r}/commits?since=  (default branch)       github.commit (emitted oldest first)

Events have the backfill's own source, ``github-backfill/{owner/repo}``, and ids naming the observed
object state (``issue/{number}/{updated_at}``, ``commit/{sha}``…), so reading the same state again (a
rerun, the inclusive ``since`` boundary) adds nothing to the ledger. Their payloads carry the same
``fact`` keys as the webhook's events for the same fact (``runledger.ingest.github_events``): a
backfill over a period the webhook already covered adds a second observation of each fact, which the
``github`` view shows once (``observations`` = 2, ``observed_via`` = [backfill, webhook]).

Resuming: per repository and kind, the cursor is the ``updated_at`` (commits: commit date) of the last
object fully processed; the next run passes it as ``since`` (GitHub's ``since`` is inclusive, so the
boundary objects are read again and deduplicated). If an object is seen twice in one run (it was
updated while we paged, which shifts later pages by one), the cursor is held back to where that object
was first seen, so nothing shifted past us is skipped next time. Cursors live in a JSON file
(``JsonCursorStore``); with none recorded, ``cursor_from_spool`` derives them from the backfill's own
events already on the spool (webhook events are ignored: the webhook may have been down before them).

Rate limits: a 403/429 with ``Retry-After`` or ``X-RateLimit-Remaining: 0`` + ``X-RateLimit-Reset`` is
waited out (at most ``max_rate_limit_wait_s`` per wait, else ``BackfillError``) and retried, through
PyGithub's ``GithubRetry`` (urllib3 ``Retry``). The token is only handed to ``github.Auth.Token``; it
is never logged nor put into events (PyGithub masks it in its own debug log).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import requests
from github import Auth, Github, GithubException, GithubRetry
from github.GithubException import RateLimitExceededExceedsMaxWait
from github.GithubObject import GithubObject
from urllib3 import Retry
from urllib3.response import HTTPResponse

from runledger.ingest.bus import EventSink
from runledger.ingest.github_events import (
    CURSOR_KIND_OF_TYPE,
    comment_event,
    commit_event,
    issue_event,
    parse_time,
    pull_event,
    review_event,
    valid_repo,
)
from runledger.schemas import Envelope, Event, decode_event
from runledger.schemas.durable import write_durably

log = logging.getLogger("runledger.github_backfill")

DEFAULT_BASE_URL = "https://api.github.com"
KINDS = ("issues", "issue_comments", "review_comments", "commits")
_SAVE_EVERY = 100  # objects between cursor saves: bounds the work a crash repeats


class BackfillError(RuntimeError):
    """A failure the user can act on (bad repository, bad token, rate limit too long, network).

    ``code`` is the exit status a command line should use: 2 for the user's own mistake (a bad name, a
    repository that does not exist, a refused token), 1 for the rest.
    """

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


# -- cursors -------------------------------------------------------------------------------------


class CursorStore(Protocol):
    def get(self, repo: str, kind: str) -> datetime | None: ...

    def set(self, repo: str, kind: str, value: datetime) -> None: ...


class MemoryCursorStore:
    def __init__(self, values: dict[str, dict[str, datetime]] | None = None) -> None:
        self.values: dict[str, dict[str, datetime]] = values or {}

    def get(self, repo: str, kind: str) -> datetime | None:
        return self.values.get(repo.lower(), {}).get(kind)

    def set(self, repo: str, kind: str, value: datetime) -> None:
        self.values.setdefault(repo.lower(), {})[kind] = value


class JsonCursorStore:
    """``{"version": 1, "repos": {"owner/name": {"issues": "2024-03-01T10:00:00Z", …}}}``.

    Replaced atomically and durably (``runledger.schemas.durable.write_durably``) on every ``set``.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._repos: dict[str, dict[str, str]] = {}
        if self.path.exists():
            data = json.loads(self.path.read_text() or "{}")
            self._repos = {k.lower(): dict(v) for k, v in (data.get("repos") or {}).items()}

    def get(self, repo: str, kind: str) -> datetime | None:
        value = self._repos.get(repo.lower(), {}).get(kind)
        return parse_time(value) if value else None

    def has(self, repo: str) -> bool:
        return bool(self._repos.get(repo.lower()))

    def set(self, repo: str, kind: str, value: datetime) -> None:
        self._repos.setdefault(repo.lower(), {})[kind] = value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        self._write()

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"version": 1, "repos": self._repos}, indent=2, sort_keys=True) + "\n"
        write_durably(self.path, text, mode=0o600)  # 0600: the mode it always had (from mkstemp)


def default_cursor_file(spool_dir: str | Path) -> Path:
    spool = Path(spool_dir)
    return spool.parent / f"{spool.name}.github-cursors.json"


def cursor_from_events(events: Iterable[Envelope], repo: str) -> dict[str, datetime]:
    """Per kind, the newest ``time`` among this repository's events that a backfill emitted.

    Valid as a cursor because a backfill emits each kind in ascending time order (commits included).
    """
    cursor: dict[str, datetime] = {}
    for envelope in events:
        kind = CURSOR_KIND_OF_TYPE.get(envelope.type)
        if kind is None or envelope.stream.lower() != repo.lower():
            continue
        if getattr(envelope.data, "via", None) != "backfill":
            continue
        if kind not in cursor or envelope.time > cursor[kind]:
            cursor[kind] = envelope.time
    return cursor


def cursor_from_spool(spool_dir: str | Path, repo: str) -> dict[str, datetime]:
    """``cursor_from_events`` over every valid event on a spool (an absent spool gives no cursor)."""
    from runledger.ingest.spool import SpoolReader

    try:
        reader = SpoolReader(spool_dir)
    except FileNotFoundError:
        return {}
    decoded = (decode_event(record.payload) for record in reader.read() if record.corrupt is None)
    return cursor_from_events((e.envelope for e in decoded if isinstance(e, Event)), repo)


class _AscendingCursor:
    """The resume point of a listing sorted by ``updated_at`` ascending (see the module docstring)."""

    def __init__(self, start: datetime | None) -> None:
        self.start = start
        self._newest: datetime | None = None
        self._first_seen: dict[Any, datetime] = {}
        self._floor: datetime | None = None

    def observe(self, key: Any, updated: datetime) -> None:
        first = self._first_seen.get(key)
        if first is None:
            self._first_seen[key] = updated
        elif self._floor is None or first < self._floor:
            self._floor = first  # re-seen: it moved to the end, pages after it shifted back by one
        if self._newest is None or updated > self._newest:
            self._newest = updated

    @property
    def value(self) -> datetime | None:
        return self._floor if self._floor is not None else (self._newest or self.start)


# -- rate limits ---------------------------------------------------------------------------------


def _header_wait(headers: Any) -> float | None:
    """Seconds GitHub asked us to wait: ``Retry-After``, else an exhausted limit's reset time."""
    retry_after = headers.get("Retry-After")
    if retry_after is not None:
        with contextlib.suppress(ValueError):
            return max(0.0, float(retry_after))
    if headers.get("X-RateLimit-Remaining") == "0":
        reset = headers.get("X-RateLimit-Reset")
        if reset is not None and str(reset).isdigit():
            return max(0.0, int(reset) - time.time()) + 1.0  # +1: the reset lands somewhere in that second
    return None


class RateLimitRetry(GithubRetry):
    """``GithubRetry`` that also waits out a 429 carrying only ``X-RateLimit-Reset``, caps every wait at
    ``max_rate_limit_wait`` (``Retry-After`` included) and reports each wait to ``on_wait``."""

    on_wait: Callable[[float, int], None] | None = None

    def new(self, **kw: Any) -> RateLimitRetry:
        retry = super().new(**kw)
        retry.on_wait = self.on_wait
        return retry

    # GithubRetry's own signature (it narrows urllib3's BaseHTTPResponse to HTTPResponse, and returns Retry).
    def increment(  # type: ignore[override]
        self,
        method: str | None = None,
        url: str | None = None,
        response: HTTPResponse | None = None,
        error: Exception | None = None,
        _pool: Any = None,
        _stacktrace: Any = None,
    ) -> Retry:
        wait = (
            _header_wait(response.headers) if response is not None and response.status in (403, 429) else None
        )
        if response is not None and wait is not None:
            cap = self.max_rate_limit_wait
            if cap is not None and wait > cap:
                raise RateLimitExceededExceedsMaxWait(
                    response.status,
                    {"message": f"rate limited for {wait:.0f} s, over the {cap:.0f} s cap"},
                    dict(response.headers),
                    wait=wait,
                )
            if response.status == 429 and "Retry-After" not in response.headers:
                retry: Retry = Retry.increment(self, method, url, response, error, _pool, _stacktrace)
                retry.get_backoff_time = lambda: wait  # type: ignore[method-assign]
            else:
                retry = super().increment(method, url, response, error, _pool, _stacktrace)
            if self.on_wait is not None:
                self.on_wait(wait, response.status)
            return retry
        return super().increment(method, url, response, error, _pool, _stacktrace)


def make_github(
    token: str | None,
    *,
    base_url: str = DEFAULT_BASE_URL,
    per_page: int = 100,
    seconds_between_requests: float | None = 0.25,
    max_rate_limit_wait_s: float = 900.0,
    retries: int = 8,
    timeout: int = 30,
    on_wait: Callable[[float, int], None] | None = None,
    connect_retries: int = 2,
) -> Github:
    # A refused or unreachable server is retried ``connect_retries`` times (about a second), not
    # ``retries`` times with doubling waits (two silent minutes): a wrong --base-url or a server that
    # is down is said at once. Rate limits and 5xx answers keep the full ``retries``.
    retry = RateLimitRetry(
        total=retries,
        connect=connect_retries,
        backoff_factor=0.5,
        status_forcelist=[429, 500, 502, 503, 504],
        secondary_rate_wait=60.0,
        max_rate_limit_wait=max_rate_limit_wait_s,
    )
    retry.on_wait = on_wait
    return Github(
        auth=Auth.Token(token) if token else None,
        base_url=base_url.rstrip("/"),
        per_page=per_page,
        retry=retry,
        timeout=timeout,
        seconds_between_requests=seconds_between_requests,
        seconds_between_writes=None,
    )


# -- the backfill --------------------------------------------------------------------------------


@dataclass
class BackfillStats:
    repo: str
    issues: int = 0
    pulls: int = 0
    reviews: int = 0
    issue_comments: int = 0
    review_comments: int = 0
    commits: int = 0
    events: int = 0
    rate_limit_waits: int = 0
    waited_s: float = 0.0
    since: dict[str, str | None] = field(default_factory=dict)
    cursor: dict[str, str] = field(default_factory=dict)
    duration_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _json(obj: GithubObject) -> dict[str, Any]:
    # List items are partial objects whose public ``raw_data`` would GET each one again; the JSON the
    # listing returned is what we map.
    return obj._rawData


def _iso(value: datetime | None) -> str | None:
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ") if value is not None else None


class _Emitter:
    def __init__(self, sink: EventSink, stats: BackfillStats) -> None:
        self.sink = sink
        self.stats = stats

    def __call__(self, envelope: Envelope) -> None:
        self.sink.emit(envelope)
        self.stats.events += 1


def backfill(
    repo: str,
    sink: EventSink,
    *,
    token: str | None,
    base_url: str = DEFAULT_BASE_URL,
    since: datetime | None = None,
    cursor_store: CursorStore | None = None,
    kinds: Iterable[str] = KINDS,
    per_page: int = 100,
    seconds_between_requests: float | None = 0.25,
    max_rate_limit_wait_s: float = 900.0,
    timeout: int = 30,
) -> BackfillStats:
    """Read ``repo``'s issues, pull requests (with files and reviews), comments and commits onto ``sink``.

    ``since`` (if given) overrides the stored cursors for every kind; else each kind resumes from
    ``cursor_store``; with neither, everything is read. Raises ``BackfillError`` on what a user can fix.
    """
    if not valid_repo(repo):
        raise BackfillError(f"not a repository name: {repo!r} (expected OWNER/NAME)", 2)
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise BackfillError(f"unknown kinds {sorted(unknown)}; known: {list(KINDS)}", 2)
    started = time.monotonic()
    stats = BackfillStats(repo=repo)

    def on_wait(seconds: float, status: int) -> None:
        stats.rate_limit_waits += 1
        stats.waited_s += seconds
        log.warning("GitHub rate limit (HTTP %d): waiting %.1f s before retrying", status, seconds)

    gh = make_github(
        token,
        base_url=base_url,
        per_page=per_page,
        seconds_between_requests=seconds_between_requests,
        max_rate_limit_wait_s=max_rate_limit_wait_s,
        timeout=timeout,
        on_wait=on_wait,
    )
    store: CursorStore = cursor_store if cursor_store is not None else MemoryCursorStore()
    try:
        repository = gh.get_repo(repo)
        full_name = str(_json(repository)["full_name"])  # GitHub's spelling names the stream
        stats.repo = full_name
        emit = _Emitter(sink, stats)
        for kind in KINDS:
            if kind not in set(kinds):
                continue
            start = since if since is not None else store.get(full_name, kind)
            stats.since[kind] = _iso(start)
            cursor = _AscendingCursor(start)
            log.info("backfilling %s %s since %s", full_name, kind, _iso(start) or "the beginning")
            _KIND_READERS[kind](repository, full_name, start, emit, cursor, store)
            if cursor.value is not None:
                store.set(full_name, kind, cursor.value)
                stats.cursor[kind] = _iso(cursor.value) or ""
    except RateLimitExceededExceedsMaxWait as exc:
        raise BackfillError(f"GitHub rate limit needs a {exc.wait:.0f} s wait, over the cap") from None
    except GithubException as exc:
        raise BackfillError(_describe(exc, repo), 2 if exc.status in (401, 404) else 1) from None
    except requests.RequestException as exc:
        raise BackfillError(f"cannot reach {base_url}: {_unreachable_reason(exc)}") from None
    finally:
        gh.close()
    sink.sync()
    stats.duration_s = round(time.monotonic() - started, 3)
    log.info("backfill of %s done: %d events", stats.repo, stats.events)
    return stats


def _unreachable_reason(exc: requests.RequestException) -> str:
    """``Connection refused (ConnectionError)``: the operating system's words when it gave some."""
    found = re.search(r"\[Errno -?\d+\] ([^'\")\]]+)", str(exc))
    kind = type(exc).__name__
    return f"{found.group(1).strip()} ({kind})" if found else kind


def _describe(exc: GithubException, repo: str) -> str:
    message = exc.data.get("message") if isinstance(exc.data, dict) else None
    if exc.status == 401:
        return "GitHub refused the token (401 Bad credentials)"
    if exc.status == 404:
        return f"repository {repo} not found (or not visible with this token)"
    if exc.status in (403, 429):
        return f"GitHub refused the request ({exc.status}): {message or 'forbidden'}"
    return f"GitHub error {exc.status}: {message or 'no message'}"


Reader = Callable[[Any, str, datetime | None, _Emitter, _AscendingCursor, CursorStore], None]


def _since_arg(start: datetime | None) -> dict[str, Any]:
    # PyGithub formats ``since`` with a literal Z, so it must already be UTC.
    return {"since": start.astimezone(UTC)} if start is not None else {}


def _checkpoint(store: CursorStore, repo: str, kind: str, cursor: _AscendingCursor, n: int) -> None:
    if n % _SAVE_EVERY == 0 and cursor.value is not None:
        store.set(repo, kind, cursor.value)


def _read_issues(
    repository: Any,
    repo: str,
    start: datetime | None,
    emit: _Emitter,
    cursor: _AscendingCursor,
    store: CursorStore,
) -> None:
    listing = repository.get_issues(state="all", sort="updated", direction="asc", **_since_arg(start))
    for n, item in enumerate(listing, 1):
        data = _json(item)
        number = int(data["number"])
        if "pull_request" in data:
            _read_pull(repository, repo, number, emit)
        else:
            emit(issue_event(repo, data))
            emit.stats.issues += 1
        # Only once its events are out does an object count as processed.
        cursor.observe(number, parse_time(data["updated_at"]))
        _checkpoint(store, repo, "issues", cursor, n)


def _read_pull(repository: Any, repo: str, number: int, emit: _Emitter) -> None:
    pull = repository.get_pull(number)
    data = pull.raw_data  # a full object (merged, merge_commit_sha, changed_files …), fetched by get_pull
    files = [str(_json(f)["filename"]) for f in pull.get_files()]
    emit(pull_event(repo, data, changed_files=files))
    emit.stats.pulls += 1
    for review in pull.get_reviews():
        emit(review_event(repo, number, _json(review), fallback_time=data["updated_at"]))
        emit.stats.reviews += 1


def _read_comments(kind: str) -> Reader:
    def read(
        repository: Any,
        repo: str,
        start: datetime | None,
        emit: _Emitter,
        cursor: _AscendingCursor,
        store: CursorStore,
    ) -> None:
        if kind == "issue_comments":
            listing = repository.get_issues_comments(sort="updated", direction="asc", **_since_arg(start))
        else:
            listing = repository.get_pulls_comments(sort="updated", direction="asc", **_since_arg(start))
        for n, item in enumerate(listing, 1):
            data = _json(item)
            emit(comment_event(repo, data, kind=kind.removesuffix("s")))
            setattr(emit.stats, kind, getattr(emit.stats, kind) + 1)
            cursor.observe(int(data["id"]), parse_time(data.get("updated_at") or data["created_at"]))
            _checkpoint(store, repo, kind, cursor, n)

    return read


def _read_commits(
    repository: Any,
    repo: str,
    start: datetime | None,
    emit: _Emitter,
    cursor: _AscendingCursor,
    store: CursorStore,
) -> None:
    # GitHub lists commits newest first and pages can shift under new pushes, so the cursor only moves
    # once the whole listing is read; emitting oldest first keeps the events a valid cursor too.
    by_id = {
        e.id: e
        for e in (commit_event(repo, _json(item)) for item in repository.get_commits(**_since_arg(start)))
    }
    for envelope in sorted(by_id.values(), key=lambda e: (e.time, e.id)):
        emit(envelope)
        emit.stats.commits += 1
        cursor.observe(envelope.id, envelope.time)


_KIND_READERS: dict[str, Reader] = {
    "issues": _read_issues,
    "issue_comments": _read_comments("issue_comments"),
    "review_comments": _read_comments("review_comments"),
    "commits": _read_commits,
}
