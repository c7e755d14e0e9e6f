"""docs/reference/cli.md is the CLI's own help, regenerated: a command, option or help text changed
without rerunning scripts/cli_reference.py fails here."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "cli_reference.py"


def _script() -> Any:
    """The script as a module (it is not a package's)."""
    spec = importlib.util.spec_from_file_location("cli_reference", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_reference_is_the_cli_help_regenerated() -> None:
    script = _script()
    committed = script.REFERENCE_FILE.read_text()
    assert committed == script.render(), "docs/reference/cli.md is stale: run python scripts/cli_reference.py"


def test_the_reference_names_every_command_with_its_options() -> None:
    text = _script().render()
    for heading in ("## `ledger query`", "## `ledger ingest kafka`", "## `ledger prove inclusion`"):
        assert heading in text, heading
    assert "`--remote <str>`" in text and "`--leaf-out <path>`" in text
    assert "Example: ledger query" in text  # the help's own example, kept


def test_the_reference_does_not_depend_on_the_terminal_or_environment(tmp_path: Path) -> None:
    # A narrow terminal and a ledger named by the environment change --help's look, never the page.
    env = {"PATH": "/usr/bin:/bin", "COLUMNS": "20", "RUNLEDGER_LEDGER": str(tmp_path / "elsewhere")}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_stale_page_is_named_with_the_command_that_fixes_it(tmp_path: Path) -> None:
    script = _script()
    script.REFERENCE_FILE = tmp_path / "cli.md"
    script.REFERENCE_FILE.write_text("# old\n")
    assert script.main(["cli_reference.py", "--check"]) == 1
    assert script.main(["cli_reference.py", "--bogus"]) == 2
    assert script.main(["cli_reference.py"]) == 0 and script.REFERENCE_FILE.read_text() == script.render()
