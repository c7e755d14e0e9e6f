"""The token-drop study end to end (``--quick``: tiny model, 512-token context, 6 steps per run):
pre-registration provably before training, the accounting cross-checked against the trainer's own
measured drops, results and scores in the ledger, the CLI's output, the report, bad input."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ledger.integrity import prove_consistency, verify_ledger
from runledger.ledger.log_checkpoint import parse_and_verify_checkpoint
from runledger.ledger.log_key import recorded_log_key
from runledger.ledger.query import Reader
from runledger.ledger.store import Ledger
from runledger.ledger.stream_checkpoints import checkpoint_path
from runledger.ledger.verifier import verify_consistency
from runledger.workflows import study
from runledger.workflows.study import Policy, StudyError, StudyOptions


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> study.StudyResult:
    work = tmp_path_factory.mktemp("study") / "work"
    return study.run_study(StudyOptions.quick(work))


def checkpoint_path_parts(ledger: Ledger, stream: str) -> tuple[str, ...]:
    return checkpoint_path(ledger.root, stream).relative_to(ledger.root / "_checkpoints").parts


def _log_key(result: study.StudyResult) -> str:
    # The log key lives with the ledger, and its lake records it as the ledger's.
    vkey = (result.ledger / ".keys" / "study-log.pub").read_text().strip()
    with Ledger.open(result.ledger) as ledger:
        assert recorded_log_key(ledger) == vkey
    return vkey


def test_predictions_are_signed_before_any_training(result: study.StudyResult) -> None:
    ledger = Ledger.open(result.ledger)
    stream = result.study_id
    prereg = result.preregistration.read_text()
    checkpoint = parse_and_verify_checkpoint(prereg, _log_key(result))
    assert checkpoint.size == result.prereg_size
    # The signed root is the study stream's tree over exactly its first `size` events, and the final
    # tree (results appended after) extends it: an RFC 9162 consistency proof checks.
    final = parse_and_verify_checkpoint(
        (result.ledger / "_checkpoints").joinpath(*checkpoint_path_parts(ledger, stream)).read_text(),
        _log_key(result),
    )
    assert final.size > checkpoint.size
    proof = prove_consistency(result.ledger, stream, checkpoint.size, final.size)
    assert base64.b64decode(proof["first_root"]) == checkpoint.root
    assert base64.b64decode(proof["second_root"]) == final.root
    verify_consistency(
        checkpoint.size,
        final.size,
        checkpoint.root,
        final.root,
        [base64.b64decode(h) for h in proof["consistency"]],
    )
    reader = Reader(result.ledger)
    rows = reader.sql(
        f"SELECT stream_seq, tags, text FROM annotations WHERE stream = '{stream}' ORDER BY stream_seq"
    ).rows
    before = [r for r in rows if r[0] < checkpoint.size]
    after = [r for r in rows if r[0] >= checkpoint.size]
    assert len(before) == checkpoint.size
    assert all("prediction" in tags or "design" in tags for _, tags, _ in before)
    assert any(text.startswith("prediction pooled-wave cf=1.15") for _, _, text in before)
    assert after and all("prediction" not in tags for _, tags, _ in after)
    # Every training event names its run, and every run id commits to the signed checkpoint.
    digest = hashlib.sha256(result.preregistration.read_bytes()).hexdigest()
    assert digest == result.prereg_sha256
    assert all(digest[:16] in run_id for run_id in result.run_ids)
    history = sorted((result.ledger / "_checkpoints").rglob(f"{checkpoint.size:012d}.txt"))
    assert any(h.read_text() == prereg for h in history)  # kept beside the later checkpoint


def test_the_trainers_measured_drop_equals_the_counterfactual(result: study.StudyResult) -> None:
    """The run trained with Megatron's capacity at cf 1.15: its telemetry (in the ledger) and the
    study's counterfactual count agree on every layer and step, and the drops are not all zero."""
    data = json.loads(result.results_json.read_text())
    cross = next(s for s in data["scores"] if "measures (trainer telemetry)" in s["claim"])
    assert cross["holds"], cross
    trained = result.run_ids[1]
    rows = (
        Reader(result.ledger)
        .sql(
            f"SELECT step, layer, dropped, tokens, token_drop_rate FROM moe_layer_stats "
            f"WHERE run_id = '{trained}' ORDER BY step, layer"
        )
        .rows
    )
    assert len(rows) == 6 * 2 and sum(r[2] for r in rows) > 0
    summary = next(s for s in result.summaries if s.run == trained and s.kind == "trainer")
    counterfactual = next(s for s in result.summaries if s.run == trained and s.policy == "megatron cf=1.15")
    assert summary.mean == pytest.approx(counterfactual.mean, abs=0)
    assert summary.mean == pytest.approx(sum(r[4] for r in rows) / len(rows))
    # The dropless control: the trainer measured nothing dropped.
    control = (
        Reader(result.ledger)
        .sql(f"SELECT sum(dropped) FROM moe_layer_stats WHERE run_id = '{result.run_ids[0]}'")
        .rows
    )
    assert control == [(0,)]


def test_results_scores_and_summaries_are_events(result: study.StudyResult) -> None:
    reader = Reader(result.ledger)
    tags = [
        t
        for (t,) in reader.sql(
            "SELECT unnest(tags) FROM annotations WHERE 'token-drop-study' = ANY(tags)"
        ).rows
    ]
    assert tags.count("score") >= len(result.scores)
    assert tags.count("result") >= len(study.study_policies(StudyOptions.quick(Path("x")))) + 1
    summaries = reader.sql('SELECT run_id, "values" FROM summaries ORDER BY run_id').rows
    assert sorted(r for r, _ in summaries) == sorted(result.run_ids)
    values = json.loads(summaries[0][1])["token_drop_study"]
    assert values["study"] == result.study_id and values["results"]
    # Both runs are normal recorded runs: launch, metrics, router stats, a clean finish.
    for run_id in result.run_ids:
        kinds = {k for (k,) in reader.sql(f"SELECT DISTINCT type FROM events WHERE run_id = '{run_id}'").rows}
        assert {"runledger.run.started", "runledger.step.metrics", "runledger.moe.router_stats"} <= kinds
    report = verify_ledger(result.ledger, _log_key(result))
    assert report.ok, [p.line() for p in report.problems]


def test_figure_report_and_predictions(result: study.StudyResult) -> None:
    assert result.figure is not None and result.figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result.report is not None
    html = result.report.read_text()
    assert all(run_id in html for run_id in result.run_ids)
    dropless = next(p for p in result.predictions if p.kind == "dropless")
    assert (dropless.point, dropless.high) == (0.0, 0.0)
    balanced = study.balanced_rates(
        StudyOptions.quick(Path("x")), [Policy("megatron", 1.0), Policy("megatron", 100.0)]
    )
    assert balanced[Policy("megatron", 1.0)] > 0 and balanced[Policy("megatron", 100.0)] == 0


def test_cli_quick_study(tmp_path: Path) -> None:
    work = tmp_path / "cli"
    out = CliRunner().invoke(app, ["study", "token-drop", "--quick", "--workdir", str(work), "--steps", "3"])
    assert out.exit_code == 0, out.output
    text = out.output
    assert "token-drop rate (dropped ÷ tokens·k)" in text
    for policy in (
        "dropless",
        "megatron cf=1.15",
        "pooled-wave cf=1.15 senders=1 shards=16 waves=3",
        "trainer",
    ):
        assert policy in text
    assert "pre-registered claims" in text
    data = json.loads((work / "results.json").read_text())
    # The table shows the results file's numbers.
    dropless_run = data["runs"][0]
    mean = next(
        s["mean"] for s in data["summaries"] if s["run"] == dropless_run and s["policy"] == "megatron cf=1"
    )
    assert f"{100 * mean:.3f}%" in text
    assert f"pre-registered: {data['preregistration']['size']} events signed before training" in text
    assert f"ledger verify --ledger {work / 'ledger'}" in text
    # The hint's command as printed: the log key is found in the ledger's own key folder.
    verify = CliRunner().invoke(app, ["verify", "--ledger", str(work / "ledger")])
    assert verify.exit_code == 0, verify.output


def test_bad_input_is_one_line_and_loses_nothing(tmp_path: Path) -> None:
    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine")
    runner = CliRunner()
    out = runner.invoke(app, ["study", "token-drop", "--quick", "--workdir", str(used)])
    assert out.exit_code == 2
    assert out.output.strip().splitlines() == [
        f"error: --workdir {used} is not an empty folder: the study needs a fresh one"
    ]
    assert (used / "notes.txt").read_text() == "mine" and len(list(used.iterdir())) == 1
    for args, message in [
        (["--capacity-factors", "1.0,abc"], "--capacity-factors '1.0,abc': give numbers separated by commas"),
        (["--pooled-wave", "64"], "--pooled-wave '64': give SENDERSxSHARDS pairs"),
        (["--pooled-wave", "1x5"], "5 shards must divide the experts (16)"),
        (["--pooled-wave", "7x4"], "7 senders must divide the tokens of a micro-batch (512)"),
        (["--top-k", "40"], "top_k 40 must be between 1 and num_experts 16"),
        (["--capacity-factors", "0,1"], "capacity factors must be positive"),
    ]:
        fresh = tmp_path / f"w{abs(hash(message))}"
        out = runner.invoke(app, ["study", "token-drop", "--quick", "--workdir", str(fresh), *args])
        assert out.exit_code == 2, (args, out.output)
        lines = out.output.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], (args, out.output)
        assert not fresh.exists()  # refused before anything was written
    with pytest.raises(StudyError):
        StudyOptions.quick(tmp_path, waves=0).validate()


# --- bench/gpu_check.py: its code path on CPU ---------------------------------------------------------


def test_gpu_check_dry_run_trains_the_path_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import gpu_check

    assert gpu_check.main(["--dry-run", "--steps", "6", "--block", "3", "--warmup", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("gpu_check on cpu (dry run): tiny dry-run shape, 1 warm-up + 6 steps")
    assert lines[1].startswith("expert module: SequentialMLP (moe.grouped_gemm = false: ")
    assert lines[2].split() == ["telemetry", "on", "telemetry", "off", "on", "vs", "off"]
    assert lines[3].startswith("   step time") and lines[4].startswith("   tokens/s")
    assert lines[-1].startswith(
        "token-drop rate at capacity factor 1.15 (trainer-measured, 2 layer-steps): mean "
    )


def test_gpu_check_probe_config_is_valid_and_cuda_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    from bench import gpu_check
    from runledger.trainer.config import load_config

    cfg = load_config(None, [*gpu_check.PROBE, *gpu_check.COMMON])
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.moe.num_experts, cfg.moe.top_k) == (
        8,
        1024,
        64,
        8,
    )
    assert (cfg.model.seq_length, cfg.model.precision, cfg.moe.dispatcher) == (4096, "bf16", "alltoall")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the no-CUDA refusal cannot be seen here")
    assert gpu_check.main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gpu_check: CUDA is not available")


def test_gpu_check_sets_the_grouped_gemm_config_key() -> None:
    """The check decides grouped GEMM through the trainer's key ``moe.grouped_gemm``, never behind
    the trainer's back; on CPU (--dry-run) it is false and the report says why."""
    from bench import gpu_check
    from runledger.trainer.config import load_config

    args = gpu_check.parse_args(["--dry-run"])
    off = load_config(None, gpu_check.overrides(args, Path("/tmp"), None))
    assert off.moe.grouped_gemm is False and off.model.spec == "local"
    on = load_config(None, gpu_check.overrides(args, Path("/tmp"), "TEGroupedMLP"))
    assert on.moe.grouped_gemm is True and on.model.spec == "transformer_engine"
    module, why_not = gpu_check.grouped_gemm_support(dry_run=True)
    assert module is None and why_not
    assert not hasattr(gpu_check, "grouped_gemm_build")  # no private switch left


def test_the_expert_bias_steers_routing_and_is_updated(tmp_path: Path) -> None:
    """The study's balance method really acts: a large bias on one expert sends every token there
    (Megatron ignores the bias with softmax scores, hence sigmoid), and the step's update lowers it."""
    from runledger.trainer.loop import train
    from tests.support.sinks import ListSink

    options = StudyOptions.quick(tmp_path, steps=2)
    collector = study.DropCollector(options, [Policy("dropless")])
    reports = []

    def on_model(model: object) -> None:
        collector.install(model)  # type: ignore[arg-type]
        for router in collector.routers:
            router.expert_bias[3] = 10.0

    def progress(report: object) -> None:
        reports.append(report)
        collector.on_step(report)

    cfg = study.train_config(options, "bias-check", None, tmp_path / "ck")
    result = train(cfg, ListSink(), on_model=on_model, progress=progress, handle_signals=False)
    assert result.status == "completed"
    assert all(layer.expert_counts[3] == layer.tokens for layer in reports[0].layers)
    assert all(
        float(router.expert_bias[3]) == pytest.approx(10.0 - 2 * options.expert_bias_rate)
        for router in collector.routers
    )
