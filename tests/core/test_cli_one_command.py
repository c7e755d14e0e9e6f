"""The program registers only the command its arguments name (``runledger.cli.main.run``, issue 41):
that command's help, options and errors are the whole app's, word for word."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from runledger.cli import main
from runledger.cli.main import COMMANDS, app, build_app, program_command

RUNNER = CliRunner()


def _help(of: object, words: list[str]) -> tuple[int, str]:
    done = RUNNER.invoke(of, [*words, "--help"], env={"COLUMNS": "100"})  # type: ignore[arg-type]
    return done.exit_code, done.output


@pytest.mark.parametrize("words", [words for words, _ in COMMANDS], ids=[words for words, _ in COMMANDS])
def test_a_commands_help_is_the_whole_apps(words: str) -> None:
    one = build_app(words)
    assert _help(one, words.split()) == _help(app, words.split())


def test_the_one_command_app_has_that_command_only() -> None:
    one = build_app("ingest spool")
    assert [info.name for info in one.registered_commands] == []
    [group] = one.registered_groups
    assert group.name == "ingest"
    assert group.typer_instance is not None
    assert [info.name for info in group.typer_instance.registered_commands] == ["spool"]
    assert [info.name for info in build_app("query").registered_commands] == ["query"]


def test_a_usage_error_reads_the_same() -> None:
    args = ["query", "SELECT 1", "--limit", "-1"]
    whole = RUNNER.invoke(app, args)
    alone = RUNNER.invoke(build_app("query"), args)
    assert (alone.exit_code, alone.output) == (whole.exit_code, whole.output)
    assert whole.exit_code == 2


@pytest.mark.parametrize(
    ("args", "command"),
    [
        (["query", "SELECT 1", "--ledger", "x"], "query"),
        (["--version", "state", "latest"], "state"),
        (["ingest", "spool", "--spool", "s"], "ingest spool"),
        (["ingest", "--help"], None),
        (["--help"], None),
        ([], None),
        (["qurey", "SELECT 1"], None),
        (["kafka", "topic", "create", "t"], None),  # (three words: the whole app answers)
    ],
)
def test_the_command_the_arguments_name(args: list[str], command: str | None) -> None:
    assert program_command(args) == command


def test_completion_gets_the_whole_app(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("_LEDGER_COMPLETE", "complete_bash")
    assert program_command(["query", "SELECT 1"]) is None


def test_every_command_is_in_the_whole_app() -> None:
    assert main.app is app
    for words, _ in COMMANDS:
        assert _help(app, words.split())[0] == 0, words


def test_building_the_app_again_answers_the_same() -> None:
    """Each build reads the commands' signatures afresh (``runledger.cli.typer_params``)."""
    first = [RUNNER.invoke(app, args).output for args in (["--version"], ["state", "--help"])]
    again = [RUNNER.invoke(build_app(), args).output for args in (["--version"], ["state", "--help"])]
    assert first == again
    assert first[0].startswith("runledger ")
