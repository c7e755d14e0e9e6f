"""The pre-registered predictions (balanced-router Monte Carlo) and claims, and their scoring against
the study's results and the reference run's figures."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from runledger.workflows.study.collect import DropCollector
from runledger.workflows.study.options import (
    REFERENCE_POOLED_WAVE_CF,
    REFERENCE_POOLED_WAVE_RATE,
    StudyOptions,
)
from runledger.workflows.study.policies import Policy, count_drops, pooled_wave_policy, summarise

# --- predictions -----------------------------------------------------------------------------


@dataclass
class Prediction:
    """A pre-registered expectation for one policy: point estimate and the range we expect."""

    policy: str
    kind: str
    capacity_factor: float | None
    shards: int | None
    point: float
    low: float
    high: float
    reasoning: str


def balanced_rates(options: StudyOptions, policies: Sequence[Policy]) -> dict[Policy, float]:
    """Drop rates of a perfectly balanced router (each token's k experts uniform without
    replacement) with the study's exact micro-batch shape: Monte Carlo, seeded."""
    gen = torch.Generator().manual_seed(options.seed)
    tokens = options.seq_length * options.micro_batch_size
    totals = dict.fromkeys(policies, 0)
    for _ in range(options.monte_carlo_samples):
        scores = torch.rand(tokens, options.num_experts, generator=gen)
        top = torch.topk(scores, options.top_k, dim=-1).indices
        selection = torch.zeros(tokens, options.num_experts, dtype=torch.bool).scatter_(1, top, True)
        for policy, n in count_drops(selection, options.top_k, policies).items():
            totals[policy] += n
    denom = options.monte_carlo_samples * tokens * options.top_k
    return {p: totals[p] / denom for p in policies}


def make_predictions(options: StudyOptions, policies: Sequence[Policy]) -> list[Prediction]:
    balanced = balanced_rates(options, policies)
    out = []
    for policy in policies:
        b = balanced[policy]
        if policy.kind == "dropless":
            out.append(
                Prediction(
                    policy.label, policy.kind, None, None, 0.0, 0.0, 0.0, "no capacity: 0 by construction"
                )
            )
            continue
        # A learned router is less even than a uniform one (the bias corrects imbalance only
        # step by step), so drops should sit at or above the balanced figure; the upper end is a
        # stated guess: 5x balanced, or +3 percentage points where balanced is near 0.
        high = max(5 * b, b + 0.03)
        out.append(
            Prediction(
                policy.label,
                policy.kind,
                policy.capacity_factor,
                policy.shards,
                b,
                b,
                high,
                f"balanced-router Monte Carlo ({options.monte_carlo_samples} micro-batches of "
                f"{options.seq_length * options.micro_batch_size} tokens, {options.num_experts} experts "
                f"top-{options.top_k}) gives {b:.3%}; a learned router is less even, so we expect "
                f"{b:.3%}..{high:.3%}",
            )
        )
    return out


def claims(options: StudyOptions) -> list[str]:
    """The pre-registered claims scored afterwards (``score``), in words."""
    senders, shards = options.pooled_wave[0]
    setup = f"{shards} shards ({senders} sender{'s' if senders > 1 else ''})"
    return [
        "dropless drops exactly 0 on every layer and step",
        f"the run trained at cf {options.trained_capacity_factor:g} measures (trainer telemetry) exactly the "
        "counterfactual drop of Megatron's capacity at that cf, on every layer and step",
        "for each policy the mean drop does not rise as cf rises",
        f"pooled-wave with {setup} drops at least as much as Megatron's per-micro-batch capacity at "
        "the same cf (smaller buffers: per sender, per destination, per wave)",
        f"pooled-wave at cf {REFERENCE_POOLED_WAVE_CF:g}, {options.waves} waves, {setup} lands within "
        f"a factor of 3 of the reference's {REFERENCE_POOLED_WAVE_RATE:.2%}",
    ]


# --- scoring ---------------------------------------------------------------------------------


@dataclass
class Score:
    claim: str
    holds: bool
    detail: str


def score(
    options: StudyOptions,
    predictions: Sequence[Prediction],
    collectors: dict[str, DropCollector],
    control_run: str,
    trained_run: str,
) -> tuple[list[Score], list[dict[str, Any]]]:
    """Each claim true or false with the numbers, and each prediction against the control run."""
    control = collectors[control_run]
    means = {p: summarise(control_run, p, s).mean for p, s in control.series.items()}
    texts = claims(options)
    zero = all(
        v == 0.0 for run in collectors.values() for step in run.series[Policy("dropless")] for v in step
    )
    rising = _rising(options, means)
    worse = [
        (c, means[pooled_wave_policy(options, c)], means[Policy("megatron", c)])
        for c in options.capacity_factors
    ]
    fails = [f"cf {c:g}: {pw:.3%} < {mg:.3%}" for c, pw, mg in worse if pw + 1e-12 < mg]
    out = [
        Score(texts[0], zero, "max dropless rate 0" if zero else "a non-zero dropless rate"),
        _cross_check(texts[1], options, collectors[trained_run]),
        Score(texts[2], not rising, "holds for every policy" if not rising else f"rises for {rising}"),
        Score(texts[3], not fails, "; ".join(fails) or "holds at every cf"),
    ]
    ref = means.get(pooled_wave_policy(options, REFERENCE_POOLED_WAVE_CF))
    if ref is None:
        out.append(Score(texts[4], False, f"cf {REFERENCE_POOLED_WAVE_CF:g} is not in the sweep"))
    else:
        ratio = ref / REFERENCE_POOLED_WAVE_RATE
        out.append(Score(texts[4], 1 / 3 <= ratio <= 3, f"{ref:.3%} = {ratio:.2f}x the reference"))
    return out, _grade(predictions, control, means)


def _cross_check(claim: str, options: StudyOptions, trained: DropCollector) -> Score:
    """The trainer's measured drop against the counterfactual at the trained cf, layer by layer."""
    cf = options.trained_capacity_factor
    counterfactual = trained.series.get(Policy("megatron", cf))
    measured = trained.series[Policy("trainer")]
    if counterfactual is None:
        return Score(claim, False, f"cf {cf:g} is not in the sweep")
    pairs = [
        (a, b) for sa, sb in zip(counterfactual, measured, strict=True) for a, b in zip(sa, sb, strict=False)
    ]
    complete = len(pairs) == sum(len(sa) for sa in counterfactual) and all(
        len(sa) == len(sb) for sa, sb in zip(counterfactual, measured, strict=True)
    )
    worst = max((abs(a - b) for a, b in pairs), default=0.0)
    detail = f"{len(pairs)} layer-steps, largest difference {worst:.3g}"
    return Score(claim, complete and bool(pairs) and worst == 0.0, detail)


def _rising(options: StudyOptions, means: dict[Policy, float]) -> list[str]:
    """The policy families whose mean drop rises somewhere as cf rises."""
    families: list[tuple[str, Callable[[float], Policy]]] = [("megatron", partial(Policy, "megatron"))]
    for setup in options.pooled_wave:
        families.append(
            (f"pooled-wave {setup[0]}x{setup[1]}", partial(pooled_wave_policy, options, setup=setup))
        )
    rising = []
    for name, make in families:
        seq = [means[make(c)] for c in sorted(options.capacity_factors)]
        if any(b > a + 1e-12 for a, b in itertools.pairwise(seq)):
            rising.append(name)
    return rising


def _grade(
    predictions: Sequence[Prediction], control: DropCollector, means: dict[Policy, float]
) -> list[dict[str, Any]]:
    """Each prediction against the control run's measured mean."""
    graded = []
    by_label = {p.label: p for p in control.series}
    for pred in predictions:
        got = means[by_label[pred.policy]]
        graded.append(
            {
                "policy": pred.policy,
                "predicted": pred.point,
                "range": [pred.low, pred.high],
                "measured": got,
                "in_range": pred.low - 1e-12 <= got <= pred.high + 1e-12,
                "error": got - pred.point,
            }
        )
    return graded
