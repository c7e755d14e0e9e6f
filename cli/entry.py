"""The ``ledger`` (and ``runledger``) console script: check the command's install extra, then run the app.

``pip install runledger`` is the client library alone: it has no typer, no DuckDB, so ``runledger.cli.main``
cannot even import there. Before importing it, this says in one line which extra the command needs
(``runledger.cli.extras``) when that extra is missing, and exits 1; otherwise it runs the app (``runledger.cli.main.run``).
Standard library only, up to the app's import.
"""

from __future__ import annotations

# First of all: SIGINT/SIGTERM follow the command's policy from its first moment (issue 42).
from runledger.cli import startup  # noqa: F401

# isort: split
import sys
from collections.abc import Sequence

from runledger.cli.command_names import command_words
from runledger.cli.extras import install_line, missing_extras

# The commands that need more than the analyst's `ledger` extra (first word, or first two words).
COMMAND_EXTRAS: dict[str, str] = {
    "demo": "trainer",
    "train": "trainer",
    "study": "trainer",
    "init": "operator",
    "ingest": "operator",
    "replay": "operator",
    "compact": "operator",
    "checkpoint": "operator",
    "publish": "operator",
    "redact": "operator",
    "migrate": "operator",
    "report": "operator",
    "plot": "operator",
    "serve": "operator",
    "alerts": "operator",
}


def needed_extra(words: Sequence[str]) -> str:
    """The extra the command named by ``words`` needs: ``ledger`` unless ``COMMAND_EXTRAS`` says more."""
    return COMMAND_EXTRAS.get(words[0], "ledger") if words else "ledger"


def missing_extra_line(args: Sequence[str]) -> str | None:
    """The one line naming the extra to install for ``ledger ARGS``, or None when it is installed."""
    words = command_words(args)
    extra = needed_extra(words)
    missing = missing_extras(extra)
    if not missing:
        return None
    return install_line(" ".join(["ledger", *words]), missing)


def extension_missing_line(args: Sequence[str], exc: Exception) -> str:
    """The line for a DuckDB extension wheel found missing while the command ran: a local ledger is a
    DuckLake (the ``operator`` extra's wheels), which an analyst's ``ledger`` extra does not have."""
    missing = missing_extras("operator")
    if not missing:
        return str(exc)  # the wheels are there, for another DuckDB version: DuckDB's own words
    return install_line(" ".join(["ledger", *command_words(args)]), missing)


def main() -> None:
    """The console script: one line and exit 1 for a missing extra, else the app itself."""
    args = sys.argv[1:]
    line = missing_extra_line(args)
    if line is not None:
        sys.stderr.write(f"error: {line}\n")
        raise SystemExit(1)
    from runledger.cli.main import run

    # A command the analyst's extra runs until it opens a local ledger: that needs the operator's.
    try:
        run()
    except Exception as exc:
        from runledger.ledger.duck import ExtensionMissing

        if not isinstance(exc, ExtensionMissing):
            raise
        sys.stderr.write(f"error: {extension_missing_line(args, exc)}\n")
        raise SystemExit(1) from None
