"""The one line a command says when its install extra is missing (``runledger.cli.extras``, ``runledger.cli.entry``), in
this (complete) environment: an extra is made missing by pointing it at a module that does not exist."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from runledger.cli import extras
from runledger.cli.entry import command_words, extension_missing_line, missing_extra_line, needed_extra
from runledger.cli.main import app

ABSENT = "runledger_no_such_module_for_tests"


@pytest.fixture
def trainer_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(extras.EXTRA_MODULES, "trainer", (ABSENT,))


def test_every_extra_is_installed_here() -> None:
    assert extras.missing_extras(*extras.EXTRA_MODULES) == []


def test_install_line_names_the_extra_and_leaves_out_what_it_brings() -> None:
    assert extras.install_line("ledger demo", ["trainer"]) == (
        "`ledger demo` needs the trainer extra: pip install 'runledger[trainer]'"
    )
    # [trainer] brings [operator] and [ledger]: only it is named.
    assert extras.install_line("ledger demo", ["ledger", "trainer", "operator"]).endswith(
        "'runledger[trainer]'"
    )


def test_an_extra_is_missing_when_one_it_brings_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(extras.EXTRA_MODULES, "ledger", (ABSENT,))
    assert extras.missing_extras("trainer", "operator", "ledger") == ["trainer", "operator", "ledger"]


def test_a_failed_import_of_an_extras_module_is_the_same_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(extras.EXTRA_MODULES, "trainer", ("torch", ABSENT + "_root"))
    monkeypatch.setattr(extras, "module_missing", lambda name: False)  # as if found, then broken
    with (
        pytest.raises(extras.MissingExtraError, match=r"needs the trainer extra"),
        extras.extra_imports("ledger train", "trainer"),
    ):
        raise ModuleNotFoundError("half-installed", name=ABSENT + "_root.sub")
    with pytest.raises(ModuleNotFoundError), extras.extra_imports("ledger train", "trainer"):
        raise ModuleNotFoundError("not an extra's", name="some_other_module")


@pytest.mark.parametrize(
    ("args", "words", "extra"),
    [
        (["demo", "--steps", "3"], ["demo"], "trainer"),
        (["--version"], [], "ledger"),
        (["-h"], [], "ledger"),
        (["ingest", "wandb", "--project", "p"], ["ingest", "wandb"], "operator"),
        (["query", "SELECT 1", "--remote", "http://x/"], ["query"], "ledger"),
        (["study", "token-drop", "--quick"], ["study", "token-drop"], "trainer"),
        (["verify", "--remote", "http://x/"], ["verify"], "ledger"),
    ],
)
def test_entry_finds_the_command_and_its_extra(args: list[str], words: list[str], extra: str) -> None:
    assert command_words(args) == words
    assert needed_extra(words) == extra
    assert missing_extra_line(args) is None  # all installed here


def test_entry_line_for_a_missing_extra(trainer_missing: None) -> None:
    assert missing_extra_line(["demo", "--steps", "3"]) == (
        "`ledger demo` needs the trainer extra: pip install 'runledger[trainer]'"
    )
    assert missing_extra_line(["query", "SELECT 1"]) is None


@pytest.mark.parametrize(
    ("args", "command"),
    [
        (["demo", "--workdir", "w", "--steps", "3"], "ledger demo"),
        (["study", "token-drop", "--quick", "--workdir", "w"], "ledger study token-drop"),
        (["train", "CONFIG", "--log-every", "0"], "ledger train"),
    ],
)
def test_trainer_commands_say_one_line_and_touch_nothing(
    trainer_missing: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], command: str
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RUNLEDGER_SPOOL", str(tmp_path / "spool"))
    (tmp_path / "CONFIG").write_text("")
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert lines == [f"error: `{command}` needs the trainer extra: pip install 'runledger[trainer]'"], (
        result.output
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["CONFIG"]  # no work folder, no spool


def test_a_missing_duckdb_extension_wheel_names_the_operator_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from runledger.ledger.duck import ExtensionMissing

    exc = ExtensionMissing("DuckDB extension 'ducklake': install the duckdb-extension-ducklake wheel")
    assert extension_missing_line(["runs"], exc) == str(exc)  # the wheels are here: DuckDB's words
    monkeypatch.setitem(extras.EXTRA_MODULES, "operator", (ABSENT,))
    assert extension_missing_line(["runs", "--ledger", "x"], exc) == (
        "`ledger runs` needs the operator extra: pip install 'runledger[operator]'"
    )
