"""`ledger study token-drop`: the pre-registered token-drop study (``runledger.workflows.study``).

A thin shell: options → ``StudyOptions``, then the library's ``run_study``; prints the results table,
the scored claims and where the record is."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from runledger.cli.extras import command_needs
from runledger.cli.output import Format, VerboseOption, console, fail, print_rows, third_party_warnings

if TYPE_CHECKING:
    from runledger.workflows.study import StudyResult, Summary

DEFAULT_WORKDIR = Path(".runledger/study")


def _floats(text: str, what: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise fail(f"{what} {text!r}: give numbers separated by commas, e.g. 1.0,1.15,2.0", 2) from None
    if not values:
        raise fail(f"{what} {text!r}: give at least one number", 2)
    return values


def _setups(text: str) -> tuple[tuple[int, int], ...]:
    out = []
    for part in text.split(","):
        senders, _, shards = part.strip().partition("x")
        if not (senders.isdigit() and shards.isdigit()):
            raise fail(f"--pooled-wave {text!r}: give SENDERSxSHARDS pairs, e.g. 1x64,1x8", 2)
        out.append((int(senders), int(shards)))
    return tuple(out)


def token_drop(
    workdir: Annotated[
        Path, typer.Option(help="A new or empty folder: ledger, spool, keys, figure, results.")
    ] = (DEFAULT_WORKDIR),
    quick: Annotated[
        bool, typer.Option("--quick", help="A minute-scale study (tiny model, 512-token context, 6 steps).")
    ] = False,
    steps: Annotated[
        int | None, typer.Option(help="Training steps per run (default 250; 6 with --quick).")
    ] = None,
    seed: Annotated[int | None, typer.Option(help="Seed of the runs and the Monte Carlo.")] = None,
    layers: Annotated[int | None, typer.Option(help="Transformer layers (default 4).")] = None,
    hidden: Annotated[int | None, typer.Option(help="Hidden size (default 128).")] = None,
    experts: Annotated[int | None, typer.Option(help="Routed experts (default 64).")] = None,
    top_k: Annotated[int | None, typer.Option("--top-k", help="Experts per token (default 8).")] = None,
    ffn: Annotated[int | None, typer.Option(help="Expert FFN size (default 128).")] = None,
    seq_length: Annotated[
        int | None, typer.Option(help="Context length (default 4096; 512 with --quick).")
    ] = None,
    capacity_factors: Annotated[
        str | None, typer.Option(help="The sweep, comma-separated (default 1.0,1.15,1.25,1.5,2.0).")
    ] = None,
    trained_cf: Annotated[
        float | None, typer.Option(help="Capacity factor of the run trained with Megatron's dropping (1.15).")
    ] = None,
    pooled_wave: Annotated[
        str | None,
        typer.Option(help="Pooled-wave set-ups SENDERSxSHARDS, the first the headline (default 1x64,1x8)."),
    ] = None,
    waves: Annotated[int | None, typer.Option(help="Waves of pooled-wave (default 3).")] = None,
    expert_bias_rate: Annotated[
        float | None, typer.Option(help="Expert-bias update per step (default 0.01; Megatron's 0.001).")
    ] = None,
    verbose: VerboseOption = False,
) -> None:
    """Reproduce the reference run's token-drop test on small experts, pre-registered in a ledger.

    Example: ledger study token-drop --quick --workdir /tmp/study
    """
    # The trainer extra (torch, Megatron-Core, matplotlib for the figure): else one line naming it.
    with command_needs("ledger study token-drop", "trainer"):
        from runledger.workflows.study import StudyError, StudyOptions, run_study

    changes: dict[str, Any] = {
        "steps": steps,
        "seed": seed,
        "num_layers": layers,
        "hidden_size": hidden,
        "num_experts": experts,
        "top_k": top_k,
        "ffn_hidden_size": ffn,
        "seq_length": seq_length,
        "trained_capacity_factor": trained_cf,
        "waves": waves,
        "expert_bias_rate": expert_bias_rate,
        "capacity_factors": _floats(capacity_factors, "--capacity-factors") if capacity_factors else None,
        "pooled_wave": _setups(pooled_wave) if pooled_wave else None,
    }
    given = {k: v for k, v in changes.items() if v is not None}
    options = StudyOptions.quick(workdir, **given) if quick else StudyOptions(workdir=workdir, **given)
    try:
        options.validate()
        with third_party_warnings(verbose):
            result = run_study(options, say=lambda line: console.print(line, markup=False, highlight=False))
    except StudyError as exc:
        raise fail(str(exc), 2) from None
    _print_result(result)


def _pct(x: float) -> str:
    return f"{100 * x:.3f}%"


def _print_result(result: StudyResult) -> None:
    graded = {g["policy"]: g for g in result.graded}
    control, trained = result.run_ids
    by_policy: dict[str, dict[str, Summary]] = {}
    for s in result.summaries:
        by_policy.setdefault(s.policy, {})[s.run] = s
    rows = []
    for policy, runs in by_policy.items():
        c, t = runs.get(control), runs.get(trained)
        g = graded.get(policy)
        rows.append(
            (
                policy,
                _pct(g["predicted"]) if g else "",
                _pct(c.mean) if c else "",
                _pct(c.p50) if c else "",
                _pct(c.max) if c else "",
                _pct(t.mean) if t else "",
                ("yes" if g["in_range"] else "no") if g else "",
            )
        )
    columns = ["policy", "predicted", "dropless run mean", "p50", "max", "cf run mean", "in range"]
    print_rows(columns, rows, Format.table, None, title="token-drop rate (dropped ÷ tokens·k)", limit=0)
    print_rows(
        ["claim", "holds", "detail"],
        [(s.claim, "yes" if s.holds else "no", s.detail) for s in result.scores],
        Format.table,
        None,
        title="pre-registered claims",
        limit=0,
    )
    ledger = shlex.quote(str(result.ledger))
    console.print(
        f"pre-registered: {result.prereg_size} events signed before training ({result.preregistration}, "
        f"sha256 {result.prereg_sha256[:16]}…, in every run id)",
        markup=False,
        highlight=False,
    )
    console.print(f"runs: {', '.join(result.run_ids)}", markup=False, highlight=False)
    outputs = [f"figure {result.figure}", f"results {result.results_json}"]
    if result.report is not None:
        outputs.append(f"report {result.report}")
    console.print("; ".join(outputs), markup=False, highlight=False)
    console.print(
        f"check it: ledger verify --ledger {ledger}  (its log key is in {shlex.quote(str(result.ledger / '.keys'))})",
        markup=False,
        highlight=False,
    )


study_app = typer.Typer(
    help="Studies whose predictions, runs and results are all in a ledger.", no_args_is_help=True
)
