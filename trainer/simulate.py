"""The reference run as an event stream anyone can generate: ``ledger simulate reference-535b``.

A producer like the trainer (trainer → bus → ingest): it emits, through any ``EventSink``, the events
the real trainer (``trainer.telemetry`` and ``loop``) and the GitHub webhook receiver would
have produced for the run of ../shared/reference/marin-535b.md, with the same event types, sources,
payload fields and scalar names. Its story, which an analyst can check against the published facts:

* shape: 48 layers, 384 experts, top-8, hidden 6144, 4,096 context, 792 ranks (11 GB200 NVL72
  racks), 11,264 sequences = 46,137,344 tokens per step, 390,000 steps (~18T tokens), ~3 months;
* per step, 32 scalars (loss falling as a data-scaling power law with noise and rare spikes, a WSD
  learning-rate schedule, grad norm, tokens/s and MFU ~22.71%, 22.87% after the switch) and per layer
  the router's drop rate, drops split by sender/receiver, load-balancing loss, z-loss and entropy;
* token-drop rate: 2.67% mean under pooled-wave (capacity factor 1.15, 3 waves) with per-layer
  variation and an early transient, 0.018% from the dispatcher switch at step 81,716 on;
* expert counts (48 × 384, skewed, summing to tokens·k − dropped) every ``expert_counts_every``
  steps, 792 per-rank stats every ``rank_stats_every`` steps (two flaky hosts run slow);
* ~19 crashes (NCCL timeouts, Xid/ECC errors, OOMs, preemptions, non-finite losses; rank and host,
  clustered on two flaky hosts), each followed by a resume from the last checkpoint (~500 steps
  back; two back after a non-finite loss): the new attempt re-emits the superseded steps;
* live config changes, each caused by a merged PR (``cause.kind="commit"``), the dispatcher switch
  (``moe.dispatcher`` pooled_wave → ragged_all_to_all) at step 81,716 among them;
* a GitHub stream of the run's repository over the same months (issues, PRs with reviews and
  synchronize pushes, squash merges pushed to main, crash reports, relaunch comments on the run's
  status issue), made by ``ingest.github_events.webhook_events`` as the receiver makes it;
  every attempt runs the commit at the head of main when it launched.

A shorter run (``steps`` < 390,000) keeps the story: every position is the reference step scaled
by ``steps / 390,000`` and the run still spans the same three months. Everything is a function of
``seed``: ids, times and values; two runs with the same options write identical bytes.
"""

from __future__ import annotations

import math
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import msgspec
import numpy as np

from ingest.bus import EventSink
from ingest.github_events import webhook_events
from ledger.config_patch import apply_config_patch
from schemas import Envelope, config_hash, make_event
from schemas import payloads as p

# --- the published facts --------------------------------------------------------------------------

REFERENCE_STEPS = 390_000
SWITCH_STEP = 81_716  # pooled-wave → ragged all-to-all (~3.77T tokens)
LAYERS, EXPERTS, TOP_K = 48, 384, 8
HIDDEN, SEQ_LENGTH = 6144, 4096
RACKS, GPUS_PER_RACK, GPUS_PER_HOST = 11, 72, 4
RANKS = RACKS * GPUS_PER_RACK  # 792
GLOBAL_BATCH_SEQUENCES = 11_264
TOKENS_PER_STEP = GLOBAL_BATCH_SEQUENCES * SEQ_LENGTH  # 46,137,344
DROP_RATE_POOLED = 0.0267
DROP_RATE_RAGGED = 0.00018
MFU_POOLED_PERCENT = 22.71
MFU_RAGGED_PERCENT = 22.87
ACTIVE_PARAMS = 23e9
PEAK_TFLOPS_PER_GPU = 2500.0  # GB200, dense BF16
# Model FLOPs per token: 6 · active parameters + attention (12 · layers · hidden · context).
FLOPS_PER_TOKEN = 6 * ACTIVE_PARAMS + 12 * LAYERS * HIDDEN * SEQ_LENGTH
REFERENCE_CHECKPOINT_EVERY = 1000
REFERENCE_CRASHES = 19
CHECKPOINT_BYTES = 7_490_000_000_000  # bf16 weights + fp32 master weights and Adam moments of 535B

RUN_ID = "moe-535b"
REPOSITORY = "openlab/moe-535b"
START = datetime(2026, 2, 2, 8, 0, tzinfo=UTC)
RUN_DAYS = 84.0  # ~3 months of wall clock, downtime included
SCENARIOS = ("reference-535b",)

# The 24 free-form scalars beside StepMetrics' 8 fields: 32 per step, as the reference run logs.
SCALAR_NAMES = (
    "token_drop_rate",  # the trainer's layer means (telemetry.step_metrics)
    "aux_loss",
    "z_loss",
    "routing_entropy",
    "events_dropped",  # the trainer's own counters
    "skipped_steps",
    "sender_drop_rate",
    "receiver_drop_rate",
    "max_expert_load",
    "min_expert_load",
    "expert_load_cv",
    "expert_bias_abs_mean",
    "router_logit_max",
    "param_norm",
    "update_to_param_ratio",
    "tflops_per_gpu",
    "tokens_per_second_per_gpu",
    "memory_allocated_gib",
    "memory_reserved_gib",
    "dataloader_wait_s",
    "all_to_all_s",
    "optimizer_step_s",
    "consumed_samples",
    "data_mixture_progress",
)

USERS = ("lena-m", "raj-p", "sofia-r", "tom-w", "yuki-s", "ahmed-k", "mara-d")
BOT = "openlab-bot"


@dataclass(frozen=True)
class SimOptions:
    steps: int = REFERENCE_STEPS
    metrics_every: int = 1
    expert_counts_every: int = 100
    rank_stats_every: int = 1000
    checkpoint_every: int | None = None  # None: 1,000 scaled to ``steps`` (at least 10)
    crashes: int = REFERENCE_CRASHES
    seed: int = 0
    run_id: str = RUN_ID
    repository: str = REPOSITORY

    def __post_init__(self) -> None:
        for name in ("steps", "metrics_every", "expert_counts_every", "rank_stats_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise ValueError("checkpoint_every must be at least 1")
        if self.crashes < 0:
            raise ValueError("crashes must be at least 0")
        if self.steps < 200:
            raise ValueError("steps must be at least 200 (the story needs room)")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", self.run_id):
            raise ValueError(f"run id {self.run_id!r}: letters, digits, '.', '_' and '-', at most 128")


# --- the story ------------------------------------------------------------------------------------


@dataclass
class Crash:
    step: int  # the last step the attempt completed
    kind: str
    rank: int
    host: str
    exc_type: str | None
    message: str
    signal: int | None
    exit_code: int
    resume_from: int  # the checkpoint the next attempt resumes from
    cause: str  # what failed: nccl, xid, ecc, oom, signal, nonfinite


@dataclass
class Change:
    step: int
    ops: list[p.PatchOp]
    title: str
    pr: int = 0  # filled in when the GitHub story is laid out
    sha: str = ""
    author: str = ""


@dataclass
class Segment:
    """One attempt: from its checkpoint to its crash (or the end), with each step's duration."""

    attempt: int
    start_step: int
    end_step: int
    crash: Crash | None
    mfu: np.ndarray  # per step start_step+1 .. end_step, percent
    step_time_s: np.ndarray
    launch_time_s: float = 0.0  # seconds since START
    wall_s: np.ndarray = field(default_factory=lambda: np.zeros(0))  # each step's end, since START
    git_commit: str = ""
    job_id: str = ""


@dataclass
class Plan:
    options: SimOptions
    scale: float
    switch_step: int
    checkpoint_every: int
    warmup_steps: int
    decay_start_step: int
    changes: list[Change]
    segments: list[Segment]
    github: list[tuple[float, list[Envelope]]] = field(default_factory=list)  # (seconds, events)
    initial_config: dict[str, Any] = field(default_factory=dict)
    profile: _Profile | None = None

    @property
    def crashes(self) -> list[Crash]:
        return [s.crash for s in self.segments if s.crash is not None]


@dataclass
class SimStats:
    events: int = 0
    values: int = 0  # step scalars, 5 router stats per layer, expert counts, 4 per rank-stats event
    by_type: dict[str, int] = field(default_factory=dict)
    attempts: int = 0
    crashes: int = 0
    switch_step: int = 0
    steps_emitted: int = 0  # including the superseded steps re-emitted by a later attempt


def at(steps: int, reference_step: float) -> int:
    """The step of a reference-run position in a run of ``steps`` steps."""
    return max(1, round(reference_step * steps / REFERENCE_STEPS))


def host_of(rank: int) -> str:
    """The rank's host: 4 GPUs per tray, 18 trays per NVL72 rack."""
    rack, local = divmod(rank, GPUS_PER_RACK)
    return f"gb200-r{rack:02d}-n{local // GPUS_PER_HOST:02d}"


FLAKY_RANKS = (4 * 44 + 1, 4 * 141 + 2)  # two hosts that fail (and run slow) more than the others


def plan(options: SimOptions) -> Plan:
    """Lay out the whole story (attempts, crashes, changes, GitHub) before emitting anything."""
    steps = options.steps
    scale = steps / REFERENCE_STEPS
    ckpt = options.checkpoint_every or max(10, round(REFERENCE_CHECKPOINT_EVERY * scale))
    rng = np.random.default_rng([options.seed, 0])
    switch = at(steps, SWITCH_STEP)
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
    story.initial_config = _initial_config(story)
    story.profile = _profile(story)
    _lay_out_github(story, rng)
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
            "name": "moe-535b-a23b",
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
        "parallel": {"tp": 1, "pp": 1, "ep": 64, "dp": RANKS},
    }


def config_at(story: Plan, step: int) -> dict[str, Any]:
    """The config live at ``step`` (every change at or before it applied)."""
    config = story.initial_config
    for change in story.changes:
        if change.step <= step:
            config = apply_config_patch(config, change.ops)
    return config


# --- the GitHub story -----------------------------------------------------------------------------


@dataclass
class _Pr:
    open_s: float
    close_s: float
    merged: bool
    title: str
    author: str
    merger: str
    branch: str
    body: str
    labels: list[str]
    head_shas: list[tuple[float, str]]  # (time, head) — the first is the head it was opened with
    merge_sha: str
    reviews: list[tuple[float, str, str, str]]  # (time, reviewer, state, body)
    files: int
    number: int = 0


@dataclass
class _Issue:
    open_s: float
    close_s: float | None
    title: str
    author: str
    labels: list[str]
    body: str
    comments: list[tuple[float, str, str]]  # (time, author, body)
    number: int = 0


_ROUTINE_PRS = (
    "Add per-layer drop-rate panels to the run dashboard",
    "Eval harness: add the long-context needle suite",
    "Tokenizer: handle NFKC edge cases in the code shards",
    "Checkpoint: write shards with 8 parallel uploads",
    "Fix the data loader's resume offset after a preemption",
    "Log the expert-bias norm per layer",
    "CI: run the MoE unit tests on GB200 nightly",
    "Docs: how to relaunch the run from a checkpoint",
    "Data: dedupe the web shards against the eval sets",
    "Profiler: capture all-to-all timelines every 5,000 steps",
    "Speed up the router's top-k with a fused kernel",
    "Recipe: record the resolved config in every relaunch comment",
    "Monitoring: alert when MFU drops below 20% for 10 minutes",
    "Refactor the pooled-wave buffer sizing into one function",
    "Add a script to compare the recorded config with a new one",
    "Bump the container to CUDA 12.9 and NCCL 2.27",
    "Evals: add MMLU-Pro and GPQA to the 2,000-step suite",
    "Make the status file record every attempt, not only the latest",
)
_EXPERIMENTS = (
    "Experiment: capacity factor 1.15 vs 1.25 for pooled-wave (2.67% drops is near the 3% goal)",
    "Experiment: ragged all-to-all on one rack (drops and MFU)",
    "Experiment: z-loss coefficient sweep on the 8B proxy",
    "Experiment: midtrain mixture ablations on the 8B proxy",
    "Experiment: expert-bias update rate 1e-3 vs 5e-4",
    "Experiment: long-context extension recipe for the last 7% of tokens",
    "Experiment: MFU with 3 vs 4 waves",
    "Question: how often did the cluster fail this month?",
)
_FIX_TITLES = {
    "nccl": "Raise the NCCL watchdog timeout to 30 min and log the stuck collective",
    "oom": "Cap the dispatcher's receive buffers to avoid an OOM on long-tail batches",
    "nonfinite": "Skip the corrupt shard and guard the router logits against NaN",
    "xid": "Drain {host} and add it to the node blocklist",
    "ecc": "Drain {host} and add it to the node blocklist",
}


class _Ids:
    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.comment = 2_610_000_000

    def sha(self) -> str:
        return self.rng.bytes(20).hex()

    def delivery(self) -> str:
        return str(uuid.UUID(bytes=self.rng.bytes(16), version=4))

    def next_comment(self) -> int:
        self.comment += int(self.rng.integers(1, 9000))
        return self.comment


def _lay_out_github(story: Plan, rng: np.random.Generator) -> None:
    """Issues, PRs, reviews, pushes and comments over the run's months; attempts get their commits."""
    ids = _Ids(np.random.default_rng([story.options.seed, 4]))
    segments = story.segments
    end_s = float(segments[-1].wall_s[-1]) if segments[-1].wall_s.size else segments[-1].launch_time_s
    prs: list[_Pr] = []
    issues: list[_Issue] = []

    def people(k: int, avoid: str = "") -> list[str]:
        pool = [u for u in USERS if u != avoid]
        return [pool[i] for i in rng.choice(len(pool), size=k, replace=False)]

    def pr(open_s: float, merge_s: float, title: str, labels: list[str], *, merged: bool = True) -> _Pr:
        author, merger = people(2)
        slug = "-".join(title.lower().replace(":", "").split()[:5])
        heads = [(open_s, ids.sha())]
        if rng.random() < 0.4:  # pushed again during review
            heads.append((open_s + (merge_s - open_s) * float(rng.uniform(0.2, 0.6)), ids.sha()))
        reviews = []
        for who in people(int(rng.integers(1, 3)), author):
            t = open_s + (merge_s - open_s) * float(rng.uniform(0.3, 0.9))
            state = "approved" if merged or rng.random() < 0.3 else "changes_requested"
            reviews.append((t, who, state, "LGTM" if state == "approved" else "Please split this up."))
        reviews.sort()
        made = _Pr(
            open_s,
            merge_s,
            merged,
            title,
            author,
            merger,
            f"{author}/{slug}",
            f"{title}.\n\nPart of the {story.options.run_id} run.",
            labels,
            heads,
            ids.sha(),
            reviews,
            int(rng.integers(1, 40)),
        )
        prs.append(made)
        return made

    day = 86400.0
    launch = pr(
        -6 * day,
        -1 * day,
        f"Launch config for the 535B-A23B pre-training run ({story.options.run_id})",
        ["run"],
    )
    switch_time = _time_of(story, story.switch_step)
    pr(
        switch_time - 20 * day,
        switch_time - 9 * day,
        "Add a ragged all-to-all MoE dispatcher (off by default)",
        ["moe", "performance"],
    )
    change_prs: list[tuple[Change, _Pr]] = []
    for change in story.changes:
        t = _time_of(story, change.step)
        previous_launch = max((s.launch_time_s for s in segments if s.launch_time_s < t), default=0.0)
        merge_s = max(previous_launch + 60.0, t - float(rng.uniform(600, 3600)))
        made = pr(merge_s - float(rng.uniform(0.5, 3.0)) * day, merge_s, change.title, ["config", "run"])
        change.sha, change.author = made.merge_sha, made.merger
        change_prs.append((change, made))
    fixes: dict[int, _Pr] = {}
    for seg in segments:
        crash = seg.crash
        if crash is None:
            continue
        t = float(seg.wall_s[-1]) if seg.wall_s.size else seg.launch_time_s
        if crash.cause in _FIX_TITLES and rng.random() < 0.6:
            title = _FIX_TITLES[crash.cause].format(host=crash.host)
            opened = t + float(rng.uniform(1, 4)) * 3600
            fixes[seg.attempt] = pr(
                opened, opened + float(rng.uniform(0.5, 2.0)) * day, title, ["fix", "infra"]
            )
    for i, title in enumerate(_ROUTINE_PRS * 3):
        opened = float(rng.uniform(0.0, end_s - day))  # after the launch PR: attempt 1 runs its merge
        merged = rng.random() < 0.85
        pr(
            opened,
            opened + float(rng.uniform(0.2, 4.0)) * day,
            title if i < len(_ROUTINE_PRS) else f"{title} (follow-up {i // len(_ROUTINE_PRS)})",
            ["chore"],
            merged=merged,
        )

    # Attempts run the head of main when they launch; the changes name their PRs.
    merges = sorted((p_.close_s, p_.merge_sha) for p_ in prs if p_.merged)
    root = ids.sha()

    def head_at(t: float) -> str:
        head = root
        for when, sha in merges:
            if when > t:
                break
            head = sha
        return head

    job_rng = np.random.default_rng([story.options.seed, 5])
    job = 4_180_000
    for seg in segments:
        seg.git_commit = head_at(seg.launch_time_s)
        job += int(job_rng.integers(50, 3000))
        seg.job_id = f"slurm-{job}"
    assert segments[0].git_commit == launch.merge_sha

    # Issues: the run's status issue with a comment per relaunch, a report per crash, experiments.
    status = _Issue(
        -2 * day,
        end_s + 3600,
        f"Run status: {story.options.run_id} (535B-A23B MoE on 792 GB200)",
        "lena-m",
        ["run", "status"],
        "Live status of the run. Relaunches are posted here.",
        [],
    )
    issues.append(status)
    for seg in segments[1:]:
        prev = segments[seg.attempt - 2].crash
        assert prev is not None
        status.comments.append(
            (
                seg.launch_time_s + float(rng.uniform(300, 1800)),
                BOT,
                f"Relaunched as attempt {seg.attempt} from checkpoint step {seg.start_step:,} at commit "
                f"{seg.git_commit[:12]} (job {seg.job_id}, cluster openlab-gb200, tree clean). Previous attempt: "
                f"{prev.kind} after step {prev.step:,} on rank {prev.rank} ({prev.host}).",
            )
        )
        t_crash = float(segments[seg.attempt - 2].wall_s[-1])
        fix = fixes.get(seg.attempt - 1)
        issues.append(
            _Issue(
                t_crash + float(rng.uniform(600, 2400)),
                (fix.close_s if fix else seg.launch_time_s) + float(rng.uniform(600, 6 * 3600)),
                f"Crash after step {prev.step:,}: {prev.kind} on {prev.host}",
                people(1)[0],
                ["crash", prev.kind],
                f"{prev.exc_type or prev.kind}: {prev.message}\n\nrank {prev.rank}, host {prev.host}",
                [
                    (
                        t_crash + float(rng.uniform(3000, 9000)),
                        people(1)[0],
                        "Looking into it; relaunching from the last checkpoint.",
                    )
                ],
            )
        )
    status.comments.append(
        (
            switch_time + 900,
            "sofia-r",
            f"Switched the dispatcher to ragged all-to-all at step {story.switch_step:,}: drops go from ~2.67% to ~0.02%.",
        )
    )
    for title in _EXPERIMENTS:
        opened = float(rng.uniform(-3 * day, end_s - 3 * day))
        author = people(1)[0]
        comments = [
            (opened + float(rng.uniform(0.1, 5.0)) * day, who, "Results attached; see the W&B report.")
            for who in people(int(rng.integers(1, 4)), author)
        ]
        issues.append(
            _Issue(
                opened,
                opened + float(rng.uniform(3, 14)) * day,
                title,
                author,
                ["experiment"],
                f"{title}.",
                sorted(comments),
            )
        )

    # Numbers in the order things were opened, as GitHub assigns them.
    things: list[_Pr | _Issue] = sorted([*prs, *issues], key=lambda x: x.open_s)
    for number, thing in enumerate(things, start=1201):
        thing.number = number
    for change, made in change_prs:
        change.pr = made.number

    deliveries: list[tuple[float, str, dict[str, Any]]] = []
    repo = story.options.repository
    repository = {"full_name": repo, "name": repo.split("/")[1], "owner": {"login": repo.split("/")[0]}}
    for p_ in prs:
        deliveries.extend(_pr_deliveries(p_, repo, repository, head_at(p_.open_s)))
    for issue in issues:
        deliveries.extend(_issue_deliveries(issue, repo, repository, ids))
    deliveries.sort(key=lambda d: d[0])
    story.github = [
        (t, webhook_events(event, payload, received_at=_when(t), delivery=ids.delivery()))
        for t, event, payload in deliveries
    ]


def _time_of(story: Plan, step: int) -> float:
    """When ``step`` first ended (seconds since START)."""
    for seg in story.segments:
        if seg.start_step < step <= seg.end_step:
            return float(seg.wall_s[step - seg.start_step - 1])
    return 0.0


def _iso(t: float) -> str:
    return _when(t).strftime("%Y-%m-%dT%H:%M:%SZ")


def _user(login: str) -> dict[str, Any]:
    return {"login": login, "type": "Bot" if login == BOT else "User"}


def _pr_deliveries(
    p_: _Pr, repo: str, repository: dict[str, Any], base_sha: str
) -> list[tuple[float, str, dict[str, Any]]]:
    url = f"https://github.com/{repo}/pull/{p_.number}"

    def obj(t: float, head: str, *, closed: bool = False) -> dict[str, Any]:
        merged = closed and p_.merged
        return {
            "number": p_.number,
            "title": p_.title,
            "state": "closed" if closed else "open",
            "user": _user(p_.author),
            "merged": merged,
            "merge_commit_sha": p_.merge_sha if merged else None,
            "head": {"sha": head, "ref": p_.branch},
            "base": {"sha": base_sha, "ref": "main"},
            "labels": [{"name": label} for label in p_.labels],
            "body": p_.body,
            "html_url": url,
            "created_at": _iso(p_.open_s),
            "updated_at": _iso(t),
            "merged_at": _iso(p_.close_s) if merged else None,
            "closed_at": _iso(p_.close_s) if closed else None,
            "draft": False,
            "changed_files": p_.files,
        }

    out: list[tuple[float, str, dict[str, Any]]] = []
    first = p_.head_shas[0][1]
    out.append(
        (
            p_.open_s,
            "pull_request",
            {
                "action": "opened",
                "number": p_.number,
                "pull_request": obj(p_.open_s, first),
                "repository": repository,
                "sender": _user(p_.author),
            },
        )
    )
    head = first
    for t, sha in p_.head_shas[1:]:
        out.append(
            (
                t,
                "pull_request",
                {
                    "action": "synchronize",
                    "number": p_.number,
                    "before": head,
                    "after": sha,
                    "pull_request": obj(t, sha),
                    "repository": repository,
                    "sender": _user(p_.author),
                },
            )
        )
        head = sha
    for n, (t, who, state, body) in enumerate(p_.reviews):
        out.append(
            (
                t,
                "pull_request_review",
                {
                    "action": "submitted",
                    "review": {
                        "id": 2_140_000_000 + p_.number * 10 + n,
                        "user": _user(who),
                        "body": body,
                        "commit_id": head,
                        "submitted_at": _iso(t),
                        "state": state,
                        "html_url": f"{url}#pullrequestreview-{2_140_000_000 + p_.number * 10 + n}",
                    },
                    "pull_request": obj(t, head),
                    "repository": repository,
                    "sender": _user(who),
                },
            )
        )
    who = p_.merger if p_.merged else p_.author
    out.append(
        (
            p_.close_s,
            "pull_request",
            {
                "action": "closed",
                "number": p_.number,
                "pull_request": obj(p_.close_s, head, closed=True),
                "repository": repository,
                "sender": _user(who),
            },
        )
    )
    if p_.merged:  # a squash merge: one commit on main, pushed by the merger
        stamp = _iso(p_.close_s)
        commit = {
            "id": p_.merge_sha,
            "message": f"{p_.title} (#{p_.number})",
            "timestamp": stamp,
            "author": {"name": p_.author, "username": p_.author},
            "url": f"https://github.com/{repo}/commit/{p_.merge_sha}",
        }
        out.append(
            (
                p_.close_s + 1,
                "push",
                {
                    "ref": "refs/heads/main",
                    "before": base_sha,
                    "after": p_.merge_sha,
                    "created": False,
                    "deleted": False,
                    "forced": False,
                    "repository": {**repository, "pushed_at": int(_when(p_.close_s + 1).timestamp())},
                    "pusher": {"name": p_.merger},
                    "sender": _user(p_.merger),
                    "head_commit": commit,
                    "commits": [commit],
                },
            )
        )
    return out


def _issue_deliveries(
    issue: _Issue, repo: str, repository: dict[str, Any], ids: _Ids
) -> list[tuple[float, str, dict[str, Any]]]:
    url = f"https://github.com/{repo}/issues/{issue.number}"

    def obj(t: float, *, closed: bool = False) -> dict[str, Any]:
        return {
            "number": issue.number,
            "title": issue.title,
            "state": "closed" if closed else "open",
            "user": _user(issue.author),
            "labels": [{"name": label} for label in issue.labels],
            "body": issue.body,
            "html_url": url,
            "created_at": _iso(issue.open_s),
            "updated_at": _iso(t),
            "closed_at": _iso(issue.close_s) if closed and issue.close_s is not None else None,
        }

    out: list[tuple[float, str, dict[str, Any]]] = [
        (
            issue.open_s,
            "issues",
            {
                "action": "opened",
                "issue": obj(issue.open_s),
                "repository": repository,
                "sender": _user(issue.author),
            },
        )
    ]
    for t, who, body in issue.comments:
        comment_id = ids.next_comment()
        out.append(
            (
                t,
                "issue_comment",
                {
                    "action": "created",
                    "issue": obj(t),
                    "comment": {
                        "id": comment_id,
                        "user": _user(who),
                        "body": body,
                        "created_at": _iso(t),
                        "updated_at": _iso(t),
                        "html_url": f"{url}#issuecomment-{comment_id}",
                    },
                    "repository": repository,
                    "sender": _user(who),
                },
            )
        )
    if issue.close_s is not None:
        out.append(
            (
                issue.close_s,
                "issues",
                {
                    "action": "closed",
                    "issue": obj(issue.close_s, closed=True),
                    "repository": repository,
                    "sender": _user(issue.author),
                },
            )
        )
    return out


_START_TS = START.timestamp()


def _when(t: float) -> datetime:
    return datetime.fromtimestamp(_START_TS + t, UTC)


# --- the values -----------------------------------------------------------------------------------


@dataclass
class _Profile:
    """Per-layer character of the run, fixed for a seed: which layers drop more, their z-loss…"""

    drop: np.ndarray  # mean 1: the layer's share of pooled-wave drops
    drop_ragged: np.ndarray
    sender_share: np.ndarray
    z_base: np.ndarray
    entropy_fall: np.ndarray
    load_hot: np.ndarray  # (layers, experts): persistent expert popularity, drifting over the run
    load_late: np.ndarray
    drop_norm: float  # mean of the early transient over the pooled-wave steps


def _profile(story: Plan) -> _Profile:
    rng = np.random.default_rng([story.options.seed, 6])
    depth = np.linspace(-1.0, 1.0, LAYERS)
    drop = np.exp(0.25 * rng.normal(size=LAYERS) + 0.35 * depth**2)  # first and last layers drop more
    ragged = np.exp(0.4 * rng.normal(size=LAYERS))
    pooled_steps = np.arange(1, story.switch_step)
    transient = _drop_transient(pooled_steps / story.scale)
    return _Profile(
        drop=drop / drop.mean(),
        drop_ragged=ragged / ragged.mean(),
        sender_share=np.clip(0.4 + 0.06 * rng.normal(size=LAYERS), 0.2, 0.6),
        z_base=9.0 + 10.0 * (depth + 1) / 2 + rng.normal(0, 1.0, LAYERS),
        entropy_fall=1.5 + 0.4 * rng.random(LAYERS),
        load_hot=rng.normal(size=(LAYERS, EXPERTS)),
        load_late=rng.normal(size=(LAYERS, EXPERTS)),
        drop_norm=float(transient.mean()) if transient.size else 1.0,
    )


def _drop_transient(ref: np.ndarray) -> np.ndarray:
    """Drops are higher while the router and the expert bias settle (first few thousand steps)."""
    return 1.0 + 1.5 * np.exp(-ref / 4000.0)


def _f32(x: np.ndarray) -> np.ndarray:
    """As a trainer reports it: float32 on the device, a Python float on the host."""
    return x.astype(np.float32).astype(np.float64)


@dataclass
class _Chunk:
    steps: list[int]
    metrics: list[list[float]]  # per step: the 8 StepMetrics fields then SCALAR_NAMES
    dropped: list[list[int]]
    rate: list[list[float]]
    sender: list[list[int]]
    receiver: list[list[int]]
    aux: list[list[float]]
    z: list[list[float]]
    entropy: list[list[float]]
    ref: np.ndarray
    step_time_s: np.ndarray


def _chunk(story: Plan, prof: _Profile, seg: Segment, lo: int, hi: int) -> _Chunk:
    """Every value of steps ``seg.start_step + 1 + lo`` … ``+ hi`` of one attempt, as arrays."""
    o = story.options
    rng = np.random.default_rng([o.seed, 3, seg.attempt, lo])
    steps = np.arange(seg.start_step + 1 + lo, seg.start_step + 1 + hi)
    n = steps.size
    ref = steps / story.scale  # the reference run's step at this position
    pooled = (steps < story.switch_step)[:, None]
    tk = TOKENS_PER_STEP * TOP_K

    # Router, per layer.
    level = DROP_RATE_POOLED * _drop_transient(ref) / prof.drop_norm
    rate_pooled = level[:, None] * prof.drop[None, :] * np.exp(0.12 * rng.normal(size=(n, LAYERS)) - 0.0072)
    rate_ragged = (
        DROP_RATE_RAGGED * prof.drop_ragged[None, :] * np.exp(0.35 * rng.normal(size=(n, LAYERS)) - 0.06125)
    )
    dropped = np.rint(np.where(pooled, rate_pooled, rate_ragged) * tk).astype(np.int64)
    rate = dropped / tk
    share = np.clip(prof.sender_share[None, :] * (1 + 0.05 * rng.normal(size=(n, LAYERS))), 0.0, 1.0)
    sender = np.where(pooled, np.rint(dropped * share), 0).astype(np.int64)
    receiver = dropped - sender
    imbalance = 0.015 + 0.3 * np.exp(-ref / 3000.0)
    aux = 1.0 + imbalance[:, None] * prof.drop[None, :] * np.exp(0.08 * rng.normal(size=(n, LAYERS)))
    z_change = at(o.steps, 3_100) / story.scale
    z_relief = np.where(ref > z_change, 1.0 - 0.25 * (1.0 - np.exp(-(ref - z_change) / 5000.0)), 1.0)
    z = (prof.z_base[None, :] * ((1.0 + 0.5 * (1.0 - np.exp(-ref / 15000.0))) * z_relief)[:, None]) * np.exp(
        0.04 * rng.normal(size=(n, LAYERS))
    )
    settle = 1.0 - np.exp(-ref / 12000.0)
    entropy = (
        math.log(EXPERTS) - prof.entropy_fall[None, :] * settle[:, None] + rng.normal(0, 0.008, (n, LAYERS))
    )

    # Step scalars.
    u = steps / o.steps
    tokens_seen = ref * TOKENS_PER_STEP
    midtrain = np.where(u >= 0.8, 0.12 * (1.0 - np.exp(-(ref - 312_000) / 8000.0)), 0.0)
    spikes = rng.random(n) < 3e-5
    loss = (
        1.69
        + 410.7 / tokens_seen**0.28
        + 7.0 * np.exp(-ref / 300.0)
        - midtrain
        + rng.normal(0, 0.012, n)
        + spikes * rng.uniform(0.2, 1.0, n)
    )
    grad_norm = (
        (0.16 + 1.5 * np.exp(-ref / 1500.0)) * np.exp(0.12 * rng.normal(size=n)) * np.where(spikes, 5.0, 1.0)
    )
    peak, floor = 2.2e-4, 2.2e-5
    warm = np.minimum(1.0, steps / story.warmup_steps)
    decay = np.clip((steps - story.decay_start_step) / max(1, o.steps - story.decay_start_step), 0.0, 1.0)
    lr = np.where(steps < story.warmup_steps, peak * warm, peak - (peak - floor) * decay)
    offset = lo
    step_time = seg.step_time_s[offset : offset + n]
    mfu = seg.mfu[offset : offset + n]
    tps = TOKENS_PER_STEP / step_time
    load_sigma = 0.08 + 0.3 * np.exp(-ref / 5000.0)
    mixture_progress = np.where(u < 0.8, u / 0.8, np.where(u < 0.93, (u - 0.8) / 0.13, (u - 0.93) / 0.07))
    allocated = np.where(pooled[:, 0], 151.3, 158.9) + rng.normal(0, 0.4, n)
    columns = [
        _f32(loss),
        _f32(grad_norm),
        lr,
        np.full(n, float(TOKENS_PER_STEP)),
        (steps * TOKENS_PER_STEP).astype(np.float64),
        tps,
        mfu,
        step_time,
        rate.mean(axis=1),
        _f32(aux).mean(axis=1),
        _f32(z).mean(axis=1),
        _f32(entropy).mean(axis=1),
        np.zeros(n),
        np.zeros(n),
        sender.sum(axis=1) / (tk * LAYERS),
        receiver.sum(axis=1) / (tk * LAYERS),
        _f32(1.0 + 3.2 * load_sigma * np.exp(0.05 * rng.normal(size=n))),
        _f32(np.maximum(0.05, 1.0 - 2.6 * load_sigma * np.exp(0.05 * rng.normal(size=n)))),
        _f32(load_sigma * np.exp(0.05 * rng.normal(size=n))),
        _f32(0.02 + 0.05 * (1.0 - np.exp(-ref / 20000.0)) + rng.normal(0, 0.001, n)),
        _f32(8.0 + 6.0 * (1.0 - np.exp(-ref / 30000.0)) + rng.normal(0, 0.15, n)),
        _f32(1450.0 + 600.0 * (1.0 - np.exp(-ref / 60000.0)) + rng.normal(0, 0.05, n)),
        _f32(lr * 4.5 * np.exp(0.1 * rng.normal(size=n))),
        mfu / 100 * PEAK_TFLOPS_PER_GPU,
        tps / RANKS,
        _f32(allocated),
        _f32(allocated + 12.0 + rng.normal(0, 0.3, n)),
        _f32(0.02 * np.exp(0.5 * rng.normal(size=n)) + np.maximum(0.0, step_time - 16.5)),
        _f32(np.where(pooled[:, 0], 1.9, 1.7) * np.exp(0.04 * rng.normal(size=n))),
        _f32(0.42 * np.exp(0.03 * rng.normal(size=n))),
        (steps * GLOBAL_BATCH_SEQUENCES).astype(np.float64),
        mixture_progress,
    ]
    metrics = np.stack(columns, axis=1)
    return _Chunk(
        steps=steps.tolist(),
        metrics=metrics.tolist(),
        dropped=dropped.tolist(),
        rate=rate.tolist(),
        sender=sender.tolist(),
        receiver=receiver.tolist(),
        aux=_f32(aux).tolist(),
        z=_f32(z).tolist(),
        entropy=_f32(entropy).tolist(),
        ref=ref,
        step_time_s=step_time,
    )


def _expert_counts(
    prof: _Profile, seed: int, attempt: int, step: int, ref: float, dropped: list[int]
) -> list[list[int]]:
    """Tokens per expert after drops, per layer: skewed (a few hot experts), summing to T·k − dropped."""
    rng = np.random.default_rng([seed, 7, attempt, step])
    w = min(1.0, ref / REFERENCE_STEPS)
    sigma = 0.12 + 0.35 * math.exp(-ref / 5000.0)
    logits = sigma * ((1 - w) * prof.load_hot + w * prof.load_late) + 0.05 * rng.normal(
        size=(LAYERS, EXPERTS)
    )
    share = np.exp(logits)
    share /= share.sum(axis=1, keepdims=True)
    kept = TOKENS_PER_STEP * TOP_K - np.asarray(dropped, dtype=np.int64)
    counts = np.floor(share * kept[:, None]).astype(np.int64)
    rest = kept - counts.sum(axis=1)
    counts[np.arange(LAYERS), counts.argmax(axis=1)] += rest
    return counts.tolist()


# --- emitting -------------------------------------------------------------------------------------

CHUNK_STEPS = 2000


class _Out:
    """Sequence numbers per source, ids and counts; hands envelopes to the sink."""

    def __init__(self, sink: EventSink, story: Plan) -> None:
        self.sink = sink
        self.run_id = story.options.run_id
        self.id_prefix = f"s{story.options.seed}-"
        self.seqs: dict[str, int] = {}
        self.stats = SimStats(switch_step=story.switch_step)

    def trainer(self, payload: msgspec.Struct, *, source: str, attempt: int, step: int, t: float) -> None:
        seq = self.seqs.get(source, 0)
        self.seqs[source] = seq + 1
        envelope = make_event(
            payload,
            source=source,
            stream=self.run_id,
            seq=seq,
            run_id=self.run_id,
            attempt=attempt,
            step=step,
            id=f"{self.id_prefix}{seq}",
            time=_when(t),
        )
        self.sink.emit(envelope)
        self.count(envelope.type)

    def envelope(self, envelope: Envelope) -> None:
        self.sink.emit(envelope)
        self.count(envelope.type)

    def count(self, type_name: str) -> None:
        self.stats.events += 1
        self.stats.by_type[type_name] = self.stats.by_type.get(type_name, 0) + 1


def simulate(
    sink: EventSink,
    options: SimOptions | None = None,
    *,
    progress: Callable[[int, int], None] | None = None,
) -> SimStats:
    """Emit the reference run through ``sink``; returns what was emitted. ``progress(step, steps)``
    is called once per chunk of steps."""
    story = plan(options or SimOptions())
    out = _Out(sink, story)
    github = iter(story.github)
    pending = next(github, None)

    def github_until(t: float) -> None:
        nonlocal pending
        while pending is not None and pending[0] <= t:
            for envelope in pending[1]:
                out.envelope(envelope)
            pending = next(github, None)

    for seg in story.segments:
        github_until(seg.launch_time_s)
        _emit_attempt(story, out, seg, github_until, progress)
    github_until(math.inf)
    stats = out.stats
    stats.attempts = len(story.segments)
    stats.crashes = len(story.crashes)
    return stats


def _launch_fields(story: Plan, seg: Segment, config: dict[str, Any]) -> dict[str, Any]:
    return {
        "config": config,
        "config_hash": config_hash(config),
        "git_commit": seg.git_commit,
        "git_dirty": False,
        "git_branch": "main",
        "repository": story.options.repository,
        "host": host_of(0),
        "cluster": "openlab-gb200",
        "job_id": seg.job_id,
        "world_size": RANKS,
        "parallelism": {"tp": 1, "pp": 1, "ep": 64, "dp": RANKS},
        "software": {"torch": "2.9.1", "megatron-core": "0.16.1", "cuda": "12.9", "nccl": "2.27.7"},
        "external": {"wandb_run_id": story.options.run_id, "wandb_project": "openlab/moe-535b"},
    }


def _emit_attempt(
    story: Plan,
    out: _Out,
    seg: Segment,
    github_until: Callable[[float], None],
    progress: Callable[[int, int], None] | None,
) -> None:
    o = story.options
    prof = story.profile
    assert prof is not None
    k = seg.attempt
    main = f"trainer/{o.run_id}/a{k}/rank0"
    config = config_at(story, seg.start_step)
    fields = _launch_fields(story, seg, config)
    if k == 1:
        out.trainer(
            p.RunStarted(name="moe-535b-a23b", **fields), source=main, attempt=k, step=0, t=seg.launch_time_s
        )
    else:
        payload = p.RunResumed(
            from_checkpoint_step=seg.start_step,
            checkpoint_path=f"{config['checkpoint']['dir']}/step_{seg.start_step:07d}",
            previous_attempt=k - 1,
            **fields,
        )
        out.trainer(payload, source=main, attempt=k, step=seg.start_step, t=seg.launch_time_s)
    changes = {c.step: c for c in story.changes if seg.start_step < c.step <= seg.end_step}
    rank_sources = [f"trainer/{o.run_id}/a{k}/rank{r}" for r in range(RANKS)]
    rank_rng = np.random.default_rng([o.seed, 8, k])
    flaky = np.isin(np.arange(RANKS) // GPUS_PER_HOST, np.asarray(FLAKY_RANKS) // GPUS_PER_HOST)
    ckpt = story.checkpoint_every
    last_rank_stats_t = seg.launch_time_s
    total = seg.end_step - seg.start_step
    for lo in range(0, total, CHUNK_STEPS):
        hi = min(total, lo + CHUNK_STEPS)
        ch = _chunk(story, prof, seg, lo, hi)
        wall = seg.wall_s[lo:hi].tolist()
        for i, step in enumerate(ch.steps):
            t = wall[i]
            github_until(t)
            change = changes.get(step)
            if change is not None:
                new = apply_config_patch(config, change.ops)
                cause = p.ChangeCause(
                    kind="commit",
                    detail=change.title,
                    actor=change.author,
                    commit=change.sha,
                )
                payload = p.ConfigChanged(
                    patch=change.ops,
                    previous_hash=config_hash(config),
                    config_hash=config_hash(new),
                    cause=cause,
                )
                out.trainer(payload, source=main, attempt=k, step=step, t=t - 1e-3)
                config = new
            if step % o.metrics_every == 0:
                m = ch.metrics[i]
                metrics = p.StepMetrics(
                    loss=m[0],
                    grad_norm=m[1],
                    lr=m[2],
                    tokens=TOKENS_PER_STEP,
                    total_tokens=step * TOKENS_PER_STEP,
                    tokens_per_second=m[5],
                    mfu=m[6],
                    step_time_s=m[7],
                    scalars=dict(zip(SCALAR_NAMES, m[8:], strict=True)),
                )
                out.trainer(metrics, source=main, attempt=k, step=step, t=t)
                with_counts = step % o.expert_counts_every == 0
                counts = (
                    _expert_counts(prof, o.seed, k, step, float(ch.ref[i]), ch.dropped[i])
                    if with_counts
                    else [[]] * LAYERS
                )
                layers = [
                    p.MoeLayerStats(
                        layer=layer,
                        tokens=TOKENS_PER_STEP,
                        top_k=TOP_K,
                        dropped=d,
                        token_drop_rate=r,
                        sender_drops=s,
                        receiver_drops=rv,
                        expert_counts=c,
                        aux_loss=a,
                        z_loss=z,
                        routing_entropy=e,
                    )
                    for layer, d, r, s, rv, c, a, z, e in zip(
                        range(LAYERS),
                        ch.dropped[i],
                        ch.rate[i],
                        ch.sender[i],
                        ch.receiver[i],
                        counts,
                        ch.aux[i],
                        ch.z[i],
                        ch.entropy[i],
                        strict=True,
                    )
                ]
                out.trainer(p.MoeRouterStats(layers=layers), source=main, attempt=k, step=step, t=t)
                out.stats.values += (
                    len(SCALAR_NAMES) + 8 + LAYERS * 5 + (LAYERS * EXPERTS if with_counts else 0)
                )
                if step % o.rank_stats_every == 0:
                    _emit_rank_stats(
                        out,
                        rank_sources,
                        rank_rng,
                        flaky,
                        k,
                        step,
                        t,
                        float(ch.step_time_s[i]),
                        t - last_rank_stats_t,
                    )
                    last_rank_stats_t = t
            if step % ckpt == 0:
                _checkpoint(out, main, config, k, step, t, "interval", rank_rng)
        out.stats.steps_emitted += len(ch.steps)
        if progress is not None:
            progress(ch.steps[-1], o.steps)
    end_t = float(seg.wall_s[-1]) if seg.wall_s.size else seg.launch_time_s
    crash = seg.crash
    if crash is None:
        if seg.end_step % ckpt:
            _checkpoint(out, main, config, k, seg.end_step, end_t + 1, "final", rank_rng)
        finished = p.RunFinished(
            status="completed",
            final_step=seg.end_step,
            total_tokens=seg.end_step * TOKENS_PER_STEP,
            duration_s=end_t - seg.launch_time_s,
        )
        out.trainer(finished, source=main, attempt=k, step=seg.end_step, t=end_t + 2)
        return
    if crash.kind == "signal" and seg.end_step % ckpt:
        _checkpoint(out, main, config, k, seg.end_step, end_t + 1, "signal", rank_rng)
    delay = (
        600.0 if crash.exc_type == "torch.distributed.DistBackendError" else float(rank_rng.uniform(1, 60))
    )
    payload = p.RunCrashed(
        kind=crash.kind,  # type: ignore[arg-type]
        exc_type=crash.exc_type,
        message=crash.message,
        traceback=_traceback(crash),
        signal=crash.signal,
        exit_code=crash.exit_code,
        rank=crash.rank,
        host=crash.host,
        last_step=crash.step,
    )
    source = main if crash.rank == 0 else rank_sources[crash.rank]
    out.trainer(payload, source=source, attempt=k, step=crash.step, t=end_t + delay)


def _traceback(crash: Crash) -> str | None:
    if crash.exc_type is None:
        return None
    return (
        "Traceback (most recent call last):\n"
        '  File "/opt/openlab/train.py", line 412, in train_step\n'
        "    loss = model(batch)\n"
        '  File "/opt/openlab/moe/dispatch.py", line 188, in dispatch\n'
        "    torch.distributed.all_to_all_single(out, inp, splits_out, splits_in, group=ep_group)\n"
        f"{crash.exc_type}: {crash.message}\n"
    )


def _checkpoint(
    out: _Out,
    source: str,
    config: dict[str, Any],
    attempt: int,
    step: int,
    t: float,
    reason: str,
    rng: np.random.Generator,
) -> None:
    payload = p.CheckpointSaved(
        path=f"{config['checkpoint']['dir']}/step_{step:07d}",
        bytes=CHECKPOINT_BYTES,
        duration_s=float(rng.uniform(85.0, 140.0)),
        reason=reason,  # type: ignore[arg-type]
    )
    out.trainer(payload, source=source, attempt=attempt, step=step, t=t + 0.5)


def _emit_rank_stats(
    out: _Out,
    sources: list[str],
    rng: np.random.Generator,
    flaky: np.ndarray,
    attempt: int,
    step: int,
    t: float,
    step_time_s: float,
    interval_s: float,
) -> None:
    """Every rank's own step time: ranks on the two flaky hosts run 2-5% slow; a random hiccup now and then."""
    factor = 0.985 + 0.01 * rng.random(RANKS) + flaky * rng.uniform(0.02, 0.05, RANKS)
    if rng.random() < 0.1:
        factor[int(rng.integers(0, RANKS))] += float(rng.uniform(0.03, 0.08))
    times = _f32(step_time_s * factor).tolist()
    depth = rng.integers(0, 4, RANKS).tolist()
    for rank in range(RANKS):
        values = {"interval_s": interval_s, "events_dropped": 0.0, "queue_depth": float(depth[rank])}
        payload = p.RankStats(rank=rank, host=_HOSTS[rank], step_time_s=times[rank], values=values)
        out.trainer(payload, source=sources[rank], attempt=attempt, step=step, t=t + 0.25)
    out.stats.values += RANKS * 4


_HOSTS = [host_of(r) for r in range(RANKS)]
