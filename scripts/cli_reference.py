"""Write docs/reference/cli.md from the `ledger` CLI's own help: every group and command, its usage
line, its help text and a table of its arguments and options.

    python scripts/cli_reference.py            # rewrite docs/reference/cli.md
    python scripts/cli_reference.py --check    # exit 1 if the committed file differs

The page is a function of the CLI's definitions only (never of the terminal's width or the
environment), so a test regenerates it in memory and compares it with the committed file.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterator
from pathlib import Path

import typer
from typer._click.core import Command  # typer 0.29 carries its own click: its classes, not click's
from typer.core import TyperGroup

REPO = Path(__file__).resolve().parents[1]
REFERENCE_FILE = REPO / "docs" / "reference" / "cli.md"
PROGRAM = "ledger"
HEADER = f"""# `{PROGRAM}` command reference

Generated from the CLI's own help by `python scripts/cli_reference.py` (do not edit by hand;
`tests/core/test_cli_reference.py` fails when this page and the CLI differ). The same text is
`{PROGRAM} COMMAND --help`. Guides: [README](../../README.md), [docs/](../).
"""


def root_command() -> Command:
    """The command behind the typer app (imported here so the script's usage error stays cheap)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from runledger.cli.main import app

    return typer.main.get_command(app)


def context_of(command: Command, name: str, parent: typer.Context | None = None) -> typer.Context:
    """The context the CLI builds for `ledger a b`: its name is what the usage line prints, and it
    inherits the app's settings (`-h` beside `--help`)."""
    return typer.Context(command, info_name=name, parent=parent, **command.context_settings)


def walk(
    command: Command, name: str = PROGRAM, parent: typer.Context | None = None
) -> Iterator[tuple[typer.Context, Command]]:
    """Each command and group under ``command`` (itself first, then by name), hidden ones left out."""
    context = context_of(command, name, parent)
    yield context, command
    for sub_name in subcommands(context, command):
        assert isinstance(command, TyperGroup)
        sub = command.get_command(context, sub_name)
        if sub is not None and not sub.hidden:
            yield from walk(sub, sub_name, context)


def subcommands(context: typer.Context, command: Command) -> list[str]:
    """A group's command names, sorted (so the page does not follow registration order)."""
    if not isinstance(command, TyperGroup):
        return []
    return sorted(command.list_commands(context))


def help_text(command: Command) -> str:
    """The help as the CLI shows it: dedented, cut at a form feed, no trailing space."""
    text = inspect.cleandoc(command.help or command.short_help or "")
    return text.partition("\f")[0].rstrip()


def cell(text: str) -> str:
    """One Markdown table cell: one line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def param_rows(context: typer.Context, command: Command) -> list[str]:
    """One table row per argument and option: `--help`'s own two columns (names with what each
    takes; help with its default, environment variable and range)."""
    rows = []
    for param in command.get_params(context):
        record = param.get_help_record(context)
        if record is not None:
            names, what = record
            rows.append(f"| `{cell(names)}` | {cell(what)} |")
    return rows


def section(context: typer.Context, command: Command) -> str:
    """A command's part of the page: heading, usage and help in a block, its parameters in a table."""
    # The usage and help keep the CLI's line breaks (examples included), so they go in a code block.
    usage = " ".join([context.command_path, *command.collect_usage_pieces(context)])
    lines = [f"## `{context.command_path}`", "", "```text", usage]
    text = help_text(command)
    if text:
        lines += ["", text]
    lines += ["```", ""]
    rows = param_rows(context, command)
    if rows:
        lines += ["| argument or option | what |", "|---|---|", *rows, ""]
    names = subcommands(context, command)
    if names:
        links = (f"[`{name}`](#{anchor(f'{context.command_path} {name}')})" for name in names)
        lines += ["Commands: " + ", ".join(links), ""]
    return "\n".join(lines)


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading `ledger a b`: lower case, spaces to hyphens, punctuation dropped."""
    return "".join(ch for ch in heading.lower().replace(" ", "-") if ch.isalnum() or ch in "-_")


def render(command: Command | None = None) -> str:
    """The whole page for ``command`` (default: the `ledger` app)."""
    root = command if command is not None else root_command()
    return HEADER + "\n" + "\n".join(section(context, sub) for context, sub in walk(root))


def main(argv: list[str]) -> int:
    """Write the page, or with ``--check`` compare it with the committed one."""
    text = render()
    if argv[1:] == ["--check"]:
        same = REFERENCE_FILE.is_file() and REFERENCE_FILE.read_text() == text
        print("up to date" if same else f"{REFERENCE_FILE} differs: run python scripts/cli_reference.py")
        return 0 if same else 1
    if argv[1:]:
        print("usage: python scripts/cli_reference.py [--check]", file=sys.stderr)
        return 2
    REFERENCE_FILE.parent.mkdir(parents=True, exist_ok=True)
    REFERENCE_FILE.write_text(text)
    print(f"wrote {REFERENCE_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
