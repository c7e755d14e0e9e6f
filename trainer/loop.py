"""The training loop, top to bottom: launch, resume, steps, live config, checkpoints, crashes.

Reading order: ``train`` sets up the process and the attempt, ``_run`` is the loop itself, one
call per phase, and the phases follow in the order it calls them: ``_announce_launch``,
``_build_or_restore``, then per step ``_step_boundary`` (signals, live config changes),
``_optimizer_step``, ``_log_telemetry``, ``_checkpoint_on_interval``; then ``_finish``, or
``_stop_on_signal`` / ``_crash``. Everything one attempt works with lives in one ``RunContext``.

Events (``runledger.schemas.payloads``), all with ``stream = run_id`` and the launch's ``attempt``:

  source   ``trainer/<run_id>/a<attempt>/rank<rank>``: a fresh source per attempt and rank, so its
           ``seq`` starts at 0 and is gap-free without any state surviving a crash. Attempt numbers
           come from the register in the checkpoint dir (``attempts/``, ``runledger.attempts``: one
           exclusively created file per attempt), written durably before a launch emits anything: a
           relaunch never reuses one, even after a SIGKILL before the first checkpoint, and two racing
           launches never share one.
  rank 0   run-started / run-resumed (resolved config, hash, git, versions, host), step metrics and
           router stats (global, all-reduced), config changed / rejected, checkpoint saved, step
           skipped, run finished.
  each rank  its own rank stats (step time, host) and its own crash.

Mirror (``mirror=``, e.g. ``runledger.ingest.wandb_mirror.WandbMirror``; rank 0 only; see ``runledger.trainer.mirror``): started
before the launch event, whose ``external`` records it (or ``wandb_error`` when it could not start:
training goes on without it); each logged step, each applied live change and the attempt's end
(summary and finish, also after a crash) are mirrored.

Durability: the loop enqueues, a background thread emits (``runledger.emitter.Emitter``, the one the
client library ``runledger.init`` uses too). A crash, signal, non-finite loss or OOM is enqueued as
a run-crashed event, then the queue is drained and
``sink.sync()`` returns before ``train`` does: the event is durable before the process exits.
A SIGKILL loses only what was still in the queue or the sink's unsynced window; what reached the
spool is a gap-free prefix of each source.

Steps are 1-based: step s is the s-th optimizer update; a checkpoint "at step s" holds the state
after it, and a run resumed from it trains step s + 1 next. A config change's step is the first
step trained with it.
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec
import torch

from runledger import provenance
from runledger import signals as signals_lib
from runledger.crashes import CrashKind, NonFinite, SignalStop, cause_of, crashed
from runledger.emitter import Emitter
from runledger.ingest.bus import EventSink
from runledger.schemas.launch import launch_event, launch_fields
from runledger.schemas.payloads import (
    ChangeCause,
    CheckpointSaved,
    ConfigChanged,
    ConfigRejected,
    PatchOp,
    RankStats,
    RunCrashed,
    RunFinished,
    StepSkipped,
)
from runledger.trainer import checkpoint as ckpt
from runledger.trainer import cpu_compat, distributed, telemetry
from runledger.trainer import mirror as mirror_lib
from runledger.trainer import model as model_lib
from runledger.trainer.config import (
    ConfigError,
    ConfigSource,
    TrainConfig,
    apply_patch,
    config_hash,
    diff,
    edit_config_file,
    finalize,
    pinned_changes,
    resolved,
    split_patch,
)
from runledger.trainer.data import Batches
from runledger.trainer.optim import MasterAdamW, lr_at

ResumeFrom = Literal["latest"] | int | str | Path | None


@dataclass(frozen=True)
class Fork:
    """A new run id that goes on from another run's complete checkpoint directory (its weights,
    optimizer, RNG and token count), at that checkpoint's step: attempt 1, recorded with
    ``parent_run`` and ``fork_step`` on its ``run.started``."""

    checkpoint: Path


Start = ResumeFrom | Fork  # how a launch begins: fresh (None), a resume of this run, or a fork
Status = Literal["completed", "stopped", "crashed", "signal"]
SaveReason = Literal["interval", "signal", "final"]
Progress = Callable[[telemetry.StepReport], None]
PatchOpDict = dict[str, Any]  # one RFC 6902 operation, as ``config.diff`` makes it


class RunExistsError(ConfigError):
    """A fresh start for a run id that was launched before (resume it, or pick a new id)."""


class NonFiniteLoss(NonFinite):
    def __init__(self, step: int, value: str) -> None:
        super().__init__(f"non-finite loss ({value}) at step {step}")
        self.step = step
        self.value = value


@dataclass
class TrainResult:
    run_id: str
    attempt: int
    status: Status
    start_step: int  # the checkpoint step this attempt started from (0: from scratch)
    final_step: int  # the last step whose update was applied (or skipped)
    total_tokens: int
    exit_code: int
    checkpoint_dir: Path
    last_checkpoint: Path | None = None
    crash: RunCrashed | None = None
    losses: list[tuple[int, float]] = field(default_factory=list)
    skipped_steps: list[int] = field(default_factory=list)
    config: TrainConfig | None = None
    external: dict[str, str] = field(default_factory=dict)  # the launch event's (the mirror's ids)
    events_emitted: int = 0
    events_dropped: int = 0
    duration_s: float = 0.0


# --- signals -----------------------------------------------------------------------------------


class _StopFlag:
    """SIGTERM/SIGINT handler: the first asks the loop to stop at the next step boundary (with a
    checkpoint); a second one stops at once. Once the attempt's end is being recorded, further
    signals change nothing here: raising then would interrupt that record's flush and record the end
    twice; they are left to the command running the attempt (``runledger.signals.note``)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.forced: int | None = None  # the second signal, once it has been raised as SignalStop
        self.ending = False  # set by ``_finish`` and ``_crash``: the end is on its way to the sink

    def __call__(self, signum: int, frame: object) -> None:
        if self.ending:
            signals_lib.note(signum)  # not this attempt's any more: the command running it acts on it
            return
        if self.signum is not None:
            self.forced = signum
            raise SignalStop(signum)
        self.signum = signum

    def take_over(self, signum: int | None) -> None:
        """A signal that came before this flag was installed (``runledger.signals.take``): asked."""
        if signum is not None and self.signum is None:
            self.signum = signum

    @property
    def requested(self) -> bool:
        return self.signum is not None


# --- what the ranks exchange, and what the phases share ----------------------------------------


@dataclass(frozen=True)
class _Launch:
    """Rank 0's decision for this launch, already durable in its attempt register; broadcast to all ranks."""

    attempt: int
    step: int  # the checkpoint step to resume (or fork) from (0: from scratch)
    path: str | None  # that checkpoint's directory (None: from scratch)
    previous: int  # how many attempts the run had before this one
    parent_run: str | None = None  # a fork: the run whose checkpoint ``path`` is


@dataclass(frozen=True)
class ConfigEdit:
    """An edit rank 0 found in the watched config file, broadcast so every rank acts on it at the
    same step boundary. Either the file loaded, and its diff is split by ``config.LIVE_KEYS`` into
    ``allowed`` and ``refused``, or it did not, and ``error`` says why (nothing is applied)."""

    path: str  # the watched file: the change's recorded cause
    allowed: tuple[PatchOpDict, ...] = ()
    refused: tuple[PatchOpDict, ...] = ()
    error: str | None = None
    actor: str | None = None  # who made the edit (the file's [change] table); None: unknown


# (the refused ops' repr, the error): the last refusal, so an unchanged file is not refused twice
_Refusal = tuple[str, str | None]


@dataclass(eq=False)
class RunContext:
    """One attempt on one rank: what every phase reads and advances, instead of a parameter list."""

    # Fixed for the attempt.
    env: distributed.DistEnv  # this rank, the world, the device, the control group
    emitter: Emitter  # this rank's event source: enqueues, a thread emits
    result: TrainResult  # what ``train`` returns, filled in as the attempt goes
    flag: _StopFlag  # set by the first SIGTERM/SIGINT
    source: ConfigSource | None  # the watched config file (None: no live changes)
    ckpt_path: Path | None  # the checkpoint this attempt restores (None: from scratch)
    parent_run: str | None  # a fork: the run ``ckpt_path`` belongs to (None: this run's, or none)
    stop_at_step: int | None  # end the attempt early ("stopped") after this step
    progress: Progress | None  # the driver's per-step callback (rank 0)
    on_model: Callable[[torch.nn.Module], None] | None  # the driver's hook on the built model
    # Advanced by the steps.
    cfg: TrainConfig  # the live config: replaced when a live change is applied
    step: int  # the last step applied or skipped (the start step before the first)
    mirror: mirror_lib.Mirror | None = None  # rank 0's tracker (None: none, or it failed to start)
    total_tokens: int = 0
    last_saved: int | None = None  # the step whose state is on disk already
    rejected: _Refusal | None = None
    started: float = field(default_factory=time.perf_counter)
    last_rank_stats: float = field(default_factory=time.perf_counter)  # when rank stats last went out
    stats: telemetry.RouterStats | None = None  # the router hooks; None while telemetry is off
    # Set by ``_build_or_restore`` before the first step.
    model: torch.nn.Module = field(init=False, repr=False)
    optimizer: MasterAdamW = field(init=False, repr=False)
    batches: Batches = field(init=False, repr=False)
    mask: torch.Tensor = field(init=False, repr=False)
    tokens_per_step: int = field(init=False, repr=False)  # global: over all data-parallel ranks

    @property
    def attempt(self) -> int:
        return self.result.attempt

    @property
    def is_main(self) -> bool:
        return self.env.is_main


@dataclass(frozen=True)
class _Update:
    """One applied optimizer step, as telemetry reports it (host floats, global values)."""

    step: int
    lr: float
    loss: float
    grad_norm: float
    step_time_s: float
    router: list[float]  # the all-reduced router counters (empty while telemetry is off)


# --- the run -----------------------------------------------------------------------------------


def train(
    config: TrainConfig | str | Path,
    sink: EventSink,
    *,
    overrides: Sequence[str] = (),
    resume_from: ResumeFrom = None,
    fork_from: str | Path | None = None,
    stop_at_step: int | None = None,
    progress: Progress | None = None,
    handle_signals: bool = True,
    watch: str | Path | None = None,
    mirror: mirror_lib.Mirror | None = None,
    on_model: Callable[[torch.nn.Module], None] | None = None,
    pending_dir: Path | None = None,
) -> TrainResult:
    """Train (or resume) one run and emit its events to ``sink``; returns how the attempt ended.

    ``config``: a TOML path (watched for live changes, ``overrides`` applied on every load) or a
    ``TrainConfig`` (watched only if ``watch`` names a file to reload). ``resume_from``: None for a
    fresh run, ``"latest"``, a step number or a checkpoint directory. ``fork_from``: another run's
    complete checkpoint directory: this new run id starts there (``Fork``; not with ``resume_from``).
    ``stop_at_step`` ends the attempt early (status "stopped") after that step. Crashes do not raise: they are recorded and
    returned (``status`` "crashed" or "signal", ``exit_code`` for a CLI to exit with).
    ``mirror``: an experiment tracker to mirror the run to (``runledger.trainer.mirror.Mirror``), used on rank 0.
    ``on_model``: called with the model once it is built (and restored), before the first step, on
    every rank: a study's own hooks (``runledger.workflows.study``) go on here.
    ``pending_dir``: the rank's spool folder, where a loss report the bus still refuses at the end is
    kept for the next start or ingest (``runledger.emitter``); None: such a report is only on stderr.
    """
    started = time.perf_counter()
    if fork_from is not None and resume_from is not None:
        raise ConfigError("fork_from starts a new run id from another run's checkpoint: not with resume_from")
    start: Start = Fork(Path(fork_from)) if fork_from is not None else resume_from
    # The set-up (config, process groups, the attempt's register entry, the emitter) defers a signal
    # (inside a command: runledger.signals): the stop flag takes it over and the first step boundary
    # honours it, so no attempt is left registered without its events.
    with signals_lib.deferred(enabled=handle_signals):
        ctx = _set_up(
            config,
            sink,
            overrides=overrides,
            start=start,
            stop_at_step=stop_at_step,
            progress=progress,
            watch=watch,
            mirror=mirror,
            on_model=on_model,
            pending_dir=pending_dir,
        )
        return _attempt(ctx, started, handle_signals=handle_signals)


def _set_up(
    config: TrainConfig | str | Path,
    sink: EventSink,
    *,
    overrides: Sequence[str],
    start: Start,
    stop_at_step: int | None,
    progress: Progress | None,
    watch: str | Path | None,
    mirror: mirror_lib.Mirror | None,
    on_model: Callable[[torch.nn.Module], None] | None,
    pending_dir: Path | None,
) -> RunContext:
    """The process, the launch (attempt and resume point, durable before any event) and the emitter."""
    cfg, source = _open_config(config, overrides, watch)
    env = _start_process(cfg)

    # One run id for every rank (rank 0 may have generated it); reloads of the file keep it.
    run_id: str = distributed.broadcast_object(env, cfg.run.run_id)
    if run_id != cfg.run.run_id:
        cfg = finalize(msgspec.structs.replace(cfg, run=msgspec.structs.replace(cfg.run, run_id="")), run_id)
    if source is not None:
        source.run_id = run_id
    root = Path(cfg.checkpoint.dir)

    # The launch: attempt number and resume point, decided by rank 0, durable before any event.
    launch = _agree_launch(cfg, root, start, env)
    ckpt_path = Path(launch.path) if launch.path else None

    emitter = Emitter(
        sink,
        source=f"trainer/{run_id}/a{launch.attempt}/rank{env.rank}",
        stream=run_id,
        run_id=run_id,
        attempt=launch.attempt,
        queue_size=cfg.telemetry.queue_size,
        critical_timeout_s=cfg.telemetry.critical_timeout_s,
        pending_dir=pending_dir,
    )
    result = TrainResult(
        run_id=run_id,
        attempt=launch.attempt,
        status="completed",
        start_step=launch.step,
        final_step=launch.step,
        total_tokens=0,
        exit_code=0,
        checkpoint_dir=root,
        last_checkpoint=ckpt_path,
        config=cfg,
    )
    return RunContext(
        env=env,
        emitter=emitter,
        result=result,
        flag=_StopFlag(),
        source=source,
        ckpt_path=ckpt_path,
        parent_run=launch.parent_run,
        stop_at_step=stop_at_step,
        progress=progress,
        cfg=cfg,
        step=launch.step,
        mirror=mirror if env.is_main else None,
        on_model=on_model,
    )


def _attempt(ctx: RunContext, started: float, *, handle_signals: bool) -> TrainResult:
    """The attempt under the stop flag, the queue drained; the mirror told how it ended."""
    result, emitter, cfg = ctx.result, ctx.emitter, ctx.cfg
    escaped = False
    try:
        with signals_lib.handling(ctx.flag, enabled=handle_signals):
            if handle_signals:
                ctx.flag.take_over(signals_lib.take())  # one that came during the set-up
            try:
                _run(ctx)
            finally:
                # Drain the queue (the launch config's timeout) so every event is handed over before
                # we return; under our handlers, so that a signal now cannot kill the process while
                # the attempt's end record is on its way.
                result.events_dropped = emitter.dropped
                emitter.close(timeout=cfg.telemetry.critical_timeout_s * 2)
                result.events_emitted = emitter.emitted
            if ctx.flag.requested and result.status != "signal":
                # Asked after the last step boundary (the attempt completed or crashed first): the
                # command running it still honours it, e.g. the demo does not resume.
                signals_lib.note(ctx.flag.signum or signal.SIGTERM)
    except BaseException:
        escaped = True  # not a recorded crash (those return): the mirror still learns it failed
        raise
    finally:
        result.duration_s = time.perf_counter() - started
        if ctx.mirror is not None:
            _finish_mirror(ctx.mirror, result, escaped)
    return result


def _run(ctx: RunContext) -> None:
    """The attempt, one phase per call. A crash is recorded (durably) and returns; it does not raise."""
    try:
        _announce_launch(ctx)
        _build_or_restore(ctx)
        while _steps_left(ctx):
            step = ctx.step + 1
            if _step_boundary(ctx, step):
                _stop_on_signal(ctx)
                return
            update = _optimizer_step(ctx, step)
            if update is None:
                continue  # skipped: non-finite, under run.nonfinite_policy = "skip"
            _log_telemetry(ctx, update)
            _checkpoint_on_interval(ctx)
            if ctx.cfg.debug.step_sleep_s > 0:  # debug pacing: a window between steps (kill tests)
                time.sleep(ctx.cfg.debug.step_sleep_s)
        _finish(ctx)
    # A second signal (SignalStop: stop mid-step, without a checkpoint), Ctrl-C while our handler is
    # not installed, a non-finite loss, OOM or any other exception: one classification (crashes.cause_of).
    except (SignalStop, KeyboardInterrupt, Exception) as exc:
        kind, signum = cause_of(exc)
        if kind == "exception" and ctx.flag.forced is not None:
            # C++ code (torch.save's writer) turns a SignalStop raised inside it into a RuntimeError:
            # the stop is still the second signal's, not an exception of the run.
            _crash(ctx, "signal", exc, signum=ctx.flag.forced, message=f"signal {ctx.flag.forced}")
        else:
            _crash(ctx, kind, exc, signum=signum)
    finally:
        if ctx.stats is not None:
            ctx.stats.close()  # take the router hooks off the model


# --- setup (before any event) ------------------------------------------------------------------


def _open_config(
    config: TrainConfig | str | Path, overrides: Sequence[str], watch: str | Path | None
) -> tuple[TrainConfig, ConfigSource | None]:
    """The launch config, and the source that is watched for live changes (None: not watched)."""
    if isinstance(config, TrainConfig):
        source = ConfigSource(watch, overrides) if watch is not None else None
        cfg = finalize(config)
        if source is not None:
            source.run_id = cfg.run.run_id
        return cfg, source
    source = ConfigSource(config, overrides)
    return source.load(), source


def _start_process(cfg: TrainConfig) -> distributed.DistEnv:
    """Device, CPU compatibility shims and thread count, then the process groups."""
    device = distributed.pick_device(cfg)
    cpu_compat.check_supported(cfg, device)
    cpu_compat.apply(device)
    if device.type == "cpu" and cfg.run.threads > 0:
        torch.set_num_threads(cfg.run.threads)
    return distributed.init_distributed(cfg, device)


def _agree_launch(cfg: TrainConfig, root: Path, start: Start, env: distributed.DistEnv) -> _Launch:
    """Rank 0 plans the launch; every rank gets its plan, or raises its refusal (no attempt registered)."""
    mine: _Launch | BaseException | None = None
    if env.is_main:
        try:
            mine = _plan_launch(cfg, root, start, env)
        except (ConfigError, ckpt.CheckpointError) as exc:
            mine = exc
    agreed: _Launch | BaseException = distributed.broadcast_object(env, mine)
    if isinstance(agreed, BaseException):
        raise agreed
    return agreed


def _plan_launch(cfg: TrainConfig, root: Path, start: Start, env: distributed.DistEnv) -> _Launch:
    previous = ckpt.attempts(root)
    path: Path | None
    parent: str | None = None
    from_origin = False  # a fork's resume from the checkpoint it forked from (its parent's)
    if start is None or isinstance(start, Fork):
        if previous:
            raise RunExistsError(
                f"run {cfg.run.run_id!r} was launched before ({len(previous)} attempt(s) in {root}); "
                "resume it or choose another run.run_id"
            )
        step, path = (0, None) if start is None else ckpt.resolve(root, start.checkpoint)
    else:
        if not previous:
            raise ckpt.CheckpointError(f"nothing to resume: run {cfg.run.run_id!r} has no attempts in {root}")
        step, path = ckpt.resolve(root, start)
        from_origin = path is None and bool(previous[0].get("parent_run"))  # none of its own yet
        if from_origin:
            step, path = _fork_origin(cfg, previous[0])
    saved = ckpt.saved_config(path) if path is not None else None
    if isinstance(start, Fork):
        parent = _fork_parent(cfg, path, saved)
    if saved is not None:
        # A resume or fork may change live keys, never what the checkpoint's shapes and data depend on.
        try:
            before = _from_saved(saved)
        except msgspec.ValidationError as exc:
            raise ckpt.CheckpointError(
                f"{path}/config.json is not a config this trainer reads: {exc}"
            ) from None
        pinned = pinned_changes(diff(before, cfg))
        if parent or from_origin:  # a fork's run id is new by definition
            pinned = [op for op in pinned if op.get("path") != "/run/run_id"]
        if pinned:
            paths = ", ".join(str(op["path"]) for op in pinned)
            verb = "fork" if parent else "resume"
            raise ConfigError(
                f"cannot {verb} from {path}: the config changes keys the checkpoint pins: {paths}"
            )
    record = {
        "time": time.time(),
        "host": env.host,
        "pid": os.getpid(),
        "from_step": step,
        "checkpoint": str(path) if path else None,
        "config_hash": config_hash(cfg),
        **({"parent_run": parent} if parent else {}),
    }
    attempt = ckpt.register_attempt(root, record)
    return _Launch(
        attempt=attempt,
        step=step,
        path=str(path) if path else None,
        previous=len(previous),
        parent_run=parent,
    )


def _fork_origin(cfg: TrainConfig, first: dict[str, Any]) -> tuple[int, Path | None]:
    """(step, path) of the checkpoint a fork's first attempt started from (its register's record):
    a fork that ended before saving a checkpoint of its own resumes there, not from step 0."""
    origin = Path(str(first.get("checkpoint")))
    try:
        return ckpt.resolve(origin.parent, origin)
    except ckpt.CheckpointError:
        raise ckpt.CheckpointError(
            f"run {cfg.run.run_id!r} has no checkpoint of its own, and the one it forked from "
            f"({origin}) is no longer complete: cannot resume it"
        ) from None


def _fork_parent(cfg: TrainConfig, path: Path | None, saved: dict[str, Any] | None) -> str:
    """The run a fork goes on from: the run id its checkpoint was written under (``saved``, its
    ``config.json``)."""
    parent = ((saved or {}).get("run") or {}).get("run_id")
    if not isinstance(parent, str) or not parent:
        raise ckpt.CheckpointError(
            f"{path} does not name the run that wrote it (no config.json): cannot fork"
        )
    if parent == cfg.run.run_id:
        raise ConfigError(
            f"{path} is run {parent!r}'s own checkpoint: a fork needs a new run.run_id (or resume the run)"
        )
    return parent


# --- phase 1: announce the launch ---------------------------------------------------------------


def _announce_launch(ctx: RunContext) -> None:
    """Rank 0: run-started (attempt 1) or run-resumed, first, so that a failure to build or load is a
    crash of a recorded attempt. The mirror starts before it: the event records the mirror's ids."""
    if not ctx.is_main:
        return
    cfg, result = ctx.cfg, ctx.result
    if ctx.mirror is not None:
        fork = (ctx.parent_run, ctx.step) if ctx.parent_run else None
        ctx.mirror, result.external = mirror_lib.start(
            ctx.mirror, result.run_id, resolved(cfg), cfg.run.name, fork
        )
    fields = launch_fields(
        config=resolved(cfg),
        config_hash=config_hash(cfg),
        provenance=provenance.of_this_process(host_name=ctx.env.host),
        repository=cfg.run.repository,
        world_size=ctx.env.world_size,
        parallelism=ctx.env.parallelism,
        external=result.external,
    )
    payload, at_step = launch_event(
        fields,
        attempt=ctx.attempt,
        name=cfg.run.name,
        # A resume always follows an attempt: attempt 1 starts the run, every later one resumes it.
        resumed_from_step=None if ctx.attempt == 1 else ctx.step,
        checkpoint_path=str(ctx.ckpt_path) if ctx.ckpt_path else None,
        parent_run=ctx.parent_run,
        fork_step=ctx.step if ctx.parent_run else None,
    )
    ctx.emitter.submit(payload, step=at_step, critical=True)


# --- phase 2: build (or restore) the model, optimizer and data ----------------------------------


def _build_or_restore(ctx: RunContext) -> None:
    """Everything from the seed; then, when resuming, the checkpoint's weights, optimizer moments,
    RNG state and token count, so the trajectory continues as if never interrupted."""
    cfg, env, device = ctx.cfg, ctx.env, ctx.env.device
    cpu_compat.seed_rng(cfg.run.seed, device)
    ctx.model = model_lib.build_model(cfg, device)
    _sync_replicas(ctx.model, env)
    ctx.optimizer = MasterAdamW(ctx.model, cfg.optimizer)
    if ctx.ckpt_path is not None:
        saved = ckpt.load(ctx.ckpt_path, env)
        model_lib.unwrap(ctx.model).load_state_dict(saved["model"])
        ctx.optimizer.load_state_dict(saved["optimizer"])
        torch.set_rng_state(saved["rng"]["torch"])
        ctx.total_tokens = int(saved["total_tokens"])
        if ctx.parent_run is None:  # (a fork's checkpoint is its parent's: this run has saved nothing)
            ctx.last_saved = ctx.step  # that state is on disk already: a save now would only rewrite it
    ctx.batches = Batches(cfg, dp_rank=_dp_rank(env), device=device)
    ctx.mask = cpu_compat.causal_attention_mask(cfg.model.seq_length, device)
    if cfg.telemetry.enabled:
        ctx.stats = _router_stats(ctx)
    if ctx.on_model is not None:
        ctx.on_model(ctx.model)
    ctx.tokens_per_step = ctx.batches.tokens_per_step * env.dp
    ctx.last_rank_stats = time.perf_counter()


def _from_saved(tree: dict[str, Any]) -> TrainConfig:
    return msgspec.convert(tree, TrainConfig)


def _dp_rank(env: distributed.DistEnv) -> int:
    from megatron.core import parallel_state as ps

    rank: int = ps.get_data_parallel_rank()
    return rank


def _sync_replicas(model: torch.nn.Module, env: distributed.DistEnv) -> None:
    """Start data-parallel replicas from identical weights (as DDP does): rank 0 of each group wins."""
    if env.world_size == 1:
        return
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    with torch.no_grad():
        for p in model.parameters():
            if distributed.is_expert(p):
                if ps.get_expert_data_parallel_world_size() > 1:
                    group = ps.get_expert_data_parallel_group()
                    dist.broadcast(p.data, src=dist.get_global_rank(group, 0), group=group)
            elif ps.get_data_parallel_world_size() > 1:
                group = ps.get_data_parallel_group()
                dist.broadcast(p.data, src=dist.get_global_rank(group, 0), group=group)


def _router_stats(ctx: RunContext) -> telemetry.RouterStats:
    return telemetry.RouterStats(ctx.model, ctx.cfg.moe.num_experts, ctx.cfg.moe.top_k, ctx.env.device)


# --- phase 3: the step boundary (signals, live config changes) ----------------------------------


def _steps_left(ctx: RunContext) -> bool:
    stop_at = ctx.stop_at_step
    return ctx.step < ctx.cfg.run.steps and (stop_at is None or ctx.step < stop_at)


def _step_boundary(ctx: RunContext, step: int) -> bool:
    """Before ``step``: did any rank get a stop signal, and did the watched file change? Decided
    together over the control group, so every rank stops, or applies an edit, at the same step.
    True: stop now (the caller checkpoints and records it)."""
    edit: ConfigEdit | None = None
    poll = max(1, ctx.cfg.telemetry.config_poll_steps)
    if ctx.is_main and ctx.source is not None and (step - 1) % poll == 0 and ctx.source.changed():
        edit = _read_edit(ctx.source, ctx.cfg)
    stop, edit = distributed.sync_control(ctx.env, ctx.flag.requested, edit)
    if stop:
        return True
    if edit is not None:
        before = ctx.cfg
        _apply_edit(ctx, edit, step)
        _follow_config(ctx, before)
    return False


def _read_edit(source: ConfigSource, current: TrainConfig) -> ConfigEdit:
    """Rank 0: the edit found in the watched file, as a message every rank can act on."""
    path = str(source.path)
    try:
        new = source.load()
    except ConfigError as exc:
        return ConfigEdit(path=path, error=str(exc))
    allowed, refused = split_patch(diff(current, new))
    return ConfigEdit(path=path, allowed=tuple(allowed), refused=tuple(refused), actor=source.change_author)


def _apply_edit(ctx: RunContext, edit: ConfigEdit, step: int) -> None:
    """Apply the allowed part of an edit before ``step`` (config.changed); refuse the rest, with the
    reason (config.rejected). All or nothing: if the allowed part does not validate, all is refused."""
    cause = ChangeCause(kind="file_edit", detail=edit.path, actor=edit.actor)
    refused, error = list(edit.refused), edit.error
    allowed = list(edit.allowed)
    if allowed:
        try:
            new = apply_patch(ctx.cfg, allowed)
        except ConfigError as exc:
            refused, error = refused + allowed, str(exc)
        else:
            if ctx.is_main:
                payload = ConfigChanged(
                    patch=_ops(allowed),
                    previous_hash=config_hash(ctx.cfg),
                    config_hash=config_hash(new),
                    cause=cause,
                )
                ctx.emitter.submit(payload, step=step, critical=True)
            model_lib.apply_live_moe(ctx.model, new.moe)
            ctx.cfg = new
    if not (refused or error):
        ctx.rejected = None
        return
    refusal: _Refusal = (repr(refused), error)
    if refusal != ctx.rejected and ctx.is_main:  # the file still holds it: say so once, not per poll
        if error:
            reason = f"the edited config is invalid: {error}"
        else:
            paths = ", ".join(sorted({str(op.get("path")) for op in refused}))
            reason = f"not changeable while the run is live: {paths} (needs a restart)"
        ctx.emitter.submit(
            ConfigRejected(patch=_ops(refused), reason=reason, cause=cause), step=step, critical=True
        )
    ctx.rejected = refusal


def _follow_config(ctx: RunContext, before: TrainConfig) -> None:
    """After an edit: the result, the mirror and the router hooks follow the (possibly) new config."""
    ctx.result.config = ctx.cfg
    if ctx.mirror is not None and ctx.cfg is not before:
        ctx.mirror.config_update(resolved(ctx.cfg))
    if ctx.cfg.telemetry.enabled and ctx.stats is None:  # telemetry switched on live
        ctx.stats = _router_stats(ctx)
    elif not ctx.cfg.telemetry.enabled and ctx.stats is not None:
        ctx.stats.close()
        ctx.stats = None


def _ops(ops: Sequence[PatchOpDict]) -> list[PatchOp]:
    return [msgspec.convert(op, PatchOp, from_attributes=False) for op in ops]


# --- phase 4: one optimizer step ----------------------------------------------------------------


def _optimizer_step(ctx: RunContext, step: int) -> _Update | None:
    """Train ``step``: forward/backward, then the update if the loss and grad norm are finite.
    None: the update was skipped (``run.nonfinite_policy = "skip"``); "stop" raises NonFiniteLoss."""
    cfg, optimizer = ctx.cfg, ctx.optimizer
    nan_now = _maybe_inject(cfg, step, ctx.attempt, ctx.env)
    t0 = time.perf_counter()
    lr = lr_at(step, cfg)
    optimizer.set_hyper(lr=lr, weight_decay=cfg.optimizer.weight_decay)
    loss, grad_norm, router = _forward_backward(ctx, step, nan_now)
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        _skip_nonfinite(ctx, step, loss, grad_norm)
        return None
    optimizer.step()
    optimizer.zero_grad()
    ctx.step = step
    ctx.total_tokens += ctx.tokens_per_step
    ctx.result.final_step = step
    ctx.result.total_tokens = ctx.total_tokens
    ctx.result.losses.append((step, loss))
    return _Update(step, lr, loss, grad_norm, time.perf_counter() - t0, router)


def _forward_backward(ctx: RunContext, step: int, nan_now: bool) -> tuple[float, float, list[float]]:
    """(global loss, global grad norm, router counters), the master gradients reduced and clipped.
    The three travel in one all-reduce and reach the host in the step's one device-to-host copy."""
    cfg, env, optimizer = ctx.cfg, ctx.env, ctx.optimizer
    params = optimizer.params
    loss_acc = torch.zeros((), dtype=torch.float32, device=env.device)
    for micro in range(cfg.data.micro_batches):
        tokens, labels = ctx.batches.get(step, micro)
        loss = model_lib.loss_fn(ctx.model, tokens, labels, ctx.mask) / cfg.data.micro_batches
        if nan_now:
            loss = loss * float("nan")  # debug.crash_kind = "nan"
        loss.backward()
        loss_acc += loss.detach()
    distributed.reduce_gradients(params, env)
    grads = optimizer.grads_to_master()
    parts = [loss_acc.reshape(1), distributed.weighted_grad_sq(params, env).reshape(1)]
    if ctx.stats is not None:
        parts.append(ctx.stats.take())
    packed = distributed.allreduce_sum(torch.cat(parts), env)
    grad_norm_dev = packed[1].sqrt()
    if cfg.optimizer.grad_clip > 0 and grads:
        coef = torch.clamp(cfg.optimizer.grad_clip / (grad_norm_dev + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coef)
    host: list[float] = packed.tolist()
    loss_value = host[0] / env.world_size
    grad_norm = math.sqrt(host[1]) if host[1] >= 0 else float("nan")
    return loss_value, grad_norm, host[2:]


def _skip_nonfinite(ctx: RunContext, step: int, loss: float, grad_norm: float) -> None:
    """A non-finite loss or grad norm: a crash under policy "stop"; otherwise drop this step's
    gradients, count the step as done and record the skip."""
    bad = _nonfinite_text(loss if not math.isfinite(loss) else grad_norm)
    if ctx.cfg.run.nonfinite_policy == "stop":
        raise NonFiniteLoss(step, bad)
    ctx.optimizer.zero_grad()
    ctx.step = step
    ctx.result.final_step = step
    ctx.result.skipped_steps.append(step)
    if ctx.is_main:
        what = "loss" if not math.isfinite(loss) else "grad_norm"
        ctx.emitter.submit(StepSkipped(reason=f"nonfinite_{what}", value=bad), step=step, critical=True)


def _nonfinite_text(value: float) -> str:
    if math.isnan(value):
        return "nan"
    return "inf" if value > 0 else "-inf"


def _maybe_inject(cfg: TrainConfig, step: int, attempt: int, env: distributed.DistEnv) -> bool:
    """``debug.crash_at_step``: one failure of the chosen kind, in one attempt. True: NaN this step."""
    d = cfg.debug
    if d.crash_at_step != step or attempt != d.crash_on_attempt:
        return False
    if d.crash_kind == "nan":
        return True
    if not env.is_main:
        return False  # the failure hits rank 0; the others learn it from the collectives
    if d.crash_kind == "oom":
        raise torch.OutOfMemoryError(f"injected out-of-memory at step {step} (debug.crash_at_step)")
    if d.crash_kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f"injected crash at step {step} (debug.crash_at_step)")


# --- phase 5: telemetry (enqueued; the emitter thread builds and sends) --------------------------


def _log_telemetry(ctx: RunContext, update: _Update) -> None:
    """Rank 0: step metrics and router stats every ``log_interval`` (and the mirror); every rank: its
    own stats every ``rank_stats_interval``. Then the driver's progress callback."""
    cfg, env, emitter, step = ctx.cfg, ctx.env, ctx.emitter, update.step
    tokens_per_second = ctx.tokens_per_step / update.step_time_s if update.step_time_s > 0 else 0.0
    report = telemetry.StepReport(
        step=step,
        loss=update.loss,
        grad_norm=update.grad_norm,
        lr=update.lr,
        tokens=ctx.tokens_per_step,
        total_tokens=ctx.total_tokens,
        step_time_s=update.step_time_s,
        tokens_per_second=tokens_per_second,
        mfu=telemetry.mfu_percent(cfg, tokens_per_second, env.world_size),
    )
    if ctx.stats is not None:
        report.layers = telemetry.layer_stats(
            update.router, ctx.stats.num_layers, cfg.moe.num_experts, cfg.moe.top_k
        )
    report.scalars = {
        "events_dropped": float(emitter.dropped),
        "skipped_steps": float(len(ctx.result.skipped_steps)),
    }
    if cfg.telemetry.enabled:
        if env.is_main and step % cfg.telemetry.log_interval == 0:
            # Payload factories: the emitter thread builds the structs, off the training thread.
            emitter.submit(lambda: telemetry.step_metrics(report), step=step)
            if report.layers:
                emitter.submit(lambda: telemetry.router_stats(report), step=step)
            if ctx.mirror is not None:
                ctx.mirror.log(step, mirror_lib.step_values(report))
        if step % cfg.telemetry.rank_stats_interval == 0:
            now = time.perf_counter()
            values: dict[str, float | None] = {
                "interval_s": now - ctx.last_rank_stats,
                "events_dropped": float(emitter.dropped),
                "queue_depth": float(emitter.pending),
            }
            ctx.last_rank_stats = now
            emitter.submit(
                RankStats(rank=env.rank, host=env.host, step_time_s=update.step_time_s, values=values),
                step=step,
            )
    if ctx.progress is not None and env.is_main:
        ctx.progress(report)


# --- phase 6: checkpoints -----------------------------------------------------------------------


def _checkpoint_on_interval(ctx: RunContext) -> None:
    """Every ``checkpoint.interval`` steps, reason "interval", also when a stop signal has already
    arrived: the stop is only agreed at the next step boundary (``_stop_on_signal``), which then
    finds this state on disk and records the signal in its crash event, without a second save."""
    if ctx.cfg.checkpoint.interval > 0 and ctx.step % ctx.cfg.checkpoint.interval == 0:
        _save(ctx, "interval")


def _save(ctx: RunContext, reason: SaveReason) -> None:
    """Every rank writes its shard; rank 0 prunes old checkpoints and records the save."""
    if ctx.last_saved == ctx.step:
        return  # this exact state is on disk already
    root = Path(ctx.cfg.checkpoint.dir)
    path, size, seconds = ckpt.save(root, ctx.step, _checkpoint_state(ctx), ctx.env, config=resolved(ctx.cfg))
    ctx.last_saved = ctx.step
    ctx.result.last_checkpoint = path
    if ctx.is_main:
        ckpt.prune(root, ctx.cfg.checkpoint.keep, protect=ctx.step)
        ctx.emitter.submit(
            CheckpointSaved(
                path=str(path), bytes=size * ctx.env.world_size, duration_s=seconds, reason=reason
            ),
            step=ctx.step,
            critical=True,
        )


def _checkpoint_state(ctx: RunContext) -> dict[str, Any]:
    return {
        "step": ctx.step,
        "total_tokens": ctx.total_tokens,
        "attempt": ctx.attempt,
        "config": resolved(ctx.cfg),
        "model": model_lib.unwrap(ctx.model).state_dict(),
        "optimizer": ctx.optimizer.state_dict(),
        "rng": {"torch": torch.get_rng_state()},
    }


# --- phase 7: the end (finished, stopped by a signal, or crashed) -------------------------------


def _finish(ctx: RunContext) -> None:
    """The loop ran out of steps: "completed" (with the final checkpoint) at ``run.steps``, else
    "stopped" by ``stop_at_step``; rank 0 records which."""
    if ctx.step >= ctx.cfg.run.steps:
        if ctx.cfg.checkpoint.final:
            _save(ctx, "final")
        ctx.result.status = "completed"
    else:
        ctx.result.status = "stopped"
    ctx.flag.ending = True  # the end is being recorded: a signal from here on adds no crash after it
    if ctx.is_main:
        ctx.emitter.submit(
            RunFinished(
                status=ctx.result.status,
                final_step=ctx.step,
                total_tokens=ctx.total_tokens,
                duration_s=time.perf_counter() - ctx.started,
            ),
            step=ctx.step,
            critical=True,
        )


def _stop_on_signal(ctx: RunContext) -> None:
    """A first SIGTERM/SIGINT, honoured at the step boundary: checkpoint, then a "signal" crash.

    One ``checkpoint.saved`` per checkpoint written, its reason the one it was written for. If the
    state of the last step is on disk already (the step was an interval step, so its interval
    checkpoint was written before this boundary, or no step ran since the checkpoint this attempt
    resumed from), nothing is rewritten and no second ``checkpoint.saved`` is made up: the stop by
    signal is recorded by the ``run.crashed`` event (kind "signal", ``last_step``), whose message
    names the checkpoint that holds that state. Otherwise a checkpoint with reason "signal" comes
    first (when ``checkpoint.on_signal``)."""
    signum = ctx.flag.signum if ctx.flag.signum is not None else signal.SIGTERM  # another rank's
    message = f"{signal.Signals(signum).name}: stopped at a step boundary after step {ctx.step}"
    if ctx.last_saved == ctx.step:
        kept = "resumed from" if ctx.step == ctx.result.start_step else "interval"
        message += f"; its state was already saved ({kept} checkpoint {ctx.result.last_checkpoint})"
    elif ctx.cfg.checkpoint.on_signal:
        _save(ctx, "signal")
    _crash(ctx, "signal", None, signum=signum, message=message)


def _crash(
    ctx: RunContext,
    kind: CrashKind,
    exc: BaseException | None,
    *,
    signum: int | None = None,
    message: str | None = None,
) -> None:
    """Record this rank's crash and make it durable before returning."""
    ctx.flag.ending = True
    payload = crashed(
        kind, exc, signum=signum, message=message, rank=ctx.env.rank, host=ctx.env.host, last_step=ctx.step
    )
    exit_code = payload.exit_code if payload.exit_code is not None else 1
    ctx.emitter.submit(payload, step=ctx.step, critical=True)
    ctx.emitter.flush(sync=True, timeout=ctx.emitter.critical_timeout_s)
    ctx.result.status = "signal" if kind == "signal" else "crashed"
    ctx.result.exit_code = exit_code
    ctx.result.crash = payload


def _finish_mirror(mirror: mirror_lib.Mirror, result: TrainResult, escaped: bool) -> None:
    """The mirror's end of the attempt: its summary and exit code (also after a crash)."""
    exit_code = result.exit_code or (1 if escaped else 0)
    summary = mirror_lib.end_summary(
        status="crashed" if escaped else result.status,
        final_step=result.final_step,
        total_tokens=result.total_tokens,
        attempt=result.attempt,
        exit_code=exit_code,
        skipped_steps=len(result.skipped_steps),
        crash_kind=result.crash.kind if result.crash is not None else None,
        duration_s=result.duration_s,
    )
    mirror_lib.finish(mirror, summary, exit_code)


# --- helpers for drivers (the demo, tests) -----------------------------------------------------


def schedule_config_change(
    path: str | Path, at_step: int, changes: dict[str, Any], *, author: str | None = None
) -> Progress:
    """A progress callback that edits the watched config file once step ``at_step - 1`` is done, so
    the change is picked up at the next boundary and ``at_step`` is the first step trained with it
    (with the default ``telemetry.config_poll_steps = 1``). ``changes``: {"moe.capacity_factor": 1.5};
    ``author``: who the change is recorded as made by (None: unknown)."""
    done = False

    def callback(report: telemetry.StepReport) -> None:
        nonlocal done
        if not done and report.step >= at_step - 1:
            edit_config_file(path, changes, author=author)
            done = True

    return callback


def chain(*callbacks: Progress | None) -> Progress:
    """One progress callback that calls several in order."""
    active = [c for c in callbacks if c is not None]

    def callback(report: telemetry.StepReport) -> None:
        for c in active:
            c(report)

    return callback
