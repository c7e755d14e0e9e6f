"""`ledger train CONFIG`: train (or resume) a run and emit its events to the bus.

Under torchrun every rank runs this command; each opens its own sink (``runledger.trainer.telemetry.
open_rank_sink``). Also runnable alone: ``python -m runledger.cli.train_cmd CONFIG ...`` (what torchrun and
the trainer's subprocess tests launch, without the rest of the CLI).

``--wandb`` mirrors the run to Weights & Biases (``runledger.ingest.wandb_mirror.WandbMirror``, on rank 0 only):
project from ``--wandb-project`` (else ``$WANDB_PROJECT``, else "runledger"), entity from
``--wandb-entity`` (else ``$WANDB_ENTITY``, else W&B's default); online, offline or disabled as
``$WANDB_MODE`` says, files under ``$WANDB_DIR``, as with wandb itself. The W&B run id is the run id,
so ``--resume`` continues the same W&B run; the launch event's ``external`` records it. If W&B cannot
start, the run trains anyway and ``external`` holds ``wandb_error``.

Exit status: 0 when the run completes or stops at ``--stop-at``; 1 on a crash (exception,
non-finite loss, OOM); 128 + N after signal N (the checkpoint and crash event are written first);
3 when the run completed but events wait in the Kafka outage spool (the line says the command that
sends them).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import typer

from runledger.cli.extras import command_needs

# Progress and the summary go to stderr; errors through `fail`, as in every command.
from runledger.cli.output import VerboseOption, err_console, fail, third_party_warnings


def train(
    config: Annotated[
        Path,
        typer.Argument(
            metavar="CONFIG", help="TOML config; watched for live changes.", exists=True, dir_okay=False
        ),
    ],
    step: Annotated[
        str | None,
        typer.Argument(
            metavar="STEP", help="With --resume: the checkpoint step or directory (default: the latest)."
        ),
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Resume the run: a new attempt from a checkpoint.")
    ] = False,
    fork_from: Annotated[
        Path | None,
        typer.Option(
            "--fork-from",
            metavar="CHECKPOINT",
            help="Start this new run id from another run's checkpoint directory (its parent_run, fork_step).",
            exists=True,
            file_okay=False,
        ),
    ] = None,
    spool: Annotated[
        Path | None,
        typer.Option("--spool", envvar="RUNLEDGER_SPOOL", help="Spool directory (the embedded bus)."),
    ] = None,
    bootstrap: Annotated[
        str | None,
        typer.Option(
            "--bootstrap",
            envvar="RUNLEDGER_KAFKA_BOOTSTRAP",
            help="Kafka bootstrap servers, host:port[,host:port] (default: the spool).",
            show_default=False,
        ),
    ] = None,
    # The name this option had before it agreed with `ingest kafka` and `replay`; kept for old scripts.
    kafka: Annotated[str | None, typer.Option("--kafka", hidden=True)] = None,
    steps: Annotated[int | None, typer.Option("--steps", help="Override run.steps.")] = None,
    stop_at: Annotated[int | None, typer.Option("--stop-at", help="End this attempt after step N.")] = None,
    run_id: Annotated[str | None, typer.Option("--run-id", help="Override run.run_id.")] = None,
    overrides: Annotated[
        list[str] | None,
        typer.Option("--set", "-s", help="Override a key: --set moe.capacity_factor=1.25 (repeatable)."),
    ] = None,
    log_every: Annotated[
        int, typer.Option("--log-every", help="Print progress every N steps (0: never).")
    ] = 10,
    wandb: Annotated[
        bool,
        typer.Option(
            "--wandb", help="Mirror the run to Weights & Biases (mode from WANDB_MODE, as wandb does)."
        ),
    ] = False,
    wandb_project: Annotated[
        str, typer.Option("--wandb-project", envvar="WANDB_PROJECT", help="W&B project (with --wandb).")
    ] = "runledger",
    wandb_entity: Annotated[
        str | None,
        typer.Option("--wandb-entity", envvar="WANDB_ENTITY", help="W&B entity (with --wandb)."),
    ] = None,
    verbose: VerboseOption = False,
) -> None:
    """Train a Megatron-Core MoE GPT; record its launch, metrics, changes, checkpoints and crashes.

    Example: ledger train config.toml --steps 200 --set moe.capacity_factor=1.25

    A fork: ledger train config.toml --run-id lr-sweep-2 --fork-from checkpoints/hero/step_000100
    """
    # The trainer extra (torch, Megatron-Core) before anything else: else one line naming it.
    with command_needs("ledger train", "trainer"):
        from runledger.cli.kafka_cmd import undelivered_of
        from runledger.emitter import rank_spool
        from runledger.trainer import loop
        from runledger.trainer.checkpoint import CheckpointError
        from runledger.trainer.config import ConfigError
        from runledger.trainer.telemetry import StepReport, open_rank_sink

    if step is not None and not resume:
        raise fail("a checkpoint STEP needs --resume", 2)
    if fork_from is not None and resume:
        raise fail("--fork-from starts a new run id from another run's checkpoint: not with --resume", 2)
    extra = list(overrides or [])
    if steps is not None:
        extra.append(f"run.steps={steps}")
    if run_id is not None:
        extra.append(f"run.run_id={run_id}")
    rank = int(os.environ.get("RANK", "0"))
    mirror = None
    if wandb and rank == 0:
        from runledger.ingest.wandb_mirror import WandbMirror  # imports wandb itself only when the run starts

        mirror = WandbMirror(project=wandb_project, entity=wandb_entity or None)
    sink = open_rank_sink(spool, rank, kafka or bootstrap)  # an explicit --kafka beats the env var

    def show(report: StepReport) -> None:
        if log_every and report.step % log_every == 0:
            drop = report.token_drop_rate
            err_console.print(
                f"step {report.step:>6}  loss {report.loss:7.4f}  lr {report.lr:.2e}  "
                f"drop {'-' if drop is None else f'{100 * drop:5.2f}%'}  "
                f"tok/s {report.tokens_per_second:9.0f}  mfu {report.mfu:6.2f}%  "
                f"{1000 * report.step_time_s:7.1f} ms",
                highlight=False,
            )

    try:
        with third_party_warnings(verbose):
            result = loop.train(
                config,
                sink,
                overrides=extra,
                resume_from=_resume_value(step or "latest") if resume else None,
                fork_from=fork_from,
                stop_at_step=stop_at,
                progress=show,
                mirror=mirror,
                pending_dir=rank_spool(spool, rank),
            )
    except (ConfigError, CheckpointError) as exc:  # refused before any event: one line
        raise fail(str(exc), 2) from None
    finally:
        sink.close()
        if "WORLD_SIZE" in os.environ:  # under torchrun: leave the process group cleanly
            from runledger.trainer.distributed import shutdown

            shutdown()
    summary = (
        f"run {result.run_id} attempt {result.attempt}: {result.status} at step {result.final_step} "
        f"({result.total_tokens} tokens, {result.events_emitted} events, {result.duration_s:.1f} s)"
    )
    if result.crash is not None:
        summary += f"\n{result.crash.kind}: {result.crash.message}"
    if mirror is not None:
        summary += "\n" + _wandb_line(result.external)
    err_console.print(summary, highlight=False, markup=False)
    undelivered = undelivered_of(sink)
    if undelivered is not None and undelivered.events:
        from runledger.ingest.kafka_sink import UNDELIVERED_EXIT_CODE

        err_console.print(undelivered.line(), highlight=False, markup=False)
        if result.exit_code == 0:  # a crash's or a signal's own status says more
            raise typer.Exit(UNDELIVERED_EXIT_CODE)
    raise typer.Exit(result.exit_code)


def edit(
    config: Annotated[
        Path,
        typer.Argument(
            metavar="CONFIG", help="The live run's watched TOML config.", exists=True, dir_okay=False
        ),
    ],
    changes: Annotated[
        list[str],
        typer.Argument(metavar="KEY=VALUE", help="Settings to change, e.g. moe.capacity_factor=1.25."),
    ],
    author: Annotated[
        str | None,
        typer.Option(
            "--author",
            envvar="RUNLEDGER_CHANGE_AUTHOR",
            help="Who makes the change: recorded on the run's config.changed (default: unknown).",
        ),
    ] = None,
) -> None:
    """Change a live run's config file; the run applies it at its next step boundary.

    The author and time go into the file's "change" table with the edit, so the run's config.changed
    names who made it; an edit made without an author is recorded as made by unknown.

    Example: ledger edit config.toml moe.capacity_factor=1.25 --author alice
    """
    from runledger.trainer.config import ConfigError, edit_config_file, parse_override

    try:
        parsed = {".".join(keys): value for keys, value in map(parse_override, changes)}
        for key, value in parsed.items():
            check_config_value(key, value)
        _check_edited_config(config, parsed)
        edit_config_file(config, parsed, author=author)
    except ConfigError as exc:
        raise fail(str(exc), 2) from None
    for key in _not_live(parsed):
        err_console.print(
            f"note: {key} is not changeable while the run is live: a running run refuses it (needs a restart)",
            highlight=False,
            markup=False,
        )
    who = f" by {author}" if author else " (author unknown)"
    err_console.print(f"edited {config}: {', '.join(changes)}{who}", highlight=False, markup=False)


def check_config_value(key: str, value: Any) -> None:
    """Refuse (``ConfigError``) a key the trainer's config does not have, or a value its type does not
    take, naming the key's type: what the run would refuse at its next step, said before the edit.

    Types are checked as the trainer reads its file (``runledger.trainer.config.from_dict``: not strict, so
    ``1`` is a float and ``"0.5"`` a number); ``none`` removes a key, which only a key that defaults
    to none allows."""
    import msgspec

    from runledger.trainer.config import CHANGE_TABLE, ConfigError, TrainConfig

    field = _config_field(TrainConfig, key.split("."), key)
    if isinstance(field.type, type) and issubclass(field.type, msgspec.Struct):
        names = ", ".join(f.name for f in msgspec.structs.fields(field.type))
        raise ConfigError(f"{key} is a section, not a key; name one of its keys: {names}")
    if key.split(".")[0] == CHANGE_TABLE:
        raise ConfigError(f"{key}: the [{CHANGE_TABLE}] table records who edited the file; use --author")
    if value is None:
        if field.default is not None:
            raise ConfigError(f"{key} cannot be none: it expects {_type_text(field.type)}")
        return
    try:
        msgspec.convert(value, field.type, strict=False)
    except msgspec.ValidationError:
        raise ConfigError(
            f"{key} expects {_type_text(field.type)}, not {_toml_text(value)} ({_kind_of(value)})"
        ) from None


def _config_field(struct: Any, parts: list[str], key: str) -> Any:
    """The ``msgspec`` field a dotted key names, or ``ConfigError`` naming the keys there are."""
    import msgspec

    from runledger.trainer.config import ConfigError

    fields = {f.name: f for f in msgspec.structs.fields(struct)}
    found = fields.get(parts[0])
    if found is None:
        where = "the config" if struct.__name__ == "TrainConfig" else key.rsplit(".", len(parts))[0]
        raise ConfigError(f"unknown config key {key!r}: {where} has {', '.join(sorted(fields))}")
    rest = parts[1:]
    if not rest:
        return found
    if not (isinstance(found.type, type) and issubclass(found.type, msgspec.Struct)):
        raise ConfigError(
            f"unknown config key {key!r}: {key.rsplit('.', len(rest))[0]} is a key, not a section"
        )
    return _config_field(found.type, rest, key)


def _type_text(kind: Any) -> str:
    """``a number``, ``an integer or none``, ``one of 'probs', 'position'``: a config type in words."""
    import types
    import typing

    words = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    if kind in words:
        return words[kind]
    origin = typing.get_origin(kind)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(kind))
    if origin in (typing.Union, types.UnionType):
        return " or ".join("none" if a is type(None) else _type_text(a) for a in typing.get_args(kind))
    if origin in (list, tuple):
        (item, *_) = typing.get_args(kind) or (Any,)
        return f"a list of {_type_text(item).removeprefix('a ').removeprefix('an ')}"
    return getattr(kind, "__name__", str(kind))


def _kind_of(value: Any) -> str:
    kinds = {bool: "true/false", int: "an integer", float: "a number", str: "a string", list: "a list"}
    return kinds.get(type(value), "a table" if isinstance(value, dict) else type(value).__name__)


def _toml_text(value: Any) -> str:
    import json

    return json.dumps(value, default=str)


def _check_edited_config(path: Path, changes: dict[str, Any]) -> None:
    """The whole config after the edit must load as the run loads it (cross-key rules included,
    e.g. ``moe.top_k`` within ``1..moe.num_experts``); else ``ConfigError``, and the file is left."""
    import tomllib

    from runledger.trainer.config import CHANGE_TABLE, ConfigError, from_dict, validate

    try:
        tree = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    tree.pop(CHANGE_TABLE, None)
    for dotted, value in changes.items():
        *sections, last = dotted.split(".")
        node = tree
        for part in sections:
            node = node.setdefault(part, {})
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    try:
        validate(from_dict(tree))
    except ConfigError as exc:
        raise ConfigError(f"{path}: the run would refuse this edit: {exc}") from None


def _not_live(changes: dict[str, Any]) -> list[str]:
    from runledger.trainer.config import LIVE_KEYS

    return [key for key in changes if "/" + key.replace(".", "/") not in LIVE_KEYS]


def _wandb_line(external: dict[str, str]) -> str:
    if "wandb_error" in external:
        return f"W&B mirror off: {external['wandb_error']}"
    where = external.get("wandb_url") or external.get("wandb_dir") or ""
    return f"W&B run {external.get('wandb_run_id', '?')} in {external.get('wandb_project', '?')} {where}".rstrip()


def _resume_value(value: str) -> Any:
    if value == "latest":
        return value
    return int(value) if value.isdigit() else Path(value)


if __name__ == "__main__":  # what torchrun launches: this one command, without the rest of the CLI
    from runledger import signals
    from runledger.cli.interrupts import InterruptibleCommand

    signals.install(starting=True)  # the command's signal policy, as `ledger train` has it (exit 128 + N)
    standalone = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    standalone.command("train", cls=InterruptibleCommand)(train)
    standalone()
