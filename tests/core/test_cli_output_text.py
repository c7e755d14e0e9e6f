"""What a command prints of a recorded value: the value as it is, every control character shown as
an escape (an ESC from a hostile event must not reach the reader's terminal), the table's shape kept."""

from __future__ import annotations

import pytest

from runledger.cli.output import print_lines, render_table

HOSTILE = "a\x1b[2Jb\x07c\nd\x9be\x7f"
SHOWN = "a\\x1b[2Jb\\x07c\\nd\\x9be\\x7f"


def test_a_table_cell_shows_control_characters_as_escapes() -> None:
    text = render_table(["v"], [(HOSTILE,)])
    assert text.splitlines()[3] == f"│ {SHOWN} │"
    assert not any(ord(ch) < 0x20 for ch in text.replace("\n", ""))


def test_plain_lines_show_control_characters_as_escapes(capsys: pytest.CaptureFixture[str]) -> None:
    print_lines(["[bold]x[/] :rocket:", HOSTILE])
    assert capsys.readouterr().out == f"[bold]x[/] :rocket:\n{SHOWN}\n"


def test_a_console_line_shows_control_characters_as_escapes(capsys: pytest.CaptureFixture[str]) -> None:
    """Lines through rich (messages, errors, blame and history lines): rich itself passes an ESC on."""
    from runledger.cli.output import LazyConsole

    LazyConsole(stderr=False).print("a\x1b[2Jb\x07c\r\n\td\x9b", markup=False, highlight=False)
    assert capsys.readouterr().out == "a\\x1b[2Jb\\x07c\\x0d\n        d\\x9b\n"  # (rich expands a tab)
