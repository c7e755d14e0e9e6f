"""Anomalies delivered to alert webhooks (issue 44): the ledger's ``ledger.anomaly`` events, POSTed
as Slack-compatible JSON, at least once, in the order the ledger recorded them.

Data flows ledger -> out: the anomalies are read through ``runledger.ledger.query.Reader`` (never the
writer), in the order of their ``ingest_position`` under the ledger's own ingest source
``ledger:anomalies`` (a total order the commits assign, never reused). A durable cursor, one small JSON
file per webhook (default ``<ledger>/.alerts/<hash of the URL>.json``, written atomically), holds the
position of the last anomaly the receiver acknowledged with a 2xx; it moves only then, so a kill at
any point re-sends at most the one anomaly in flight, with the same ``Idempotency-Key`` (its event id)
for the receiver to drop.

Each POST is retried on a connection error, a timeout, a 5xx or a 429 with bounded exponential backoff
(a ``Retry-After`` is honoured up to a cap), and given up on at once on any other status, with one line
naming it. The URL's path is never printed (a Slack webhook's path is its secret): only its scheme,
host and port. Standard library only (``http.client``).
"""

from __future__ import annotations

import fcntl
import hashlib
import http.client
import json
import math
import socket
import ssl
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgspec

from runledger.ledger.lake import LakeError, LakeFolder
from runledger.ledger.query import Reader
from runledger.ledger.records import LedgerError, newest_commit_number, read_commit_record
from runledger.schemas.durable import write_durably

ANOMALY_TYPE = "ledger.anomaly"
ANOMALY_SOURCE = "ledger:anomalies"  # the ingest source the ledger records its anomalies under
CURSOR_AREA = ".alerts"  # in the ledger folder: one cursor file per webhook
CURSOR_FORMAT = 1
USER_AGENT = "runledger-alerts/1"


class DeliveryError(LedgerError):
    """An alert that could not be delivered (or a bad URL or cursor): one line, the cursor unmoved."""


# ---------------------------------------------------------------------------------------- anomalies
@dataclass(frozen=True)
class Anomaly:
    """One recorded anomaly: where the ledger put it (``position``) and what its payload says (None
    throughout when the event was redacted: only its envelope columns are left)."""

    position: int
    event_id: str
    run_id: str | None
    attempt: int | None
    step: int | None
    time: datetime | None
    commit: int
    rule: str | None = None
    rule_version: int | None = None
    params: dict[str, float] = field(default_factory=dict)
    metric: str | None = None
    value: float | None = None
    baseline: float | None = None
    score: float | None = None
    cause_event_id: str | None = None

    @property
    def redacted(self) -> bool:
        return self.rule is None


_ANOMALY_SQL = (
    "SELECT ingest_position, id, run_id, attempt, step, time, commit, canonical FROM events "
    "WHERE type = ? AND ingest_source = ? AND ingest_position > ?"
)


def read_anomalies(
    reader: Reader,
    *,
    after_position: int = -1,
    run_id: str | None = None,
    rule: str | None = None,
    limit: int | None = None,
) -> list[Anomaly]:
    """The anomalies after ``after_position``, in recorded order (optionally one run's, one rule's)."""
    sql, params = _ANOMALY_SQL, [ANOMALY_TYPE, ANOMALY_SOURCE, after_position]
    if run_id is not None:
        sql, params = sql + " AND run_id = ?", [*params, run_id]
    sql += " ORDER BY ingest_position"
    if limit is not None and rule is None:  # (a rule filter is applied to the decoded payloads)
        sql += f" LIMIT {int(limit)}"
    found = [_anomaly(row) for row in reader.sql(sql, params).rows]
    if rule is not None:
        found = [a for a in found if a.rule == rule]
    return found[:limit] if limit is not None else found


def _anomaly(row: Sequence[Any]) -> Anomaly:
    position, event_id, run_id, attempt, step, at, commit, canonical = row
    head = Anomaly(int(position), str(event_id), run_id, attempt, step, at, int(commit))
    data = _payload(canonical)
    if data is None:
        return head
    return replace(
        head,
        rule=str(data.get("rule")),
        rule_version=_int_or_none(data.get("rule_version")),
        params={str(k): v for k, v in (data.get("params") or {}).items()},
        metric=_str_or_none(data.get("metric")),
        value=_float_or_none(data.get("value")),
        baseline=_float_or_none(data.get("baseline")),
        score=_float_or_none(data.get("score")),
        cause_event_id=_str_or_none(data.get("event_id")),
    )


def _payload(canonical: str | None) -> dict[str, Any] | None:
    """The event's ``data`` (None: redacted, or not an object)."""
    if not canonical:
        return None
    try:
        data = msgspec.json.decode(canonical).get("data")
    except (msgspec.DecodeError, AttributeError):
        return None
    return data if isinstance(data, dict) and data.get("rule") else None


def _int_or_none(value: Any) -> int | None:
    return int(value) if isinstance(value, int | float) else None


def _float_or_none(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def _str_or_none(value: Any) -> str | None:
    return str(value) if value is not None else None


# ---------------------------------------------------------------------------------- the message
def alert_message(anomaly: Anomaly, ledger_id: str) -> dict[str, Any]:
    """The POST's body: Slack's ``text`` and ``blocks`` (what producers named, escaped: a metric
    called ``<!channel>`` must not ping anyone), and a ``runledger`` object for machines."""
    text = _slack_escape(_headline(anomaly))
    context = _slack_escape(
        f"event `{anomaly.event_id}`"
        + (f" · caused by `{anomaly.cause_event_id}`" if anomaly.cause_event_id else "")
    )
    return {
        "text": text,
        "blocks": [
            {"type": "section", "text": {"type": "mrkdwn", "text": text}},
            {"type": "context", "elements": [{"type": "mrkdwn", "text": context}]},
        ],
        "runledger": {
            "event_id": anomaly.event_id,
            "ledger_id": ledger_id,
            "position": anomaly.position,
            "rule": anomaly.rule,
            "rule_version": anomaly.rule_version,
            "params": anomaly.params,
            "run_id": anomaly.run_id,
            "attempt": anomaly.attempt,
            "step": anomaly.step,
            "metric": anomaly.metric,
            "value": anomaly.value,
            "baseline": anomaly.baseline,
            "score": anomaly.score,
            "cause_event_id": anomaly.cause_event_id,
            "time": anomaly.time.isoformat() if anomaly.time is not None else None,
            "redacted": anomaly.redacted,
        },
    }


def _slack_escape(text: str) -> str:
    """Slack's three control characters as its entities (its mrkdwn reads ``<…>`` as links and mentions)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _headline(a: Anomaly) -> str:
    where = f"run {a.run_id or '?'} step {a.step if a.step is not None else '?'} (attempt {a.attempt or 1})"
    if a.redacted:
        return f"runledger anomaly (redacted) on {where}"
    seen = f"{a.metric} = {_number(a.value)}"
    if a.baseline is not None:
        seen += f", baseline {_number(a.baseline)}"
    if a.score is not None:
        seen += f", score {_number(a.score)}"
    return f"runledger anomaly: {a.rule} v{a.rule_version} on {where}: {seen}"


def _number(value: float | None) -> str:
    return "non-finite" if value is None else f"{value:.6g}"


# ---------------------------------------------------------------------------------------- the cursor
@dataclass(frozen=True)
class AlertCursor:
    """The last anomaly a webhook acknowledged: its position (-1: none yet) and event id."""

    position: int = -1
    event_id: str | None = None
    ledger_id: str | None = None


def default_cursor_path(ledger: Path, url: str) -> Path:
    """One cursor per webhook in the ledger folder, named by a hash of its URL (never the URL)."""
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    return Path(ledger) / CURSOR_AREA / f"{digest}.json"


def load_cursor(path: Path) -> AlertCursor:
    """The cursor saved at ``path`` (none there: from the first anomaly)."""
    try:
        obj = json.loads(path.read_bytes())
    except FileNotFoundError:
        return AlertCursor()
    except (OSError, ValueError) as exc:
        raise DeliveryError(f"alert cursor {path}: unreadable ({exc})") from None
    if (
        not isinstance(obj, dict)
        or obj.get("format") != CURSOR_FORMAT
        or not isinstance(obj.get("position"), int)
    ):
        raise DeliveryError(f"alert cursor {path}: not a cursor this version writes")
    return AlertCursor(obj["position"], obj.get("event_id"), obj.get("ledger_id"))


def save_cursor(path: Path, cursor: AlertCursor) -> None:
    """Atomically and durably: a kill leaves the old cursor or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "format": CURSOR_FORMAT,
        "position": cursor.position,
        "event_id": cursor.event_id,
        "ledger_id": cursor.ledger_id,
        "saved_at": datetime.now(UTC).isoformat(),
    }
    write_durably(path, json.dumps(record, sort_keys=True) + "\n")


# ----------------------------------------------------------------------------------------- the POST
@dataclass(frozen=True)
class Webhook:
    """A parsed webhook URL; ``shown`` leaves out the path and query (they may hold its secret)."""

    scheme: str
    host: str
    port: int
    target: str  # path and query, as sent

    @property
    def shown(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"


def parse_webhook(url: str) -> Webhook:
    """The URL as a webhook, or one line saying what is wrong with it."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise DeliveryError(f"bad webhook URL: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise DeliveryError(
            f"bad webhook URL: the scheme must be http or https, not {parts.scheme or 'none'!r}"
        )
    if not parts.hostname:
        raise DeliveryError("bad webhook URL: no host")
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    if any(ch.isspace() or ord(ch) < 32 or ord(ch) == 127 for ch in target):
        raise DeliveryError("bad webhook URL: a space or control character in its path (percent-encode it)")
    return Webhook(parts.scheme, parts.hostname, port or (443 if parts.scheme == "https" else 80), target)


@dataclass(frozen=True)
class RetryPolicy:
    """How long one POST may take and how often it is tried: every wait is bounded."""

    timeout_s: float = 10.0  # each connect, send and read of one try
    max_tries: int = 6
    first_backoff_s: float = 0.5  # doubled after each failed try …
    max_backoff_s: float = 30.0  # … up to this
    max_retry_after_s: float = 60.0  # a receiver's Retry-After is honoured up to this

    def backoff_s(self, failed_tries: int, retry_after_s: float | None) -> float:
        if retry_after_s is not None:
            return min(max(retry_after_s, 0.0), self.max_retry_after_s)
        return min(self.first_backoff_s * 2 ** (failed_tries - 1), self.max_backoff_s)


@dataclass(frozen=True)
class _Try:
    """One try's outcome: a status (None: no answer) and what to say about it."""

    status: int | None
    problem: str = ""
    retry_after_s: float | None = None

    final: bool = False  # no answer, and none would come on a retry (a certificate refused)

    @property
    def retryable(self) -> bool:
        if self.status is None:
            return not self.final
        return self.status == 429 or self.status >= 500


def _post_once(hook: Webhook, body: bytes, headers: dict[str, str], timeout_s: float) -> _Try:
    """One POST, its answer read whole (a receiver that stops answering times out)."""
    kind = http.client.HTTPSConnection if hook.scheme == "https" else http.client.HTTPConnection
    conn = kind(hook.host, hook.port, timeout=timeout_s)
    try:
        conn.request("POST", hook.target, body=body, headers=headers)
        response = conn.getresponse()
        response.read()
        return _Try(
            response.status, f"HTTP {response.status} {response.reason}".strip(), _retry_after(response)
        )
    except ssl.SSLCertVerificationError as exc:
        return _Try(None, f"certificate refused: {exc.verify_message or exc}", final=True)
    except (OSError, http.client.HTTPException) as exc:
        return _Try(None, _connection_problem(exc, timeout_s))
    finally:
        conn.close()


def _connection_problem(exc: BaseException, timeout_s: float) -> str:
    if isinstance(exc, TimeoutError | socket.timeout):
        return f"no answer within {timeout_s:g} s"
    said = " ".join(str(exc).split())  # one line, whatever the exception says
    return f"{type(exc).__name__}: {said}" if said else type(exc).__name__


def _retry_after(response: http.client.HTTPResponse) -> float | None:
    """Retry-After in seconds (a number, or an HTTP date from now); None when absent or unreadable."""
    value = response.getheader("Retry-After")
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        return (parsedate_to_datetime(value) - datetime.now(UTC)).total_seconds()
    except (TypeError, ValueError):
        return None


def post_alert(
    hook: Webhook,
    message: dict[str, Any],
    event_id: str,
    policy: RetryPolicy,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """POST until a 2xx (returns the tries it took); one line as ``DeliveryError`` otherwise."""
    body = json.dumps(message, sort_keys=True).encode()
    headers = {
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
        "Idempotency-Key": event_id,  # the receiver drops a re-sent anomaly by it
        "X-Runledger-Event-Id": event_id,
    }
    last = _Try(None)
    for tries in range(1, policy.max_tries + 1):
        last = _post_once(hook, body, headers, policy.timeout_s)
        if last.status is not None and 200 <= last.status < 300:
            return tries
        if not last.retryable:
            raise DeliveryError(f"{hook.shown} refused anomaly {event_id}: {last.problem}; not retried")
        if tries < policy.max_tries:
            sleep(policy.backoff_s(tries, last.retry_after_s))
    raise DeliveryError(
        f"{hook.shown}: gave up on anomaly {event_id} after {policy.max_tries} tries: {last.problem}"
    )


# ---------------------------------------------------------------------------------------- delivery
@dataclass
class DeliveryReport:
    """What one pass did: anomalies delivered, the POSTs it took, and where the cursor stands."""

    delivered: int = 0
    posts: int = 0
    cursor: AlertCursor = field(default_factory=AlertCursor)


BATCH_ANOMALIES = 1000  # read from one snapshot at a time: a backlog never sits in memory whole


@dataclass(frozen=True)
class _Delivery:
    """What every pass of one ``deliver``/``follow`` uses."""

    ledger: Path
    hook: Webhook
    cursor_path: Path
    policy: RetryPolicy
    on_delivered: Callable[[Anomaly], None] | None
    sleep: Callable[[float], None]


def deliver_alerts(
    ledger: Path,
    url: str,
    cursor_path: Path | None = None,
    *,
    policy: RetryPolicy | None = None,
    on_delivered: Callable[[Anomaly], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> DeliveryReport:
    """Deliver every anomaly after the cursor, in order, moving the cursor after each 2xx."""
    delivery = _delivery(ledger, url, cursor_path, policy, on_delivered, sleep)
    with cursor_lock(delivery.cursor_path):
        return _deliver_pass(delivery)


def _delivery(
    ledger: Path,
    url: str,
    cursor_path: Path | None,
    policy: RetryPolicy | None,
    on_delivered: Callable[[Anomaly], None] | None,
    sleep: Callable[[float], None],
) -> _Delivery:
    hook = parse_webhook(url)  # a bad URL is refused before the ledger is opened
    path = cursor_path if cursor_path is not None else default_cursor_path(ledger, url)
    return _Delivery(
        Path(ledger), hook, path, policy if policy is not None else RetryPolicy(), on_delivered, sleep
    )


@contextmanager
def cursor_lock(path: Path) -> Iterator[None]:
    """One deliverer per cursor (two would each send every anomaly): ``<cursor>.lock``, held."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a+b") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DeliveryError(f"alert cursor {path} is in use by another `ledger alerts deliver`") from None
        yield


def _deliver_pass(d: _Delivery) -> DeliveryReport:
    report = DeliveryReport(cursor=load_cursor(d.cursor_path))
    while True:
        ledger_id, batch = _pending(d, report.cursor)
        # One at a time, in order: the cursor never passes an anomaly the receiver has not acknowledged.
        for anomaly in batch:
            message = alert_message(anomaly, ledger_id)
            report.posts += post_alert(d.hook, message, anomaly.event_id, d.policy, d.sleep)
            report.cursor = AlertCursor(anomaly.position, anomaly.event_id, ledger_id)
            save_cursor(d.cursor_path, report.cursor)
            report.delivered += 1
            if d.on_delivered is not None:
                d.on_delivered(anomaly)
        if len(batch) < BATCH_ANOMALIES:
            return report


def _pending(d: _Delivery, cursor: AlertCursor) -> tuple[str, list[Anomaly]]:
    """The ledger's id and the next batch of anomalies after ``cursor``, at the newest snapshot."""
    reader = Reader(d.ledger)
    try:
        ledger_id = _ledger_id(d.ledger, reader)
        _same_ledger(d.cursor_path, cursor, ledger_id)
        return ledger_id, read_anomalies(reader, after_position=cursor.position, limit=BATCH_ANOMALIES)
    finally:
        reader.close()


def _ledger_id(ledger: Path, reader: Reader) -> str:
    """The ledger's id: a lake's from its marker (the reader's head would read the newest commit
    record from the catalog, ~0.3 s on a loaded machine), a published copy's from the reader."""
    try:
        lake = LakeFolder.read(Path(ledger))
    except LakeError:
        lake = None
    return lake.ledger_id if lake is not None else reader.head.ledger_id


def _same_ledger(path: Path, cursor: AlertCursor, ledger_id: str) -> None:
    """A cursor of another ledger (one re-created at the same path) would skip or repeat anomalies."""
    if cursor.ledger_id is not None and cursor.ledger_id != ledger_id:
        raise DeliveryError(
            f"alert cursor {path} belongs to ledger {cursor.ledger_id}, not {ledger_id}: "
            "remove it to start over, or name another with --cursor"
        )


@dataclass
class CommitWatch:
    """Whether a follow pass could find anything new, from the ledger folder's commit records alone
    (a directory listing and, after a new commit, its record's next anomaly position), so an idle
    follower never opens a Reader. Commits another host made on a shared lake reach this folder only
    when synced, so a full pass runs at least every ``full_look_s`` whatever the records say."""

    ledger: Path
    full_look_s: float = 30.0
    seen_commit: int = -2  # the newest commit record looked at (-2: none yet)
    next_position: int | None = None  # its ``ledger:anomalies`` position (None: unknown)
    looked_at: float = -math.inf  # time.monotonic() of the last full pass

    def worth_a_pass(self, cursor_position: int) -> bool:
        newest = newest_commit_number(Path(self.ledger))
        if newest is None or time.monotonic() - self.looked_at >= self.full_look_s:
            return True
        if newest != self.seen_commit:
            self.seen_commit, self.next_position = (
                newest,
                _next_anomaly_position(Path(self.ledger), newest),
            )
        return self.next_position is None or self.next_position - 1 > cursor_position

    def passed(self) -> None:
        self.looked_at = time.monotonic()


def _next_anomaly_position(root: Path, commit: int) -> int | None:
    """The position the ledger's next anomaly takes as of ``commit`` (None: unreadable)."""
    try:
        record = read_commit_record(root, commit)
        return int(record["positions"].get(ANOMALY_SOURCE, 0))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def follow_alerts(
    ledger: Path,
    url: str,
    cursor_path: Path | None = None,
    *,
    interval_s: float = 2.0,
    passes: int | None = None,
    policy: RetryPolicy | None = None,
    on_delivered: Callable[[Anomaly], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    watch: CommitWatch | None = None,
) -> DeliveryReport:
    """Deliver, then look again every ``interval_s`` (``passes`` looks; None: until interrupted),
    opening the ledger's newest snapshot only when ``watch`` says there may be something new. A
    pass that fails ends the follow with its line."""
    if not interval_s > 0:
        raise DeliveryError(f"--interval must be above 0 s, not {interval_s:g}")
    delivery = _delivery(ledger, url, cursor_path, policy, on_delivered, sleep)
    watch = watch if watch is not None else CommitWatch(ledger)
    with cursor_lock(delivery.cursor_path):
        total = DeliveryReport(cursor=load_cursor(delivery.cursor_path))
        done = 0
        while passes is None or done < passes:
            if watch.worth_a_pass(total.cursor.position):
                report = _deliver_pass(delivery)
                watch.passed()
                total.delivered += report.delivered
                total.posts += report.posts
                total.cursor = report.cursor
            done += 1
            if passes is None or done < passes:
                sleep(interval_s)
    return total
