"""Read-side library: SQL over the views, a run's events, its state, history and diffs.

The CLI is a thin shell over these functions; tests and other programs call them directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import duckdb
import jsonpatch

from ledger.fold import STATE_TYPES, RunState, attempts_of, fold_run
from ledger.store import Ledger, LedgerError
from ledger.views import connect
from schemas import Envelope, decode_event
from schemas import catalogue as c

READ_ONLY_STATEMENTS = {"SELECT", "EXPLAIN"}


class QueryError(LedgerError):
    pass


@dataclass
class Result:
    columns: list[str]
    rows: list[tuple[Any, ...]]


class Reader:
    """Read-only access to one ledger."""

    def __init__(self, root: str | Path) -> None:
        self.ledger = Ledger.open(root)
        self.root = Path(root)
        self.con = connect(self.root)

    def sql(self, statement: str, params: Sequence[Any] | None = None) -> Result:
        """Run one or more read-only statements; returns the last one's rows. Writes are refused."""
        try:
            statements = self.con.extract_statements(statement)
        except duckdb.Error as exc:
            raise QueryError(_one_line(exc)) from None
        if not statements:
            raise QueryError("empty query")
        for st in statements:
            kind = st.type.name
            if kind not in READ_ONLY_STATEMENTS:
                raise QueryError(f"refused: the ledger is read-only here ({kind} statements are not allowed)")
        try:
            rel = None
            for st in statements:
                rel = self.con.execute(st.query, params) if params else self.con.execute(st.query)
            assert rel is not None
            columns = [d[0] for d in rel.description or []]
            return Result(columns, rel.fetchall())
        except duckdb.Error as exc:
            raise QueryError(_one_line(exc)) from None

    def runs(self) -> Result:
        return self.sql("SELECT * FROM runs ORDER BY started_at")

    def run_exists(self, run_id: str) -> bool:
        return bool(self.sql("SELECT count(*) FROM launches WHERE run_id = ?", [run_id]).rows[0][0])

    def require_run(self, run_id: str) -> None:
        if not self.run_exists(run_id):
            known = [r[0] for r in self.sql("SELECT DISTINCT run_id FROM launches ORDER BY 1").rows]
            hint = f" (known runs: {', '.join(known[:10])})" if known else " (the ledger has no runs yet)"
            raise QueryError(f"unknown run {run_id!r}{hint}")

    def events(self, run_id: str, types: Sequence[str] = STATE_TYPES) -> list[Envelope]:
        """A run's events of the given types, in stream order."""
        marks = ", ".join("?" for _ in types)
        rows = self.sql(
            f"SELECT canonical FROM events WHERE stream = ? AND type IN ({marks}) ORDER BY stream_seq",
            [run_id, *types],
        ).rows
        out = []
        for (canonical,) in rows:
            decoded = decode_event(canonical.encode())
            if not hasattr(decoded, "envelope"):
                raise QueryError(f"stored event of run {run_id} no longer decodes: {decoded.reason}")
            out.append(decoded.envelope)
        return out

    def github_rows(self, repository: str | None) -> list[dict[str, Any]]:
        if not repository:
            return []
        res = self.sql(
            "SELECT time, kind, action, number, title, state, actor, merged, sha, head_sha, url "
            "FROM github WHERE repo = ? ORDER BY time, stream_seq",
            [repository],
        )
        return [dict(zip(res.columns, row, strict=True)) for row in res.rows]

    def last_step(self, run_id: str) -> int | None:
        return self.sql("SELECT max(step) FROM events WHERE stream = ?", [run_id]).rows[0][0]

    def state(self, run_id: str, *, step: int | None = None, at: datetime | None = None) -> RunState:
        self.require_run(run_id)
        if step is not None:
            last = self.last_step(run_id)
            if step < 0 or (last is not None and step > last):
                raise QueryError(f"step {step} is out of range for run {run_id} (steps 0..{last})")
        events = self.events(run_id)
        attempts = attempts_of(events)
        repository = next((a.repository for a in attempts.values() if a.repository), None)
        if step is None and at is None:
            step = self.last_step(run_id)
        return fold_run(run_id, events, step=step, at=at, github=self.github_rows(repository))

    def diff(self, run_id: str, from_step: int, to_step: int) -> dict[str, Any]:
        """Config diff between two steps and everything that happened in between."""
        before = self.state(run_id, step=from_step)
        after = self.state(run_id, step=to_step)
        patch = jsonpatch.make_patch(before.config, after.config).patch
        lo, hi = sorted((from_step, to_step))
        happened = [
            item
            for item in self.history(run_id)
            if item.step is not None and lo < item.step <= hi and item.kind != "github"
        ]
        return {
            "from": {
                "step": from_step,
                "attempt": before.attempt,
                "config_hash": before.config_hash,
                "git_commit": before.git_commit,
            },
            "to": {
                "step": to_step,
                "attempt": after.attempt,
                "config_hash": after.config_hash,
                "git_commit": after.git_commit,
            },
            "config_patch": patch,
            "events": happened,
        }

    def blame(self, run_id: str, key: str, step: int | None = None) -> dict[str, Any]:
        """Which change set ``key`` (dotted path) to its value live at ``step``, and who is behind it."""
        state = self.state(run_id, step=step)
        path = "/" + key.replace(".", "/")
        value: Any = state.config
        for part in key.split("."):
            if not isinstance(value, dict) or part not in value:
                raise QueryError(f"config key {key!r} is not in run {run_id}'s config at step {state.step}")
            value = value[part]
        launch = next(a for a in state.attempts if a.attempt == state.attempt)
        setter: dict[str, Any] = {
            "kind": launch.kind,
            "step": launch.start_step,
            "attempt": launch.attempt,
            "time": launch.started_at,
            "cause": None,
        }
        for change in state.config_changes:
            touched = any(
                op["path"] == path or path.startswith(op["path"] + "/") or op["path"].startswith(path + "/")
                for op in change["patch"]
            )
            if change["accepted"] and change["attempt"] == state.attempt and touched:
                setter = {
                    "kind": "config.changed",
                    "step": change["step"],
                    "attempt": change["attempt"],
                    "time": change["time"],
                    "cause": change["cause"],
                }
        commit = (setter["cause"] or {}).get("commit") or state.git_commit
        return {
            "run_id": run_id,
            "key": key,
            "value": value,
            "step": state.step,
            "set_by": setter,
            "commit": commit,
            "git_dirty": state.git_dirty,
            "pull_requests": self.prs_for_commit(commit),
        }

    def prs_for_commit(self, sha: str | None) -> list[dict[str, Any]]:
        """The PRs whose merge, head or pushed commits include ``sha`` (prefixes allowed)."""
        if not sha:
            return []
        res = self.sql(
            "SELECT DISTINCT repo, number, title, actor, merged, sha FROM github WHERE kind = 'pull_request' "
            "AND (starts_with(sha, ?) OR starts_with(head_sha, ?)) ORDER BY number",
            [sha, sha],
        )
        return [dict(zip(res.columns, row, strict=True)) for row in res.rows]

    def history(self, run_id: str) -> list[HistoryItem]:
        self.require_run(run_id)
        events = self.events(run_id)
        attempts = attempts_of(events)
        items = [history_item(e) for e in events]
        repository = next((a.repository for a in attempts.values() if a.repository), None)
        if events:
            start, end = events[0].time, events[-1].time
            for g in self.github_rows(repository):
                if g["time"] <= end and (g["time"] >= start or g["kind"] in ("pull_request", "push")):
                    items.append(github_item(g))
        items.sort(key=lambda i: i.time)
        return items


@dataclass
class HistoryItem:
    time: datetime
    step: int | None
    attempt: int | None
    kind: str
    text: str


def history_item(e: Envelope) -> HistoryItem:
    d = e.data
    t = e.type
    if t == c.RUN_STARTED:
        text = (
            f"run started: commit {_short(d.git_commit)}{' (dirty)' if d.git_dirty else ''}, host {d.host}, "
            f"world size {d.world_size}, config {d.config_hash[:12]}"
        )
    elif t == c.RUN_RESUMED:
        text = (
            f"attempt {e.attempt} resumed from checkpoint step {d.from_checkpoint_step} at commit "
            f"{_short(d.git_commit)}{' (dirty)' if d.git_dirty else ''} on {d.host}"
        )
    elif t == c.CONFIG_CHANGED:
        text = "config changed: " + "; ".join(_op_text(op) for op in d.patch) + f" ({d.cause.kind})"
    elif t == c.CONFIG_REJECTED:
        text = "config change refused: " + "; ".join(_op_text(op) for op in d.patch) + f" — {d.reason}"
    elif t == c.CHECKPOINT_SAVED:
        text = f"checkpoint saved ({d.reason}): {d.path}"
    elif t == c.RUN_CRASHED:
        text = f"crash ({d.kind}): {d.exc_type or ''} {d.message}".strip() + f" on rank {d.rank} {d.host}"
    elif t == c.STEP_SKIPPED:
        text = f"step skipped: {d.reason} ({d.value})"
    elif t == c.RUN_FINISHED:
        text = f"attempt finished: {d.status}"
    elif t == c.ANNOTATION:
        text = f"note by {d.author}: {d.text}"
    else:
        text = t
    return HistoryItem(e.time, e.step, e.attempt, t.removeprefix("runledger."), text)


def github_item(g: dict[str, Any]) -> HistoryItem:
    kind, action, number = g["kind"], g["action"], g["number"]
    if kind == "pull_request" and g["merged"] and action == "closed":
        text = f"PR #{number} merged ({_short(g['sha'])}): {g['title']}"
    elif kind == "push":
        text = f"push to {g['title']} ({_short(g['sha'])}) by {g['actor']}"
    elif kind in ("issues", "pull_request"):
        label = "issue" if kind == "issues" else "PR"
        text = f"{label} #{number} {action}: {g['title']}"
    else:
        text = f"{kind} {action or ''} #{number or ''} by {g['actor']}"
    return HistoryItem(g["time"], None, None, "github", text)


def _op_text(op: Any) -> str:
    value = getattr(op, "value", None)
    return f"{op.op} {op.path}" + (f" = {value!r}" if op.op in ("add", "replace") else "")


def _short(sha: str | None) -> str:
    return sha[:7] if sha else "unknown"


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())
