"""Command-line values read without pydantic where plain Python reads them the same (issue 41).

typer 0.29 coerces every parameter of the command that runs through a pydantic ``TypeAdapter``:
importing pydantic and building the adapters is ~70 ms of a one-shot ``ledger query``. The values
the ledger's commands take are mostly plain: text, a whole or decimal number, a path, a flag, one of
an enum's names; and an option left out needs no reading at all. ``install`` makes typer read such a
value in plain Python, and hand everything else (a malformed number, an out-of-range one, a date, a
list, a custom parser) to its own adapter, built then, so the value, and every error message, is
exactly typer's. On a typer without this layer it does nothing.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Any

import typer.core
import typer.main
from typer.models import ParamMeta

try:  # typer's internal coercion layer (0.2x): absent elsewhere, where nothing is changed
    from typer import _coercion
    from typer._param_types import coerce_cli_choice, coerce_cli_path
except ImportError:  # pragma: no cover - another typer
    _coercion = None  # type: ignore[assignment]

_ParamsReader = Callable[[Callable[..., Any]], dict[str, ParamMeta]]  # typer's reader of a signature
_WHOLE = re.compile(r"-?[0-9]+")
_DECIMAL = re.compile(r"-?[0-9]+(\.[0-9]+)?")
_UNKNOWN = object()  # "plain Python cannot say": typer's adapter reads the value


def _within(number: float, info: Any) -> bool:
    """``number`` lies inside the parameter's min/max (a clamped one goes to typer)."""
    if info.clamp:
        return False
    return (info.min is None or number >= info.min) and (info.max is None or number <= info.max)


def _plain_number(annotation: type, value: Any, info: Any) -> Any:
    """An int or float option's value, when its text is a plain number within its bounds."""
    if isinstance(value, annotation) and not isinstance(value, bool):
        number: Any = value
    elif isinstance(value, str) and (_WHOLE if annotation is int else _DECIMAL).fullmatch(value):
        number = annotation(value)
    else:
        return _UNKNOWN
    return number if _within(number, info) else _UNKNOWN


def _plain_value(descriptor: Any, value: Any, param: Any, ctx: Any) -> Any:
    """The value typer would make of ``value``, or ``_UNKNOWN``."""
    annotation, info = descriptor.annotation, descriptor.parameter_info
    if info.parser is not None:
        return _UNKNOWN
    if annotation is str:
        return value if isinstance(value, str) else _UNKNOWN
    if annotation is bool:
        return value if isinstance(value, bool) else _UNKNOWN
    if annotation in (int, float):
        return _plain_number(annotation, value, info)
    if annotation is Path and info.path_type is None and isinstance(value, (str, Path)):
        # typer's own checks (exists, readable, ...) with its messages; the text made a Path as typer does.
        return coerce_cli_path(Path(value), info, path_type=Path, param=param, ctx=ctx)
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        try:
            return coerce_cli_choice(
                value, choices=list(annotation), case_sensitive=info.case_sensitive, ctx=ctx
            )
        except ValueError:
            return _UNKNOWN  # (typer's adapter raises the usage error with its wording)
    return _UNKNOWN


if _coercion is not None:

    class PlainRuntimeParam(_coercion.RuntimeParam):
        """A parameter read in plain Python where it can be, else by typer's own adapter. (Not a
        dataclass of its own: defining one is ~0.8 ms here, on every command's start.)"""

        descriptor: Any

        def __init__(self, parameter_info: Any, annotation: Any, descriptor: Any) -> None:
            super().__init__(parameter_info=parameter_info, annotation=annotation)
            object.__setattr__(self, "descriptor", descriptor)  # (the parent is a frozen dataclass)

        def _coerce_value(self, value: Any, param: Any, ctx: Any) -> Any:
            plain = _plain_value(self.descriptor, value, param, ctx)
            if plain is not _UNKNOWN:
                return plain
            typers = _TYPER_BUILD(self.descriptor)
            return typers._coerce_value(value, param=param, ctx=ctx)

    _TYPER_BUILD = _coercion.build_runtime_param


def _build_runtime_param(descriptor: Any) -> Any:
    """typer's ``build_runtime_param``, its adapter built only for a value plain Python cannot read:
    an option left out (None) builds none (a file is opened by typer's own reader)."""
    if descriptor.file_annotation is not None:
        return _TYPER_BUILD(descriptor)
    return PlainRuntimeParam(
        parameter_info=descriptor.parameter_info, annotation=descriptor.annotation, descriptor=descriptor
    )


def _read_once_for_two(read: _ParamsReader) -> _ParamsReader:
    """typer's ``get_params_from_function``, whose every command asks twice in a row (its parameters,
    then its call's argument names: ~30 ms of building the whole app for ``ledger --help``): the
    second ask gets the first's answer, the next ask reads the function again."""
    read_once: dict[Callable[..., Any], dict[str, ParamMeta]] = {}

    def params_of(func: Callable[..., Any]) -> dict[str, ParamMeta]:
        if func in read_once:
            return read_once.pop(func)
        answer = read_once[func] = read(func)
        return answer

    return params_of


def install() -> None:
    """From now on typer's parameters read plain values without pydantic, and a command's
    signature is read once per build (a typer without these layers is left as it is)."""
    if _coercion is not None and hasattr(typer.core, "build_runtime_param"):
        typer.core.build_runtime_param = _build_runtime_param
    read = getattr(typer.main, "get_params_from_function", None)
    if read is not None and read.__module__ == "typer.utils":  # (not installed yet)
        typer.main.get_params_from_function = _read_once_for_two(read)  # type: ignore[assignment]
