"""GPU check: the trainer's GPU paths at the probe shape, on one CUDA device (one H200 is typical).

Trains the Megatron-Core MoE GPT at the probe shape (8 layers, hidden 1024, 64 experts top-8,
sequence 4096, bf16) for ~60 steps with the alltoall token dispatcher and, where the installed
Megatron-Core can build it, grouped GEMM experts; telemetry is switched on and off live (a config
edit) in alternating blocks of the same run. Prints tokens/s, MFU, step time per mode (telemetry
overhead beside its baseline), peak device memory and the token-drop rates the trainer measured.

    python -m bench.gpu_check                 # on a CUDA machine (~5 min on an H200, mostly start-up)
    python -m bench.gpu_check --dry-run       # on CPU: the same code path at a tiny shape

Grouped GEMM in Megatron-Core 0.16.1 (``megatron.core.transformer.moe.experts``): ``TEGroupedMLP``
needs Transformer Engine ≥ 1.7 and the Transformer Engine layer spec; the legacy ``GroupedMLP``
needs the ``grouped_gemm`` package (``pip install git+https://github.com/fanshiqing/grouped_gemm``).
The trainer's config key ``moe.grouped_gemm`` switches them on; this check sets it true where the
install can build them (with ``model.spec = "transformer_engine"`` when Transformer Engine is there),
else false and says why, and reports which expert module ran. ``--dry-run`` (CPU) always sets it
false: grouped GEMM runs CUDA kernels.

Never run on a GPU by its author (no GPU in that session): the ``--dry-run`` path is tested on CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import statistics
import sys
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path

warnings.filterwarnings("ignore")  # Megatron-Core's notes about Transformer Engine/Apex

import torch  # noqa: E402

from runledger.ingest.bus import open_sink  # noqa: E402
from runledger.trainer.config import (  # noqa: E402
    ModelConfig,
    MoeConfig,
    TrainConfig,
    edit_config_file,
    load_config,
    write_config,
)

SETTLE = 2  # steps after each telemetry switch left out (reload, hooks (un)installed)

PROBE = (
    "model.num_layers=8",
    "model.hidden_size=1024",
    "model.num_attention_heads=8",
    "model.seq_length=4096",
    "model.precision=bf16",
    "moe.num_experts=64",
    "moe.top_k=8",
    "moe.ffn_hidden_size=1024",
    "data.micro_batch_size=2",
    "run.device=cuda",
    "moe.dispatcher=alltoall",
    "telemetry.peak_tflops=989",  # H100/H200 SXM dense BF16
)
# --dry-run: the probe's shape scaled down to run on CPU, with the CPU dispatcher.
TINY = (
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.seq_length=128",
    "model.precision=bf16",
    "moe.num_experts=8",
    "moe.top_k=2",
    "moe.ffn_hidden_size=64",
    "data.micro_batch_size=2",
    "run.device=cpu",
    "moe.dispatcher=allgather",
    "telemetry.peak_tflops=0.16",
)
COMMON = (
    "model.vocab_size=256",
    "data.source=synthetic",
    "moe.drop_policy=probs",
    "schedule.decay=constant",
    "checkpoint.interval=0",
    "checkpoint.final=false",
    "run.nonfinite_policy=skip",
)


class NoCuda(RuntimeError):
    pass


def grouped_gemm_support(dry_run: bool = False) -> tuple[str | None, str]:
    """(the expert module the trainer builds with ``moe.grouped_gemm = true`` on this install, or
    None; a few words on why not). The trainer's own check decides (``cpu_compat``)."""
    from runledger.trainer.cpu_compat import grouped_gemm_module, grouped_gemm_problem

    te = TrainConfig(model=ModelConfig(spec="transformer_engine"), moe=MoeConfig(grouped_gemm=True))
    local = TrainConfig(moe=MoeConfig(grouped_gemm=True))
    module = grouped_gemm_module(te) or grouped_gemm_module(local)
    if module is None:
        return None, grouped_gemm_problem(local) or "not buildable"
    if dry_run:
        return None, f"{module} is installed, but grouped GEMM runs CUDA kernels and --dry-run is on CPU"
    return module, ""


def overrides(args: argparse.Namespace, work: Path, grouped: str | None) -> list[str]:
    shape = TINY if args.dry_run else PROBE
    out = [*shape, *COMMON]
    out += [
        f"run.run_id=gpu-check-{'dry' if args.dry_run else 'h200'}",
        f"run.steps={args.warmup + args.steps}",
        f"moe.capacity_factor={args.capacity_factor}",
        f"checkpoint.dir={work / 'checkpoints'}",
    ]
    out.append(f"moe.grouped_gemm={'true' if grouped else 'false'}")
    if grouped == "TEGroupedMLP":
        out.append("model.spec=transformer_engine")
    return out


@dataclasses.dataclass
class Measured:
    step_s: dict[bool, list[float]]
    tokens_per_s: dict[bool, list[float]]
    mfu: dict[bool, list[float]]
    drop_rates: list[float]
    expert_module: str
    peak_memory_gib: float
    device: str
    grouped_gemm: str = ""  # how moe.grouped_gemm was set, and why


def run_check(args: argparse.Namespace) -> Measured:
    if not args.dry_run and not torch.cuda.is_available():
        raise NoCuda(
            "CUDA is not available (torch.cuda.is_available() is False): run this on a CUDA machine, "
            "or pass --dry-run to check the code path on CPU at a tiny shape"
        )
    support, why_not = grouped_gemm_support(args.dry_run)
    if args.grouped_gemm == "off":
        support, why_not = None, "--grouped-gemm off"
    if args.grouped_gemm == "on" and support is None:
        raise NoCuda(f"--grouped-gemm on: {why_not}")
    from runledger.trainer.cpu_compat import check_supported
    from runledger.trainer.loop import train

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        path = work / "gpu_check.toml"
        cfg = load_config(None, overrides(args, work, support))
        if not args.dry_run:
            check_supported(cfg, torch.device("cuda"))
        else:  # the probe's own config must also load and pass the CUDA checks
            probe = load_config(None, [*PROBE, *COMMON])
            check_supported(probe, torch.device("cuda"))
        write_config(path, cfg)
        measured = Measured(
            {True: [], False: []}, {True: [], False: []}, {True: [], False: []}, [], "?", 0.0, ""
        )
        measured.grouped_gemm = (
            f"moe.grouped_gemm = true ({support})" if support else f"moe.grouped_gemm = false: {why_not}"
        )
        model_box: list[torch.nn.Module] = []

        def progress(report) -> None:  # type: ignore[no-untyped-def]
            if report.step <= args.warmup:  # telemetry is on from the start: the first block is "on"
                return
            index, offset = divmod(report.step - args.warmup - 1, args.block)
            on = index % 2 == 0  # even blocks on, odd blocks off
            if offset >= SETTLE:
                measured.step_s[on].append(report.step_time_s)
                measured.tokens_per_s[on].append(report.tokens_per_second)
                measured.mfu[on].append(report.mfu)
                if on and report.layers:
                    measured.drop_rates.extend(layer.token_drop_rate for layer in report.layers)
            if offset == args.block - 1:
                edit_config_file(path, {"telemetry.enabled": not on})

        sink = open_sink(work / "spool", None)
        if torch.cuda.is_available() and not args.dry_run:
            torch.cuda.reset_peak_memory_stats()
        try:
            result = train(path, sink, progress=progress, on_model=model_box.append, handle_signals=False)
        finally:
            sink.close()
        if result.status != "completed":
            why = result.crash.message if result.crash else result.status
            raise RuntimeError(f"the check run did not complete: {why}")
        measured.expert_module = _expert_module(model_box[0]) if model_box else "?"
        if torch.cuda.is_available() and not args.dry_run:
            measured.peak_memory_gib = torch.cuda.max_memory_allocated() / 2**30
            measured.device = torch.cuda.get_device_name()
        else:  # CPU: the process's peak resident memory (Linux: KiB)
            measured.peak_memory_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
            measured.device = "cpu (dry run)"
        return measured


def _expert_module(model: torch.nn.Module) -> str:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    for module in model.modules():
        if isinstance(module, MoELayer):
            return type(module.experts).__name__
    return "?"


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def report(args: argparse.Namespace, m: Measured) -> str:
    on, off = m.step_s[True], m.step_s[False]
    lines = [
        f"gpu_check on {m.device}: {'tiny dry-run shape' if args.dry_run else 'probe shape'}, "
        f"{args.warmup} warm-up + {args.steps} steps, telemetry on/off in blocks of {args.block}",
        f"expert module: {m.expert_module} ({m.grouped_gemm})",
        f"   {'':14} {'telemetry on':>14} {'telemetry off':>14} {'on vs off':>10}",
        f"   {'step time':14} {1000 * _median(on):11.1f} ms {1000 * _median(off):11.1f} ms "
        f"{100 * (_median(on) / _median(off) - 1):+9.1f}%",
        f"   {'tokens/s':14} {_median(m.tokens_per_s[True]):14.0f} {_median(m.tokens_per_s[False]):14.0f}",
        f"   {'MFU':14} {_median(m.mfu[True]):13.2f}% {_median(m.mfu[False]):13.2f}%",
        f"peak memory: {m.peak_memory_gib:.2f} GiB"
        + ("" if not args.dry_run else " (process RSS, not device memory)"),
    ]
    if m.drop_rates:
        lines.append(
            f"token-drop rate at capacity factor {args.capacity_factor} (trainer-measured, {len(m.drop_rates)} "
            f"layer-steps): mean {100 * statistics.fmean(m.drop_rates):.3f}%, max {100 * max(m.drop_rates):.3f}%"
        )
    else:
        lines.append("token-drop rate: no telemetry-on steps were measured")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=60, help="measured steps (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=6, help="steps before measuring")
    parser.add_argument("--block", type=int, default=10, help="steps per telemetry on/off block")
    parser.add_argument(
        "--capacity-factor", type=float, default=1.15, help="Megatron's capacity (drops measured)"
    )
    parser.add_argument("--grouped-gemm", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shape: check the code path")
    args = parser.parse_args(argv)
    if args.block <= SETTLE or args.steps < 2 * args.block or args.warmup < 1:
        parser.error(f"need --block > {SETTLE}, --steps ≥ 2 × --block and --warmup ≥ 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        measured = run_check(args)
    except NoCuda as exc:
        print(f"gpu_check: {exc}", file=sys.stderr)
        return 2
    print(report(args, measured))
    return 0


if __name__ == "__main__":
    sys.exit(main())
