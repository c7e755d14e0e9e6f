"""The training loop, top to bottom: launch, resume, steps, live config, checkpoints, crashes.

Events (``runledger.schemas.payloads``), all with ``stream = run_id`` and the launch's ``attempt``:

  source   ``trainer/<run_id>/a<attempt>/rank<rank>``: a fresh source per attempt and rank, so its
           ``seq`` starts at 0 and is gap-free without any state surviving a crash. Attempt numbers
           come from ``attempts.json`` in the checkpoint dir, written durably before a launch emits
           anything: a relaunch never reuses one, even after a SIGKILL before the first checkpoint.
  rank 0   run-started / run-resumed (resolved config, hash, git, versions, host), step metrics and
           router stats (global, all-reduced), config changed / rejected, checkpoint saved, step
           skipped, run finished.
  each rank  its own rank stats (step time, host) and its own crash.

Mirror (``mirror=``, e.g. ``runledger.ingest.wandb_mirror.WandbMirror``; rank 0 only; see ``runledger.trainer.mirror``): started
before the launch event, whose ``external`` records it (or ``wandb_error`` when it could not start:
training goes on without it); each logged step, each applied live change and the attempt's end
(summary and finish, also after a crash) are mirrored.

Durability: the loop enqueues, a background thread emits (``telemetry.Emitter``). A crash, signal,
non-finite loss or OOM is enqueued as a run-crashed event, then the queue is drained and
``sink.sync()`` returns before ``train`` does: the event is durable before the process exits.
A SIGKILL loses only what was still in the queue or the sink's unsynced window; what reached the
spool is a gap-free prefix of each source.

Steps are 1-based: step s is the s-th optimizer update; a checkpoint "at step s" holds the state
after it, and a run resumed from it trains step s + 1 next. A config change's step is the first
step trained with it.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec
import torch

from runledger.ingest.bus import EventSink
from runledger.schemas.payloads import (
    ChangeCause,
    CheckpointSaved,
    ConfigChanged,
    ConfigRejected,
    PatchOp,
    RankStats,
    RunCrashed,
    RunFinished,
    RunResumed,
    RunStarted,
    StepSkipped,
)
from runledger.trainer import checkpoint as ckpt
from runledger.trainer import cpu_compat, distributed, provenance, telemetry
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
Status = Literal["completed", "stopped", "crashed", "signal"]


class RunExistsError(ConfigError):
    """A fresh start for a run id that was launched before (resume it, or pick a new id)."""


class NonFiniteLoss(RuntimeError):
    def __init__(self, step: int, value: str) -> None:
        super().__init__(f"non-finite loss ({value}) at step {step}")
        self.step = step
        self.value = value


class SignalStop(BaseException):
    """Raised by a second SIGTERM/SIGINT: stop now, without waiting for the step boundary."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


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
    checkpoint); a second one stops at once."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def __call__(self, signum: int, frame: object) -> None:
        if self.signum is not None:
            raise SignalStop(signum)
        self.signum = signum

    @property
    def requested(self) -> bool:
        return self.signum is not None


@contextlib.contextmanager
def _signal_handlers(flag: _StopFlag, enabled: bool) -> Iterator[None]:
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, flag) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


# --- the run -----------------------------------------------------------------------------------


def train(
    config: TrainConfig | str | Path,
    sink: EventSink,
    *,
    overrides: Sequence[str] = (),
    resume_from: ResumeFrom = None,
    stop_at_step: int | None = None,
    progress: Callable[[telemetry.StepReport], None] | None = None,
    handle_signals: bool = True,
    watch: str | Path | None = None,
    mirror: mirror_lib.Mirror | None = None,
) -> TrainResult:
    """Train (or resume) one run and emit its events to ``sink``; returns how the attempt ended.

    ``config``: a TOML path (watched for live changes, ``overrides`` applied on every load) or a
    ``TrainConfig`` (watched only if ``watch`` names a file to reload). ``resume_from``: None for a
    fresh run, ``"latest"``, a step number or a checkpoint directory. ``stop_at_step`` ends the
    attempt early (status "stopped") after that step. Crashes do not raise: they are recorded and
    returned (``status`` "crashed" or "signal", ``exit_code`` for a CLI to exit with).
    ``mirror``: an experiment tracker to mirror the run to (``runledger.trainer.mirror.Mirror``), used on rank 0.
    """
    started = time.perf_counter()
    if isinstance(config, TrainConfig):
        source = ConfigSource(watch, overrides) if watch is not None else None
        cfg = finalize(config)
        if source is not None:
            source.run_id = cfg.run.run_id
    else:
        source = ConfigSource(config, overrides)
        cfg = source.load()

    device = distributed.pick_device(cfg)
    cpu_compat.check_supported(cfg, device)
    cpu_compat.apply(device)
    if device.type == "cpu" and cfg.run.threads > 0:
        torch.set_num_threads(cfg.run.threads)
    env = distributed.init_distributed(cfg, device)

    # One run id for every rank (rank 0 may have generated it).
    run_id = distributed.broadcast_object(env, cfg.run.run_id)
    if run_id != cfg.run.run_id:
        cfg = finalize(msgspec.structs.replace(cfg, run=msgspec.structs.replace(cfg.run, run_id="")), run_id)
    if source is not None:
        source.run_id = run_id
    root = Path(cfg.checkpoint.dir)

    # The launch: attempt number and resume point, decided by rank 0, durable before any event.
    launch: dict[str, Any] | BaseException
    if env.is_main:
        try:
            launch = _plan_launch(cfg, root, resume_from, env)
        except (ConfigError, ckpt.CheckpointError) as exc:
            launch = exc
    else:
        launch = {}
    launch = distributed.broadcast_object(env, launch)
    if isinstance(launch, BaseException):
        raise launch
    attempt: int = launch["attempt"]
    start_step: int = launch["step"]
    ckpt_path: Path | None = Path(launch["path"]) if launch["path"] else None

    emitter = telemetry.Emitter(
        sink,
        source=f"trainer/{run_id}/a{attempt}/rank{env.rank}",
        stream=run_id,
        run_id=run_id,
        attempt=attempt,
        queue_size=cfg.telemetry.queue_size,
        critical_timeout_s=cfg.telemetry.critical_timeout_s,
    )
    result = TrainResult(
        run_id=run_id,
        attempt=attempt,
        status="completed",
        start_step=start_step,
        final_step=start_step,
        total_tokens=0,
        exit_code=0,
        checkpoint_dir=root,
        last_checkpoint=ckpt_path,
        config=cfg,
    )
    flag = _StopFlag()
    state = _State(cfg=cfg, step=start_step, mirror=mirror if env.is_main else None)
    escaped = False
    try:
        with _signal_handlers(flag, handle_signals):
            _run(cfg, state, env, emitter, result, flag, source, ckpt_path, launch, stop_at_step, progress)
    except BaseException:
        escaped = True  # not a recorded crash (those return): the mirror still learns it failed
        raise
    finally:
        result.events_dropped = emitter.dropped
        emitter.close(timeout=cfg.telemetry.critical_timeout_s * 2)
        result.events_emitted = emitter.emitted
        result.duration_s = time.perf_counter() - started
        if state.mirror is not None:
            _finish_mirror(state.mirror, result, escaped)
    return result


def _finish_mirror(mirror: mirror_lib.Mirror, result: TrainResult, escaped: bool) -> None:
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


@dataclass
class _State:
    cfg: TrainConfig
    step: int
    total_tokens: int = 0
    last_saved: int | None = None
    rejected: object = None  # the last refused change, so an unchanged file is not refused twice
    started: float = field(default_factory=time.perf_counter)
    mirror: mirror_lib.Mirror | None = None  # rank 0's, once started (None: none, or it failed to)


def _plan_launch(
    cfg: TrainConfig, root: Path, resume_from: ResumeFrom, env: distributed.DistEnv
) -> dict[str, Any]:
    previous = ckpt.attempts(root)
    if resume_from is None:
        if previous:
            raise RunExistsError(
                f"run {cfg.run.run_id!r} was launched before ({len(previous)} attempt(s) in {root}); "
                "resume it or choose another run.run_id"
            )
        step, path = 0, None
    else:
        if not previous:
            raise ckpt.CheckpointError(f"nothing to resume: run {cfg.run.run_id!r} has no attempts in {root}")
        step, path = ckpt.resolve(root, resume_from)
        saved = ckpt.saved_config(path) if path is not None else None
        if saved is not None:
            pinned = pinned_changes(diff(_from_saved(saved), cfg))
            if pinned:
                paths = ", ".join(str(op["path"]) for op in pinned)
                raise ConfigError(
                    f"cannot resume from {path}: the config changes keys the checkpoint pins: {paths}"
                )
    record = {
        "time": time.time(),
        "host": env.host,
        "pid": os.getpid(),
        "from_step": step,
        "checkpoint": str(path) if path else None,
        "config_hash": config_hash(cfg),
    }
    attempt = ckpt.register_attempt(root, record)
    return {"attempt": attempt, "step": step, "path": str(path) if path else None, "previous": len(previous)}


def _launch_fields(cfg: TrainConfig, env: distributed.DistEnv, external: dict[str, str]) -> dict[str, Any]:
    commit, dirty, branch = provenance.git_info()
    return {
        "config": resolved(cfg),
        "config_hash": config_hash(cfg),
        "git_commit": commit,
        "git_dirty": dirty,
        "git_branch": branch,
        "repository": cfg.run.repository,
        "host": env.host,
        "cluster": provenance.cluster(),
        "job_id": provenance.job_id(),
        "world_size": env.world_size,
        "parallelism": env.parallelism,
        "software": provenance.software(),
        "external": external,
    }


def _run(
    cfg: TrainConfig,
    state: _State,
    env: distributed.DistEnv,
    emitter: telemetry.Emitter,
    result: TrainResult,
    flag: _StopFlag,
    source: ConfigSource | None,
    ckpt_path: Path | None,
    launch: dict[str, Any],
    stop_at_step: int | None,
    progress: Callable[[telemetry.StepReport], None] | None,
) -> None:
    device = env.device
    model: torch.nn.Module | None = None
    stats: telemetry.RouterStats | None = None
    try:
        # --- the launch event first: a failure to build or load is then a crash of this attempt
        if env.is_main:
            if state.mirror is not None:  # before the launch event, which records its ids
                state.mirror, result.external = mirror_lib.start(
                    state.mirror, result.run_id, resolved(cfg), cfg.run.name
                )
            fields = _launch_fields(cfg, env, result.external)
            if result.attempt == 1:  # a resume always follows an attempt
                emitter.submit(RunStarted(name=cfg.run.name, **fields), step=0, critical=True)
            else:
                payload = RunResumed(
                    from_checkpoint_step=state.step,
                    checkpoint_path=str(ckpt_path) if ckpt_path else None,
                    previous_attempt=max(1, result.attempt - 1),
                    **fields,
                )
                emitter.submit(payload, step=state.step, critical=True)

        # --- build (or restore) the model and optimizer -------------------------------------
        cpu_compat.seed_rng(cfg.run.seed, device)
        model = model_lib.build_model(cfg, device)
        _sync_replicas(model, env)
        optimizer = MasterAdamW(model, cfg.optimizer)
        if ckpt_path is not None:
            saved = ckpt.load(ckpt_path, env)
            model_lib.unwrap(model).load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            torch.set_rng_state(saved["rng"]["torch"])
            state.total_tokens = int(saved["total_tokens"])
            state.last_saved = state.step
        batches = Batches(cfg, dp_rank=_dp_rank(env), device=device)
        mask = cpu_compat.causal_attention_mask(cfg.model.seq_length, device)
        if cfg.telemetry.enabled:
            stats = telemetry.RouterStats(model, cfg.moe.num_experts, cfg.moe.top_k, device)

        tokens_per_step = batches.tokens_per_step * env.dp
        params = optimizer.params
        last_log = time.perf_counter()
        while state.step < cfg.run.steps and (stop_at_step is None or state.step < stop_at_step):
            step = state.step + 1

            # --- step boundary: signals and live config, the same decision on every rank ----
            patch_msg = None
            poll = max(1, cfg.telemetry.config_poll_steps)
            if env.is_main and source is not None and (step - 1) % poll == 0 and source.changed():
                patch_msg = _read_change(source, cfg)
            stop, patch_msg = distributed.sync_control(env, flag.requested, patch_msg)
            if stop:
                _stop_on_signal(cfg, state, env, emitter, result, flag, model, optimizer)
                return
            if patch_msg is not None:
                before = cfg
                cfg = _apply_change(cfg, state, env, emitter, patch_msg, step, model)
                result.config = cfg
                if state.mirror is not None and cfg is not before:
                    state.mirror.config_update(resolved(cfg))
                if cfg.telemetry.enabled and stats is None:  # telemetry switched on live
                    stats = telemetry.RouterStats(model, cfg.moe.num_experts, cfg.moe.top_k, device)
                elif not cfg.telemetry.enabled and stats is not None:
                    stats.close()
                    stats = None
            nan_now = _maybe_inject(cfg, step, result.attempt, env)

            # --- one optimizer step ----------------------------------------------------------
            t0 = time.perf_counter()
            lr = lr_at(step, cfg)
            optimizer.set_hyper(lr=lr, weight_decay=cfg.optimizer.weight_decay)
            loss_acc = torch.zeros((), dtype=torch.float32, device=device)
            for micro in range(cfg.data.micro_batches):
                tokens, labels = batches.get(step, micro)
                loss = model_lib.loss_fn(model, tokens, labels, mask) / cfg.data.micro_batches
                if nan_now:
                    loss = loss * float("nan")
                loss.backward()
                loss_acc += loss.detach()
            distributed.reduce_gradients(params, env)
            grads = optimizer.grads_to_master()
            parts = [loss_acc.reshape(1), distributed.weighted_grad_sq(params, env).reshape(1)]
            if stats is not None:
                parts.append(stats.take())
            packed = distributed.allreduce_sum(torch.cat(parts), env)
            grad_norm_dev = packed[1].sqrt()
            if cfg.optimizer.grad_clip > 0 and grads:
                coef = torch.clamp(cfg.optimizer.grad_clip / (grad_norm_dev + 1e-6), max=1.0)
                torch._foreach_mul_(grads, coef)
            host = packed.tolist()  # the step's one device-to-host transfer
            loss_value = host[0] / env.world_size
            grad_norm = math.sqrt(host[1]) if host[1] >= 0 else float("nan")

            if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
                bad = _nonfinite_text(loss_value if not math.isfinite(loss_value) else grad_norm)
                if cfg.run.nonfinite_policy == "stop":
                    raise NonFiniteLoss(step, bad)
                optimizer.zero_grad()
                state.step = step
                result.final_step = step
                result.skipped_steps.append(step)
                if env.is_main:
                    what = "loss" if not math.isfinite(loss_value) else "grad_norm"
                    emitter.submit(
                        StepSkipped(reason=f"nonfinite_{what}", value=bad), step=step, critical=True
                    )
                continue
            optimizer.step()
            optimizer.zero_grad()
            state.step = step
            state.total_tokens += tokens_per_step
            result.final_step = step
            result.total_tokens = state.total_tokens
            result.losses.append((step, loss_value))
            step_time = time.perf_counter() - t0

            # --- telemetry (enqueued; the emitter thread builds and sends) ---------------------
            tokens_per_second = tokens_per_step / step_time if step_time > 0 else 0.0
            report = telemetry.StepReport(
                step=step,
                loss=loss_value,
                grad_norm=grad_norm,
                lr=lr,
                tokens=tokens_per_step,
                total_tokens=state.total_tokens,
                step_time_s=step_time,
                tokens_per_second=tokens_per_second,
                mfu=telemetry.mfu_percent(cfg, tokens_per_second, env.world_size),
            )
            if stats is not None:
                report.layers = telemetry.layer_stats(
                    host[2:], stats.num_layers, cfg.moe.num_experts, cfg.moe.top_k
                )
            report.scalars = {
                "events_dropped": float(emitter.dropped),
                "skipped_steps": float(len(result.skipped_steps)),
            }
            if cfg.telemetry.enabled:
                if env.is_main and step % cfg.telemetry.log_interval == 0:
                    emitter.submit(lambda r=report: telemetry.step_metrics(r), step=step)
                    if report.layers:
                        emitter.submit(lambda r=report: telemetry.router_stats(r), step=step)
                    if state.mirror is not None:
                        state.mirror.log(step, mirror_lib.step_values(report))
                if step % cfg.telemetry.rank_stats_interval == 0:
                    now = time.perf_counter()
                    values = {
                        "interval_s": now - last_log,
                        "events_dropped": float(emitter.dropped),
                        "queue_depth": float(emitter.pending),
                    }
                    last_log = now
                    emitter.submit(
                        RankStats(rank=env.rank, host=env.host, step_time_s=step_time, values=values),
                        step=step,
                    )
            if progress is not None and env.is_main:
                progress(report)

            # --- checkpoint on interval ------------------------------------------------------
            if cfg.checkpoint.interval > 0 and step % cfg.checkpoint.interval == 0:
                _save(cfg, state, env, emitter, result, model, optimizer, "interval")
            if cfg.debug.step_sleep_s > 0:
                time.sleep(cfg.debug.step_sleep_s)

        if state.step >= cfg.run.steps:
            if cfg.checkpoint.final:
                _save(cfg, state, env, emitter, result, model, optimizer, "final")
            result.status = "completed"
        else:
            result.status = "stopped"
        if env.is_main:
            emitter.submit(
                RunFinished(
                    status=result.status,
                    final_step=state.step,
                    total_tokens=state.total_tokens,
                    duration_s=time.perf_counter() - state.started,
                ),
                step=state.step,
                critical=True,
            )
    except SignalStop as exc:
        _crash(result, env, emitter, state, "signal", exc, signum=exc.signum)
    except KeyboardInterrupt as exc:
        _crash(result, env, emitter, state, "signal", exc, signum=signal.SIGINT)
    except NonFiniteLoss as exc:
        _crash(result, env, emitter, state, "nonfinite_loss", exc)
    except (torch.OutOfMemoryError, MemoryError) as exc:
        _crash(result, env, emitter, state, "oom", exc)
    except Exception as exc:
        _crash(result, env, emitter, state, "exception", exc)
    finally:
        if stats is not None:
            stats.close()


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


def _nonfinite_text(value: float) -> str:
    if math.isnan(value):
        return "nan"
    return "inf" if value > 0 else "-inf"


def _read_change(source: ConfigSource, current: TrainConfig) -> dict[str, Any]:
    """Rank 0: the edit found in the watched file, as a message every rank can act on."""
    try:
        new = source.load()
    except ConfigError as exc:
        return {"error": str(exc), "path": str(source.path)}
    allowed, refused = split_patch(diff(current, new))
    return {"allowed": allowed, "refused": refused, "path": str(source.path)}


def _apply_change(
    cfg: TrainConfig,
    state: _State,
    env: distributed.DistEnv,
    emitter: telemetry.Emitter,
    msg: dict[str, Any],
    step: int,
    model: torch.nn.Module,
) -> TrainConfig:
    """Apply the allowed part of a file edit before ``step``; refuse the rest, with the reason."""
    cause = ChangeCause(kind="file_edit", detail=str(msg.get("path", "")))
    refused: list[dict[str, Any]] = msg.get("refused", [])
    error = msg.get("error")
    allowed: list[dict[str, Any]] = msg.get("allowed", [])
    if allowed:
        try:
            new = apply_patch(cfg, allowed)
        except ConfigError as exc:
            refused, error, new = refused + allowed, str(exc), cfg
        else:
            if env.is_main:
                payload = ConfigChanged(
                    patch=_ops(allowed),
                    previous_hash=config_hash(cfg),
                    config_hash=config_hash(new),
                    cause=cause,
                )
                emitter.submit(payload, step=step, critical=True)
            model_lib.apply_live_moe(model, new.moe)
            cfg = new
            state.cfg = new
    if refused or error:
        key = (repr(refused), error)
        if key != state.rejected and env.is_main:
            if error:
                reason = f"the edited config is invalid: {error}"
            else:
                paths = ", ".join(sorted({str(op.get("path")) for op in refused}))
                reason = f"not changeable while the run is live: {paths} (needs a restart)"
            emitter.submit(
                ConfigRejected(patch=_ops(refused), reason=reason, cause=cause), step=step, critical=True
            )
        state.rejected = key
    else:
        state.rejected = None
    return cfg


def _ops(ops: Sequence[dict[str, Any]]) -> list[PatchOp]:
    return [msgspec.convert(op, PatchOp, from_attributes=False) for op in ops]


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


def _checkpoint_state(
    state: _State, model: torch.nn.Module, optimizer: MasterAdamW, attempt: int
) -> dict[str, Any]:
    return {
        "step": state.step,
        "total_tokens": state.total_tokens,
        "attempt": attempt,
        "config": resolved(state.cfg),
        "model": model_lib.unwrap(model).state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": {"torch": torch.get_rng_state()},
    }


def _save(
    cfg: TrainConfig,
    state: _State,
    env: distributed.DistEnv,
    emitter: telemetry.Emitter,
    result: TrainResult,
    model: torch.nn.Module,
    optimizer: MasterAdamW,
    reason: Literal["interval", "signal", "final"],
) -> None:
    if state.last_saved == state.step:
        return  # this exact state is on disk already
    root = Path(cfg.checkpoint.dir)
    path, size, seconds = ckpt.save(
        root, state.step, _checkpoint_state(state, model, optimizer, result.attempt), env
    )
    state.last_saved = state.step
    result.last_checkpoint = path
    if env.is_main:
        ckpt.prune(root, cfg.checkpoint.keep, protect=state.step)
        emitter.submit(
            CheckpointSaved(path=str(path), bytes=size * env.world_size, duration_s=seconds, reason=reason),
            step=state.step,
            critical=True,
        )


def _stop_on_signal(
    cfg: TrainConfig,
    state: _State,
    env: distributed.DistEnv,
    emitter: telemetry.Emitter,
    result: TrainResult,
    flag: _StopFlag,
    model: torch.nn.Module,
    optimizer: MasterAdamW,
) -> None:
    signum = flag.signum if flag.signum is not None else signal.SIGTERM
    if cfg.checkpoint.on_signal:
        _save(cfg, state, env, emitter, result, model, optimizer, "signal")
    name = signal.Signals(signum).name
    _crash(
        result,
        env,
        emitter,
        state,
        "signal",
        None,
        signum=signum,
        message=f"{name}: stopped at a step boundary",
    )


def _crash(
    result: TrainResult,
    env: distributed.DistEnv,
    emitter: telemetry.Emitter,
    state: _State,
    kind: Literal["exception", "nonfinite_loss", "signal", "oom"],
    exc: BaseException | None,
    *,
    signum: int | None = None,
    message: str | None = None,
) -> None:
    """Record this rank's crash and make it durable before returning."""
    exit_code = 128 + signum if signum is not None else 1
    payload = RunCrashed(
        kind=kind,
        exc_type=type(exc).__qualname__ if exc is not None else None,
        message=message or (str(exc) if exc is not None else ""),
        traceback="".join(traceback.format_exception(exc)) if exc is not None else None,
        signal=signum,
        exit_code=exit_code,
        rank=env.rank,
        host=env.host,
        last_step=state.step,
    )
    emitter.submit(payload, step=state.step, critical=True)
    emitter.flush(sync=True, timeout=emitter.critical_timeout_s)
    result.status = "signal" if kind == "signal" else "crashed"
    result.exit_code = exit_code
    result.crash = payload


# --- helpers for drivers (the demo, tests) -----------------------------------------------------


def schedule_config_change(
    path: str | Path, at_step: int, changes: dict[str, Any]
) -> Callable[[telemetry.StepReport], None]:
    """A progress callback that edits the watched config file once step ``at_step - 1`` is done, so
    the change is picked up at the next boundary and ``at_step`` is the first step trained with it
    (with the default ``telemetry.config_poll_steps = 1``). ``changes``: {"moe.capacity_factor": 1.5}."""
    done = False

    def callback(report: telemetry.StepReport) -> None:
        nonlocal done
        if not done and report.step >= at_step - 1:
            edit_config_file(path, changes)
            done = True

    return callback


def chain(
    *callbacks: Callable[[telemetry.StepReport], None] | None,
) -> Callable[[telemetry.StepReport], None]:
    """One progress callback that calls several in order."""
    active = [c for c in callbacks if c is not None]

    def callback(report: telemetry.StepReport) -> None:
        for c in active:
            c(report)

    return callback
