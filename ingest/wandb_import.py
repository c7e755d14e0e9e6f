"""Import an offline Weights & Biases run into the ledger (W&B → events on the bus).

Import (``import_offline_run``): a W&B offline run directory (``wandb/offline-run-*/run-*.wandb``)
becomes ledger events:

  RunStarted     the config given to ``wandb.init`` (``_wandb`` internals dropped), its config_hash,
                 ``external`` = wandb_run_id / wandb_project / wandb_entity / wandb_file
  ConfigChanged  one per mid-run ``config.update`` (RFC 6902 add/replace/remove, cause "api")
  StepMetrics    one per history row, as the live bridge records it (``runledger.schemas.wandb_rows``):
                 every number under the name it was logged with, the typed fields (loss, lr,
                 grad_norm, tokens…) filled from it (``train/loss`` → loss); bools as 1/0;
                 NaN/±inf → null (JSON cannot carry them); strings, media, histograms are skipped.
                 The step is the row's ``define_metric`` step metric (the Hugging Face Trainer's
                 ``train/global_step``, from the file's ``metric`` records), else W&B's ``_step``;
                 consecutive rows at one step (a train row and its eval row) are one event
  RunSummary     the final summary (W&B's ``_``-prefixed internals dropped)
  RunFinished    from the exit record ("completed" for exit code 0, else "failed"); absent when the
                 file ends without one (a crashed or still-running run)

The ``.wandb`` file is read with wandb's own reader: wandb 0.31 no longer ships a Python datastore
reader (``wandb.sdk.internal.datastore`` is gone); its bundled ``wandb-core`` binary decodes the log
(``wandb-core leet inspect -json``: one JSON record per line) and we map those records. Ids are
``wandb/{wandb_run_id}/…`` and seq counts from 0, so importing the same file twice is deduplicated.

**Damage.** wandb's reader skips what it cannot decode ("skipped corrupt data") and goes on; the
import keeps what is readable and says what was skipped (``ImportStats.skipped_stretches``, the
reader's messages, the history steps around each hole). Unless ``accept_partial``, a partial import
then raises ``PartialImportError`` (the readable events are on the bus already: a second import of
the same file adds nothing). A file whose run record is damaged is imported when the caller names
the ledger run (``run_id``): the W&B run id then comes from the file's name.

Online runs (``ENTITY/PROJECT[/RUN]`` through W&B's public API) are imported by
``runledger.ingest.wandb_online``, which shares this module's row mapping (``history_values``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec

from runledger.ingest.bus import EventSink
from runledger.schemas import Envelope, config_hash, make_event
from runledger.schemas import payloads as p
from runledger.schemas.launch import Provenance, launch_event, launch_fields
from runledger.schemas.wandb_rows import StepAxis, step_metrics_of_row

log = logging.getLogger("runledger.wandb")

RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_NONFINITE = {"NaN", "nan", "Infinity", "-Infinity", "inf", "-inf"}


class WandbImportError(RuntimeError):
    """The path holds no readable W&B offline run (or wandb's reader failed on it)."""


class PartialImportError(WandbImportError):
    """wandb's reader skipped damaged data: what was readable was imported (``stats``), not all."""

    def __init__(self, message: str, stats: ImportStats) -> None:
        super().__init__(message)
        self.stats = stats


# -- reading an offline run ----------------------------------------------------------------------


def find_offline_runs(path: str | Path) -> list[Path]:
    """The ``run-*.wandb`` files under ``path``: a .wandb file, a run directory, or a wandb directory."""
    root = Path(path)
    if root.is_file():
        if root.suffix != ".wandb":
            raise WandbImportError(f"{root} is not a .wandb file")
        return [root]
    if not root.is_dir():
        raise WandbImportError(f"no such directory: {root}")
    found = sorted(root.glob("run-*.wandb"))
    if not found:
        found = sorted(root.glob("*run-*/run-*.wandb"))  # a wandb/ directory holding run directories
    if not found:
        found = sorted(root.glob("wandb/*run-*/run-*.wandb"))  # the directory wandb was started in
    if not found:
        raise WandbImportError(f"no W&B run (run-*.wandb) under {root}")
    return found


_SKIPPED_MARK = "skipped corrupt data"


def read_records(wandb_file: str | Path, skipped: list[str] | None = None) -> Iterator[dict[str, Any]]:
    """The records of a ``.wandb`` file as decoded by wandb's own reader (``wandb-core``). Each
    stretch the reader skipped as corrupt is one of its messages appended to ``skipped`` (known
    once the records are all read)."""
    from wandb.util import get_core_path

    try:
        core = get_core_path()
    except Exception as exc:
        raise WandbImportError(f"wandb's reader (wandb-core) is not available: {exc}") from None
    args = [core, "leet", "inspect", "-no-observability", "-json", "-run-file", str(wandb_file)]
    env = os.environ | {"WANDB_ERROR_REPORTING": "false"}
    with tempfile.TemporaryFile() as errors:
        # stderr to a file, so a chatty reader can never block on a full pipe while we read stdout.
        with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=errors, env=env, close_fds=True) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.strip():
                    yield json.loads(line)
            code = proc.wait()
        errors.seek(0)
        lines = [ln for ln in errors.read().decode(errors="replace").splitlines() if ln.strip()]
        if skipped is not None:
            skipped.extend(ln.split(": ", 1)[-1] for ln in lines if _SKIPPED_MARK in ln)
        if code != 0:
            raise WandbImportError(f"wandb could not read {wandb_file}: {lines[-1] if lines else code}")


@dataclass
class ImportStats:
    run_id: str
    wandb_run_id: str
    wandb_file: str
    steps: int = 0
    config_changes: int = 0
    summary_keys: int = 0
    skipped_values: int = 0
    events: int = 0
    finished: bool = False
    skipped_stretches: int = 0  # damaged stretches wandb's reader skipped
    reader_messages: list[str] = field(default_factory=list)  # what it said about each
    history_gaps: list[list[int]] = field(default_factory=list)  # [W&B step before, after] each jump
    run_record: bool = True  # False: the run record was unreadable (the run named by --run-id)

    @property
    def partial(self) -> bool:
        return self.skipped_stretches > 0 or not self.run_record

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"partial": self.partial}

    def damage(self) -> str:
        """One line: what wandb's reader skipped, and where the history jumps."""
        where = ", ".join(f"{a}→{b}" for a, b in self.history_gaps[:10]) or "no step jump seen"
        first = self.reader_messages[0] if self.reader_messages else "its run record was unreadable"
        return (
            f"{self.wandb_file}: wandb's reader skipped {self.skipped_stretches} damaged stretch(es) "
            f"({first}); W&B history steps jump at {where}; imported {self.steps} step(s)"
        )


def _strip_internal(config: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if not k.startswith("_wandb")}


def _config_update(record: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(updated keys → values, removed keys) of a config record, in either JSON shape wandb uses."""
    update = record.get("update") or {}
    if isinstance(update, list):  # protobuf-JSON shape: [{"key": …, "value_json": "…"}]
        update = {u.get("key"): json.loads(u.get("value_json", "null")) for u in update if u.get("key")}
    removed = record.get("remove") or []
    keys = [r.get("key") if isinstance(r, Mapping) else r for r in removed]
    return _strip_internal(update), [str(k) for k in keys if k and not str(k).startswith("_wandb")]


def branch_point(run: Mapping[str, Any], run_id: str) -> tuple[str | None, int | None]:
    """(parent run, fork step) of a run record whose ``wandb.init`` had ``fork_from`` or
    ``resume_from``: the record's ``branch_point`` (``run``, ``value`` of ``_step``), else the
    ``_wandb.branch_point`` (``run_id``, ``step``) wandb writes into the run's config. None where there
    is none, where it names the run itself (a rewind of one run id), where the run id is not a ledger
    run id; the step None where it is not a whole non-negative number."""
    parent, step = _moment_of(run)
    if not isinstance(parent, str) or not RUN_ID_RE.match(parent) or parent == run_id:
        return None, None
    whole = isinstance(step, int | float) and not isinstance(step, bool) and math.isfinite(step)
    return parent, int(step) if whole and step >= 0 and step == int(step) else None


def _moment_of(run: Mapping[str, Any]) -> tuple[Any, Any]:
    """The (run, step) a run record branches from, as written: its own field, else its config's."""
    point = run.get("branch_point")
    if isinstance(point, Mapping) and point.get("run"):
        return point.get("run"), point.get("value")
    update = (run.get("config") or {}).get("update") or {}
    if isinstance(update, list):  # protobuf-JSON shape: [{"key": …, "value_json": "…"}]
        raw = next((u.get("value_json") for u in update if u.get("key") == "_wandb"), None)
        try:
            internal = json.loads(raw) if isinstance(raw, str) else None
        except json.JSONDecodeError:
            internal = None
    else:
        internal = update.get("_wandb")
    point = internal.get("branch_point") if isinstance(internal, Mapping) else None
    return (point.get("run_id"), point.get("step")) if isinstance(point, Mapping) else (None, None)


def _pointer(key: str) -> str:
    return "/" + key.replace("~", "~0").replace("/", "~1")


def _number(value: Any) -> tuple[bool, float | int | None]:
    """(is a scalar, its JSON-safe value): NaN/inf become None; bools 1.0/0.0 (as the bridge keeps
    them); ints as they are (counts above 2**53 stay exact); non-numbers are not scalars."""
    if isinstance(value, bool):
        return True, float(value)
    if isinstance(value, int):
        return True, value
    if isinstance(value, float):
        return True, float(value) if math.isfinite(value) else None
    if isinstance(value, str) and value in _NONFINITE:
        return True, None
    return False, None


def history_values(item: Mapping[str, Any]) -> tuple[dict[str, float | int | None], int]:
    """(named numbers, values skipped) of one W&B history row, for ``step_metrics_of_row``.

    W&B's ``_``-prefixed internals are dropped; NaN/±inf (numbers or the strings W&B stores for
    them) become None; text, media and histograms are not scalars and are only counted. Shared by
    the offline and the online import."""
    values: dict[str, float | int | None] = {}
    skipped = 0
    for key, value in item.items():
        if key.startswith("_"):
            continue
        is_scalar, number = _number(value)
        if is_scalar:
            values[key] = number
        else:
            skipped += 1
    return values, skipped


def _repository_of(remote: str | None) -> str | None:
    match = re.search(r"github\.com[:/]([^/]+/[^/]+?)(?:\.git)?/?$", remote or "")
    return match.group(1) if match else None


def _time_of(seconds: Any, fallback: datetime) -> datetime:
    ok, value = _number(seconds)
    return datetime.fromtimestamp(value, UTC) if ok and value is not None else fallback


class _Importer:
    def __init__(self, sink: EventSink, wandb_file: Path, run_id: str | None) -> None:
        self.sink = sink
        self.wandb_file = wandb_file
        self.requested_run_id = run_id
        self.seq = 0
        self.config: dict[str, Any] = {}
        self.summary: dict[str, Any] = {}
        self.last_step: int | None = None
        self.last_time: datetime | None = None
        self.total_tokens: int | None = None
        self.runtime: float | None = None
        self.stats: ImportStats | None = None
        self.source = ""
        self.wandb_id = ""
        self.start_time = datetime.now(UTC)
        self.axis = StepAxis()  # the run's define_metric step metrics (``metric`` records)
        self.pending: dict[str, float | int | None] = {}  # rows at one ledger step, not yet emitted
        self.pending_at: tuple[int, int, datetime] | None = None  # (ledger step, first _step, time)
        self.skips: list[str] = []
        self.last_wandb_step: int | None = None
        self.gaps: list[list[int]] = []

    def emit(self, payload: Any, *, kind: str, time: datetime, step: int | None = None) -> None:
        assert self.stats is not None
        envelope: Envelope = make_event(
            payload,
            source=self.source,
            stream=self.stats.run_id,
            seq=self.seq,
            run_id=self.stats.run_id,
            attempt=1,
            step=step,
            id=f"wandb/{self.wandb_id}/{kind}",
            time=time,
            subject=f"wandb/{self.wandb_id}",
        )
        self.sink.emit(envelope)
        self.seq += 1
        self.stats.events += 1

    def run(self) -> ImportStats:
        version = ""
        for record in read_records(self.wandb_file, self.skips):
            kind = record.get("type")
            body = record.get(kind) if isinstance(kind, str) else None
            if not isinstance(body, Mapping):
                continue
            if kind == "header":
                version = str((body.get("version_info") or {}).get("producer") or "").split("+")[0]
            elif kind == "run" and self.stats is None:
                self.on_run(body, version)
            elif self.stats is None and not self.adopt_unnamed_run(kind, version):
                continue  # nothing before the run record belongs to a run
            if kind == "config":
                self.on_config(body, int(record.get("num") or 0))
            elif kind == "metric":
                self.on_metric(body)
            elif kind == "history":
                self.on_history(body)
            elif kind == "summary":
                self.on_summary(body)
            elif kind == "exit":
                self.on_exit(body)
        if self.stats is None:
            more = "" if self.requested_run_id else " (if it was damaged, name the run: --run-id)"
            raise WandbImportError(f"{self.wandb_file} holds no readable run record{more}")
        self.stats.skipped_stretches = len(self.skips)
        self.stats.reader_messages = list(self.skips)
        self.stats.history_gaps = self.gaps
        return self.stats

    def adopt_unnamed_run(self, kind: Any, version: str) -> bool:
        """A record of the run before (or without) its run record: the run record was damaged. With
        a ledger run id given, the run is still imported: its W&B id from the file name
        (``run-<id>.wandb``), its config from the config records that survived."""
        if self.requested_run_id is None or kind not in ("config", "metric", "history", "summary", "exit"):
            return False
        wandb_id = self.wandb_file.stem.removeprefix("run-") or self.requested_run_id
        self.on_run({"run_id": wandb_id}, version)
        assert self.stats is not None
        self.stats.run_record = False
        return True

    def on_metric(self, metric: Mapping[str, Any]) -> None:
        name = metric.get("name") or metric.get("glob_name")
        step_metric = metric.get("step_metric") or None
        if isinstance(name, str) and name:
            control = metric.get("_control") or {}
            overwrite = bool(control.get("overwrite")) if isinstance(control, Mapping) else False
            self.axis.define(name, str(step_metric) if step_metric else None, overwrite=overwrite)

    def on_run(self, run: Mapping[str, Any], version: str) -> None:
        self.wandb_id = str(run.get("run_id") or "")
        if not self.wandb_id:
            raise WandbImportError(f"{self.wandb_file}: the run record has no run id")
        run_id = self.requested_run_id or self.wandb_id
        if not RUN_ID_RE.match(run_id):
            raise WandbImportError(f"W&B run id {run_id!r} is not a valid ledger run id; pass --run-id")
        project = str(run.get("project") or "")
        self.source = f"wandb:{project}/{self.wandb_id}" if project else f"wandb:{self.wandb_id}"
        self.stats = ImportStats(run_id=run_id, wandb_run_id=self.wandb_id, wandb_file=str(self.wandb_file))
        with contextlib.suppress(ValueError, TypeError):
            self.start_time = datetime.fromisoformat(str(run.get("start_time"))).astimezone(UTC)
        self.last_time = self.start_time
        self.config, _ = _config_update(run.get("config") or {})
        external = {"wandb_run_id": self.wandb_id, "wandb_file": str(self.wandb_file)}
        if project:
            external["wandb_project"] = project
        if run.get("entity"):
            external["wandb_entity"] = str(run["entity"])
        git = run.get("git") or {}
        fields = launch_fields(
            config=self.config,
            config_hash=config_hash(self.config),
            provenance=Provenance(
                host=str(run.get("host") or ""),
                git_commit=git.get("commit") or None,
                software={"wandb": version} if version else {},
            ),
            repository=_repository_of(git.get("remote_url")),
            world_size=1,
            external=external,
        )
        started, _ = launch_event(fields, attempt=1, name=run.get("display_name") or None)
        # A run forked or resumed from another (W&B's fork_from/resume_from) continues it: its lineage.
        parent, fork_step = branch_point(run, run_id)
        if parent is not None:
            started = msgspec.structs.replace(started, parent_run=parent, fork_step=fork_step)
        self.emit(started, kind="started", time=self.start_time)

    def on_config(self, record: Mapping[str, Any], num: int) -> None:
        update, removed = _config_update(record)
        ops: list[p.PatchOp] = []
        new = dict(self.config)
        for key, value in update.items():
            if key in new and new[key] == value:
                continue
            ops.append(p.PatchOp(op="replace" if key in new else "add", path=_pointer(key), value=value))
            new[key] = value
        for key in removed:
            if key in new:
                ops.append(p.PatchOp(op="remove", path=_pointer(key)))
                del new[key]
        if not ops:
            return
        previous = config_hash(self.config)
        self.config = new
        applies_from = 0 if self.last_step is None else self.last_step + 1
        assert self.stats is not None
        self.stats.config_changes += 1
        self.emit(
            p.ConfigChanged(
                patch=ops,
                previous_hash=previous,
                config_hash=config_hash(new),
                cause=p.ChangeCause(kind="api", detail="wandb config.update (imported from a W&B run)"),
            ),
            kind=f"config/{num}",
            time=self.last_time or self.start_time,
            step=applies_from,
        )

    def on_history(self, history: Mapping[str, Any]) -> None:
        item = history.get("item") or {}
        step_value = (history.get("step") or {}).get("num", item.get("_step"))
        if not isinstance(step_value, int) or isinstance(step_value, bool) or step_value < 0:
            return
        assert self.stats is not None
        if self.last_wandb_step is not None and step_value != self.last_wandb_step + 1:
            self.gaps.append([self.last_wandb_step, step_value])
        self.last_wandb_step = step_value
        values, skipped = history_values(item)
        self.stats.skipped_values += skipped
        when = _time_of(item.get("_timestamp"), self.last_time or self.start_time)
        self.last_time = when
        self._runtime(item.get("_runtime"))
        ledger_step = self.axis.step_of(item, step_value)
        if self.pending_at is not None and self.pending_at[0] != ledger_step:
            self.emit_pending()
        if self.pending_at is None:
            self.pending_at = (ledger_step, step_value, when)
        self.pending.update(values)
        self.last_step = ledger_step if self.last_step is None else max(self.last_step, ledger_step)

    def emit_pending(self) -> None:
        """The rows at one ledger step as one event, id'd by its first row's W&B ``_step`` (unique
        even when a step metric goes back), as the bridge sends them."""
        if self.pending_at is None:
            return
        assert self.stats is not None
        step, wandb_step, when = self.pending_at
        metrics = step_metrics_of_row(self.pending)
        if metrics.total_tokens is not None:
            self.total_tokens = metrics.total_tokens
        self.stats.steps += 1
        self.emit(metrics, kind=f"step/{wandb_step}", time=when, step=step)
        self.pending, self.pending_at = {}, None

    def _runtime(self, value: Any) -> None:
        ok, seconds = _number(value)
        if ok and seconds is not None and (self.runtime is None or seconds > self.runtime):
            self.runtime = seconds

    def on_summary(self, summary: Mapping[str, Any]) -> None:
        update = summary.get("update") or {}
        if isinstance(update, Mapping):
            self._runtime(update.get("_runtime"))
            self.summary.update({k: v for k, v in update.items() if not k.startswith("_")})
        for removed in summary.get("remove") or []:
            key = removed.get("key") if isinstance(removed, Mapping) else removed
            self.summary.pop(str(key), None)

    def on_exit(self, exit_record: Mapping[str, Any]) -> None:
        assert self.stats is not None
        self.emit_pending()
        code = exit_record.get("exit_code") or 0
        self._runtime(exit_record.get("runtime"))
        end = self.start_time + timedelta(seconds=self.runtime) if self.runtime else self.last_time
        end = max(end or self.start_time, self.last_time or self.start_time)
        self.stats.summary_keys = len(self.summary)
        self.emit(p.RunSummary(values=dict(self.summary)), kind="summary", time=end, step=self.last_step)
        self.emit(
            p.RunFinished(
                status="completed" if code == 0 else "failed",
                final_step=self.last_step,
                total_tokens=self.total_tokens,
                duration_s=self.runtime,
            ),
            kind="finished",
            time=end,
            step=self.last_step,
        )
        self.stats.finished = True

    def finish_incomplete(self) -> None:
        # No exit record: the run crashed or is still going. Its summary so far is still worth keeping.
        assert self.stats is not None
        self.emit_pending()
        if self.stats.finished or not self.summary:
            return
        self.stats.summary_keys = len(self.summary)
        self.emit(
            p.RunSummary(values=dict(self.summary)),
            kind="summary",
            time=self.last_time or self.start_time,
            step=self.last_step,
        )


def import_offline_run(
    run_dir: str | Path, sink: EventSink, *, run_id: str | None = None, accept_partial: bool = False
) -> ImportStats:
    """Turn one W&B offline run (its directory or its ``.wandb`` file) into ledger events on ``sink``.

    Damaged data wandb's reader skipped: what was readable is imported and synced, then (unless
    ``accept_partial``) ``PartialImportError`` says what was skipped."""
    files = find_offline_runs(run_dir)
    if len(files) > 1:
        names = ", ".join(str(f.parent.name) for f in files)
        raise WandbImportError(f"{run_dir} holds {len(files)} runs ({names}); import one at a time")
    importer = _Importer(sink, files[0], run_id)
    stats = importer.run()
    importer.finish_incomplete()
    sink.sync()
    log.info("imported W&B run %s as %s: %d events", stats.wandb_run_id, stats.run_id, stats.events)
    if stats.partial:
        if not accept_partial:
            raise PartialImportError(f"{stats.damage()} (--accept-partial to accept it)", stats)
        log.warning("partial import accepted: %s", stats.damage())
    return stats
