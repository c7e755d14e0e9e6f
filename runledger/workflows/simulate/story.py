"""The story: the plan of the whole run (attempts, crashes, config changes) before anything is emitted.

Every position is a reference-run step scaled to the run's length; crashes are spread over the run
(none superseding a config change), each attempt is a segment from its checkpoint to its crash with
each step's duration, and the wall clock spans the same three months whatever the length.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from runledger.schemas import payloads as p
from runledger.schemas.config_patch import apply_config_patch
from runledger.workflows.simulate.facts import (
    EXPERTS,
    FLAKY_RANKS,
    FLOPS_PER_TOKEN,
    GLOBAL_BATCH_SEQUENCES,
    GPUS_PER_HOST,
    HIDDEN,
    LAYERS,
    MFU_POOLED_PERCENT,
    MFU_RAGGED_PERCENT,
    PARALLELISM,
    PEAK_TFLOPS_PER_GPU,
    RANKS,
    REFERENCE_CHECKPOINT_EVERY,
    REFERENCE_STEPS,
    RUN_DAYS,
    RUN_NAME,
    SEQ_LENGTH,
    SWITCH_STEP,
    TOKENS_PER_STEP,
    TOP_K,
    SimOptions,
    at,
    host_of,
)
from runledger.workflows.simulate.github_story import lay_out_github
from runledger.workflows.simulate.timeline import Change, Crash, Plan, Segment
from runledger.workflows.simulate.values import profile_of


def plan(options: SimOptions) -> Plan:
    """Lay out the whole story (attempts, crashes, changes, GitHub) before emitting anything."""
    # Positions: the reference run's, scaled to ``steps``; the checkpoint interval likewise.
    steps = options.steps
    scale = steps / REFERENCE_STEPS
    ckpt = options.checkpoint_every or max(10, round(REFERENCE_CHECKPOINT_EVERY * scale))
    rng = np.random.default_rng([options.seed, 0])
    switch = at(steps, SWITCH_STEP)
    # The config changes, the crashes (none superseding a change), the attempts between crashes.
    changes = _changes(steps, switch)
    crashes = _crashes(options, ckpt, sorted(c.step for c in changes), rng)
    segments = _segments(options, crashes)
    story = Plan(
        options=options,
        scale=scale,
        switch_step=switch,
        checkpoint_every=ckpt,
        warmup_steps=at(steps, 2000),
        decay_start_step=at(steps, 312_000),
        changes=changes,
        segments=segments,
    )
    # The starting config, the layers' character for the values, and the GitHub story (which gives
    # each attempt its commit and each change its PR).
    story.initial_config = _initial_config(story)
    story.profile = profile_of(story)
    lay_out_github(story, rng)
    return story


def _changes(steps: int, switch: int) -> list[Change]:
    def replace(path: str, value: Any) -> p.PatchOp:
        return p.PatchOp(op="replace", path=path, value=value)

    return [
        Change(
            at(steps, 3_100),
            [replace("/moe/z_loss_coeff", 0.002)],
            "Double the router z-loss coefficient: logsumexp² climbing in layers 40-47",
        ),
        Change(
            at(steps, 19_500),
            [replace("/optimizer/grad_clip", 0.5)],
            "Clip gradients at 0.5 after the loss spikes around step 19k",
        ),
        Change(
            at(steps, 58_500),
            [replace("/moe/expert_bias_update_rate", 0.0005)],
            "Halve the expert-bias update rate: bias oscillation in late layers",
        ),
        Change(
            switch,
            [
                replace("/moe/dispatcher", "ragged_all_to_all"),
                replace("/moe/capacity_factor", None),
                replace("/moe/transport_capacity_factor", None),
                replace("/moe/waves", None),
            ],
            "Switch MoE dispatch from pooled-wave to ragged all-to-all (2.67% → ~0.02% dropped)",
        ),
        Change(
            at(steps, 241_800),
            [replace("/eval/interval", 2000)],
            "Evaluate every 2,000 steps instead of 1,000",
        ),
        Change(
            at(steps, 312_000),
            [replace("/data/mixture", "midtrain-v1"), replace("/schedule/phase", "decay")],
            "Mid-training: switch to the midtrain-v1 mixture and start the LR decay",
        ),
        Change(
            at(steps, 363_000),
            [replace("/data/mixture", "midtrain-v2-longctx")],
            "midtrain-v2: add the long-context and code-heavy shards",
        ),
    ]


_CRASH_KINDS = (
    "nccl",
    "xid",
    "signal",
    "nccl",
    "oom",
    "ecc",
    "nccl",
    "signal",
    "nonfinite",
    "nccl",
    "xid",
    "oom",
    "signal",
    "nccl",
    "ecc",
    "signal",
    "oom",
    "nonfinite",
    "signal",
)


def _crashes(
    options: SimOptions, ckpt: int, change_steps: list[int], rng: np.random.Generator
) -> list[Crash]:
    """``options.crashes`` crashes spread over the run, none superseding a config change."""
    steps, n = options.steps, options.crashes
    out: list[Crash] = []
    if n == 0:
        return out
    lo, hi = 0.02 * steps, 0.98 * steps
    width = (hi - lo) / n
    previous = 0
    for i in range(n):
        step = int(lo + width * (i + rng.uniform(0.15, 0.85)))
        kind = _CRASH_KINDS[i % len(_CRASH_KINDS)]
        step = max(step, previous + 2 * ckpt + 2)
        if step % ckpt == 0:
            step += 1
        for s in change_steps:  # a change must stay on the final lineage: crash just before it
            if _resume_step(kind, step, ckpt) < s <= step:
                step = s - 1 if (s - 1) % ckpt else s - 2
        resume = _resume_step(kind, step, ckpt)
        if step >= steps or step <= previous:
            continue
        rank = int(rng.choice(FLAKY_RANKS)) if rng.random() < 0.45 else int(rng.integers(0, RANKS))
        host = host_of(rank)
        out.append(_crash(kind, step, rank, host, resume, rng))
        previous = step
    return out


def _resume_step(kind: str, step: int, ckpt: int) -> int:
    """The checkpoint the next attempt resumes from: a SIGTERM saves one at the step it stops at; a NaN
    goes back two checkpoints, past the bad data; anything else resumes from the last one."""
    if kind == "signal":
        return step
    back = 2 if kind == "nonfinite" else 1
    return max(0, (step // ckpt - (back - 1)) * ckpt)


def _crash(kind: str, step: int, rank: int, host: str, resume: int, rng: np.random.Generator) -> Crash:
    gpu = rank % GPUS_PER_HOST
    if kind == "nccl":
        ms = 600_000 + int(rng.integers(1, 900))
        seq = int(rng.integers(10_000_000, 90_000_000))
        message = (
            f"[Rank {rank}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum={seq}, "
            f"OpType=ALLTOALL_BASE, Timeout(ms)=600000) ran for {ms} milliseconds before timing out."
        )
        return Crash(
            step,
            "exception",
            rank,
            host,
            "torch.distributed.DistBackendError",
            message,
            None,
            1,
            resume,
            kind,
        )
    if kind == "xid":
        message = (
            f"CUDA error: unspecified launch failure (Xid 79: GPU {gpu} on {host} has fallen off the bus)"
        )
        return Crash(step, "exception", rank, host, "RuntimeError", message, None, 1, resume, kind)
    if kind == "ecc":
        message = f"CUDA error: uncorrectable ECC error encountered (GPU {gpu} on {host})"
        return Crash(step, "exception", rank, host, "RuntimeError", message, None, 1, resume, kind)
    if kind == "oom":
        want = round(float(rng.uniform(1.5, 6.0)), 2)
        free = round(float(rng.uniform(0.2, 1.4)), 2)
        message = (
            f"CUDA out of memory. Tried to allocate {want:.2f} GiB. GPU {gpu} has a total capacity of "
            f"184.00 GiB of which {free:.2f} GiB is free."
        )
        return Crash(step, "oom", rank, host, "torch.OutOfMemoryError", message, None, 1, resume, kind)
    if kind == "signal":
        message = (
            f"SIGTERM: stopped at a step boundary after step {step} (node {host} drained for maintenance)"
        )
        return Crash(step, "signal", rank, host, None, message, 15, 143, resume, kind)
    message = f"non-finite loss (nan) at step {step + 1}: stopping (nonfinite_policy=stop)"
    return Crash(step, "nonfinite_loss", 0, host_of(0), None, message, None, 1, resume, kind)


def _segments(options: SimOptions, crashes: list[Crash]) -> list[Segment]:
    out: list[Segment] = []
    start = 0
    for attempt, crash in enumerate([*crashes, None], start=1):
        end = crash.step if crash is not None else options.steps
        rng = np.random.default_rng([options.seed, 1, attempt])
        steps = np.arange(start + 1, end + 1)
        mfu = _mfu(steps, options.steps, rng)
        tokens_per_second = mfu / 100 * PEAK_TFLOPS_PER_GPU * 1e12 * RANKS / FLOPS_PER_TOKEN
        seg = Segment(attempt, start, end, crash, mfu, TOKENS_PER_STEP / tokens_per_second)
        out.append(seg)
        start = crash.resume_from if crash is not None else end
    # Wall clock: ~3 months over the executed steps (evals, checkpoints and stalls stretch each
    # step's wall time beyond its step_time_s) plus each restart's downtime.
    rng = np.random.default_rng([options.seed, 2])
    downtime = [float(rng.uniform(0.3, 5.0)) * 3600 for _ in out]
    busy = sum(float(s.step_time_s.sum()) for s in out)
    stretch = max(1.0, (RUN_DAYS * 86400 - sum(downtime[:-1])) / busy)
    clock = 0.0
    for seg, pause in zip(out, downtime, strict=True):
        seg.launch_time_s = clock
        seg.wall_s = np.cumsum(seg.step_time_s * stretch) + clock  # each step's end, seconds since START
        clock = (float(seg.wall_s[-1]) if seg.wall_s.size else clock) + pause
    return out


def _mfu(steps: np.ndarray, total: int, rng: np.random.Generator) -> np.ndarray:
    switch = at(total, SWITCH_STEP)
    base = np.where(steps < switch, MFU_POOLED_PERCENT, MFU_RAGGED_PERCENT)
    noise = rng.normal(0.0, 0.18, steps.size)
    stalls = (rng.random(steps.size) < 0.002) * rng.uniform(2.0, 8.0, steps.size)  # data/IO stalls
    return np.clip(base + noise - stalls, 5.0, 40.0)


# --- the config the run starts with ---------------------------------------------------------------


def _initial_config(story: Plan) -> dict[str, Any]:
    o = story.options
    return {
        "run": {
            "run_id": o.run_id,
            "name": RUN_NAME,
            "seed": o.seed,
            "steps": o.steps,
            "repository": o.repository,
        },
        "model": {
            "num_layers": LAYERS,
            "hidden_size": HIDDEN,
            "num_attention_heads": 48,
            "num_query_groups": 8,
            "seq_length": SEQ_LENGTH,
            "vocab_size": 151_936,
            "normalization": "RMSNorm",
            "activation": "swiglu",
            "position_embedding": "rope",
            "precision": "bf16",
        },
        "moe": {
            "num_experts": EXPERTS,
            "top_k": TOP_K,
            "ffn_hidden_size": 1536,
            "dispatcher": "pooled_wave",
            "capacity_factor": 1.15,
            "transport_capacity_factor": 1.15,
            "waves": 3,
            "score_function": "sigmoid",
            "aux_loss_coeff": 0.0,  # logged, not trained on: balance comes from the expert bias
            "z_loss_coeff": 0.001,
            "expert_bias_update_rate": 0.001,
        },
        "optimizer": {
            "lr": 2.2e-4,
            "min_lr": 2.2e-5,
            "weight_decay": 0.1,
            "beta1": 0.9,
            "beta2": 0.95,
            "eps": 1e-8,
            "grad_clip": 1.0,
        },
        "schedule": {
            "warmup_steps": story.warmup_steps,
            "decay": "wsd",
            "decay_start_step": story.decay_start_step,
            "phase": "stable",
        },
        "data": {
            "mixture": "pretrain-v3",
            "global_batch_size": GLOBAL_BATCH_SEQUENCES,
            "micro_batch_size": 1,
        },
        "eval": {"interval": 1000},
        "checkpoint": {"dir": f"gs://openlab-ckpt/{o.run_id}", "interval": story.checkpoint_every, "keep": 5},
        "telemetry": {
            "log_interval": o.metrics_every,
            "rank_stats_interval": o.rank_stats_every,
            "expert_counts_interval": o.expert_counts_every,
            "peak_tflops": PEAK_TFLOPS_PER_GPU,
        },
        "parallel": dict(PARALLELISM),
    }


def config_at(story: Plan, step: int) -> dict[str, Any]:
    """The config live at ``step`` (every change at or before it applied)."""
    config = story.initial_config
    for change in story.changes:
        if change.step <= step:
            config = apply_config_patch(config, change.ops)
    return config
