"""``run_study``: the token-drop study's pipeline, one named step per phase (the package's docstring
says what each does): ``_open_study``, ``_preregister``, ``_train_runs``, ``_record_results``,
``_write_outputs``; the study's own events go through ``StudyEvents``."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runledger.trainer.config import CONFIG_DIR
from runledger.workflows.study.collect import DropCollector
from runledger.workflows.study.options import (
    REFERENCE_POOLED_WAVE_CF,
    REFERENCE_POOLED_WAVE_RATE,
    REFERENCE_RAGGED_RATE,
    StudyError,
    StudyOptions,
)
from runledger.workflows.study.output import StudyResult, plot_study, write_results_json
from runledger.workflows.study.policies import Policy, Summary, pooled_wave_policy, study_policies, summarise
from runledger.workflows.study.predictions import Prediction, Score, claims, make_predictions, score

if TYPE_CHECKING:
    from runledger.ingest.bus import EventSink
    from runledger.ledger.store import Ledger
    from runledger.trainer.config import TrainConfig
    from runledger.trainer.telemetry import StepReport

AUTHOR = "ledger study token-drop"
TAG = "token-drop-study"
STUDY_CONFIG = CONFIG_DIR / "study_token_drop.toml"

Say = Callable[[str], None]


def _silent(line: str) -> None:
    pass


def train_config(
    options: StudyOptions, run_id: str, capacity_factor: float | None, checkpoints: Path
) -> TrainConfig:
    """The TrainConfig of one study run (a normal recorded run): ``trainer/configs/study_token_drop.toml``
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


class StudyEvents:
    """The study's own events: one source per stream, signed by the study's producer key."""

    def __init__(self, sink: EventSink, study_id: str) -> None:
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


# --- the study under way -----------------------------------------------------------------------


@dataclass
class _Study:
    """One study under way: its id (also its stream), folders, ledger, sink, events and timings."""

    options: StudyOptions
    study_id: str
    ledger: Ledger
    sink: EventSink
    events: StudyEvents
    log_key: Path  # signs the ledger's checkpoints
    policies: list[Policy]
    started: float
    durations: dict[str, float] = field(default_factory=dict)

    @property
    def workdir(self) -> Path:
        return self.options.workdir

    @property
    def ledger_dir(self) -> Path:
        return self.workdir / "ledger"

    @property
    def spool(self) -> Path:
        return self.workdir / "spool"

    @property
    def stream(self) -> str:
        return self.study_id

    def fold_and_sign(self) -> None:
        """What the spool holds into the ledger, then every stream's checkpoint signed."""
        from runledger.ingest.spool_ingester import ingest_spool
        from runledger.ledger.stream_checkpoints import sign_checkpoints

        ingest_spool(self.ledger, self.spool)
        sign_checkpoints(self.ledger_dir, self.log_key.read_text().strip())


@dataclass
class _Preregistration:
    """The signed checkpoint that covers the predictions, and what it covers."""

    path: Path
    sha256: str
    size: int  # the study stream's tree size it signs
    predictions: list[Prediction]


@dataclass
class _Results:
    """Per run and policy, the drop statistics; the claims scored; the predictions graded."""

    summaries: list[Summary]
    scores: list[Score]
    graded: list[dict[str, Any]]


def _open_study(options: StudyOptions) -> _Study:
    """Keys, a fresh ledger that admits the study's producer key, and the sink its events go to."""
    from runledger.ingest.bus import open_sink
    from runledger.ledger.log_key import default_keys, record_log_key
    from runledger.ledger.registry import register_producer
    from runledger.ledger.store import Ledger
    from runledger.schemas.note import write_keypair
    from runledger.schemas.payloads import ProducerScope
    from runledger.schemas.signing import Sealer

    workdir = options.workdir
    started = time.perf_counter()
    study_id = f"token-drop-study-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    producer_key, producer_pub = write_keypair(workdir / "keys", "study-producer")
    ledger = Ledger.create(workdir / "ledger")
    # The log key lives with the ledger (where `ledger checkpoint`/`verify` look) and the lake records it.
    log_key, log_pub = write_keypair(default_keys(ledger.root), "study-log")
    record_log_key(ledger, log_pub.read_text().strip())
    register_producer(
        ledger, "study-producer", producer_pub.read_text(), ProducerScope(sources=["trainer/", "study/"])
    )
    sink = open_sink(workdir / "spool", None, sealer=Sealer(producer_key.read_text()))
    return _Study(
        options=options,
        study_id=study_id,
        ledger=ledger,
        sink=sink,
        events=StudyEvents(sink, study_id),
        log_key=log_key,
        policies=study_policies(options),
        started=started,
    )


def _preregister(study: _Study, say: Say) -> _Preregistration:
    """1. Predictions and claims, ingested and signed before any training."""
    from runledger.ledger.store import Ledger
    from runledger.ledger.stream_checkpoints import checkpoint_path

    options, events, stream = study.options, study.events, study.stream
    say(f"study {study.study_id}: predicting {len(study.policies)} policies (balanced-router Monte Carlo)")
    predictions = make_predictions(options, study.policies)
    events.note(_design_text(options), ["design"], stream=stream)
    for pred in predictions:
        events.note(
            f"prediction {pred.policy}: {pred.point:.4%} (range {pred.low:.4%}..{pred.high:.4%}). {pred.reasoning}",
            ["prediction", f"policy:{pred.kind}"],
            stream=stream,
        )
    for i, text in enumerate(claims(options)):
        events.note(f"claim {i + 1}: {text}", ["prediction", "claim"], stream=stream)
    study.sink.sync()
    study.fold_and_sign()
    prereg = study.workdir / "preregistration.txt"
    prereg.write_text(checkpoint_path(study.ledger_dir, stream).read_text())
    sha = hashlib.sha256(prereg.read_bytes()).hexdigest()
    size = Ledger.open(study.ledger_dir).stream_heads()[stream].size
    study.durations["preregistration"] = time.perf_counter() - study.started
    say(f"pre-registered: {size} events signed at {prereg} (sha256 {sha[:16]}…)")
    return _Preregistration(prereg, sha, size, predictions)


def _train_runs(study: _Study, prereg: _Preregistration, say: Say) -> dict[str, DropCollector]:
    """2. The runs, each with its collector. Their ids embed the checkpoint's hash: each training
    event names it."""
    tag = prereg.sha256[:16]
    cf = study.options.trained_capacity_factor
    plan = [(f"tds-{tag}-dropless", None), (f"tds-{tag}-cf{cf:g}", cf)]
    collectors: dict[str, DropCollector] = {}
    try:
        for run_id, capacity_factor in plan:
            collectors[run_id] = _train_run(study, run_id, capacity_factor, say)
    finally:
        study.sink.sync()
    return collectors


def _train_run(study: _Study, run_id: str, capacity_factor: float | None, say: Say) -> DropCollector:
    """One recorded run through the trainer, its routers' selections counted by a ``DropCollector``."""
    from runledger.trainer.loop import train

    options = study.options
    collector = DropCollector(options, study.policies)
    cfg = train_config(options, run_id, capacity_factor, study.workdir / "checkpoints")
    t0 = time.perf_counter()

    def progress(report: StepReport) -> None:
        collector.on_step(report)
        if report.step % max(1, options.steps // 10) == 0 or report.step == options.steps:
            say(
                f"{run_id}: step {report.step}/{options.steps} loss {report.loss:.3f} ({report.step_time_s:.1f} s/step)"
            )

    result = train(cfg, study.sink, progress=progress, on_model=collector.install, handle_signals=False)
    study.durations[run_id] = time.perf_counter() - t0
    if result.status != "completed":
        why = result.crash.message if result.crash else result.status
        raise StudyError(
            f"run {run_id} did not complete: {why} (its events are in {study.spool}; fold them with "
            f"`ledger ingest spool --spool {study.spool} --ledger {study.ledger_dir}`)"
        )
    return collector


def _record_results(
    study: _Study, prereg: _Preregistration, collectors: dict[str, DropCollector]
) -> _Results:
    """3. Results and scores as events (a run summary and result notes per run, the control's results,
    the scores and the comparison with the reference on the study stream), then folded and signed: the
    second checkpoint."""
    from runledger.schemas.payloads import RunSummary

    options, events = study.options, study.events
    run_ids = list(collectors)
    summaries = [summarise(r, p, s) for r, c in collectors.items() for p, s in c.series.items()]
    scores, graded = score(options, prereg.predictions, collectors, run_ids[0], run_ids[1])
    for run_id in run_ids:
        mine = [s for s in summaries if s.run == run_id]
        values = {"token_drop_study": {"study": study.study_id, "results": [asdict(s) for s in mine]}}
        events.emit(RunSummary(values=values), stream=run_id, run_id=run_id, step=options.steps)
        for s in mine:
            if s.kind in ("trainer", "dropless") or s.capacity_factor == REFERENCE_POOLED_WAVE_CF:
                tags = ["result", f"policy:{s.kind}"]
                events.note(_result_text(s), tags, stream=run_id, run_id=run_id, step=options.steps)
    for s in summaries:
        if s.run == run_ids[0]:
            events.note(_result_text(s), ["result", f"policy:{s.kind}"], stream=study.stream)
    for i, sc in enumerate(scores):
        events.note(
            f"claim {i + 1} {'HOLDS' if sc.holds else 'FAILS'}: {sc.claim} ({sc.detail})",
            ["score"],
            stream=study.stream,
        )
    headline = pooled_wave_policy(options, REFERENCE_POOLED_WAVE_CF).label
    ref = next((s for s in summaries if s.run == run_ids[0] and s.policy == headline), None)
    if ref is not None:
        events.note(_reference_text(options, ref), ["score", "reference"], stream=study.stream)
    study.sink.close()
    study.fold_and_sign()
    return _Results(summaries, scores, graded)


def _write_outputs(
    study: _Study,
    prereg: _Preregistration,
    collectors: dict[str, DropCollector],
    results: _Results,
    say: Say,
) -> StudyResult:
    """4. The figure, the HTML report (a view: a failure is said, not raised) and ``results.json``."""
    workdir, run_ids = study.workdir, list(collectors)
    figure = workdir / "token_drop_study.png"
    plot_study(study.options, collectors, run_ids[0], figure)
    report_path: Path | None = workdir / "report.html"
    try:
        from runledger.ledger.report import write_report

        write_report(study.ledger_dir, run_ids, workdir / "report.html")
    except Exception as exc:  # the report is a view; the study's record is already complete
        say(f"report not written: {exc}")
        report_path = None
    trained = collectors[run_ids[1]]
    result = StudyResult(
        study_id=study.study_id,
        workdir=workdir,
        ledger=study.ledger_dir,
        run_ids=run_ids,
        preregistration=prereg.path,
        prereg_size=prereg.size,
        prereg_sha256=prereg.sha256,
        predictions=prereg.predictions,
        summaries=results.summaries,
        scores=results.scores,
        graded=results.graded,
        figure=figure,
        report=report_path,
        results_json=workdir / "results.json",
        durations_s=study.durations,
        cross_check_layer_steps=sum(len(x) for x in trained.series[Policy("trainer")]),
    )
    write_results_json(result, study.options, collectors)
    return result


def run_study(options: StudyOptions, say: Say = _silent) -> StudyResult:
    """The whole study in ``options.workdir`` (a new or empty folder); ``say`` hears its progress."""
    options.validate()
    prepare_workdir(options.workdir)
    study = _open_study(options)
    prereg = _preregister(study, say)
    collectors = _train_runs(study, prereg, say)
    results = _record_results(study, prereg, collectors)
    study.durations["total"] = time.perf_counter() - study.started
    return _write_outputs(study, prereg, collectors, results, say)


# --- the texts of the study's notes -------------------------------------------------------------


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


def _reference_text(o: StudyOptions, ref: Summary) -> str:
    return (
        f"versus the reference: pooled-wave cf 1.15, {o.waves} waves, {ref.shards} shards "
        f"({ref.senders} sender(s)) {ref.mean:.3%} "
        f"here vs {REFERENCE_POOLED_WAVE_RATE:.2%} there; ragged/dropless 0 here vs "
        f"{REFERENCE_RAGGED_RATE:.3%} there"
    )
