"""Which install extra a command needs, and the one line that says so when it is missing (issue 41).

``pip install runledger`` is the client library and the W&B bridge only. The extras, one per user:
``ledger`` (an analyst: this command line over a published copy), ``operator`` (a ledger of one's
own: the DuckLake tables, ingesters, publishing; brings ``ledger``), ``trainer`` (the Megatron
trainer and the demo; brings ``operator``). A command whose extra is not installed says, in one line
on stderr, which extra to install: never a traceback from deep inside an import.

Standard library only: the ``ledger`` entry point (``runledger.cli.entry``) uses this before typer exists.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager

# What each extra installs that its commands import (one module per distribution is enough).
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "ledger": ("typer", "rich", "duckdb", "pyarrow", "pytz", "duckdb_extension_httpfs"),
    "operator": (
        "duckdb_extension_ducklake",
        "duckdb_extension_sqlite_scanner",
        "duckdb_extension_postgres_scanner",
        "github",
        "requests",
        "uvicorn",
        "starlette",
        "wandb",
        "matplotlib",
    ),
    "trainer": ("torch", "megatron.core"),
}
# The extra each extra brings with it: `runledger[trainer]` installs `runledger[operator]`, and so on.
EXTRA_INCLUDES: dict[str, str] = {"operator": "ledger", "trainer": "operator"}


class MissingExtraError(Exception):
    """An extra a command needs is not installed; the message is the one line to show."""


def module_missing(name: str) -> bool:
    """True when ``name`` cannot be imported here (looked up without importing it)."""
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):  # its parent package is missing, or half-installed
        return True


def with_included(extra: str) -> list[str]:
    """``extra`` and every extra it brings with it: trainer → [trainer, operator, ledger]."""
    chain = [extra]
    while chain[-1] in EXTRA_INCLUDES:
        chain.append(EXTRA_INCLUDES[chain[-1]])
    return chain


def missing_extras(*extras: str) -> list[str]:
    """The extras among ``extras`` not wholly installed (theirs or an included extra's module missing)."""
    return [
        extra
        for extra in extras
        if any(module_missing(m) for part in with_included(extra) for m in EXTRA_MODULES[part])
    ]


def install_line(command: str, extras: list[str]) -> str:
    """ "`ledger demo` needs the trainer extra: pip install 'runledger[trainer]'"."""
    # An extra that another named one brings along is left out: [trainer] already has [ledger].
    named = [e for e in extras if not any(e in with_included(o)[1:] for o in extras)]
    kind = f"the {named[0]} extra" if len(named) == 1 else f"the {' and '.join(named)} extras"
    return f"`{command}` needs {kind}: pip install 'runledger[{','.join(named)}]'"


def require_extra(command: str, *extras: str) -> None:
    """Raise ``MissingExtraError`` (its one line) when one of ``extras`` is not installed."""
    missing = missing_extras(*extras)
    if missing:
        raise MissingExtraError(install_line(command, missing))


def extra_of_module(name: str) -> str | None:
    """The extra that installs the (top-level) module ``name``, or None when none does."""
    root = name.split(".", 1)[0]
    for extra, modules in EXTRA_MODULES.items():
        if any(module.split(".", 1)[0] == root for module in modules):
            return extra
    return None


@contextmanager
def extra_imports(command: str, *extras: str) -> Iterator[None]:
    """Around a command's heavy imports: first check that ``extras`` are installed (their modules may
    be imported later, lazily, deep inside the work), then turn a failed import of one of their
    modules (a half-installed extra) into the same one line."""
    require_extra(command, *extras)
    try:
        yield
    except ModuleNotFoundError as exc:
        extra = extra_of_module(exc.name or "")
        if extra is None:
            raise
        raise MissingExtraError(install_line(command, [extra])) from None


@contextmanager
def command_needs(command: str, *extras: str) -> Iterator[None]:
    """``extra_imports`` inside a running command: the missing extra's line goes out through
    ``runledger.cli.output.fail`` (one line on stderr, exit 1), as every command's errors do."""
    try:
        with extra_imports(command, *extras):
            yield
    except MissingExtraError as exc:
        from runledger.cli.output import fail  # typer is there: the command is running

        raise fail(str(exc)) from None
