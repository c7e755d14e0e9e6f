"""A command's plain values read without pydantic (``runledger.cli.typer_params``, issue 41) come out
exactly as typer's own adapters make them: the same value, or the same error with the same words."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from typer import _coercion
from typer.models import OptionInfo

from runledger.cli import typer_params
from runledger.cli.output import Format


def _outcome(runtime: Any, raw: Any) -> tuple[str, Any]:
    """("value", the value) or ("error", its type and message) of reading ``raw``."""
    try:
        return "value", runtime._coerce_value(raw, param=None, ctx=None)
    except Exception as exc:  # the outcome compared, whatever it is
        return "error", (type(exc).__name__, str(exc))


def _cases(tmp_path: Path) -> list[tuple[type, dict[str, Any], Any]]:
    """(annotation, option settings, raw value): plain values, and values only typer can judge."""
    folder = tmp_path / "a-folder"
    folder.mkdir()
    return [
        (str, {}, "SELECT 1"),
        (str, {}, ""),
        (int, {}, "42"),
        (int, {}, "-7"),
        (int, {}, "007"),
        (int, {}, "4x"),
        (int, {}, " 5"),
        (int, {}, "1_000"),
        (int, {"min": 0}, "0"),
        (int, {"min": 0}, "-1"),
        (int, {"min": 0, "clamp": True}, "-3"),
        (int, {}, 12),
        (float, {}, "2.5"),
        (float, {}, "3"),
        (float, {}, "1e3"),
        (float, {}, "nan"),
        (float, {}, "x"),
        (float, {"max": 1.0}, "2"),
        (float, {}, 30.0),
        (bool, {}, True),
        (Path, {}, "some/where"),
        (Path, {}, Path(".runledger/ledger")),
        (Path, {"exists": True}, str(tmp_path / "missing")),
        (Path, {"dir_okay": False}, str(folder)),
        (Path, {"file_okay": False}, str(folder)),
        (Format, {}, "csv"),
        (Format, {}, Format.json),
        (Format, {}, "xml"),
        (Format, {}, "CSV"),
        (Format, {"case_sensitive": False}, "CSV"),
    ]


def test_plain_values_are_read_as_typer_reads_them(tmp_path: Path) -> None:
    for annotation, settings, raw in _cases(tmp_path):
        descriptor = _coercion.resolve_type_descriptor(annotation, OptionInfo(**settings))
        ours = typer_params._build_runtime_param(descriptor)
        assert isinstance(ours, typer_params.PlainRuntimeParam), annotation  # (the plain reader runs)
        typers = typer_params._TYPER_BUILD(descriptor)
        assert not isinstance(typers, typer_params.PlainRuntimeParam)
        # (compared as repr: the value's type shows, and NaN equals NaN)
        assert repr(_outcome(ours, raw)) == repr(_outcome(typers, raw)), (annotation, settings, raw)


@pytest.mark.parametrize(
    ("annotation", "raw"),
    [(list[str], ["a", "b"]), (tuple[int, int], ("1", "2")), (datetime, "2026-01-02T03:04:05")],
)
def test_other_types_are_read_by_typer(annotation: Any, raw: Any) -> None:
    """A list, a tuple, a date: typer's adapter reads them (built when such a value comes)."""
    descriptor = _coercion.resolve_type_descriptor(annotation, OptionInfo())
    ours = typer_params._build_runtime_param(descriptor)
    typers = typer_params._TYPER_BUILD(descriptor)
    assert repr(_outcome(ours, raw)) == repr(_outcome(typers, raw))
    assert _outcome(ours, raw)[0] == "value"


def test_a_custom_parser_is_typers() -> None:
    descriptor = _coercion.resolve_type_descriptor(str, OptionInfo(parser=str.upper))
    runtime = typer_params._build_runtime_param(descriptor)
    assert runtime._coerce_value("abc", param=None, ctx=None) == "ABC"


def test_a_signature_is_read_once_for_the_two_asks() -> None:
    reads: list[object] = []

    def read(func: Any) -> dict[str, Any]:
        reads.append(func)
        return {"n": len(reads)}

    params_of = typer_params._read_once_for_two(read)
    assert params_of(len) == params_of(len) == {"n": 1}  # (a command's two asks: one read)
    assert params_of(len) == {"n": 2}  # the next build reads the function again
    assert params_of(abs) == {"n": 3}
    assert reads == [len, len, abs]
