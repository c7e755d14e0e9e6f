"""A run's history as a story: each history row (an event, a GitHub row) told as one line.

The narration ``ledger history`` prints and ``ledger diff`` quotes: ``runledger.ledger.query.Reader.history``
reads the rows and the code each attempt ran; this module turns them into ``HistoryItem`` sentences,
and summarises a long history to a screen (``summarise_history``, ``history_range``,
``history_counts``). No queries here: everything it tells comes in as arguments.
"""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import jsonpatch
import jsonpointer
import msgspec

from runledger.ledger.fold import RANGE_KINDS, incident_fact
from runledger.schemas import Envelope
from runledger.schemas import catalogue as c
from runledger.schemas.config_patch import ConfigPatchError, apply_config_patch


class HistoryItem(msgspec.Struct):
    time: datetime
    step: int | None
    attempt: int | None
    kind: str
    text: str
    count: int = 1  # the records the line tells of: a range of incidents tells of many
    run_id: str | None = None  # in a lineage's history: the run id it is of, if not the one asked

    @property
    def routine(self) -> bool:
        """An interval checkpoint or a GitHub event other than a merge: a summary counts these."""
        if self.kind == "checkpoint.saved":
            return self.text.startswith("checkpoint saved (interval)")
        return self.kind == "github" and not _MERGE_TEXT.match(self.text)


_MERGE_TEXT = re.compile(r"PR #\d+ merged \(")  # github_item's line for a merge


# A history longer than this is summarised unless asked for in full: what a terminal table shows
# (runledger.cli.output.TABLE_ROWS_DEFAULT), so a summary is never cut by the row limit.
SCREEN_LINES = 40


def history_range(
    items: Sequence[HistoryItem],
    from_step: int | None,
    to_step: int | None,
    window: tuple[datetime, datetime] | None = None,
) -> list[HistoryItem]:
    """The items of steps ``from_step``..``to_step`` (either end open), and the step-less ones
    (GitHub events) that happened meanwhile: within ``window``, the times the run was at those steps
    (``Reader.step_window``: from step ``from_step``'s time to the last event of the range), else
    between the first and the last item of the range. The window matters: a run's history items are
    its launches, changes and checkpoints, so the PR merged shortly before a change at a step inside
    the range happened before the range's first history item."""
    lo = from_step if from_step is not None else -1
    hi = to_step if to_step is not None else float("inf")
    stepped = [i for i in items if i.step is not None and lo <= i.step <= hi]
    if window is None:
        if not stepped:
            return []
        window = (min(i.time for i in stepped), max(i.time for i in stepped))
    start, end = window
    return [
        i
        for i in items
        if (i.step is not None and lo <= i.step <= hi) or (i.step is None and start <= i.time <= end)
    ]


def summarise_history(items: Sequence[HistoryItem], max_lines: int = SCREEN_LINES) -> list[HistoryItem]:
    """A history that fits ``max_lines`` as it is; else its notable items (launches, config changes,
    crashes, merges, notes, ends) with each stretch of routine items between them as one counted line;
    if that is still longer than a screen (a months-long run), only what changed the run: launches,
    config changes, notes, ends, and each crash with the resume that followed it as one line."""
    if len(items) <= max_lines:
        return list(items)
    notable = _notable(items)
    return notable if len(notable) <= max_lines else _turning_points(items)


def _notable(items: Sequence[HistoryItem]) -> list[HistoryItem]:
    out: list[HistoryItem] = []
    stretch: list[HistoryItem] = []
    for item in [*items, None]:
        if item is not None and item.routine:
            stretch.append(item)
            continue
        if stretch:
            out.append(_routine_line(stretch))
            stretch = []
        if item is not None:
            out.append(item)
    return out


def _turning_points(items: Sequence[HistoryItem]) -> list[HistoryItem]:
    """No routine lines and no GitHub events (the title counts them); a crash and its resume fused
    (the anomalies the crash caused, a NaN loss's, follow the fused line)."""
    kept = [i for i in items if not i.routine and i.kind != "github"]
    out: list[HistoryItem] = []
    for item in kept:
        at = len(out) - 1
        while at >= 0 and out[at].kind == c.LEDGER_ANOMALY:
            at -= 1
        previous = out[at] if at >= 0 else None
        if item.kind == "run.resumed" and previous is not None and previous.kind == "run.crashed":
            where = f" from step {item.step:,}" if item.step is not None else ""
            text = f"resumed as attempt {item.attempt}{where} after {previous.text}"
            out[at] = HistoryItem(previous.time, previous.step, previous.attempt, "crash → resume", text)
        else:
            out.append(item)
    return out


def _routine_line(stretch: Sequence[HistoryItem]) -> HistoryItem:
    checkpoints = [i for i in stretch if i.kind != "github"]
    parts = []
    if checkpoints:
        steps = [i.step for i in checkpoints if i.step is not None]
        where = f" (steps {min(steps):,}–{max(steps):,})" if steps else ""
        parts.append(f"{len(checkpoints):,} checkpoint{'s' if len(checkpoints) != 1 else ''}{where}")
    github = len(stretch) - len(checkpoints)
    if github:
        parts.append(f"{github:,} GitHub event{'s' if github != 1 else ''}")
    attempts = {i.attempt for i in checkpoints}
    first = checkpoints[0] if checkpoints else stretch[0]
    return HistoryItem(
        first.time,
        first.step,
        attempts.pop() if len(attempts) == 1 else None,
        "routine",
        "… " + ", ".join(parts),
    )


def history_counts(items: Sequence[HistoryItem]) -> str:
    """``20 attempts, 19 crashes, 4 config changes, 780 checkpoints, 212 GitHub events``."""
    kinds = [i.kind for i in items]
    counted = [
        (sum(k in ("run.started", "run.resumed") for k in kinds), "attempt"),
        (kinds.count("run.crashed"), "crash"),
        (kinds.count("config.changed"), "config change"),
        (kinds.count("config.rejected"), "refused change"),
        (sum(i.count for i in items if i.kind in ("producer.dropped", "ledger.incident")), "incident"),
        (kinds.count("checkpoint.saved"), "checkpoint"),
        (kinds.count(c.LEDGER_ANOMALY), "anomaly"),
        (kinds.count("github"), "GitHub event"),
    ]
    return ", ".join(
        f"{n:,} {what if n == 1 else _PLURALS.get(what, what + 's')}" for n, what in counted if n
    )


_PLURALS = {"crash": "crashes", "anomaly": "anomalies"}


PrLookup = Callable[[str | None], list[dict[str, Any]]]


def history_item(
    e: Envelope,
    previous_config: dict[str, Any] | None = None,
    code: dict[str, Any] | None = None,
    prs_for_commit: PrLookup | None = None,
) -> HistoryItem:
    """One event as a line of the story; ``previous_config`` is the config live just before it."""
    d = e.data
    t = e.type
    if t == c.RUN_STARTED:
        text = (
            f"run started at {_commit_text(d.git_commit, d.git_dirty, code)}, host {d.host}, "
            f"world size {d.world_size}, config {d.config_hash[:12]}"
        )
        if d.parent_run is not None:  # a relaunch under a new run id: the run and step it goes on from
            text += f"; continues run {d.parent_run}" + (
                f" from step {d.fork_step:,}" if d.fork_step is not None else ""
            )
    elif t == c.RUN_RESUMED:
        text = (
            f"attempt {e.attempt} resumed from checkpoint step {d.from_checkpoint_step:,} at "
            f"{_commit_text(d.git_commit, d.git_dirty, code)} on {d.host}"
        )
        if previous_config is not None:
            changed = [
                op_text(op, previous_config) for op in jsonpatch.make_patch(previous_config, d.config).patch
            ]
            if changed:
                text += f"; config vs attempt {d.previous_attempt}: " + "; ".join(changed)
    elif t == c.CONFIG_CHANGED:
        ops = "; ".join(op_text(op, previous_config) for op in d.patch)
        text = f"config changed at step {e.step:,}: {ops} ({_cause_text(d.cause, prs_for_commit)})"
    elif t == c.CONFIG_REJECTED:
        ops = "; ".join(op_text(op, previous_config) for op in d.patch)
        text = f"config change refused: {ops} — {d.reason}"
    elif t == c.CHECKPOINT_SAVED:
        text = f"checkpoint saved ({d.reason}): {d.path}"
    elif t == c.RUN_CRASHED:
        text = f"{_crash_text(d)} on rank {d.rank}" + (f" {d.host}" if d.host else "")
    elif t == c.STEP_SKIPPED:
        text = f"step skipped: {d.reason} ({d.value})"
    elif t == c.RUN_FINISHED:
        text = f"attempt finished: {d.status}"
    elif t == c.ANNOTATION:
        text = f"note by {d.author}: {d.text}"
    elif t in (c.PRODUCER_DROPPED, c.LEDGER_INCIDENT, c.BUS_POSITIONS_MISSING):
        text = incident_text(incident_fact(e))
    elif t == c.LEDGER_ANOMALY:
        from runledger.ledger.anomalies import anomaly_text  # (the detectors' module: ~5 ms to import)

        text = f"anomaly: {anomaly_text(d)}"
    elif t == c.LEDGER_REDACTION:
        text = f"REDACTED {d.event_type} {d.event_id} (#{d.stream_seq}) by {d.actor}: {d.reason}"
    else:
        text = t
    return HistoryItem(e.time, e.step, e.attempt, t.removeprefix("runledger."), text)


def incident_items(ranges: Sequence[Mapping[str, Any]]) -> list[HistoryItem]:
    """Ingest's incidents read in summary (``runledger.ledger.views.incident_range_facts``) as history lines:
    one per source and kind, at its first incident, counting the incidents it folds."""
    return [
        HistoryItem(
            fact["first_time"],
            fact["first_step"],
            fact["attempt"],
            c.LEDGER_INCIDENT,
            incident_text(fact),
            fact["incidents"],
        )
        for fact in ranges
    ]


# ``ledger state``'s words for each kind of incident (``incident_text(fact, brief=True)``); another
# kind is named as it is.
_BRIEF_WORDS = {
    "dropped": "lost by the producer",
    "gap": "missing (a gap)",
    "fork": "forked",
    "positions-missing": "missing from the bus",
}


def incident_text(fact: Mapping[str, Any], *, brief: bool = False) -> str:
    """An incident as the fold lists it (``runledger.ledger.fold.incident_fact``), told as ``ledger history``
    tells it: ``1,203 events lost by trainer/r/a1/rank0 (steps 318–1,520; seq 319–1,521): bus down
    (…)``, ``gap in trainer/r/a1/rank0: 5 events missing (seq 40–44)``, ``fork in … at seq 7
    (expected 5)``; or ``brief``, as ``ledger state`` lists it: ``8 events lost by the producer
    (trainer/r/a1, steps 3..10): queue full``."""
    kind, count, source, reason = fact["kind"], fact["count"], fact["source"], fact.get("reason")
    if fact.get("incidents", 1) > 1 or fact.get("sources", 1) > 1:
        return _range_text(fact, brief=brief)
    if brief:
        first, last = fact.get("first_step"), fact.get("last_step")
        stepped = first is not None and last is not None and kind not in RANGE_KINDS  # a gap: its seq
        steps = f", steps {first}..{last}" if stepped else ""
        noun = "event" if count == 1 else "events"
        why = f": {reason}" if reason else ""
        return f"{count} {noun} {_BRIEF_WORDS.get(kind, kind)} ({source}{steps}){why}"
    first_seq: Any = fact.get("first_seq")  # None only in a drop report of an older producer
    last_seq: Any = fact.get("last_seq")
    if kind == "dropped":
        first_step = fact.get("first_step")
        where = [f"steps {_span(first_step, fact.get('last_step'))}"] if first_step is not None else []
        if first_seq is not None:
            where.append(f"seq {_span(first_seq, last_seq)}")
        detail = f" ({'; '.join(where)})" if where else ""
        return f"{count:,} event{'s' if count != 1 else ''} lost by {source}{detail}: {reason}"
    if kind == "positions-missing":
        return f"{count:,} records missing from {source} (positions {_span(first_seq, last_seq)}): {reason}"
    if kind == "gap":
        noun = "event" if count == 1 else "events"
        return f"gap in {source}: {count:,} {noun} missing (seq {_span(first_seq, last_seq)})"
    expected = fact.get("expected_seq")
    return (
        f"{kind} in {source} at seq {first_seq:,}"
        + (f" (expected {expected:,})" if expected is not None else "")
        + (f": {reason}" if reason else "")
    )


# A range of ingest's incidents (``runledger.ledger.fold.range_fact``), ``ledger state``'s words and history's.
_RANGE_BRIEF = {"gap": "missing", "fork": "forked", "duplicate-launch": "launched twice"}
_RANGE_NOUNS = {"gap": "gaps", "fork": "forks", "duplicate-launch": "duplicate launches"}


def _range_text(fact: Mapping[str, Any], *, brief: bool) -> str:
    """Many incidents of one kind, from one source or (``sources`` > 1) many: ``39 gaps in
    trainer/r/a1/rank7: 30,849 events missing (seq 2–30,888; steps 2,000–40,000)``; ``30,537 gaps in
    788 sources (trainer/r/a1/rank10 … trainer/r/a1/rank99): …``; ``brief``: ``30849 events missing
    (39 gaps) (trainer/r/a1/rank7, steps 2000..40000, seq 2..30888)``."""
    kind, count, incidents = fact["kind"], fact["count"], fact["incidents"]
    nouns = _RANGE_NOUNS.get(kind, f"{kind} incidents") if incidents != 1 else kind
    sources = fact.get("sources", 1)
    source = (
        fact["source"] if sources == 1 else f"{sources:,} sources ({fact['source']} … {fact['last_source']})"
    )
    first_step, last_step = fact.get("first_step"), fact.get("last_step")
    noun = "event" if count == 1 else "events"
    if brief:
        steps = f", steps {first_step}..{last_step}" if first_step is not None else ""
        what = f"{count} {noun} {_RANGE_BRIEF.get(kind, kind)} ({incidents:,} {nouns})"
        return f"{what} ({source}{steps}, seq {fact['first_seq']}..{fact['last_seq']})"
    where = [f"seq {_span(fact['first_seq'], fact['last_seq'])}"]
    if first_step is not None:
        where.append(f"steps {_span(first_step, last_step)}")
    events = f": {count:,} {noun} missing" if kind == "gap" else ""
    return f"{incidents:,} {nouns} in {source}{events} ({'; '.join(where)})"


def _span(first: int, last: int | None) -> str:
    return f"{first:,}" if last is None or last == first else f"{first:,}–{last:,}"


def _crash_text(d: Any) -> str:
    """``crash (exception): RuntimeError boom``; a signal stop reads ``interrupted by SIGINT: …``."""
    message = (d.message or "").strip()
    if d.kind != "signal":
        return f"crash ({d.kind}): " + (
            " ".join(part for part in (d.exc_type, message) if part) or "no message"
        )
    name = _signal_name(d.signal)
    detail = message.removeprefix(f"{name}:").strip()
    # A bare exception text (``signal 2`` from a second signal, empty from KeyboardInterrupt) adds nothing.
    if detail in (name, f"signal {d.signal}"):
        detail = ""
    if d.exc_type == "SignalStop":
        detail = detail or "stopped at once, mid-step (a second signal)"
    return f"interrupted by {name}" + (f": {detail}" if detail else "")


def _signal_name(signum: int | None) -> str:
    if signum is None:
        return "a signal"
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def github_item(g: dict[str, Any]) -> HistoryItem:
    kind, action, number, actor = g["kind"], g["action"], g["number"], g["actor"]
    if kind == "pull_request" and g["merged"] and action in ("closed", "snapshot"):
        text = f"PR #{number} merged ({_short(g['sha'])}) by {actor}: {g['title']}"
    elif kind == "push":
        text = f"push to {g['title']} ({_short(g['sha'])}) by {actor}"
    elif kind == "commit":
        text = f"commit {_short(g['sha'])} by {actor}: {g['title']}"
    elif kind in ("issues", "pull_request"):
        label = "issue" if kind == "issues" else "PR"
        text = f"{label} #{number} {action}: {g['title']}"
    elif kind == "pull_request_review":
        text = f"review of PR #{number} by {actor}: {g['state'] or action}" + _excerpt(g["body"])
    elif kind in ("issue_comment", "pull_request_review_comment"):
        where = "PR" if kind == "pull_request_review_comment" else "#"
        text = f"comment on {where}{' #' if where == 'PR' else ''}{number} by {actor}" + _excerpt(g["body"])
    else:
        text = f"{kind} {action or ''}".strip() + (f" #{number}" if number else "") + f" by {actor}"
    return HistoryItem(g["time"], None, None, "github", text)


def _excerpt(body: str | None, width: int = 80) -> str:
    if not body:
        return ""
    flat = " ".join(body.split())
    return ": " + (flat if len(flat) <= width else flat[: width - 1] + "…")


def config_after(e: Envelope, config: dict[str, Any] | None) -> dict[str, Any] | None:
    """The config live after event ``e`` (launches replace it; accepted changes patch it)."""
    if e.type in (c.RUN_STARTED, c.RUN_RESUMED):
        return e.data.config
    if e.type == c.CONFIG_CHANGED and config is not None:
        try:
            return apply_config_patch(config, e.data.patch)
        except ConfigPatchError:
            return config  # the fold reports a patch that does not apply; the story goes on
    return config


def _commit_text(sha: str | None, dirty: bool | None, code: dict[str, Any] | None) -> str:
    full = (code or {}).get("commit_sha") or sha
    text = f"commit {_short(full)}{' (dirty)' if dirty else ''}"
    if code and code.get("commit_title"):
        text += f" “{code['commit_title']}”"
    if code and code.get("pr_number") is not None:
        how = "merged" if code.get("pr_relation") == "merge_commit" else "head"
        text += f" (PR #{code['pr_number']} {how}: {code['pr_title']})"
    return text


def _cause_text(cause: Any, prs_for_commit: PrLookup | None) -> str:
    if cause.commit:
        what = f"commit {_short(cause.commit)}"
        prs = prs_for_commit(cause.commit) if prs_for_commit else []
        if prs:
            what += " (" + ", ".join(f"PR #{pr['number']}" for pr in prs) + ")"
        if cause.kind != "commit":
            what = f"{cause.kind}, {what}"
    else:
        what = cause.kind
    if cause.detail:
        what += f" {cause.detail}"
    return what + (f" by {cause.actor}" if cause.actor else "")


def op_text(op: Any, config: dict[str, Any] | None = None) -> str:
    """``moe.capacity_factor 1.0 → 1.15``: the key, the value it replaced (when known), the new value."""
    kind, path = _get(op, "op"), _get(op, "path")
    key = _dotted(path)
    if kind in ("move", "copy"):
        return f"{kind} {_dotted(_get(op, 'from'))} → {key}"
    if kind == "test":
        return f"test {key} = {_value(_get(op, 'value'))}"
    old = value_at(config, path)
    before = _value(old) if old is not MISSING else None
    if kind == "remove":
        return f"{key} {before} → removed" if before is not None else f"{key} removed"
    after = _value(_get(op, "value"))
    return f"{key} {before} → {after}" if before is not None else f"{key} = {after}"


MISSING = object()  # ``value_at``'s answer for a path the config does not have


def _get(op: Any, name: str) -> Any:
    if isinstance(op, dict):
        return op.get(name)
    return getattr(op, "from_" if name == "from" else name, None)


def _dotted(path: str | None) -> str:
    if not path:
        return "(root)"
    return ".".join(part.replace("~1", "/").replace("~0", "~") for part in path.lstrip("/").split("/"))


def value_at(config: dict[str, Any] | None, path: str | None) -> Any:
    """The value at JSON pointer ``path`` in ``config``, or ``MISSING``."""
    if config is None or path is None:
        return MISSING
    try:
        return jsonpointer.resolve_pointer(config, path)
    except jsonpointer.JsonPointerException:
        return MISSING


def _value(value: Any) -> str:
    if value is msgspec.UNSET:
        return "?"
    return json.dumps(value, separators=(",", ":"), default=str)


def _short(sha: str | None) -> str:
    return sha[:7] if sha else "unknown"
