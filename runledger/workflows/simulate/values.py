"""The values: every number the run reports, a chunk of steps at a time, as arrays.

A per-layer profile fixed for a seed (which layers drop more, their z-loss, expert popularity), then
per chunk the router's drops, balance, z-loss and entropy per layer, the step scalars (loss as a
data-scaling power law, a WSD learning-rate schedule, grad norm, throughput and MFU, memory and
timings) and, on the steps that carry them, tokens per expert.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from runledger.workflows.simulate.facts import (
    DROP_RATE_POOLED,
    DROP_RATE_RAGGED,
    EXPERTS,
    GLOBAL_BATCH_SEQUENCES,
    LAYERS,
    PEAK_TFLOPS_PER_GPU,
    RANKS,
    REFERENCE_STEPS,
    TOKENS_PER_STEP,
    TOP_K,
    at,
)
from runledger.workflows.simulate.timeline import Plan, Profile, Segment

TOKEN_SLOTS = TOKENS_PER_STEP * TOP_K  # routed tokens per layer and step (tokens · k)


def profile_of(story: Plan) -> Profile:
    rng = np.random.default_rng([story.options.seed, 6])
    depth = np.linspace(-1.0, 1.0, LAYERS)
    drop = np.exp(0.25 * rng.normal(size=LAYERS) + 0.35 * depth**2)  # first and last layers drop more
    ragged = np.exp(0.4 * rng.normal(size=LAYERS))
    pooled_steps = np.arange(1, story.switch_step)
    transient = _drop_transient(pooled_steps / story.scale)
    return Profile(
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


def f32(x: np.ndarray) -> np.ndarray:
    """As a trainer reports it: float32 on the device, a Python float on the host."""
    return x.astype(np.float32).astype(np.float64)


@dataclass
class Chunk:
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


@dataclass(frozen=True)
class _Span:
    """The steps of a chunk: where they sit in the reference run, and which ran pooled-wave."""

    steps: np.ndarray
    ref: np.ndarray  # the reference run's step at each position
    pooled: np.ndarray  # (n, 1): before the dispatcher switch

    @property
    def n(self) -> int:
        return int(self.steps.size)


@dataclass(frozen=True)
class _Router:
    """Per step and layer (n, layers): what the router dropped and how it balanced."""

    dropped: np.ndarray
    rate: np.ndarray
    sender: np.ndarray
    receiver: np.ndarray
    aux: np.ndarray
    z: np.ndarray
    entropy: np.ndarray


def chunk(story: Plan, prof: Profile, seg: Segment, lo: int, hi: int) -> Chunk:
    """Every value of steps ``seg.start_step + 1 + lo`` … ``+ hi`` of one attempt, as arrays."""
    rng = np.random.default_rng([story.options.seed, 3, seg.attempt, lo])
    steps = np.arange(seg.start_step + 1 + lo, seg.start_step + 1 + hi)
    span = _Span(steps, steps / story.scale, (steps < story.switch_step)[:, None])

    # Router, per layer.
    router = _router(story, prof, rng, span)

    # Step scalars: the 8 StepMetrics fields then SCALAR_NAMES, a row per step.
    metrics = _step_metrics(story, seg, lo, rng, span, router)

    # As the trainer hands them over: Python values, float32 where the device computes them.
    return Chunk(
        steps=steps.tolist(),
        metrics=metrics.tolist(),
        dropped=router.dropped.tolist(),
        rate=router.rate.tolist(),
        sender=router.sender.tolist(),
        receiver=router.receiver.tolist(),
        aux=f32(router.aux).tolist(),
        z=f32(router.z).tolist(),
        entropy=f32(router.entropy).tolist(),
        ref=span.ref,
        step_time_s=seg.step_time_s[lo : lo + span.n],
    )


def _router(story: Plan, prof: Profile, rng: np.random.Generator, span: _Span) -> _Router:
    """Drops (pooled-wave's split by sender and receiver; ragged's far fewer), balance loss, z-loss
    (relieved by the z-loss change) and routing entropy, per step and layer."""
    n, ref, pooled = span.n, span.ref, span.pooled
    # Drops: the published rate with the early transient, per layer, then split sender/receiver.
    level = DROP_RATE_POOLED * _drop_transient(ref) / prof.drop_norm
    rate_pooled = level[:, None] * prof.drop[None, :] * np.exp(0.12 * rng.normal(size=(n, LAYERS)) - 0.0072)
    rate_ragged = (
        DROP_RATE_RAGGED * prof.drop_ragged[None, :] * np.exp(0.35 * rng.normal(size=(n, LAYERS)) - 0.06125)
    )
    dropped = np.rint(np.where(pooled, rate_pooled, rate_ragged) * TOKEN_SLOTS).astype(np.int64)
    share = np.clip(prof.sender_share[None, :] * (1 + 0.05 * rng.normal(size=(n, LAYERS))), 0.0, 1.0)
    sender = np.where(pooled, np.rint(dropped * share), 0).astype(np.int64)
    # Balance: the imbalance settles over the first few thousand steps.
    imbalance = 0.015 + 0.3 * np.exp(-ref / 3000.0)
    aux = 1.0 + imbalance[:, None] * prof.drop[None, :] * np.exp(0.08 * rng.normal(size=(n, LAYERS)))
    # z-loss: rising as the logits grow, relieved after the coefficient is doubled.
    z_change = at(story.options.steps, 3_100) / story.scale
    z_relief = np.where(ref > z_change, 1.0 - 0.25 * (1.0 - np.exp(-(ref - z_change) / 5000.0)), 1.0)
    z = (prof.z_base[None, :] * ((1.0 + 0.5 * (1.0 - np.exp(-ref / 15000.0))) * z_relief)[:, None]) * np.exp(
        0.04 * rng.normal(size=(n, LAYERS))
    )
    # Entropy: from uniform routing down as the router specialises.
    settle = 1.0 - np.exp(-ref / 12000.0)
    entropy = (
        math.log(EXPERTS) - prof.entropy_fall[None, :] * settle[:, None] + rng.normal(0, 0.008, (n, LAYERS))
    )
    return _Router(dropped, dropped / TOKEN_SLOTS, sender, dropped - sender, aux, z, entropy)


def _training_curves(
    story: Plan, rng: np.random.Generator, span: _Span
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(loss, grad norm, lr): a data-scaling power law with noise and rare spikes, a WSD schedule."""
    o, n, steps, ref = story.options, span.n, span.steps, span.ref
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
    return loss, grad_norm, lr


def _step_metrics(
    story: Plan, seg: Segment, lo: int, rng: np.random.Generator, span: _Span, router: _Router
) -> np.ndarray:
    """(n, 32): StepMetrics' loss, grad norm, lr, tokens, total tokens, tokens/s, MFU and step time,
    then SCALAR_NAMES' values in their order."""
    n, steps, ref, pooled = span.n, span.steps, span.ref, span.pooled
    loss, grad_norm, lr = _training_curves(story, rng, span)
    step_time = seg.step_time_s[lo : lo + n]
    mfu = seg.mfu[lo : lo + n]
    tps = TOKENS_PER_STEP / step_time
    load_sigma = 0.08 + 0.3 * np.exp(-ref / 5000.0)
    u = steps / story.options.steps
    mixture_progress = np.where(u < 0.8, u / 0.8, np.where(u < 0.93, (u - 0.8) / 0.13, (u - 0.93) / 0.07))
    allocated = np.where(pooled[:, 0], 151.3, 158.9) + rng.normal(0, 0.4, n)
    columns = [
        f32(loss),
        f32(grad_norm),
        lr,
        np.full(n, float(TOKENS_PER_STEP)),
        (steps * TOKENS_PER_STEP).astype(np.float64),
        tps,
        mfu,
        step_time,
        router.rate.mean(axis=1),
        f32(router.aux).mean(axis=1),
        f32(router.z).mean(axis=1),
        f32(router.entropy).mean(axis=1),
        np.zeros(n),
        np.zeros(n),
        router.sender.sum(axis=1) / (TOKEN_SLOTS * LAYERS),
        router.receiver.sum(axis=1) / (TOKEN_SLOTS * LAYERS),
        f32(1.0 + 3.2 * load_sigma * np.exp(0.05 * rng.normal(size=n))),
        f32(np.maximum(0.05, 1.0 - 2.6 * load_sigma * np.exp(0.05 * rng.normal(size=n)))),
        f32(load_sigma * np.exp(0.05 * rng.normal(size=n))),
        f32(0.02 + 0.05 * (1.0 - np.exp(-ref / 20000.0)) + rng.normal(0, 0.001, n)),
        f32(8.0 + 6.0 * (1.0 - np.exp(-ref / 30000.0)) + rng.normal(0, 0.15, n)),
        f32(1450.0 + 600.0 * (1.0 - np.exp(-ref / 60000.0)) + rng.normal(0, 0.05, n)),
        f32(lr * 4.5 * np.exp(0.1 * rng.normal(size=n))),
        mfu / 100 * PEAK_TFLOPS_PER_GPU,
        tps / RANKS,
        f32(allocated),
        f32(allocated + 12.0 + rng.normal(0, 0.3, n)),
        f32(0.02 * np.exp(0.5 * rng.normal(size=n)) + np.maximum(0.0, step_time - 16.5)),
        f32(np.where(pooled[:, 0], 1.9, 1.7) * np.exp(0.04 * rng.normal(size=n))),
        f32(0.42 * np.exp(0.03 * rng.normal(size=n))),
        (steps * GLOBAL_BATCH_SEQUENCES).astype(np.float64),
        mixture_progress,
    ]
    return np.stack(columns, axis=1)


def expert_counts(
    prof: Profile, seed: int, attempt: int, step: int, ref: float, dropped: list[int]
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
    kept = TOKEN_SLOTS - np.asarray(dropped, dtype=np.int64)
    counts = np.floor(share * kept[:, None]).astype(np.int64)
    rest = kept - counts.sum(axis=1)
    counts[np.arange(LAYERS), counts.argmax(axis=1)] += rest
    return counts.tolist()
