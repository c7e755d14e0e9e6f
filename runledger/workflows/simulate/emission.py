"""The emission: the planned story, step by step, as the trainer's envelopes through an ``EventSink``.

Each attempt announces itself (``run.started`` or ``run.resumed``, built by ``runledger.schemas.launch`` as
every producer builds it), then emits per step its config changes, metrics, router stats, expert
counts and rank stats on their intervals and its checkpoints, and ends finished or crashed; the
GitHub deliveries are interleaved at the moments they happened.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import numpy as np

from runledger.ingest.bus import EventSink
from runledger.schemas import Envelope, config_hash, make_event
from runledger.schemas import payloads as p
from runledger.schemas.config_patch import apply_config_patch
from runledger.schemas.launch import Provenance, launch_event, launch_fields
from runledger.workflows.simulate.facts import (
    CHECKPOINT_BYTES,
    CLUSTER,
    EXPERTS,
    FLAKY_RANKS,
    GPUS_PER_HOST,
    LAYERS,
    PARALLELISM,
    RANKS,
    RUN_NAME,
    SCALAR_NAMES,
    SOFTWARE,
    TOKENS_PER_STEP,
    TOP_K,
    WANDB_PROJECT,
    SimOptions,
    host_of,
    when,
)
from runledger.workflows.simulate.story import config_at, plan
from runledger.workflows.simulate.timeline import Change, Crash, Plan, Profile, Segment
from runledger.workflows.simulate.values import Chunk, chunk, expert_counts, f32

CHUNK_STEPS = 2000
CheckpointReason = Literal["interval", "signal", "final", "manual"]  # as checkpoint.saved names them


@dataclass
class SimStats:
    events: int = 0
    values: int = 0  # step scalars, 5 router stats per layer, expert counts, 4 per rank-stats event
    by_type: dict[str, int] = field(default_factory=dict)
    attempts: int = 0
    crashes: int = 0
    switch_step: int = 0
    steps_emitted: int = 0  # including the superseded steps re-emitted by a later attempt


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
            time=when(t),
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


# --- one attempt ----------------------------------------------------------------------------------


@dataclass
class _Attempt:
    """One attempt being emitted: its sources, its live config, its own draws."""

    story: Plan
    out: _Out
    seg: Segment
    prof: Profile
    config: dict[str, Any]  # live: every change so far applied
    main: str  # rank 0's source
    rank_sources: list[str]
    rank_rng: np.random.Generator  # rank stats, checkpoint durations, the crash's delay
    flaky: np.ndarray  # per rank: on one of the two flaky hosts
    changes: dict[int, Change]  # the config changes this attempt applies, by step
    last_rank_stats_t: float

    @classmethod
    def begin(cls, story: Plan, out: _Out, seg: Segment) -> _Attempt:
        o, k = story.options, seg.attempt
        assert story.profile is not None
        return cls(
            story=story,
            out=out,
            seg=seg,
            prof=story.profile,
            config=config_at(story, seg.start_step),
            main=f"trainer/{o.run_id}/a{k}/rank0",
            rank_sources=[f"trainer/{o.run_id}/a{k}/rank{r}" for r in range(RANKS)],
            rank_rng=np.random.default_rng([o.seed, 8, k]),
            flaky=np.isin(np.arange(RANKS) // GPUS_PER_HOST, np.asarray(FLAKY_RANKS) // GPUS_PER_HOST),
            changes={c.step: c for c in story.changes if seg.start_step < c.step <= seg.end_step},
            last_rank_stats_t=seg.launch_time_s,
        )

    def emit(self, payload: msgspec.Struct, *, step: int, t: float, source: str | None = None) -> None:
        source = self.main if source is None else source
        self.out.trainer(payload, source=source, attempt=self.seg.attempt, step=step, t=t)


def _emit_attempt(
    story: Plan,
    out: _Out,
    seg: Segment,
    github_until: Callable[[float], None],
    progress: Callable[[int, int], None] | None,
) -> None:
    a = _Attempt.begin(story, out, seg)

    # Launch: run.started for the first attempt, run.resumed from its checkpoint for the others.
    payload, step = _launch(story, seg, a.config)
    a.emit(payload, step=step, t=seg.launch_time_s)

    # Steps, a chunk of values at a time; GitHub's deliveries in between, when they happened.
    total = seg.end_step - seg.start_step
    for lo in range(0, total, CHUNK_STEPS):
        hi = min(total, lo + CHUNK_STEPS)
        ch = chunk(story, a.prof, seg, lo, hi)
        wall = seg.wall_s[lo:hi].tolist()
        for i, step in enumerate(ch.steps):
            github_until(wall[i])
            _emit_step(a, ch, i, step, wall[i])
        out.stats.steps_emitted += len(ch.steps)
        if progress is not None:
            progress(ch.steps[-1], story.options.steps)

    # The end: a last checkpoint and run.finished, or the crash.
    end_t = float(seg.wall_s[-1]) if seg.wall_s.size else seg.launch_time_s
    if seg.crash is None:
        _emit_finished(a, end_t)
    else:
        _emit_crashed(a, seg.crash, end_t)


def _launch(story: Plan, seg: Segment, config: dict[str, Any]) -> tuple[msgspec.Struct, int]:
    """The attempt's launch record (payload, step): the reference run's machine and code, the head of
    main when it launched, its job."""
    provenance = Provenance(
        host=host_of(0),
        git_commit=seg.git_commit,
        git_dirty=False,
        git_branch="main",
        cluster=CLUSTER,
        job_id=seg.job_id,
        software=dict(SOFTWARE),
    )
    fields = launch_fields(
        config=config,
        config_hash=config_hash(config),
        provenance=provenance,
        repository=story.options.repository,
        world_size=RANKS,
        parallelism=PARALLELISM,
        external={"wandb_run_id": story.options.run_id, "wandb_project": WANDB_PROJECT},
    )
    if seg.attempt == 1:
        return launch_event(fields, attempt=1, name=RUN_NAME)
    return launch_event(
        fields,
        attempt=seg.attempt,
        resumed_from_step=seg.start_step,
        checkpoint_path=_checkpoint_path(config, seg.start_step),
    )


def _emit_step(a: _Attempt, ch: Chunk, i: int, step: int, t: float) -> None:
    """Step ``step`` (row ``i`` of its chunk), ended at ``t``."""
    o = a.story.options
    # A config change lands just before the step that first runs with it.
    change = a.changes.get(step)
    if change is not None:
        _emit_config_change(a, change, step, t - 1e-3)
    # Metrics and router stats on their interval; rank stats on theirs, among those steps.
    if step % o.metrics_every == 0:
        _emit_metrics(a, ch, i, step, t)
        if step % o.rank_stats_every == 0:
            _emit_rank_stats(a, step, t, float(ch.step_time_s[i]), t - a.last_rank_stats_t)
            a.last_rank_stats_t = t
    # Checkpoints on the interval.
    if step % a.story.checkpoint_every == 0:
        _checkpoint(a, step, t, "interval")


def _emit_config_change(a: _Attempt, change: Change, step: int, t: float) -> None:
    """The change's patch, blamed on its PR's merge commit; the attempt's config becomes the new one."""
    new = apply_config_patch(a.config, change.ops)
    cause = p.ChangeCause(kind="commit", detail=change.title, actor=change.author, commit=change.sha)
    payload = p.ConfigChanged(
        patch=change.ops,
        previous_hash=config_hash(a.config),
        config_hash=config_hash(new),
        cause=cause,
    )
    a.emit(payload, step=step, t=t)
    a.config = new


def _emit_metrics(a: _Attempt, ch: Chunk, i: int, step: int, t: float) -> None:
    """The step's StepMetrics (8 fields and SCALAR_NAMES) and router stats (expert counts on their
    interval)."""
    o = a.story.options
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
    a.emit(metrics, step=step, t=t)
    with_counts = step % o.expert_counts_every == 0
    counts = (
        expert_counts(a.prof, o.seed, a.seg.attempt, step, float(ch.ref[i]), ch.dropped[i])
        if with_counts
        else [[]] * LAYERS
    )
    a.emit(p.MoeRouterStats(layers=_layer_stats(ch, i, counts)), step=step, t=t)
    a.out.stats.values += len(SCALAR_NAMES) + 8 + LAYERS * 5 + (LAYERS * EXPERTS if with_counts else 0)


def _layer_stats(ch: Chunk, i: int, counts: list[list[int]]) -> list[p.MoeLayerStats]:
    return [
        p.MoeLayerStats(
            layer=layer,
            tokens=TOKENS_PER_STEP,
            top_k=TOP_K,
            dropped=d,
            token_drop_rate=r,
            sender_drops=s,
            receiver_drops=rv,
            expert_counts=c,
            aux_loss=aux,
            z_loss=z,
            routing_entropy=e,
        )
        for layer, d, r, s, rv, c, aux, z, e in zip(
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


def _emit_rank_stats(a: _Attempt, step: int, t: float, step_time_s: float, interval_s: float) -> None:
    """Every rank's own step time: ranks on the two flaky hosts run 2-5% slow; a random hiccup now and then."""
    rng = a.rank_rng
    factor = 0.985 + 0.01 * rng.random(RANKS) + a.flaky * rng.uniform(0.02, 0.05, RANKS)
    if rng.random() < 0.1:
        factor[int(rng.integers(0, RANKS))] += float(rng.uniform(0.03, 0.08))
    times = f32(step_time_s * factor).tolist()
    depth = rng.integers(0, 4, RANKS).tolist()
    for rank in range(RANKS):
        values: dict[str, float | None] = {
            "interval_s": interval_s,
            "events_dropped": 0.0,
            "queue_depth": float(depth[rank]),
        }
        payload = p.RankStats(rank=rank, host=_HOSTS[rank], step_time_s=times[rank], values=values)
        a.emit(payload, step=step, t=t + 0.25, source=a.rank_sources[rank])
    a.out.stats.values += RANKS * 4


def _checkpoint(a: _Attempt, step: int, t: float, reason: CheckpointReason) -> None:
    payload = p.CheckpointSaved(
        path=_checkpoint_path(a.config, step),
        bytes=CHECKPOINT_BYTES,
        duration_s=float(a.rank_rng.uniform(85.0, 140.0)),
        reason=reason,
    )
    a.emit(payload, step=step, t=t + 0.5)


def _checkpoint_path(config: dict[str, Any], step: int) -> str:
    return f"{config['checkpoint']['dir']}/step_{step:07d}"


# --- the attempt's end ----------------------------------------------------------------------------


def _emit_finished(a: _Attempt, end_t: float) -> None:
    """The last attempt: a final checkpoint unless the last step saved one, then run.finished."""
    seg = a.seg
    if seg.end_step % a.story.checkpoint_every:
        _checkpoint(a, seg.end_step, end_t + 1, "final")
    finished = p.RunFinished(
        status="completed",
        final_step=seg.end_step,
        total_tokens=seg.end_step * TOKENS_PER_STEP,
        duration_s=end_t - seg.launch_time_s,
    )
    a.emit(finished, step=seg.end_step, t=end_t + 2)


def _emit_crashed(a: _Attempt, crash: Crash, end_t: float) -> None:
    """A SIGTERM saves a checkpoint at the step it stops at; the crash is reported by the failing rank,
    an NCCL timeout only once its 10-minute watchdog fires."""
    seg = a.seg
    if crash.kind == "signal" and seg.end_step % a.story.checkpoint_every:
        _checkpoint(a, seg.end_step, end_t + 1, "signal")
    delay = (
        600.0 if crash.exc_type == "torch.distributed.DistBackendError" else float(a.rank_rng.uniform(1, 60))
    )
    payload = p.RunCrashed(
        kind=crash.kind,
        exc_type=crash.exc_type,
        message=crash.message,
        traceback=_traceback(crash),
        signal=crash.signal,
        exit_code=crash.exit_code,
        rank=crash.rank,
        host=crash.host,
        last_step=crash.step,
    )
    source = a.main if crash.rank == 0 else a.rank_sources[crash.rank]
    a.emit(payload, step=crash.step, t=end_t + delay, source=source)


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


_HOSTS = [host_of(r) for r in range(RANKS)]
