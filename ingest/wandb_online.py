"""Import online W&B runs (``ENTITY/PROJECT[/RUN]``) through wandb's public API into ledger events.

wandb's own client (``wandb.Api``) does the talking: it lists the project's runs (paged), loads each
run's config and summary, scans its full history (``run.scan_history``: wandb-core pages it by step
range) and reads its system metrics (``run.history(stream="system")``, sampled by W&B). The base URL
and the API key are wandb's own settings (``WANDB_BASE_URL``, ``WANDB_API_KEY``); a 429 is retried by
wandb-core after ``Retry-After``.

Each W&B run becomes, on three sources (so each source's ``seq`` depends only on W&B's data, and a
re-import from scratch gives the same ids and bytes: duplicates, never conflicts):

  ``wandb-api:E/P/R``          RunStarted (attempt 1, ``external.wandb_url``), RunResumed per restart
                               found in the history, then RunSummary + RunFinished once W&B says the
                               run ended (finished → completed, crashed/failed → failed, killed → stopped)
  ``wandb-api:E/P/R/history``  StepMetrics per history row (names as logged, typed fields from
                               them), at the row's ``define_metric`` step metric (the run config's
                               ``_wandb.m``: the Hugging Face Trainer's ``train/global_step``), else
                               at W&B's ``_step``; consecutive rows at one step (a train row and its
                               eval row) are one event. All of it ``runledger.schemas.wandb_rows``'s, as the
                               offline import and the bridge do it
  ``wandb-api:E/P/R/system``   RankStats (rank 0) per system-metrics sample, ``system.*`` keys

**Attempts.** W&B keeps one history per run and refuses rows whose ``_step`` is not above the last it
holds, so a resume from an earlier checkpoint is visible only indirectly. A row starts a new attempt
when its ``_step`` is not above the previous row's (a rewind W&B kept), when ``_runtime`` went back
(the relaunched process counts from zero), or when the wall clock moved ``RELAUNCH_GAP_S`` more than
``_runtime`` did (the process was down while W&B carried its runtime on). The resumed attempt's
``from_checkpoint_step`` is the step before a rewind, else the last step W&B kept before the restart
(an upper bound: the real checkpoint may be earlier, and the steps W&B refused are lost).

**Resume.** A cursor per run (``runledger.ingest.wandb_cursor``, JSON beside the spool) holds the last imported step, the
next ``seq`` of each source, the attempt and the previous row. It is written only after the events it
covers were handed to the sink and synced, after every page of rows and when a read fails mid-run, so
an interrupted import continues at the next row. Nothing is emitted for a run before its config and
summary were read: a deleted or unreadable run leaves nothing behind. With step metrics, the rows of
the last ledger step are held until a row of another step (or the run's end) shows the step is
complete, and the cursor stays before them, so a run still going gives the same events over several
imports as in one; a resumed import reads the last row it emitted again (not emitting it) for the
step metrics' last values and the last ledger step.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal, TypedDict

import msgspec

from runledger.ingest.bus import EventSink
from runledger.ingest.wandb_cursor import CursorStore, RunCursor
from runledger.ingest.wandb_import import RUN_ID_RE, history_values
from runledger.schemas import config_hash, make_event
from runledger.schemas import payloads as p
from runledger.schemas.launch import Provenance, launch_event, launch_fields
from runledger.schemas.wandb_rows import StepAxis, step_metrics_of_row

log = logging.getLogger("runledger.wandb")

TARGET_RE = re.compile(
    r"^([A-Za-z0-9][A-Za-z0-9_.-]*)/([A-Za-z0-9][A-Za-z0-9_.-]*)(?:/([A-Za-z0-9][A-Za-z0-9_.-]*))?$"
)
RELAUNCH_GAP_S = 300.0  # wall-clock time the runtime did not account for: the process was down
SYSTEM_SAMPLES = 100_000  # ask for every system sample W&B will give (it samples on its side anyway)
PAGE_ROWS = 1000  # history rows per page; the cursor is saved after each
_STATUS_OF_STATE: dict[str, Literal["completed", "stopped", "failed"]] = {
    "finished": "completed",
    "crashed": "failed",
    "failed": "failed",
    "killed": "stopped",
}


class OnlineImportError(RuntimeError):
    """A W&B project or run could not be read (one line, naming it)."""


def parse_target(text: str) -> tuple[str, str, str | None]:
    """``ENTITY/PROJECT`` or ``ENTITY/PROJECT/RUN`` (W&B's own path form) → its parts."""
    match = TARGET_RE.match(text.strip())
    if not match:
        raise OnlineImportError(f"not a W&B path: {text!r} (expected ENTITY/PROJECT or ENTITY/PROJECT/RUN)")
    return match.group(1), match.group(2), match.group(3)


# -- results ----------------------------------------------------------------------------------------


@dataclass
class OnlineRunStats:
    run_id: str
    wandb_path: str
    wandb_url: str
    rows: int = 0
    attempts: int = 1
    system_samples: int = 0
    skipped_values: int = 0
    events: int = 0
    resumed_at_step: int | None = None  # an earlier import's cursor: where this one picked up
    finished: bool = False

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ProjectImport:
    runs: list[OnlineRunStats] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # one line per run that could not be imported


# -- reading W&B --------------------------------------------------------------------------------------


def open_api(base_url: str | None = None, *, timeout_s: float = 60.0) -> Any:
    """wandb's public API client; ``base_url`` overrides ``WANDB_BASE_URL`` (tests point it at a local
    server). The API key is wandb's: ``WANDB_API_KEY`` or its netrc, never a command-line argument."""
    import wandb

    overrides = {"base_url": base_url} if base_url else {}
    try:
        return wandb.Api(overrides=overrides, timeout=int(timeout_s))
    except Exception as exc:  # wandb raises its own UsageError/AuthenticationError/CommError
        raise OnlineImportError(f"cannot connect to W&B: {_one_line(exc)}") from None


_HTTP_ERROR_RE = re.compile(r"returned error (\d{3}): (\{.*\})\s*$", re.S)


def _one_line(exc: BaseException) -> str:
    """wandb's error as one short line; for an HTTP error, its status and the server's own message."""
    text = str(exc)
    match = _HTTP_ERROR_RE.search(text)
    if match:
        try:
            errors = json.loads(match.group(2)).get("errors") or []
            messages = [str(e.get("message")) for e in errors if isinstance(e, dict) and e.get("message")]
        except (ValueError, AttributeError):
            messages = []
        if messages:
            text = f"HTTP {match.group(1)}: {'; '.join(messages)}"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    line = lines[0] if lines else type(exc).__name__
    return line.removeprefix("input: ")[:300]


def list_runs(api: Any, entity: str, project: str, *, per_page: int = 50) -> Iterator[Any]:
    """The project's runs, oldest first, paged by wandb's client."""
    try:
        yield from api.runs(f"{entity}/{project}", per_page=per_page, order="+created_at")
    except Exception as exc:
        raise OnlineImportError(f"{entity}/{project}: cannot list runs: {_one_line(exc)}") from None


# -- mapping ------------------------------------------------------------------------------------------


def _json_safe(value: Any) -> Any:
    """NaN/±inf (JSON cannot carry them) → None, recursively."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def _float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _parse_time(text: Any) -> datetime | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        value = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _unix(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


def step_axis_of(rawconfig: Any) -> StepAxis:
    """The run's ``define_metric`` step metrics, from its config's ``_wandb.m``: wandb-core's list of
    metric records by proto field number (``"1"`` name, ``"2"`` glob name, ``"5"`` the step metric's
    1-based index in the list). Anything else there is ignored: no step metric, rows at ``_step``."""
    axis = StepAxis()
    internal = rawconfig.get("_wandb") if isinstance(rawconfig, Mapping) else None
    records = internal.get("m") if isinstance(internal, Mapping) else None
    if not isinstance(records, list):
        return axis
    names = [_metric_name(r) for r in records]
    for record, name in zip(records, names, strict=True):
        index = record.get("5") if isinstance(record, Mapping) else None
        step_metric = None
        if isinstance(index, int) and not isinstance(index, bool) and 1 <= index <= len(names):
            step_metric = names[index - 1]
        if name is not None:
            axis.define(name, step_metric)
    return axis


def _metric_name(record: Any) -> str | None:
    if not isinstance(record, Mapping):
        return None
    name = record.get("1") or record.get("2")
    return name if isinstance(name, str) and name else None


@dataclass
class _Pending:
    """History rows at one ledger step, not yet emitted, and the cursor as it was before them."""

    step: int
    wandb_step: int  # the first row's: the event's id
    attempt: int
    time: datetime
    before: RunCursor
    values: dict[str, float | int | None] = field(default_factory=dict)


class _Where(TypedDict):
    """The ``_RunImport.emit`` arguments a run's summary and its finish share."""

    source: str
    attempt: int
    time: datetime
    step: int | None


class _RunImport:
    """One W&B run → events on ``sink``; the cursor advances only past synced events."""

    def __init__(
        self,
        run: Any,
        entity: str,
        project: str,
        sink: EventSink,
        cursors: CursorStore,
        *,
        run_id: str | None,
        page_rows: int,
    ) -> None:
        self.run, self.sink, self.cursors, self.page_rows = run, sink, cursors, page_rows
        self.wandb_id = str(run.id)
        self.key = f"{entity}/{project}/{self.wandb_id}"
        self.source = f"wandb-api:{self.key}"
        self.entity, self.project = entity, project
        self.requested_run_id = run_id
        self.stats: OnlineRunStats | None = None
        self.axis = StepAxis()  # the run's define_metric step metrics (its config's ``_wandb.m``)
        self.pending: _Pending | None = None
        self.last_step: int | None = None  # the ledger step of the last row read

    # Everything a launch needs is read before the first event, so an unreadable run writes nothing.
    def read_run(self) -> tuple[dict[str, Any], dict[str, Any], str, str]:
        try:
            config = {k: v for k, v in dict(self.run.config).items() if not k.startswith("_wandb")}
            summary = dict(self.run.summary_metrics)
            raw = getattr(self.run, "rawconfig", None) or {}
            url = str(self.run.url)
            state = str(self.run.state)
        except Exception as exc:
            raise OnlineImportError(f"{self.key}: cannot read the run: {_one_line(exc)}") from None
        version = str(
            ((raw.get("_wandb") or {}) if isinstance(raw, Mapping) else {}).get("cli_version") or ""
        )
        self.software = {"wandb": version} if version else {}
        self.axis = step_axis_of(raw)
        return _json_safe(config), summary, url, state

    def emit(
        self,
        payload: Any,
        *,
        source: str,
        seq: int,
        kind: str,
        attempt: int,
        time: datetime,
        step: int | None,
    ) -> None:
        assert self.stats is not None
        self.sink.emit(
            make_event(
                payload,
                source=source,
                stream=self.stats.run_id,
                seq=seq,
                run_id=self.stats.run_id,
                attempt=attempt,
                step=step,
                id=f"wandb-api/{self.key}/{kind}",
                time=time,
                subject=f"wandb/{self.key}",
            )
        )
        self.stats.events += 1

    def checkpoint(self, cursor: RunCursor) -> None:
        """Make what was emitted durable, then (only then) record how far it went: up to the rows
        held for a step not complete yet (they are read again next time)."""
        self.sink.sync()
        self.cursors.save(self.key, cursor if self.pending is None else self.pending.before)

    def run_import(self) -> OnlineRunStats:
        config, summary, url, state = self.read_run()
        cursor = self.cursors.get(self.key)
        run_id = self.requested_run_id or (cursor.run_id if cursor else self.wandb_id)
        if cursor is not None and cursor.run_id != run_id:
            raise OnlineImportError(
                f"{self.key} was imported as run {cursor.run_id!r}; import it again with --run-id "
                f"{cursor.run_id} (or a new --cursor-file and --spool)"
            )
        if not RUN_ID_RE.match(run_id):
            raise OnlineImportError(f"W&B run id {run_id!r} is not a valid ledger run id; pass --run-id")
        self.stats = OnlineRunStats(run_id=run_id, wandb_path=self.key, wandb_url=url)
        self.launch = launch_fields(
            config=config,
            config_hash=config_hash(config),
            provenance=Provenance(
                host="", git_commit=getattr(self.run, "commit", None) or None, software=self.software
            ),
            repository=None,
            world_size=1,
            external={
                "wandb_run_id": self.wandb_id,
                "wandb_project": self.project,
                "wandb_entity": self.entity,
                "wandb_url": url,
            },
        )
        if cursor is None:
            cursor = RunCursor(run_id=run_id)
            created = _parse_time(getattr(self.run, "created_at", None)) or _unix(0)
            cursor.attempt_starts = [created.timestamp()]
            self.emit(
                launch_event(self.launch, attempt=1, name=getattr(self.run, "name", None) or None)[0],
                source=self.source,
                seq=0,
                kind="started",
                attempt=1,
                time=created,
                step=None,
            )
            self.checkpoint(cursor)
        else:
            self.stats.resumed_at_step = cursor.next_step
            if cursor.done:
                self.stats.attempts, self.stats.finished = cursor.attempt, True
                return self.stats
        self.import_history(cursor)
        self.import_system(cursor)
        if state in _STATUS_OF_STATE:
            self.emit_pending(cursor)  # the run ended: its last step is complete
            self.finish(cursor, summary, state)
        self.checkpoint(cursor)
        self.stats.attempts = cursor.attempt
        return self.stats

    def import_history(self, cursor: RunCursor) -> None:
        pending = 0
        try:
            for row in self.scan(cursor):
                self.on_row(cursor, row)
                pending += 1
                if pending >= self.page_rows:
                    self.checkpoint(cursor)
                    pending = 0
        finally:
            if pending:  # however the scan stopped (W&B failed, Ctrl-C), the rows handed over count
                self.checkpoint(cursor)

    def scan(self, cursor: RunCursor) -> Iterator[Mapping[str, Any]]:
        """The run's history from the cursor on; W&B's failures as one line saying where it stopped.
        With step metrics, a resumed import first reads the last row it emitted again, for the step
        metrics' last values and its ledger step (``recall``), without emitting it."""
        recall = self.axis.defined and cursor.prev_step is not None
        start = cursor.prev_step if recall and cursor.prev_step is not None else cursor.next_step
        try:
            rows = iter(self.run.scan_history(page_size=self.page_rows, min_step=start))
            while True:
                try:
                    row = next(rows)
                except StopIteration:
                    return
                step = row.get("_step")
                if recall and isinstance(step, int) and step < cursor.next_step:
                    self.last_step = self.axis.step_of(row, step)
                    continue
                yield row
        except Exception as exc:
            raise OnlineImportError(
                f"{self.key}: history read failed after step {cursor.prev_step}: {_one_line(exc)} "
                "(run the import again to continue)"
            ) from None

    def on_row(self, cursor: RunCursor, row: Mapping[str, Any]) -> None:
        assert self.stats is not None
        step = row.get("_step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            self.stats.skipped_values += 1
            return
        runtime, timestamp = _float(row.get("_runtime")), _float(row.get("_timestamp"))
        ledger_step = self.axis.step_of(row, step)
        if self.is_relaunch(cursor, step, runtime, timestamp):
            self.emit_pending(cursor)  # the rows before the restart are the earlier attempt's
            self.resume(cursor, step, runtime, timestamp, ledger_step)
        if self.pending is not None and self.pending.step != ledger_step:
            self.emit_pending(cursor)
        if self.pending is None:
            when = _unix(timestamp) if timestamp is not None else _unix(cursor.attempt_starts[-1])
            before = msgspec.structs.replace(cursor, attempt_starts=list(cursor.attempt_starts))
            self.pending = _Pending(ledger_step, step, cursor.attempt, when, before)
        # wandb-core hands the row over in no fixed key order: sorted, so the same row gives the same bytes
        values, skipped = history_values(dict(sorted(row.items())))
        self.stats.skipped_values += skipped
        self.pending.values.update(values)
        self.last_step = ledger_step
        cursor.next_step = step + 1
        cursor.prev_step, cursor.prev_runtime_s, cursor.prev_timestamp_s = step, runtime, timestamp
        self.stats.rows += 1
        if not self.axis.defined:
            self.emit_pending(cursor)  # no step metric: one row a step, nothing to wait for

    def emit_pending(self, cursor: RunCursor) -> None:
        """The held rows of one ledger step as one event, id'd by its first row's ``_step``."""
        held, self.pending = self.pending, None
        if held is None:
            return
        metrics = step_metrics_of_row(held.values)
        if metrics.total_tokens is not None:
            cursor.total_tokens = metrics.total_tokens
        self.emit(
            metrics,
            source=f"{self.source}/history",
            seq=cursor.history_seq,
            kind=f"step/{held.attempt}/{held.wandb_step}",
            attempt=held.attempt,
            time=held.time,
            step=held.step,
        )
        cursor.history_seq += 1

    @staticmethod
    def is_relaunch(cursor: RunCursor, step: int, runtime: float | None, timestamp: float | None) -> bool:
        if cursor.prev_step is None:
            return False
        if step <= cursor.prev_step:
            return True  # a rewind W&B kept
        if runtime is None or cursor.prev_runtime_s is None:
            return False
        if runtime < cursor.prev_runtime_s:
            return True  # the runtime started again: a new process
        if timestamp is None or cursor.prev_timestamp_s is None:
            return False
        return (timestamp - cursor.prev_timestamp_s) - (runtime - cursor.prev_runtime_s) > RELAUNCH_GAP_S

    def resume(
        self,
        cursor: RunCursor,
        step: int,
        runtime: float | None,
        timestamp: float | None,
        ledger_step: int,
    ) -> None:
        """A new attempt from the row at ``_step`` ``step`` (``ledger_step``): resumed from the step
        before a rewind, else from the last step read (ledger steps: with step metrics, theirs)."""
        assert cursor.prev_step is not None
        last = self.last_step if self.last_step is not None else cursor.prev_step
        from_step = ledger_step - 1 if step <= cursor.prev_step else last
        started = timestamp - runtime if timestamp is not None and runtime is not None else timestamp
        started = started if started is not None else cursor.attempt_starts[-1]
        cursor.attempt += 1
        cursor.attempt_starts.append(started)
        self.emit(
            launch_event(self.launch, attempt=cursor.attempt, resumed_from_step=max(from_step, 0))[0],
            source=self.source,
            seq=cursor.lifecycle_seq,
            kind=f"resumed/{cursor.attempt}",
            attempt=cursor.attempt,
            time=_unix(started),
            step=max(from_step, 0),
        )
        cursor.lifecycle_seq += 1

    def import_system(self, cursor: RunCursor) -> None:
        assert self.stats is not None
        try:
            samples = self.run.history(stream="system", pandas=False, samples=SYSTEM_SAMPLES)
        except Exception as exc:
            raise OnlineImportError(f"{self.key}: system metrics read failed: {_one_line(exc)}") from None
        timed = [
            (t, s)
            for s in samples
            if isinstance(s, Mapping) and (t := _float(s.get("_timestamp"))) is not None
        ]
        for when, sample in sorted(timed, key=lambda pair: pair[0]):
            if cursor.system_until is not None and when <= cursor.system_until:
                continue
            values = {k: _float(v) for k, v in sorted(sample.items()) if k.startswith("system.")}
            attempt = _attempt_at(cursor.attempt_starts, when)
            self.emit(
                p.RankStats(rank=0, host="", values=values),
                source=f"{self.source}/system",
                seq=cursor.system_seq,
                kind=f"system/{round(when * 1000)}",
                attempt=attempt,
                time=_unix(when),
                step=None,
            )
            cursor.system_seq += 1
            cursor.system_until = when
            self.stats.system_samples += 1

    def finish(self, cursor: RunCursor, summary: Mapping[str, Any], state: str) -> None:
        assert self.stats is not None
        values = _json_safe({k: v for k, v in summary.items() if not k.startswith("_")})
        runtime = (
            _float((summary.get("_wandb") or {}).get("runtime"))
            if isinstance(summary.get("_wandb"), Mapping)
            else None
        )
        runtime = runtime if runtime is not None else cursor.prev_runtime_s
        end = _parse_time(getattr(self.run, "heartbeat_at", None))
        if end is None or (cursor.prev_timestamp_s is not None and end.timestamp() < cursor.prev_timestamp_s):
            end = (
                _unix(cursor.prev_timestamp_s)
                if cursor.prev_timestamp_s is not None
                else _unix(cursor.attempt_starts[-1])
            )
        last = self.last_step if self.last_step is not None else cursor.prev_step  # a ledger step
        common = _Where(source=self.source, attempt=cursor.attempt, time=end, step=last)
        self.emit(p.RunSummary(values=values), seq=cursor.lifecycle_seq, kind="summary", **common)
        self.emit(
            p.RunFinished(
                status=_STATUS_OF_STATE[state],
                final_step=last,
                total_tokens=cursor.total_tokens,
                duration_s=runtime,
            ),
            seq=cursor.lifecycle_seq + 1,
            kind="finished",
            **common,
        )
        cursor.lifecycle_seq += 2
        cursor.done = True
        self.stats.finished = True


def _attempt_at(starts: list[float], when: float) -> int:
    """The attempt live at ``when``: the last one launched at or before it."""
    attempt = 1
    for index, start in enumerate(starts, start=1):
        if start <= when:
            attempt = index
    return attempt


# -- entry points ---------------------------------------------------------------------------------------


def import_online_run(
    run: Any,
    entity: str,
    project: str,
    sink: EventSink,
    cursors: CursorStore,
    *,
    run_id: str | None = None,
    page_rows: int = PAGE_ROWS,
) -> OnlineRunStats:
    """One W&B run (a ``wandb.apis.public.Run``) → events on ``sink``, resuming from its cursor."""
    stats = _RunImport(run, entity, project, sink, cursors, run_id=run_id, page_rows=page_rows).run_import()
    log.info("imported W&B run %s as %s: %d events", stats.wandb_path, stats.run_id, stats.events)
    return stats


def import_online(
    target: str,
    sink: EventSink,
    cursors: CursorStore,
    *,
    api: Any = None,
    run_id: str | None = None,
    page_rows: int = PAGE_ROWS,
    per_page: int = 50,
) -> ProjectImport:
    """``ENTITY/PROJECT`` (every run, oldest first) or ``ENTITY/PROJECT/RUN``. A run that cannot be read
    is one line in ``errors`` and the others are still imported."""
    entity, project, run_name = parse_target(target)
    if run_id is not None and run_name is None:
        raise OnlineImportError("--run-id needs one run (ENTITY/PROJECT/RUN)")
    api = api if api is not None else open_api()
    result = ProjectImport()
    try:
        for run in _runs_of(api, entity, project, run_name, per_page):
            try:
                stats = import_online_run(
                    run, entity, project, sink, cursors, run_id=run_id, page_rows=page_rows
                )
            except OnlineImportError as exc:
                log.warning("%s", exc)
                result.errors.append(str(exc))
            else:
                result.runs.append(stats)
    except OnlineImportError as exc:  # the project (or the one run asked for) could not be read
        result.errors.append(str(exc))
    return result


def _runs_of(api: Any, entity: str, project: str, run_name: str | None, per_page: int) -> Iterator[Any]:
    if run_name is None:
        yield from list_runs(api, entity, project, per_page=per_page)
        return
    try:
        run = api.run(f"{entity}/{project}/{run_name}")
    except Exception as exc:
        raise OnlineImportError(
            f"{entity}/{project}/{run_name}: cannot read the run: {_one_line(exc)}"
        ) from None
    yield run
