"""The fold: a run's state at a step or a time, rebuilt from its events alone.

Lineage: attempt ``b`` resumed from checkpoint step ``S_b``. Step ``N`` belongs, on the run's final
lineage, to the latest attempt that started below it (``S_b < N``); an earlier attempt's steps after
a later attempt's resume point are superseded. The config live at step ``N`` is that attempt's launch
config with its accepted patches of step <= N applied in stream order (a change's step is the first
step trained with it).

The fold tells the truth about disagreement: each launch's config and each accepted change's result
is hashed again here and compared with the hash its producer recorded; where they differ the state
lists it (``hash_mismatches``) and the answers flag it, rather than trusting either side. Events the
ledger admitted unsigned under its policy (``unauthenticated``: their (source, id)) are marked
``authenticated: False`` and listed in ``RunState.unauthenticated``, so every answer can say so.

What the record is missing is said too: a producer's ``producer.dropped`` report (events that never
reached the bus: a full queue, a full disk) and ingest's ``ledger.incident`` (a gap or fork in a
chained source) are the state's ``incidents`` (every attempt's, up to the step), whether or not the
producer signs its events.

Ingest's incidents are recorded one per event (the record), but read in summary: a source that skips
its ``seq`` on every event makes one incident per event, and a state that listed each would cost every
reader as much as the flood. So the incidents of one source and kind fold into one range
(``fold_incidents``: how many, first..last seq, step and time), and of a kind with many sources the
few with the most incidents stand apart and the rest fold into one: a state lists a few lines
however many incidents or sources there are. A reader with SQL folds them where it reads them
(``runledger.ledger.views.incident_ranges_query``) and decodes only ``FOLD_TYPES``; handed the incident events
themselves, the fold folds them the same way.
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Iterable, Sequence
from datetime import datetime
from typing import Any

import msgspec

from runledger.schemas import Envelope
from runledger.schemas import catalogue as c
from runledger.schemas.canonical import config_hash
from runledger.schemas.config_patch import ConfigPatchError, apply_config_patch

# The event types the fold decodes (metrics are not needed to know a run's state), and what the
# ``state_events`` table holds. Ingest's incidents (``ledger.incident``) are not among them: a flood
# makes one per event, and a reader folds them where they are typed rows (``ingest_incidents``,
# ``runledger.ledger.views.incident_ranges_query``), so the fold's scan costs the same with 30,000
# as with 3. (A lake made before that table keeps its incidents in ``state_events`` too.)
STATE_TYPES = (
    c.RUN_STARTED,
    c.RUN_RESUMED,
    c.CONFIG_CHANGED,
    c.CONFIG_REJECTED,
    c.CHECKPOINT_SAVED,
    c.RUN_CRASHED,
    c.STEP_SKIPPED,
    c.RUN_FINISHED,
    c.ANNOTATION,
    c.PRODUCER_DROPPED,  # what a producer lost: one of the state's incidents
    c.BUS_POSITIONS_MISSING,  # bus positions that hold no record any more (a deleted segment)
    c.LEDGER_REDACTION,  # an event of the run whose payload was erased: the state says so
    c.LEDGER_ANOMALY,  # a detector's finding (runledger.ledger.anomalies): history, the report, the page
)
# (the name readers used for the state events without ingest's incidents: now the same)
FOLD_TYPES = STATE_TYPES
# Every event type the fold reads: with ingest's incidents, each decoded (``fold_incidents`` folds
# them as the SQL does); what ``state_events`` held on a lake made before ``ingest_incidents``.
EVERY_STATE_TYPE = (*STATE_TYPES, c.LEDGER_INCIDENT)
# Ingest's incident kinds (``ledger.incident``), folded per (kind, source) into ranges; of a kind with
# more sources than this, all but the ``SOURCES_APART - 1`` with the most incidents fold into one.
RANGE_KINDS = frozenset({"gap", "fork", "duplicate-launch"})
SOURCES_APART = 5
# Facts of every attempt, not only of the lineage: a crash, and events that were lost.
_INCIDENT_TYPES = (c.PRODUCER_DROPPED, c.LEDGER_INCIDENT, c.BUS_POSITIONS_MISSING, c.LEDGER_REDACTION)
_ANY_ATTEMPT_TYPES = frozenset({c.RUN_CRASHED, *_INCIDENT_TYPES})


class Attempt(msgspec.Struct):
    attempt: int
    start_step: int
    started_at: datetime
    kind: str
    git_commit: str | None
    git_dirty: bool | None
    host: str
    config: dict[str, Any]
    config_hash: str
    repository: str | None = None
    job_id: str | None = None
    cluster: str | None = None
    hash_matches: bool = True  # the launch config hashes again to the producer's config_hash
    authenticated: bool = True  # False: admitted unsigned under the ledger's policy


class RunState(msgspec.Struct):
    run_id: str
    step: int | None
    at: datetime | None
    attempt: int | None
    config: dict[str, Any]
    config_hash: str | None
    git_commit: str | None
    git_dirty: bool | None
    last_checkpoint: dict[str, Any] | None
    crashes: list[dict[str, Any]] = msgspec.field(default_factory=list)
    config_changes: list[dict[str, Any]] = msgspec.field(default_factory=list)
    annotations: list[dict[str, Any]] = msgspec.field(default_factory=list)
    github: list[dict[str, Any]] = msgspec.field(default_factory=list)
    attempts: list[Attempt] = msgspec.field(default_factory=list)
    # Where the config recomputed here and the producer's hash disagree: launches and changes so far.
    hash_mismatches: list[dict[str, Any]] = msgspec.field(default_factory=list)
    # The facts of this state that were admitted unsigned (kind, step, attempt, source).
    unauthenticated: list[dict[str, Any]] = msgspec.field(default_factory=list)
    # What the record lacks: producers' drop reports and ingest's gaps and forks, up to the step.
    incidents: list[dict[str, Any]] = msgspec.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = msgspec.to_builtins(self)
        return out


def attempts_of(
    events: Iterable[Envelope], unauthenticated: Collection[tuple[str, str]] = ()
) -> dict[int, Attempt]:
    out: dict[int, Attempt] = {}
    for e in events:
        if e.type in (c.RUN_STARTED, c.RUN_RESUMED):
            d = e.data
            attempt = e.attempt or 1
            if attempt in out:
                continue  # a second launch of one attempt (a duplicate-launch incident): the first holds
            out[attempt] = Attempt(
                attempt=attempt,
                start_step=getattr(d, "from_checkpoint_step", 0) or 0,
                started_at=e.time,
                kind="start" if e.type == c.RUN_STARTED else "resume",
                git_commit=d.git_commit,
                git_dirty=d.git_dirty,
                host=d.host,
                config=d.config,
                config_hash=d.config_hash,
                repository=d.repository,
                job_id=d.job_id,
                cluster=d.cluster,
                hash_matches=config_hash(d.config) == d.config_hash,
                authenticated=(e.source, e.id) not in unauthenticated,
            )
    return out


def covering_attempt(attempts: dict[int, Attempt], step: int) -> int | None:
    """The attempt that owns ``step`` on the final lineage."""
    if not attempts:
        return None
    below = [a for a in attempts.values() if a.start_step < step]
    return max(a.attempt for a in below) if below else min(attempts)


def superseded_after(attempts: dict[int, Attempt], attempt: int) -> int | None:
    later = [a.start_step for a in attempts.values() if a.attempt > attempt]
    return min(later) if later else None


def on_lineage(attempts: dict[int, Attempt], attempt: int, step: int | None) -> bool:
    cutoff = superseded_after(attempts, attempt)
    return cutoff is None or step is None or step <= cutoff


def fold_run(
    run_id: str,
    events: Sequence[Envelope],
    *,
    step: int | None = None,
    at: datetime | None = None,
    github: Sequence[dict[str, Any]] = (),
    unauthenticated: Collection[tuple[str, str]] = (),
) -> RunState:
    """State of ``run_id`` at ``step`` (on the final lineage) or as known at time ``at``.

    ``events`` are the run's events in stream order; ``github`` the rows of its repository's
    GitHub events (with a ``time``), of which those up to the cut time are kept; ``unauthenticated``
    the (source, id) of its events admitted unsigned.
    """
    if at is not None:
        events = [e for e in events if e.time <= at]
    attempts = attempts_of(events, unauthenticated)
    if at is not None:
        live = max(attempts) if attempts else None
        steps = [e.step for e in events if e.attempt == live and e.step is not None]
        if step is None:
            step = max(steps) if steps else None
    else:
        live = covering_attempt(attempts, step if step is not None else 0)
    state = RunState(run_id, step, at, live, {}, None, None, None, None, attempts=list(attempts.values()))
    if live is None:
        return state
    launch = attempts[live]
    config = copy.deepcopy(launch.config)
    state.git_commit, state.git_dirty = launch.git_commit, launch.git_dirty
    _check_launches(state, attempts, live)
    cut_time = at or launch.started_at
    erased = _erased_config_steps(events)
    for e in events:
        attempt = e.attempt or 1
        in_live = attempt == live and (step is None or e.step is None or e.step <= step)
        # Earlier attempts count only up to where the lineage left them.
        in_past = attempt < live and on_lineage(attempts, attempt, e.step)
        if not (in_live or in_past or (attempt < live and e.type in _ANY_ATTEMPT_TYPES)):
            continue
        if in_live and e.time > cut_time:
            cut_time = e.time
        authenticated = (e.source, e.id) not in unauthenticated
        try:
            config = _fold_event(
                state, e, config, in_live=in_live, in_past=in_past, authenticated=authenticated
            )
        except ConfigPatchError:
            # A change made to a config that held a redacted change: it cannot apply here. The
            # state lists the redaction as an incident; its config is what the record still shows.
            if not (attempt in erased and e.step is not None and erased[attempt] <= e.step):
                raise
    state.incidents = fold_incidents(state.incidents)
    state.config = config
    state.config_hash = config_hash(config)
    state.github = [g for g in github if g["time"] <= cut_time]
    return state


def _erased_config_steps(events: Iterable[Envelope]) -> dict[int, int]:
    """attempt -> the first step at which a config event of it was redacted (``ledger redact``)."""
    out: dict[int, int] = {}
    for e in events:
        if e.type == c.LEDGER_REDACTION and e.data.event_type == c.CONFIG_CHANGED:
            attempt, step = e.attempt or 1, e.step if e.step is not None else 0
            out[attempt] = min(step, out.get(attempt, step))
    return out


def _check_launches(state: RunState, attempts: dict[int, Attempt], live: int) -> None:
    """The launches on the lineage up to ``live`` whose config hash or signature does not hold."""
    for a in sorted(attempts.values(), key=lambda a: a.attempt):
        if a.attempt > live or not on_lineage(attempts, a.attempt, a.start_step):
            continue
        fact = {"kind": a.kind, "step": a.start_step, "attempt": a.attempt}
        if not a.hash_matches:
            state.hash_mismatches.append(
                {**fact, "recorded": a.config_hash, "recomputed": config_hash(a.config)}
            )
        if not a.authenticated:
            state.unauthenticated.append(fact)


def _fold_event(
    state: RunState,
    e: Envelope,
    config: dict[str, Any],
    *,
    in_live: bool,
    in_past: bool,
    authenticated: bool,
) -> dict[str, Any]:
    """One event of the lineage into ``state``; returns the config after it (a live change applied)."""
    attempt = e.attempt or 1
    d = e.data
    if not authenticated and e.type != c.RUN_STARTED and e.type != c.RUN_RESUMED:
        state.unauthenticated.append(
            {"kind": e.type.removeprefix("runledger."), "step": e.step, "attempt": attempt}
        )
    if e.type == c.CONFIG_CHANGED and in_live:
        config = apply_config_patch(config, d.patch)  # a patch that does not apply raises
        recomputed = config_hash(config)
        change = _change(e, accepted=True, authenticated=authenticated)
        change["hash_matches"] = recomputed == d.config_hash
        if not change["hash_matches"]:
            state.hash_mismatches.append(
                {
                    "kind": "config.changed",
                    "step": e.step,
                    "attempt": attempt,
                    "recorded": d.config_hash,
                    "recomputed": recomputed,
                }
            )
        state.config_changes.append(change)
    elif e.type == c.CONFIG_REJECTED and (in_live or in_past):
        state.config_changes.append(_change(e, accepted=False, authenticated=authenticated))
    elif e.type == c.CONFIG_CHANGED and in_past:
        state.config_changes.append(_change(e, accepted=True, authenticated=authenticated))
    elif e.type == c.CHECKPOINT_SAVED and (in_live or in_past):
        state.last_checkpoint = {"step": e.step, "attempt": attempt, "path": d.path, "time": e.time}
    elif e.type == c.RUN_CRASHED:
        state.crashes.append(
            {
                "step": e.step,
                "attempt": attempt,
                "kind": d.kind,
                "exc_type": d.exc_type,
                "message": d.message,
                "rank": d.rank,
                "host": d.host,
                "time": e.time,
            }
        )
    elif e.type == c.ANNOTATION and (in_live or in_past):
        state.annotations.append({"step": e.step, "author": d.author, "text": d.text, "time": e.time})
    elif e.type in _INCIDENT_TYPES:
        state.incidents.append(incident_fact(e))
    return config


def incident_fact(e: Envelope) -> dict[str, Any]:
    """A drop report or a gap/fork as the state lists it: kind (``dropped``/``gap``/``fork``), how
    many events, their steps and seq numbers, which source, why."""
    d = e.data
    fact: dict[str, Any] = {"step": e.step, "attempt": e.attempt, "time": e.time}
    if e.type == c.PRODUCER_DROPPED:
        return fact | {
            "kind": "dropped",
            "count": d.count,
            "first_step": d.first_step,
            "last_step": d.last_step,
            "first_seq": d.first_seq,
            "last_seq": d.last_seq,
            "source": e.source,
            "reason": d.reason,
        }
    if e.type == c.BUS_POSITIONS_MISSING:
        return fact | {
            "kind": "positions-missing",
            "count": d.count,
            "first_seq": d.first,  # bus positions, not producer seq numbers
            "last_seq": d.last,
            "source": d.source,
            "reason": d.reason,
        }
    if e.type == c.LEDGER_REDACTION:  # the erased event's place, and why (its facts are gone)
        return fact | {
            "kind": "redacted",
            "count": 1,
            "first_seq": d.stream_seq,  # its place in the stream, not a producer seq number
            "last_seq": d.stream_seq,
            "source": d.event_source,
            "reason": f"{d.event_type} {d.event_id} redacted by {d.actor}: {d.reason}",
        }
    gap = d.kind == "gap"  # seq numbers expected_seq..got_seq - 1 are missing; else the one event
    return fact | {
        "kind": d.kind,
        "count": d.missing if gap else 1,
        "first_seq": d.expected_seq if gap else d.got_seq,
        "last_seq": d.got_seq - 1 if gap else d.got_seq,
        "source": d.source,
        "reason": getattr(d, "detail", None),
        "expected_seq": d.expected_seq,  # a fork's sentence names it
    }


def fold_incidents(facts: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Incident facts (``incident_fact``, in stream order) with ingest's gaps and forks folded: one
    range per (kind, source) (``range_fact``), and of a kind with more than ``SOURCES_APART`` sources,
    the ``SOURCES_APART - 1`` with the most incidents apart and the rest as one range; in time order
    (a range at its first incident's). ``runledger.ledger.views.incident_ranges_query`` folds them alike in SQL."""
    per_source: dict[tuple[Any, Any], dict[str, Any]] = {}
    out: list[dict[str, Any]] = []
    for fact in facts:
        if fact["kind"] not in RANGE_KINDS:
            out.append(fact)
        elif (fact["kind"], fact["source"]) in per_source:
            _widen(per_source[(fact["kind"], fact["source"])], fact)
        else:
            per_source[(fact["kind"], fact["source"])] = range_fact(fact)
    for kind in sorted({kind for kind, _ in per_source}):
        # Their first seen first among equals: the order of ``per_source`` is the stream's.
        ranges = sorted((r for (k, _), r in per_source.items() if k == kind), key=lambda r: -r["incidents"])
        out += ranges[: SOURCES_APART - 1]
        if ranges[SOURCES_APART - 1 :]:
            out.append(_merged(ranges[SOURCES_APART - 1 :]))
    return sorted(out, key=lambda fact: fact["time"])


def range_fact(fact: dict[str, Any]) -> dict[str, Any]:
    """One incident as a range of one: ``incidents`` (how many it folds), ``first_step``/``last_step``,
    ``first_time``/``last_time`` and ``sources`` (how many, ``source``..``last_source`` by name) beside
    the fact's own keys (``step``/``time``/``attempt``: the earliest)."""
    return fact | {
        "expected_seq": fact.get("expected_seq"),
        "incidents": 1,
        "first_step": fact["step"],
        "last_step": fact["step"],
        "first_time": fact["time"],
        "last_time": fact["time"],
        "sources": 1,
        "last_source": fact["source"],
    }


def _widen(folded: dict[str, Any], fact: dict[str, Any]) -> None:
    """``folded`` grown by one more incident, or range (``range_fact``), of its kind."""
    other = fact if "incidents" in fact else range_fact(fact)
    folded["incidents"] += other["incidents"]
    folded["count"] += other["count"]
    folded["expected_seq"] = None  # one incident's own: a range has none
    folded["first_seq"] = min(folded["first_seq"], other["first_seq"])
    folded["last_seq"] = max(folded["last_seq"], other["last_seq"])
    steps = [
        s
        for s in (folded["first_step"], folded["last_step"], other["first_step"], other["last_step"])
        if s is not None
    ]
    folded["first_step"], folded["last_step"] = (min(steps), max(steps)) if steps else (None, None)
    folded["step"] = folded["first_step"]
    folded["first_time"] = folded["time"] = min(folded["first_time"], other["first_time"])
    folded["last_time"] = max(folded["last_time"], other["last_time"])
    attempts = [a for a in (folded["attempt"], other["attempt"]) if a is not None]
    folded["attempt"] = min(attempts) if attempts else None


def _merged(ranges: list[dict[str, Any]]) -> dict[str, Any]:
    """Ranges of one kind from many sources as one (``source``: the first name, ``last_source``: the last)."""
    merged = dict(ranges[0])
    for other in ranges[1:]:
        _widen(merged, other)
    names = sorted(r["source"] for r in ranges)
    merged |= {"source": names[0], "last_source": names[-1], "sources": len(ranges)}
    return merged


def with_incident_ranges(
    incidents: Iterable[dict[str, Any]], ranges: Iterable[dict[str, Any]]
) -> list[dict[str, Any]]:
    """A state's incidents (a fold handed no ``ledger.incident`` event) and ingest's incidents read
    in summary (``runledger.ledger.views.incident_range_facts``), in time order."""
    return sorted([*incidents, *ranges], key=lambda fact: fact["time"])


def _change(e: Envelope, *, accepted: bool, authenticated: bool = True) -> dict[str, Any]:
    """A change as the state lists it; ``hash_matches`` is set (True/False) only where this fold
    applied it (the live attempt's accepted changes), None elsewhere."""
    return {
        "step": e.step,
        "attempt": e.attempt,
        "accepted": accepted,
        "patch": msgspec.to_builtins(e.data.patch),
        "reason": getattr(e.data, "reason", None),
        "cause": msgspec.to_builtins(e.data.cause),
        "time": e.time,
        "hash_matches": None,
        "authenticated": authenticated,
    }
