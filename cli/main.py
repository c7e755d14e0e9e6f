"""`ledger`: the command line over runledger's library. Every command here is a thin shell.

Each command is a plain module-level function in a ``cli/*_cmd.py`` module; this file builds the app
and its groups from ``COMMANDS`` and ``GROUPS`` below, which name every command (and nowhere else).
Listing order in ``ledger --help`` is their order. Shared options, output and errors are in
``cli/output.py``.

``app`` is the whole app (every module imported, every command registered: help, completion, the
reference page, tests). The program (``run``: the ``ledger`` script, ``python -m runledger.cli.main``)
registers only the command its arguments name when they name one (issue 41: typer builds each
registered command's parameters, ~0.1 s for all of them, and each command module imports its own
helpers); the command's definition, help and options are the same function's either way.
"""

from __future__ import annotations

# First of all: SIGINT/SIGTERM follow the command's policy from its first moment (issue 42).
from runledger.cli import startup  # noqa: F401

# isort: split
import importlib.util
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Annotated, Any, Protocol

import typer
from typer.core import TyperArgument

from runledger import signals
from runledger.cli import typer_params
from runledger.cli.command_names import COMMANDS, GROUPS, MADE_BY_MODULE, command_words
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


# A command's plain values (text, numbers, paths, flags, choices) are read without pydantic (~70 ms).
typer_params.install()

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
        import logging  # (only here: ~4 ms a command otherwise)

        logging.basicConfig(
            level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True
        )


# -- every command ---------------------------------------------------------------------------------
# COMMANDS and GROUPS (runledger.cli.command_names) name every command and group once.


def _attribute(reference: str) -> Any:
    """``"module:attribute"`` of ``runledger.cli``, imported."""
    module, attribute = reference.split(":")
    # (``__import__``, not ``importlib.import_module``: ``-X importtime`` logs what it imports under it)
    return getattr(__import__(f"runledger.cli.{module}", fromlist=[attribute]), attribute)


def _new_app() -> _App:
    """The app with its options and no command yet."""
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
    app.callback()(configure_logging)
    return app


def _group(groups: dict[str, typer.Typer], words: str) -> typer.Typer:
    """The typer app of the group named by ``words`` (made, and added to its parent, on first use)."""
    if words in groups:
        return groups[words]
    parent, _, name = words.rpartition(" ")
    described = dict(GROUPS)[words]
    made: typer.Typer = (
        _attribute(described)
        if words in MADE_BY_MODULE
        else typer.Typer(help=described, no_args_is_help=True)
    )
    _group(groups, parent).add_typer(made, name=name)
    groups[words] = made
    return made


def build_app(only: str | None = None) -> _App:
    """The app with every command, or with only the command named ``only`` (its words)."""
    app = _new_app()
    groups: dict[str, typer.Typer] = {"": app}
    # Groups are made in GROUPS' order (their listing order), then filled; a group made by its
    # command module is shared by every build, so a command already on it is not added again.
    for words, _ in GROUPS:
        if only is None or only.startswith(words + " "):
            _group(groups, words)
    for words, reference in COMMANDS:
        if only is not None and words != only:
            continue
        parent, _, name = words.rpartition(" ")
        group = _group(groups, parent)
        if not any(info.name == name for info in group.registered_commands):
            group.command(name)(_attribute(reference))
    return app


def program_command(args: Sequence[str]) -> str | None:
    """The command ``ledger ARGS`` runs, as COMMANDS names it; None for the app's own help, shell
    completion, a group's help or a name that is no command (the whole app answers those)."""
    if any(name.startswith("_") and name.endswith("_COMPLETE") for name in os.environ):
        return None
    words = " ".join(command_words(args))
    return words if any(words == named for named, _ in COMMANDS) else None


def run() -> None:
    """The program: the app with the one command its arguments name (or the whole app), run."""
    # Still starting while the command's module imports: a signal now exits at once with 128 + N.
    signals.install(starting=True)
    build_app(program_command(sys.argv[1:]))()


def __getattr__(name: str) -> Any:
    """``app``, the whole app, built on first use (the program builds its own, ``run``)."""
    if name != "app":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    whole = globals()["app"] = build_app()
    return whole


# The imports are done; a test process that imported the app gets Ctrl-C as KeyboardInterrupt again
# (``_App.__call__``: the program stays starting until its command runs).
signals.started()

if __name__ == "__main__":
    run()
