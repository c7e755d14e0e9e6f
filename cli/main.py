"""`ledger`: the command line over runledger's library. Every command here is a thin shell.

Each command is a plain module-level function in a ``cli/*_cmd.py`` module; this file builds the app
and its groups and registers every command, by name, below (and nowhere else). Listing order in
``ledger --help`` is registration order. Shared options, output and errors are in ``cli/output.py``.
"""

from __future__ import annotations

# First of all: SIGINT/SIGTERM follow the command's policy from its first moment (issue 42).
from runledger.cli import startup  # noqa: F401

# isort: split
import importlib.util
import logging
import os
import sys
from types import ModuleType
from typing import Annotated, Any, Protocol

import typer
from typer.core import TyperArgument

from runledger import signals
from runledger.cli import (
    demo_cmd,
    ingest_cmd,
    init_cmd,
    kafka_cmd,
    ledger_cmd,
    merkle_cmd,
    migrate_cmd,
    page_cmd,
    producers_cmd,
    publish_cmd,
    redact_cmd,
    report_cmd,
    s3_cmd,
    schemas_cmd,
    serve_cmd,
    shell_cmd,
    simulate_cmd,
    study_cmd,
    train_cmd,
)
from runledger.cli.interrupts import InterruptibleGroup
from runledger.cli.output import Program, fail


def _usage_name(self: TyperArgument) -> str:
    """``RUN`` and ``[STEP]`` in usage lines, as click and git write them (typer 0.2x writes ``{RUN}``)."""
    name = self.metavar or (self.name or "").upper()
    name = name if self.required else f"[{name}]"
    return name + ("..." if self.nargs != 1 else "")


if hasattr(TyperArgument, "_usage_display_name"):  # typer versions that brace required arguments
    TyperArgument._usage_display_name = _usage_name  # type: ignore[method-assign]


class _ClickError(Protocol):
    """What typer hands its error printer: click's ``ClickException``, or (typer versions that carry
    their own copy of click, ``typer._click``) that copy's."""

    exit_code: int

    def format_message(self) -> str: ...


def _usage_error(self: _ClickError) -> None:  # the parameter's name is typer's, so that it can stand in
    """A mistyped option or a missing argument: one line on stderr like every other error (typer
    draws a boxed panel under a usage line); the exit status stays click's (2)."""
    exc = self
    if exc.__class__.__name__ == "NoArgsIsHelpError":  # `ledger` alone: the help was printed
        return
    ctx = getattr(exc, "ctx", None)
    hint = f" (see `{ctx.command_path} -h`)" if ctx is not None else ""
    fail(exc.format_message() + hint, exc.exit_code)


def _lazy_module(name: str) -> ModuleType:
    """``name`` registered as imported, its code run at its first attribute read: what is set on it
    before then stays set (``importlib.util.LazyLoader`` re-applies it after the run)."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ImportError(f"no module {name}")
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# typer's help and error printer (rich's Markdown, tracebacks: ~85 ms) is read only by help and errors;
# lazily loaded, a command that runs never imports it, and our one-line error is still the one used.
_rich_utils: Any = sys.modules.get("typer.rich_utils") or _lazy_module("typer.rich_utils")
_rich_utils.rich_format_error = _usage_error  # typer's _main looks it up at each error


class _App(typer.Typer):
    """The app. Called as the program (the ``ledger`` script, ``python -m runledger.cli.main``), it is still
    starting until its command runs (typer builds the command, click parses): a signal until then
    exits at once with 128 + N, nothing done. (Tests invoke it through click, not this call.)"""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        signals.install(starting=True)
        Program.is_whole_process = True
        return super().__call__(*args, **kwargs)


app = _App(
    name="ledger",
    help="runledger: an append-only, verifiable, SQL-queryable record of a training run.",
    # A full disk in any command: one line naming where, not a traceback; a signal: exit 128 + N.
    cls=InterruptibleGroup,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    # typer's own: `ledger --install-completion` (bash, zsh, fish, PowerShell), `--show-completion`.
    add_completion=True,
    # -h as well as --help, inherited by every subcommand's context.
    context_settings={"help_option_names": ["-h", "--help"]},
)
ingest_app = typer.Typer(
    help="Fold events from a bus or an outside system into the ledger.", no_args_is_help=True
)
schemas_app = typer.Typer(help="The event catalogue.", no_args_is_help=True)
serve_app = typer.Typer(help="Long-running receivers.", no_args_is_help=True)
kafka_app = typer.Typer(help="Kafka bus utilities.", no_args_is_help=True)
kafka_topic_app = typer.Typer(
    help="Kafka topics: create with N partitions, describe, add partitions.", no_args_is_help=True
)
s3_app = typer.Typer(help="S3 buckets for lakes and published copies.", no_args_is_help=True)
s3_bucket_app = typer.Typer(help="S3 buckets.", no_args_is_help=True)
keys_app = typer.Typer(help="The Ed25519 key pair that signs log checkpoints.", no_args_is_help=True)
producers_app = typer.Typer(
    help="Producer keys and what each may write (kept as events in the log).", no_args_is_help=True
)
prove_app = typer.Typer(
    help="Proofs anyone can check with `python -m runledger.ledger.verifier`.", no_args_is_help=True
)


def _print_version(value: bool) -> None:
    if value:
        from runledger import __version__

        typer.echo(f"runledger {__version__}")
        raise typer.Exit()


def configure_logging(
    show_version: Annotated[
        bool,
        typer.Option("--version", help="Print the version and exit.", is_eager=True, callback=_print_version),
    ] = False,
) -> None:
    # Long-running commands (ingesters, receivers) log through `logging`; RUNLEDGER_LOG_LEVEL
    # (e.g. INFO, DEBUG) shows it, kafka-python's own group and fetch logs included.
    level = os.environ.get("RUNLEDGER_LOG_LEVEL")
    if level:
        logging.basicConfig(
            level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True
        )


app.callback()(configure_logging)

# -- every command ---------------------------------------------------------------------------------

# Reading the ledger.
app.command("query")(ledger_cmd.query)
app.command("runs")(ledger_cmd.runs)
app.command("history")(ledger_cmd.history)
app.command("state")(ledger_cmd.state)
app.command("diff")(ledger_cmd.diff)
app.command("blame")(ledger_cmd.blame)
app.command("compact")(ledger_cmd.compact)
app.command("views")(ledger_cmd.views)
app.command("shell")(shell_cmd.shell)
app.command("report")(report_cmd.report)
app.command("plot")(report_cmd.plot)
# Producing and rebuilding.
app.command("init")(init_cmd.init)
app.command("train")(train_cmd.train)
app.command("edit")(train_cmd.edit)
app.command("simulate")(simulate_cmd.simulate)
app.command("replay")(kafka_cmd.replay)
# Tamper evidence (a "checkpoint" here is a signed log checkpoint, not a model checkpoint).
app.command("checkpoint")(merkle_cmd.checkpoint)
app.command("verify")(merkle_cmd.verify)
app.command("verify-proof")(merkle_cmd.verify_proof)
app.command("publish")(publish_cmd.publish)
app.command("redact")(redact_cmd.redact)
app.command("monitor")(publish_cmd.monitor)
app.command("demo")(demo_cmd.demo)
app.command("migrate")(migrate_cmd.migrate)

app.add_typer(ingest_app, name="ingest")
ingest_app.command("spool")(ingest_cmd.ingest_spool)
ingest_app.command("kafka")(ingest_cmd.ingest_kafka)
ingest_app.command("github")(ingest_cmd.ingest_github)
ingest_app.command("wandb")(ingest_cmd.ingest_wandb)

app.add_typer(schemas_app, name="schemas")
schemas_app.command("export")(schemas_cmd.export_schemas)
schemas_app.command("list")(schemas_cmd.list_schemas)

app.add_typer(serve_app, name="serve")
serve_app.command("webhooks")(serve_cmd.serve_webhooks)
serve_app.command("page")(page_cmd.serve_page)

app.add_typer(kafka_app, name="kafka")
kafka_app.command("drain-spool")(kafka_cmd.drain_spool)
kafka_app.add_typer(kafka_topic_app, name="topic")
kafka_topic_app.command("create")(kafka_cmd.topic_create)
kafka_topic_app.command("describe")(kafka_cmd.topic_describe)
kafka_topic_app.command("add-partitions")(kafka_cmd.topic_add_partitions)

app.add_typer(s3_app, name="s3")
s3_app.add_typer(s3_bucket_app, name="bucket")
s3_bucket_app.command("create")(s3_cmd.bucket_create)

app.add_typer(keys_app, name="keys")
keys_app.command("init")(merkle_cmd.keys_init)

app.add_typer(producers_app, name="producers")
producers_app.command("add")(producers_cmd.add)
producers_app.command("rotate")(producers_cmd.rotate)
producers_app.command("revoke")(producers_cmd.revoke)
producers_app.command("list")(producers_cmd.list_producers)
producers_app.command("policy")(producers_cmd.policy)
producers_app.command("export")(producers_cmd.export)

app.add_typer(study_cmd.study_app, name="study")
study_cmd.study_app.command("token-drop")(study_cmd.token_drop)

app.add_typer(publish_cmd.witness_app, name="witness")
publish_cmd.witness_app.command("add")(publish_cmd.witness_add)
publish_cmd.witness_app.command("quorum")(publish_cmd.witness_quorum)
publish_cmd.witness_app.command("list")(publish_cmd.witness_list)

app.add_typer(prove_app, name="prove")
prove_app.command("inclusion")(merkle_cmd.prove_inclusion)
prove_app.command("consistency")(merkle_cmd.prove_consistency)

# The imports are done; a test process that imported the app gets Ctrl-C as KeyboardInterrupt again
# (``_App.__call__``: the program stays starting until its command runs).
signals.started()

if __name__ == "__main__":
    app()
