"""The token-drop study: reproduce the reference run's 4K-context drop test on small experts.

One call (``run_study``) does, in order, all into one ledger in the study's work folder:

1. **Pre-registration.** Predictions for every (policy, capacity factor) from a balanced-router
   Monte Carlo with the study's exact shapes, plus stated claims, are written as annotation events on
   the study's own stream, ingested, and a log checkpoint is signed. Every training run's id embeds
   the SHA-256 of that signed checkpoint, so each training event (all of them carry the run id,
   signed by the producer key) provably came after it.
2. **Runs.** Small Megatron-Core MoE GPTs train through ``runledger.trainer.loop.train`` (normal
   recorded runs): a dropless run (the ragged control) and a run trained with Megatron's capacity
   dropping on. On each, hooks on the routers keep every micro-batch's top-k selection before
   dropping, and every layer's drop rate per step is counted for Megatron's per-micro-batch capacity
   at each capacity factor of the sweep, for pooled-wave accounting (stated shards and waves) and
   for dropless (0). The capacity-trained run cross-checks the accounting: the trainer's own measured
   drop must equal the counterfactual at that factor, layer by layer and step by step.
3. **Results.** Per policy × cf (× shards) mean / p50 / max drop over layers and steps, as events
   (annotations on the study stream and each run's, a run summary per run), a scored comparison with
   the predictions and with the reference run's published figures, a second signed checkpoint, the
   figure and ``results.json``.

Router losses as in the reference run where Megatron has them: the switch load-balancing loss is
logged but not trained on (coefficient 0); balance comes from a per-expert bias updated outside the
gradient (Megatron's ``moe_router_enable_expert_bias``, updated after every step with the rule of
``moe_utils.get_updated_expert_bias``); the z-loss is logged (and trained with a small coefficient).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from runledger.trainer import drop_accounting as da

# The reference run's published figures (../shared/reference/marin-535b.md).
REFERENCE_POOLED_WAVE_CF = 1.15
REFERENCE_WAVES = 3
REFERENCE_POOLED_WAVE_RATE = 0.0267
REFERENCE_RAGGED_RATE = 0.00018

AUTHOR = "ledger study token-drop"
TAG = "token-drop-study"


class StudyError(ValueError):
    """A study that cannot start (bad options, a used work folder): one line for the user."""


@dataclass(frozen=True)
class StudyOptions:
    """What the study trains and how it accounts. Defaults: the ~30-minute study on 2 CPU cores."""

    workdir: Path
    num_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 2
    num_experts: int = 64
    top_k: int = 8
    ffn_hidden_size: int = 128
    seq_length: int = 4096
    micro_batch_size: int = 1
    steps: int = 250
    seed: int = 1234
    capacity_factors: tuple[float, ...] = (1.0, 1.15, 1.25, 1.5, 2.0)
    trained_capacity_factor: float = 1.15  # the run trained with Megatron's dropping on
    drop_policy: str = "probs"
    # Pooled-wave set-ups as (senders, shards): (1, 64) is 64-way expert parallelism seen from one
    # rank sending its whole 4,096-token micro-batch (the reference's per-rank shape).
    pooled_wave: tuple[tuple[int, int], ...] = ((1, 64), (1, 8))
    waves: int = REFERENCE_WAVES
    # Megatron's default moe_router_bias_update_rate is 1e-3, meant for runs of 10⁵ steps; a study
    # run of ~100 steps needs the bias to move by about the spread of the sigmoid scores (~0.05)
    # within ~10 steps, or the router collapses onto a few experts before the bias catches up.
    expert_bias_rate: float = 1e-2
    z_loss_coeff: float = 1e-3
    lr: float = 2e-3
    monte_carlo_samples: int = 8
    threads: int = 0

    @classmethod
    def quick(cls, workdir: Path, **changes: Any) -> StudyOptions:
        """A minute-scale study for tests: tiny model, 512-token context (4096 is too slow for a
        test on 2 cores), 16 experts top-4, a few steps."""
        base = dict(
            num_layers=2,
            hidden_size=32,
            num_attention_heads=2,
            num_experts=16,
            top_k=4,
            ffn_hidden_size=32,
            seq_length=512,
            steps=6,
            pooled_wave=((1, 16), (4, 4)),
            monte_carlo_samples=4,
        )
        base.update(changes)
        return cls(workdir=workdir, **base)  # type: ignore[arg-type]

    def validate(self) -> None:
        tokens = self.seq_length * self.micro_batch_size
        if not 1 <= self.top_k <= self.num_experts:
            raise StudyError(f"top_k {self.top_k} must be between 1 and num_experts {self.num_experts}")
        if self.steps < 1:
            raise StudyError("steps must be ≥ 1")
        if not self.capacity_factors or any(cf <= 0 for cf in self.capacity_factors):
            raise StudyError("capacity factors must be positive")
        if self.trained_capacity_factor <= 0:
            raise StudyError("the trained capacity factor must be positive")
        if self.expert_bias_rate < 0:
            raise StudyError("the expert-bias rate must be ≥ 0")
        if self.waves < 1:
            raise StudyError("waves must be ≥ 1")
        if not self.pooled_wave:
            raise StudyError("at least one pooled-wave set-up (senders, shards) is needed")
        for senders, shards in self.pooled_wave:
            if shards < 1 or self.num_experts % shards:
                raise StudyError(f"{shards} shards must divide the experts ({self.num_experts})")
            if senders < 1 or tokens % senders:
                raise StudyError(f"{senders} senders must divide the tokens of a micro-batch ({tokens})")
        if self.drop_policy not in ("probs", "position"):
            raise StudyError(f"drop policy {self.drop_policy!r}: probs or position")


# --- policies and their labels -----------------------------------------------------------------


@dataclass(frozen=True, order=True)
class Policy:
    """One accounting rule: ``megatron`` (per-micro-batch capacity), ``pooled_wave`` (with shards,
    waves), ``dropless`` (no capacity), or ``trainer`` (the trainer's own measured drop)."""

    kind: str
    capacity_factor: float | None = None
    shards: int | None = None
    waves: int | None = None
    senders: int | None = None

    @property
    def label(self) -> str:
        if self.kind == "megatron":
            return f"megatron cf={self.capacity_factor:g}"
        if self.kind == "pooled_wave":
            return (
                f"pooled-wave cf={self.capacity_factor:g} senders={self.senders} shards={self.shards} "
                f"waves={self.waves}"
            )
        return self.kind


def pooled_wave_policy(options: StudyOptions, cf: float, setup: tuple[int, int] | None = None) -> Policy:
    """The pooled-wave policy at ``cf`` for a (senders, shards) set-up (default: the headline, the
    first one)."""
    senders, shards = setup or options.pooled_wave[0]
    return Policy("pooled_wave", cf, shards, options.waves, senders)


def study_policies(options: StudyOptions) -> list[Policy]:
    out = [Policy("dropless")]
    for cf in options.capacity_factors:
        out.append(Policy("megatron", cf))
    for senders, shards in options.pooled_wave:
        for cf in options.capacity_factors:
            out.append(Policy("pooled_wave", cf, shards, options.waves, senders))
    return out


def count_drops(selection: torch.Tensor, top_k: int, policies: Sequence[Policy]) -> dict[Policy, int]:
    """Every policy's dropped assignments for one micro-batch's selection (one wave layout per
    shard count, shared by the sweep's capacity factors)."""
    out: dict[Policy, int] = {}
    layouts: dict[tuple[int, int, int], da.WaveLayout] = {}
    for policy in policies:
        if policy.kind == "dropless":
            out[policy] = da.dropless_dropped(selection)
        elif policy.kind == "megatron":
            assert policy.capacity_factor is not None
            out[policy] = da.capacity_dropped(selection, top_k, policy.capacity_factor)
        elif policy.kind == "pooled_wave":
            assert policy.capacity_factor is not None and policy.shards and policy.waves
            key = (policy.senders or policy.shards, policy.shards, policy.waves)
            if key not in layouts:
                layouts[key] = da.wave_layout(selection, top_k, policy.shards, policy.waves, key[0])
            out[policy] = da.pooled_wave_dropped_from_layout(layouts[key], policy.capacity_factor).total
    return out


# --- on the model: selections, drop counts and the expert bias ---------------------------------


class DropCollector:
    """Hooks on a model's routers (installed by ``train(on_model=...)``) and the per-step callback.

    ``series[policy]`` is, per step, the list of per-layer drop rates."""

    def __init__(self, options: StudyOptions, policies: Sequence[Policy]) -> None:
        self.options = options
        self.policies = list(policies)
        self.series: dict[Policy, list[list[float]]] = {p: [] for p in [*self.policies, Policy("trainer")]}
        self.steps: list[int] = []
        self.routers: list[torch.nn.Module] = []
        self._selections: dict[int, list[torch.Tensor]] = {}
        self.accounting_s = 0.0

    def install(self, model: torch.nn.Module) -> None:
        from runledger.trainer import model as model_lib

        self.routers = model_lib.routers(model)
        for index, router in enumerate(self.routers):
            _enable_expert_bias(router)
            self._wrap_routing(index, router)

    def _wrap_routing(self, index: int, router: torch.nn.Module) -> None:
        from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

        original = router.routing  # the bound method
        tcfg = router.config
        experts = tcfg.num_moe_experts

        def routing(logits: torch.Tensor, padding_mask: torch.Tensor | None = None) -> Any:
            # The router's own selection before any capacity is applied (expert bias included).
            with torch.no_grad():
                _, selection = topk_routing_with_score_function(
                    logits.detach().reshape(-1, experts).float(),
                    tcfg.moe_router_topk,
                    use_pre_softmax=tcfg.moe_router_pre_softmax,
                    num_groups=tcfg.moe_router_num_groups,
                    group_topk=tcfg.moe_router_group_topk,
                    scaling_factor=tcfg.moe_router_topk_scaling_factor,
                    score_function=tcfg.moe_router_score_function,
                    expert_bias=router.expert_bias,
                )
            self._selections.setdefault(index, []).append(selection.bool())
            return original(logits, padding_mask=padding_mask)

        router.routing = routing  # instance attribute: this router only

    def on_step(self, report: Any) -> None:
        """``train(progress=...)``: count this step's drops, then update the expert bias."""
        started = time.perf_counter()
        k = self.options.top_k
        per_policy: dict[Policy, list[float]] = {p: [] for p in self.policies}
        for layer in range(len(self.routers)):
            selections = self._selections.pop(layer, [])
            tokens = sum(s.shape[0] for s in selections)
            dropped = dict.fromkeys(self.policies, 0)
            for selection in selections:
                for policy, n in count_drops(selection, k, self.policies).items():
                    dropped[policy] += n
            for policy in self.policies:
                per_policy[policy].append(da.drop_rate(dropped[policy], tokens, k))
        for policy, rates in per_policy.items():
            self.series[policy].append(rates)
        self.series[Policy("trainer")].append([layer.token_drop_rate for layer in report.layers])
        self.steps.append(report.step)
        self._update_expert_bias()
        self.accounting_s += time.perf_counter() - started

    @torch.no_grad()
    def _update_expert_bias(self) -> None:
        # Megatron's rule (moe_utils.get_updated_expert_bias), on one process: no all-reduce needed.
        for router in self.routers:
            counts = router.local_tokens_per_expert
            offset = counts.mean() - counts
            router.expert_bias += torch.sign(offset) * self.options.expert_bias_rate
            counts.zero_()


def _enable_expert_bias(router: torch.nn.Module) -> None:
    """Turn on Megatron's aux-loss-free expert bias on a built router (the trainer's config has no
    switch for it): the config flag and the two buffers its constructor would have made."""
    if router.config.moe_router_score_function != "sigmoid":
        # Megatron adds the bias to sigmoid scores only; with softmax it would silently do nothing.
        raise StudyError("the expert bias needs moe.score_function = 'sigmoid'")
    experts = router.config.num_moe_experts
    device = router.weight.device
    router.config.moe_router_enable_expert_bias = True
    router.enable_expert_bias = True
    for name, persistent in (("local_tokens_per_expert", False), ("expert_bias", True)):
        if name in router.__dict__:
            del router.__dict__[name]  # the constructor stored None as a plain attribute
        router.register_buffer(
            name, torch.zeros(experts, dtype=torch.float32, device=device), persistent=persistent
        )


# --- statistics ------------------------------------------------------------------------------


@dataclass
class Summary:
    """One policy's drop rate over layers × steps of one run."""

    run: str
    policy: str
    kind: str
    capacity_factor: float | None
    shards: int | None
    waves: int | None
    senders: int | None
    mean: float
    p50: float
    max: float
    mean_last_half: float
    samples: int


def summarise(run: str, policy: Policy, per_step: list[list[float]]) -> Summary:
    values = [v for layer_rates in per_step for v in layer_rates]
    half = per_step[len(per_step) // 2 :]
    last = [v for layer_rates in half for v in layer_rates]
    return Summary(
        run=run,
        policy=policy.label,
        kind=policy.kind,
        capacity_factor=policy.capacity_factor,
        shards=policy.shards,
        waves=policy.waves,
        senders=policy.senders,
        mean=statistics.fmean(values) if values else 0.0,
        p50=statistics.median(values) if values else 0.0,
        max=max(values) if values else 0.0,
        mean_last_half=statistics.fmean(last) if last else 0.0,
        samples=len(values),
    )


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
    out: list[Score] = []
    zero = all(
        v == 0.0 for run in collectors.values() for step in run.series[Policy("dropless")] for v in step
    )
    out.append(Score(texts[0], zero, "max dropless rate 0" if zero else "a non-zero dropless rate"))
    trained = collectors[trained_run]
    cf = options.trained_capacity_factor
    counterfactual = trained.series.get(Policy("megatron", cf))
    measured = trained.series[Policy("trainer")]
    if counterfactual is None:
        out.append(Score(texts[1], False, f"cf {cf:g} is not in the sweep"))
    else:
        pairs = [
            (a, b)
            for sa, sb in zip(counterfactual, measured, strict=True)
            for a, b in zip(sa, sb, strict=False)
        ]
        complete = len(pairs) == sum(len(sa) for sa in counterfactual) and all(
            len(sa) == len(sb) for sa, sb in zip(counterfactual, measured, strict=True)
        )
        worst = max((abs(a - b) for a, b in pairs), default=0.0)
        detail = f"{len(pairs)} layer-steps, largest difference {worst:.3g}"
        out.append(Score(texts[1], complete and bool(pairs) and worst == 0.0, detail))
    rising = []
    families: list[tuple[str, Callable[[float], Policy]]] = [("megatron", lambda c: Policy("megatron", c))]
    for setup in options.pooled_wave:
        families.append(
            (f"pooled-wave {setup[0]}x{setup[1]}", lambda c, st=setup: pooled_wave_policy(options, c, st))
        )
    for name, make in families:
        seq = [means[make(c)] for c in sorted(options.capacity_factors)]
        if any(b > a + 1e-12 for a, b in itertools.pairwise(seq)):
            rising.append(name)
    out.append(Score(texts[2], not rising, "holds for every policy" if not rising else f"rises for {rising}"))
    worse = [
        (c, means[pooled_wave_policy(options, c)], means[Policy("megatron", c)])
        for c in options.capacity_factors
    ]
    fails = [f"cf {c:g}: {pw:.3%} < {mg:.3%}" for c, pw, mg in worse if pw + 1e-12 < mg]
    out.append(Score(texts[3], not fails, "; ".join(fails) or "holds at every cf"))
    ref = means.get(pooled_wave_policy(options, REFERENCE_POOLED_WAVE_CF))
    if ref is None:
        out.append(Score(texts[4], False, f"cf {REFERENCE_POOLED_WAVE_CF:g} is not in the sweep"))
    else:
        ratio = ref / REFERENCE_POOLED_WAVE_RATE
        out.append(Score(texts[4], 1 / 3 <= ratio <= 3, f"{ref:.3%} = {ratio:.2f}x the reference"))
    graded = []
    by_label = {p.label: p for p in control.series}
    for pred in predictions:
        policy = by_label[pred.policy]
        got = means[policy]
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
    return out, graded


# --- the study -------------------------------------------------------------------------------


@dataclass
class StudyResult:
    study_id: str
    workdir: Path
    ledger: Path
    run_ids: list[str]
    preregistration: Path  # the signed checkpoint that covers the predictions
    prereg_size: int  # study-stream tree size it signs
    prereg_sha256: str
    predictions: list[Prediction]
    summaries: list[Summary]
    scores: list[Score]
    graded: list[dict[str, Any]]
    figure: Path | None
    report: Path | None
    results_json: Path
    durations_s: dict[str, float] = field(default_factory=dict)
    cross_check_layer_steps: int = 0


Say = Callable[[str], None]


STUDY_CONFIG = Path(__file__).parent / "configs" / "study_token_drop.toml"


def train_config(options: StudyOptions, run_id: str, capacity_factor: float | None, checkpoints: Path):
    """The TrainConfig of one study run (a normal recorded run): ``configs/study_token_drop.toml``
    with the study's options over it."""
    from runledger.trainer.config import load_config

    o = options
    overrides = [
        f"run.run_id={run_id}",
        f"run.seed={o.seed}",
        f"run.steps={o.steps}",
        f"run.threads={o.threads}",
        f"model.num_layers={o.num_layers}",
        f"model.hidden_size={o.hidden_size}",
        f"model.num_attention_heads={o.num_attention_heads}",
        f"model.seq_length={o.seq_length}",
        f"moe.num_experts={o.num_experts}",
        f"moe.top_k={o.top_k}",
        f"moe.ffn_hidden_size={o.ffn_hidden_size}",
        f"moe.capacity_factor={'none' if capacity_factor is None else capacity_factor}",
        f"moe.drop_policy={o.drop_policy}",
        f"moe.z_loss_coeff={o.z_loss_coeff}",
        f"optimizer.lr={o.lr}",
        f"optimizer.min_lr={o.lr / 10}",
        f"schedule.warmup_steps={max(1, min(15, o.steps // 10))}",
        f"data.micro_batch_size={o.micro_batch_size}",
        f"checkpoint.dir={checkpoints / run_id}",
    ]
    return load_config(STUDY_CONFIG, overrides)


def prepare_workdir(workdir: Path) -> None:
    if workdir.exists() and (not workdir.is_dir() or any(workdir.iterdir())):
        raise StudyError(f"--workdir {workdir} is not an empty folder: the study needs a fresh one")
    workdir.mkdir(parents=True, exist_ok=True)


class _Events:
    """The study's own events: one source per stream, signed by the study's producer key."""

    def __init__(self, sink: Any, study_id: str) -> None:
        self.sink = sink
        self.study_id = study_id
        self.seq: dict[str, int] = {}

    def emit(self, payload: Any, *, stream: str, run_id: str | None = None, step: int | None = None) -> None:
        from runledger.schemas import make_event

        source = f"study/{self.study_id}" if run_id is None else f"study/{self.study_id}/{run_id}"
        seq = self.seq.get(source, 0)
        self.seq[source] = seq + 1
        self.sink.emit(make_event(payload, source=source, stream=stream, seq=seq, run_id=run_id, step=step))

    def note(
        self,
        text: str,
        tags: Sequence[str],
        *,
        stream: str,
        run_id: str | None = None,
        step: int | None = None,
    ) -> None:
        from runledger.schemas.payloads import Annotation

        self.emit(
            Annotation(author=AUTHOR, text=text[:1000], tags=[TAG, *tags]),
            stream=stream,
            run_id=run_id,
            step=step,
        )


def run_study(options: StudyOptions, say: Say = lambda _: None) -> StudyResult:
    """The whole study in ``options.workdir`` (a new or empty folder)."""
    from runledger.ingest.bus import open_sink
    from runledger.ingest.spool_ingester import ingest_spool
    from runledger.ledger.admission import register_producer
    from runledger.ledger.integrity import checkpoint_path, sign_checkpoints
    from runledger.ledger.log_checkpoint import write_keypair
    from runledger.ledger.store import Ledger
    from runledger.schemas.payloads import ProducerScope, RunSummary
    from runledger.schemas.signing import Sealer
    from runledger.trainer.loop import train

    options.validate()
    workdir = options.workdir
    prepare_workdir(workdir)
    durations: dict[str, float] = {}
    started = time.perf_counter()
    study_id = f"token-drop-study-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    stream = study_id
    ledger_dir, spool = workdir / "ledger", workdir / "spool"
    producer_key, producer_pub = write_keypair(workdir / "keys", "study-producer")
    log_key, _ = write_keypair(workdir / "keys", "study-log")
    ledger = Ledger.create(ledger_dir)
    register_producer(
        ledger, "study-producer", producer_pub.read_text(), ProducerScope(sources=["trainer/", "study/"])
    )
    sink = open_sink(spool, None, sealer=Sealer(producer_key.read_text()))
    events = _Events(sink, study_id)
    policies = study_policies(options)

    # 1. Pre-registration: predictions and claims, ingested and signed before any training.
    say(f"study {study_id}: predicting {len(policies)} policies (balanced-router Monte Carlo)")
    predictions = make_predictions(options, policies)
    events.note(_design_text(options), ["design"], stream=stream)
    for pred in predictions:
        events.note(
            f"prediction {pred.policy}: {pred.point:.4%} (range {pred.low:.4%}..{pred.high:.4%}). {pred.reasoning}",
            ["prediction", f"policy:{pred.kind}"],
            stream=stream,
        )
    for i, text in enumerate(claims(options)):
        events.note(f"claim {i + 1}: {text}", ["prediction", "claim"], stream=stream)
    sink.sync()
    ingest_spool(ledger, spool)
    sign_checkpoints(ledger_dir, log_key.read_text().strip())
    signed = checkpoint_path(ledger_dir, stream)
    prereg = workdir / "preregistration.txt"
    prereg.write_text(signed.read_text())
    prereg_sha = hashlib.sha256(prereg.read_bytes()).hexdigest()
    prereg_size = Ledger.open(ledger_dir).stream_heads()[stream].size
    durations["preregistration"] = time.perf_counter() - started
    say(f"pre-registered: {prereg_size} events signed at {prereg} (sha256 {prereg_sha[:16]}…)")

    # 2. The runs. Their ids embed the checkpoint's hash: each training event names it.
    tag = prereg_sha[:16]
    plan = [
        (f"tds-{tag}-dropless", None),
        (f"tds-{tag}-cf{options.trained_capacity_factor:g}", options.trained_capacity_factor),
    ]
    collectors: dict[str, DropCollector] = {}
    try:
        for run_id, cf in plan:
            collector = DropCollector(options, policies)
            cfg = train_config(options, run_id, cf, workdir / "checkpoints")
            t0 = time.perf_counter()

            def progress(report: Any, c: DropCollector = collector, rid: str = run_id) -> None:
                c.on_step(report)
                if report.step % max(1, options.steps // 10) == 0 or report.step == options.steps:
                    say(
                        f"{rid}: step {report.step}/{options.steps} loss {report.loss:.3f} ({report.step_time_s:.1f} s/step)"
                    )

            result = train(cfg, sink, progress=progress, on_model=collector.install, handle_signals=False)
            durations[run_id] = time.perf_counter() - t0
            if result.status != "completed":
                why = result.crash.message if result.crash else result.status
                raise StudyError(
                    f"run {run_id} did not complete: {why} (its events are in {spool}; fold them with "
                    f"`ledger ingest spool --spool {spool} --ledger {ledger_dir}`)"
                )
            collectors[run_id] = collector
    finally:
        sink.sync()
    run_ids = [r for r, _ in plan]

    # 3. Results, scores, events, a second checkpoint.
    summaries = [summarise(r, p, s) for r, c in collectors.items() for p, s in c.series.items()]
    scores, graded = score(options, predictions, collectors, run_ids[0], run_ids[1])
    for run_id in run_ids:
        mine = [s for s in summaries if s.run == run_id]
        events.emit(
            RunSummary(
                values={"token_drop_study": {"study": study_id, "results": [asdict(s) for s in mine]}}
            ),
            stream=run_id,
            run_id=run_id,
            step=options.steps,
        )
        for s in mine:
            if s.kind in ("trainer", "dropless") or s.capacity_factor == REFERENCE_POOLED_WAVE_CF:
                events.note(
                    _result_text(s),
                    ["result", f"policy:{s.kind}"],
                    stream=run_id,
                    run_id=run_id,
                    step=options.steps,
                )
    for s in summaries:
        if s.run == run_ids[0]:
            events.note(_result_text(s), ["result", f"policy:{s.kind}"], stream=stream)
    for i, sc in enumerate(scores):
        events.note(
            f"claim {i + 1} {'HOLDS' if sc.holds else 'FAILS'}: {sc.claim} ({sc.detail})",
            ["score"],
            stream=stream,
        )
    ref = next(
        (
            s
            for s in summaries
            if s.run == run_ids[0] and s.policy == pooled_wave_policy(options, REFERENCE_POOLED_WAVE_CF).label
        ),
        None,
    )
    if ref is not None:
        events.note(
            f"versus the reference: pooled-wave cf 1.15, {options.waves} waves, {ref.shards} shards "
            f"({ref.senders} sender(s)) {ref.mean:.3%} "
            f"here vs {REFERENCE_POOLED_WAVE_RATE:.2%} there; ragged/dropless 0 here vs "
            f"{REFERENCE_RAGGED_RATE:.3%} there",
            ["score", "reference"],
            stream=stream,
        )
    sink.close()
    ingest_spool(ledger, spool)
    sign_checkpoints(ledger_dir, log_key.read_text().strip())
    durations["total"] = time.perf_counter() - started

    figure = workdir / "token_drop_study.png"
    plot_study(options, collectors, run_ids[0], figure)
    report_path: Path | None = workdir / "report.html"
    try:
        from runledger.ledger.report import write_report

        write_report(ledger_dir, run_ids, report_path)  # type: ignore[arg-type]
    except Exception as exc:  # the report is a view; the study's record is already complete
        say(f"report not written: {exc}")
        report_path = None
    trained = collectors[run_ids[1]]
    cross = sum(len(x) for x in trained.series[Policy("trainer")])
    result = StudyResult(
        study_id=study_id,
        workdir=workdir,
        ledger=ledger_dir,
        run_ids=run_ids,
        preregistration=prereg,
        prereg_size=prereg_size,
        prereg_sha256=prereg_sha,
        predictions=predictions,
        summaries=summaries,
        scores=scores,
        graded=graded,
        figure=figure,
        report=report_path,
        results_json=workdir / "results.json",
        durations_s=durations,
        cross_check_layer_steps=cross,
    )
    _write_json(result, options, collectors)
    return result


def _design_text(o: StudyOptions) -> str:
    return (
        f"design: Megatron-Core MoE GPT, {o.num_layers} layers, hidden {o.hidden_size}, {o.num_attention_heads} heads, "
        f"{o.num_experts} experts top-{o.top_k} (expert FFN {o.ffn_hidden_size}), context {o.seq_length}, "
        f"{o.micro_batch_size} sequence(s) per micro-batch, {o.steps} steps, seed {o.seed}; runs: dropless and "
        f"Megatron capacity cf {o.trained_capacity_factor:g} ({o.drop_policy}); sweep cf {list(o.capacity_factors)}; "
        f"pooled-wave (senders, shards) {list(o.pooled_wave)} (a micro-batch's tokens split into contiguous "
        "sender slices, experts into destination shards), "
        f"{o.waves} waves; router: aux loss logged not trained, expert bias rate {o.expert_bias_rate:g}, "
        f"z-loss coeff {o.z_loss_coeff:g}"
    )


def _result_text(s: Summary) -> str:
    return (
        f"result {s.policy}: mean {s.mean:.4%}, p50 {s.p50:.4%}, max {s.max:.4%}, last half mean "
        f"{s.mean_last_half:.4%} over {s.samples} layer-steps of {s.run}"
    )


def _write_json(result: StudyResult, options: StudyOptions, collectors: dict[str, DropCollector]) -> None:
    data = {
        "study_id": result.study_id,
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(options).items()},
        "runs": result.run_ids,
        "preregistration": {
            "path": str(result.preregistration),
            "sha256": result.prereg_sha256,
            "size": result.prereg_size,
        },
        "predictions": [asdict(p) for p in result.predictions],
        "summaries": [asdict(s) for s in result.summaries],
        "scores": [asdict(s) for s in result.scores],
        "graded": result.graded,
        "durations_s": result.durations_s,
        "accounting_s": {r: c.accounting_s for r, c in collectors.items()},
    }
    result.results_json.write_text(json.dumps(data, indent=1))


def plot_study(
    options: StudyOptions, collectors: dict[str, DropCollector], control_run: str, path: Path
) -> Path:
    """Drop rate vs capacity factor per policy (control run), and over training steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    control = collectors[control_run]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    cfs = sorted(options.capacity_factors)
    lines: list[tuple[Any, str]] = [("megatron", "Megatron per-micro-batch capacity")] + [
        (st, f"pooled-wave, {st[1]} shards, {st[0]} sender(s), {options.waves} waves")
        for st in options.pooled_wave
    ]
    for setup, name in lines:
        policies = [
            Policy("megatron", c) if setup == "megatron" else pooled_wave_policy(options, c, setup)
            for c in cfs
        ]
        ys = [100 * summarise(control_run, p, control.series[p]).mean for p in policies]
        left.plot(cfs, ys, marker="o", label=name)
    left.axhline(0, color="grey", lw=0.8, label="dropless / ragged (0)")
    left.scatter(
        [REFERENCE_POOLED_WAVE_CF],
        [100 * REFERENCE_POOLED_WAVE_RATE],
        marker="*",
        s=150,
        color="black",
        zorder=5,
        label="reference: pooled-wave cf 1.15, 3 waves",
    )
    left.set_xlabel("capacity factor")
    left.set_ylabel("dropped assignments (% of tokens × k)")
    left.set_title("drop rate vs capacity factor (dropless run's router)")
    left.legend(fontsize=7)
    cf = REFERENCE_POOLED_WAVE_CF if REFERENCE_POOLED_WAVE_CF in options.capacity_factors else cfs[0]
    for run_id, c in collectors.items():
        suffix = run_id.rsplit("-", 1)[-1]
        for policy in (Policy("megatron", cf), pooled_wave_policy(options, cf)):
            ys = [100 * statistics.fmean(step) for step in c.series[policy]]
            right.plot(c.steps, ys, label=f"{suffix}: {policy.label}")
        if run_id != control_run:
            ys = [100 * statistics.fmean(step) for step in c.series[Policy("trainer")]]
            right.plot(c.steps, ys, ls="--", color="black", label=f"{suffix}: trainer measured")
    right.set_xlabel("step")
    right.set_ylabel("mean over layers (%)")
    right.set_title(f"over training steps (cf {cf:g})")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
