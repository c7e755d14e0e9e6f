"""The token-drop study: reproduce the reference run's 4K-context drop test on small experts.

One call (``run_study``) does, in order, all into one ledger in the study's work folder:

1. **Pre-registration.** Predictions for every (policy, capacity factor) from a balanced-router
   Monte Carlo with the study's exact shapes, plus stated claims, are written as annotation events on
   the study's own stream, ingested, and a log checkpoint is signed. Every training run's id embeds
   the SHA-256 of that signed checkpoint, so each training event (all of them carry the run id,
   signed by the producer key) provably came after it.
2. **Runs.** Small Megatron-Core MoE GPTs train through ``trainer.loop.train`` (normal
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

The modules: ``study_options`` (options, the reference figures), ``study_policies`` (accounting rules,
counts, statistics), ``study_collect`` (router hooks, per-step counts, expert bias),
``study_predictions`` (predictions, claims, scoring), ``study_output`` (``StudyResult``,
``results.json``, figure); this one runs the study.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from trainer.study_collect import DropCollector
from trainer.study_options import (
    REFERENCE_POOLED_WAVE_CF,
    REFERENCE_POOLED_WAVE_RATE,
    REFERENCE_RAGGED_RATE,
    REFERENCE_WAVES,
    StudyError,
    StudyOptions,
)
from trainer.study_output import StudyResult, plot_study, write_results_json
from trainer.study_policies import (
    Policy,
    Summary,
    count_drops,
    pooled_wave_policy,
    study_policies,
    summarise,
)
from trainer.study_predictions import (
    Prediction,
    Score,
    balanced_rates,
    claims,
    make_predictions,
    score,
)

# The public names of the study, importable from here as before the split.
__all__ = [
    "AUTHOR",
    "REFERENCE_POOLED_WAVE_CF",
    "REFERENCE_POOLED_WAVE_RATE",
    "REFERENCE_RAGGED_RATE",
    "REFERENCE_WAVES",
    "STUDY_CONFIG",
    "TAG",
    "DropCollector",
    "Policy",
    "Prediction",
    "Say",
    "Score",
    "StudyError",
    "StudyOptions",
    "StudyResult",
    "Summary",
    "balanced_rates",
    "claims",
    "count_drops",
    "make_predictions",
    "plot_study",
    "pooled_wave_policy",
    "prepare_workdir",
    "run_study",
    "score",
    "study_policies",
    "summarise",
    "train_config",
]

AUTHOR = "ledger study token-drop"
TAG = "token-drop-study"


Say = Callable[[str], None]


STUDY_CONFIG = Path(__file__).parent / "configs" / "study_token_drop.toml"


def train_config(options: StudyOptions, run_id: str, capacity_factor: float | None, checkpoints: Path):
    """The TrainConfig of one study run (a normal recorded run): ``configs/study_token_drop.toml``
    with the study's options over it."""
    from trainer.config import load_config

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
        from schemas import make_event

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
        from schemas.payloads import Annotation

        self.emit(
            Annotation(author=AUTHOR, text=text[:1000], tags=[TAG, *tags]),
            stream=stream,
            run_id=run_id,
            step=step,
        )


def run_study(options: StudyOptions, say: Say = lambda _: None) -> StudyResult:
    """The whole study in ``options.workdir`` (a new or empty folder)."""
    from ingest.bus import open_sink
    from ingest.spool_ingester import ingest_spool
    from ledger.admission import register_producer
    from ledger.integrity import checkpoint_path, sign_checkpoints
    from ledger.log_checkpoint import write_keypair
    from ledger.store import Ledger
    from schemas.payloads import ProducerScope, RunSummary
    from schemas.signing import Sealer
    from trainer.loop import train

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

    # 4. The figure, the HTML report and results.json.
    figure = workdir / "token_drop_study.png"
    plot_study(options, collectors, run_ids[0], figure)
    report_path: Path | None = workdir / "report.html"
    try:
        from ledger.report import write_report

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
    write_results_json(result, options, collectors)
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
