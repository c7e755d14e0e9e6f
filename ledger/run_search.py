"""Search and sort a ledger's runs: the one query behind ``ledger runs`` and the page's run index.

A lab keeps thousands of runs. ``RunFilter`` says which (a run id or name pattern, tags, a status,
config values, a start-time window) and how to show them (a metric's best or last value, a sort
column, a row limit); ``search_runs`` answers it with one parameterised statement over the
``run_status`` view (``runledger.ledger.views``). User text never becomes SQL text: values travel
as parameters, config paths are checked key by key, and a sort column must be one of the answer's
columns. The ``parse_*`` functions turn command-line or URL text into a filter's typed parts and
raise ``RunFilterError`` (one line) on bad input.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, Protocol, TypeVar

_Rows = TypeVar("_Rows", covariant=True)
_Answer = TypeVar("_Answer")


class SqlReader(Protocol[_Rows]):
    """What the search needs of a reader (``runledger.ledger.query.Reader``): one parameterised
    statement answered (named here, not imported: the reader's module imports this one)."""

    def sql(self, statement: str, params: Sequence[Any] | None = None) -> _Rows: ...


STATUSES = ("running", "finished", "crashed")
MetricMode = Literal["min", "max", "last"]
METRIC_MODES: tuple[MetricMode, ...] = ("min", "max", "last")
ConfigValue = bool | int | float | str | None

# The answer's columns, in order; a metric adds METRIC_COLUMNS after them.
RUN_COLUMNS = (
    "run_id",
    "name",
    "status",
    "started_at",
    "attempts",
    "last_step",
    "crashes",
    "tags",
    "git_commit",
    "config_hash",
)
METRIC_COLUMNS = ("metric_value", "metric_step")

_CONFIG_TEST = re.compile(r"^(?P<path>[^=!<>\s]+)\s*(?P<op>==|=|!=|<=|>=|<|>)\s*(?P<value>.*)$", re.DOTALL)
_CONFIG_KEY = re.compile(r"^[A-Za-z0-9_\-/:@+]+$")
_RELATIVE_TIME = re.compile(r"^(?P<count>\d{1,6})(?P<unit>[mhdw])$")
_UNIT_SECONDS = {"m": 60, "h": 3600, "d": 86_400, "w": 604_800}


class RunFilterError(ValueError):
    """A filter's text that cannot be understood; its message is one line."""


@dataclass(frozen=True)
class ConfigTest:
    """One comparison of the value at a dotted path in a run's latest resolved config."""

    path: tuple[str, ...]
    op: str  # = != < <= > >=
    value: ConfigValue


@dataclass(frozen=True)
class RunFilter:
    """Which runs, and how to show them. Every field is optional; the empty filter lists every run."""

    pattern: str | None = None  # glob over run id and name; text without * ? [ matches as a substring
    tags: tuple[str, ...] = ()  # every one of them among the tags of the run's notes
    status: str | None = None  # running | finished | crashed
    config: tuple[ConfigTest, ...] = ()
    since: datetime | None = None  # started at or after
    until: datetime | None = None  # started before
    metric: str | None = None  # adds metric_value and metric_step; runs without the metric are left out
    metric_mode: MetricMode = "last"
    sort: str | None = None  # one of the answer's columns; default: the metric's best, else started_at
    descending: bool = False
    limit: int | None = None


# -- parsing user text into typed parts -------------------------------------------------------------


def parse_config_test(text: str) -> ConfigTest:
    """``moe.capacity_factor=1.25`` → a typed test. The value is read as JSON when it is a JSON
    number, true, false or null (or a quoted string), else as plain text."""
    match = _CONFIG_TEST.match(text.strip())
    if match is None:
        raise RunFilterError(f"config filter {text!r} is not KEY=VALUE (e.g. moe.capacity_factor=1.25)")
    path = tuple(match["path"].split("."))
    bad = [key for key in path if not _CONFIG_KEY.match(key)]
    if bad:
        raise RunFilterError(
            f"config filter {text!r}: key {bad[0]!r} is not a config key (A-Z a-z 0-9 _ - / : @ +)"
        )
    op = "=" if match["op"] == "==" else match["op"]
    value = _config_value(match["value"].strip())
    if op not in ("=", "!=") and (isinstance(value, bool) or value is None):
        raise RunFilterError(
            f"config filter {text!r}: {op} compares numbers or text, not {json.dumps(value)}"
        )
    return ConfigTest(path, op, value)


def _config_value(text: str) -> ConfigValue:
    """JSON scalars as themselves, anything else as the text it is."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    raise RunFilterError(f"config value {text!r} is a JSON list or object; compare one value at a time")


def parse_time(text: str, *, now: datetime | None = None) -> datetime:
    """An ISO date or date-time (UTC unless it names a zone), or an age: 30m, 12h, 7d, 2w ago."""
    relative = _RELATIVE_TIME.match(text.strip())
    if relative:
        seconds = int(relative["count"]) * _UNIT_SECONDS[relative["unit"]]
        return (now or datetime.now(UTC)) - timedelta(seconds=seconds)
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise RunFilterError(
            f"time {text!r} is not a date (2026-06-01), a date-time or an age (7d)"
        ) from None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def parse_status(text: str) -> str:
    if text not in STATUSES:
        raise RunFilterError(f"status {text!r} is not one of {', '.join(STATUSES)}")
    return text


def parse_metric_mode(text: str) -> MetricMode:
    for mode in METRIC_MODES:
        if text == mode:
            return mode
    raise RunFilterError(f"metric mode {text!r} is not one of {', '.join(METRIC_MODES)}")


def answer_columns(filt: RunFilter) -> tuple[str, ...]:
    return RUN_COLUMNS + (METRIC_COLUMNS if filt.metric else ())


def check(filt: RunFilter) -> None:
    """Refuse, in one line, a filter whose parts do not fit together (the sort column, the limit)."""
    columns = answer_columns(filt)
    if filt.sort is not None and filt.sort not in columns:
        hint = " (metric_value and metric_step come with --metric)" if filt.sort in METRIC_COLUMNS else ""
        raise RunFilterError(f"unknown column {filt.sort!r} to sort by; columns: {', '.join(columns)}{hint}")
    if filt.limit is not None and filt.limit < 0:
        raise RunFilterError(f"limit {filt.limit} is negative")
    if filt.since and filt.until and filt.since >= filt.until:
        raise RunFilterError(
            f"--since {filt.since.isoformat()} is not before --until {filt.until.isoformat()}"
        )


# -- the statement ----------------------------------------------------------------------------------


def search_runs(reader: SqlReader[_Answer], filt: RunFilter) -> _Answer:
    """The runs ``filt`` selects, with ``answer_columns(filt)``, in its order."""
    check(filt)
    statement, params = search_statement(filt)
    return reader.sql(statement, params)


def search_statement(filt: RunFilter) -> tuple[str, list[Any]]:
    """One SELECT over ``run_status`` (and, for a metric, one grouped scan of ``metrics``) with every
    user value as a parameter."""
    params: list[Any] = []
    metric_join = _metric_join(filt, params)
    where = _where(filt, params)
    columns = ", ".join(
        f"s.{c}" if c != "tags" else "array_to_string(s.tags, ',') AS tags" for c in RUN_COLUMNS
    )
    if filt.metric:
        columns += ", m.metric_value, m.metric_step"
    statement = f"SELECT {columns} FROM run_status s{metric_join}"
    if where:
        statement += " WHERE " + " AND ".join(where)
    statement += " ORDER BY " + _order(filt)
    if filt.limit:
        statement += " LIMIT ?"
        params.append(filt.limit)
    return statement, params


def _metric_join(filt: RunFilter, params: list[Any]) -> str:
    """The metric's best (lowest or highest finite value) or last value per run, with its step."""
    if not filt.metric:
        return ""
    params.append(filt.metric)
    finite = "FILTER (WHERE isfinite(value))"
    value, step = {
        "min": (f"min(value) {finite}", f"arg_min(step, value) {finite}"),
        "max": (f"max(value) {finite}", f"arg_max(step, value) {finite}"),
        "last": ("arg_max(value, step)", "max(step)"),
    }[filt.metric_mode]
    return (
        f" JOIN (SELECT run_id, {value} AS metric_value, {step} AS metric_step"
        " FROM metrics WHERE name = ? GROUP BY run_id) m ON m.run_id = s.run_id"
    )


def _where(filt: RunFilter, params: list[Any]) -> list[str]:
    """The filter's conditions, in the order their parameters are appended."""
    where: list[str] = []
    if filt.pattern:
        glob = filt.pattern if any(ch in filt.pattern for ch in "*?[") else f"*{filt.pattern}*"
        where.append("(s.run_id GLOB ? OR coalesce(s.name, '') GLOB ?)")
        params += [glob, glob]
    for tag in filt.tags:
        where.append("list_contains(s.tags, ?)")
        params.append(tag)
    if filt.status:
        where.append("s.status = ?")
        params.append(filt.status)
    for test in filt.config:
        where.append(_config_condition(test, params))
    if filt.since:
        where.append("s.started_at >= ?")
        params.append(filt.since)
    if filt.until:
        where.append("s.started_at < ?")
        params.append(filt.until)
    return where


def _config_condition(test: ConfigTest, params: list[Any]) -> str:
    """A typed comparison: a number matches only a JSON number (1 = 1.0), text only a JSON string,
    true/false only a JSON boolean, null only a JSON null. ``!=`` is every run the ``=`` misses."""
    path = "$." + ".".join(f'"{key}"' for key in test.path)
    op = "=" if test.op == "!=" else test.op
    if test.value is None:
        condition = "coalesce(json_type(s.config, ?) = 'NULL', false)"
        params.append(path)
    elif isinstance(test.value, bool):
        condition = (
            "coalesce(json_type(s.config, ?) = 'BOOLEAN' AND json_extract_string(s.config, ?) = ?, false)"
        )
        params += [path, path, "true" if test.value else "false"]
    elif isinstance(test.value, int | float):
        condition = (
            "coalesce(json_type(s.config, ?) IN ('BIGINT', 'UBIGINT', 'DOUBLE')"
            f" AND CAST(json_extract_string(s.config, ?) AS DOUBLE) {op} ?, false)"
        )
        params += [path, path, float(test.value)]
    else:
        condition = (
            f"coalesce(json_type(s.config, ?) = 'VARCHAR' AND json_extract_string(s.config, ?) {op} ?, false)"
        )
        params += [path, path, test.value]
    return f"NOT {condition}" if test.op == "!=" else condition


def _order(filt: RunFilter) -> str:
    """ORDER BY a checked column (then run id, so ties have one order)."""
    column, descending = filt.sort, filt.descending
    if column is None and filt.metric and filt.metric_mode != "last":  # the best first, unless --desc
        column, descending = "metric_value", (filt.metric_mode == "max") != filt.descending
    if column is None:
        column = "started_at"
    source = "m" if column in METRIC_COLUMNS else "s"
    direction = " DESC" if descending else ""
    return f"{source}.{column}{direction} NULLS LAST, s.run_id"
