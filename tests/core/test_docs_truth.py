"""Issue 16: the docs promise only what the code does. The dead-letter reason codes the docs list are
the codes the ledger can give (``runledger.ledger.store.QUARANTINE_REASONS``), and every
`ledger ...` command line in the README and docs names a command, and options, that the CLI has."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer
from typer.core import TyperGroup

from runledger.cli.main import app
from runledger.ledger.store import QUARANTINE_REASONS

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]  # guides, notes/ and reference/


def _codes(text: str) -> list[str]:
    return re.findall(r"`([a-z][a-z-]*)`", text)


def test_the_dead_letter_reasons_in_docs_kafka_are_codes_the_ledger_gives() -> None:
    text = (REPO / "docs" / "kafka.md").read_text()
    [listed] = re.findall(r"`reason` \(a short code such as (.*?)\)", text, re.S)
    codes = _codes(listed)
    assert len(codes) >= 5, listed
    assert set(codes) <= set(QUARANTINE_REASONS), set(codes) - set(QUARANTINE_REASONS)


def test_the_reason_code_table_in_docs_kafka_bus_is_exactly_the_codes_the_ledger_gives() -> None:
    text = (REPO / "docs" / "kafka_bus.md").read_text()
    table = text.split("Reason codes:", 1)[1].strip().split("\n\n", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    documented = [code for row in rows for code in _codes(row.split("|")[1])]
    assert sorted(documented) == sorted(QUARANTINE_REASONS)


_COMMAND = re.compile(r"^(?:\S*/)?(?:run)?ledger\s+(.*)$")


def _command_lines() -> list[tuple[str, str]]:
    """(file, the words after `ledger`) for each command line: inline code and lines of code blocks."""
    found = []
    for path in DOCS:
        text = path.read_text()
        blocks = re.findall(r"^```[a-z]*\n(.*?)^```", text, re.S | re.M)
        spans = re.findall(r"`([^`\n]+)`", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M))
        for line in [*spans, *(line for block in blocks for line in block.splitlines())]:
            match = _COMMAND.match(line.strip().removeprefix("$ "))
            if match:
                found.append((path.relative_to(REPO).as_posix(), match.group(1).split("#")[0]))
    return found


def test_the_docs_name_many_command_lines() -> None:
    assert len(_command_lines()) > 30  # the parser above still finds them


@pytest.mark.parametrize(("doc", "words"), _command_lines())
def test_every_ledger_command_in_the_docs_exists(doc: str, words: str) -> None:
    command = typer.main.get_command(app)
    options: set[str] = {"--help", "--version"}
    for word in words.split():
        if isinstance(command, TyperGroup) and re.fullmatch(r"[a-z][a-z-]*", word):
            sub = command.commands.get(word)
            assert sub is not None, f"{doc}: `ledger {words}`: no command {word!r}"
            command = sub
            options = {"--help"} | {o for p in command.params for o in [*p.opts, *p.secondary_opts]}
            continue
        if isinstance(command, TyperGroup):
            break  # `ledger …`, `ledger --version`: no command named
        option = re.match(r"\[?(--[a-z][a-z-]*)", word)
        if option:
            assert option.group(1) in options, f"{doc}: `ledger {words}`: no option {option.group(1)}"
