"""`ledger report`: one self-contained HTML file that draws a run's history on its curves.

Everything the page shows is read here with DuckDB through the ledger's views (``Reader``), reduced
in the query so the file stays small at any run length: each curve keeps, per pixel bucket (default
2,000 across the step range), the minimum and the maximum point of every attempt, so spikes survive
while the point count is bounded. Event markers (launches, resumes, config changes, checkpoints,
crashes, skipped steps, annotations, PR merges and pushes) are never reduced: every one is kept
with its exact step and text. The page inlines Apache ECharts (``report_assets/``) and the data as
JSON; a Content-Security-Policy forbids any fetch, so it opens from disk with no network.

``build_report`` returns the data (a dict, also what ``ledger plot`` draws); ``render_html`` turns
it into the page; ``write_report`` does both and writes the file durably.
"""

from __future__ import annotations

import html
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import resources
from pathlib import Path
from typing import Any

from runledger.ledger.history import github_item
from runledger.ledger.log_checkpoint import parse_and_verify_checkpoint, parse_checkpoint
from runledger.ledger.query import QueryError, Reader
from runledger.ledger.store import StreamHead
from runledger.ledger.stream_checkpoints import checkpoint_path
from runledger.schemas.durable import write_durably

# The curves drawn against step, in page order: (metric name in the `metrics` view, label).
CURVES = (
    ("loss", "loss"),
    ("lr", "learning rate"),
    ("grad_norm", "grad norm"),
    ("tokens_per_second", "tokens/s"),
    ("mfu", "MFU (%)"),
)
# Event kinds as markers, for the page and the plot alike: label, colour, ECharts and matplotlib symbol,
# the height (0..1 of the plot) of the row its symbols sit on, and (line: False) no vertical line on the page.
MARKER_KINDS: dict[str, dict[str, Any]] = {
    "run.started": {"label": "launch", "color": "#2f6fde", "symbol": "triangle", "mpl": "^", "row": 0.94},
    "run.resumed": {"label": "resume", "color": "#7b3fe4", "symbol": "triangle", "mpl": "^", "row": 0.94},
    "config.changed": {
        "label": "config change",
        "color": "#e08a00",
        "symbol": "diamond",
        "mpl": "D",
        "row": 0.86,
    },
    "config.rejected": {
        "label": "config refused",
        "color": "#a15c00",
        "symbol": "emptyDiamond",
        "mpl": "d",
        "row": 0.86,
    },
    "checkpoint.saved": {
        "label": "checkpoint",
        "color": "#2e9e5b",
        "symbol": "rect",
        "mpl": "s",
        "row": 0.78,
        "line": False,  # routine (every 1,000 steps): its symbol, not a line through every chart
    },
    # A detector's finding (runledger.ledger.anomalies): its symbol only, as a finding is not a change.
    "ledger.anomaly": {
        "label": "anomaly",
        "color": "#b42318",
        "symbol": "pin",
        "mpl": "*",
        "row": 0.7,
        "line": False,
    },
    "run.crashed": {"label": "crash", "color": "#d92d20", "symbol": "circle", "mpl": "X", "row": 0.94},
    "step.skipped": {
        "label": "skipped step",
        "color": "#c4320a",
        "symbol": "emptyCircle",
        "mpl": "o",
        "row": 0.7,
    },
    "run.finished": {"label": "finished", "color": "#344054", "symbol": "rect", "mpl": "s", "row": 0.94},
    "annotation": {"label": "annotation", "color": "#0e9384", "symbol": "roundRect", "mpl": "P", "row": 0.7},
    "github.merge": {"label": "PR merge", "color": "#6941c6", "symbol": "arrow", "mpl": "v", "row": 0.62},
    "github.push": {
        "label": "push",
        "color": "#9e77ed",
        "symbol": "arrow",
        "mpl": "v",
        "row": 0.62,
        "line": False,
    },
}
SUPERSEDED_COLOR = "#98a2b3"
DEFAULT_BUCKETS = 2000
HEATMAP_BUCKETS = 500  # layer × step cells: 48 layers × 500 steps keeps the page light
EXPERT_LOAD_STEPS = 8  # logged steps whose layer × expert matrix is embedded (the chosen one included)
SIGNIFICANT_DIGITS = 6  # values are written with 6 significant digits: finer than a pixel


class ReportError(QueryError):
    pass


@dataclass(frozen=True)
class StepRange:
    lo: int
    hi: int

    @property
    def span(self) -> int:
        return self.hi - self.lo + 1


def _num(value: float | None) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return float(f"{value:.{SIGNIFICANT_DIGITS}g}")


# ---------------------------------------------------------------------------------------- reduction
# key → (steps, values, how many raw points they stand for)
Reduced = dict[tuple[Any, ...], tuple[list[int], list[float | None], int]]


def _minmax(
    reader: Reader, source_sql: str, params: list[Any], keys: Sequence[str], rng: StepRange, buckets: int
) -> Reduced:
    """Rows of ``source_sql`` (columns ``keys``…, step, value) reduced to each bucket's min and max point,
    plus each key's very first and last point (so a curve spans exactly the steps it has).

    Returns {key tuple: (steps, values)} with points in step order, at most 2 per bucket + 2. Non-finite
    values (a NaN loss) are left out: the event markers (skipped step, crash) tell of them.
    """
    key_cols = "".join(f"{k}, " for k in keys)
    rows = reader.sql(
        f"WITH s AS ({source_sql}) "
        f"SELECT {key_cols}(step - {rng.lo}) * {buckets} // {rng.span} AS bucket, "
        "arg_min(step, value) AS min_step, min(value) AS min_value, "
        "arg_max(step, value) AS max_step, max(value) AS max_value, "
        "min(step) AS first_step, arg_min(value, step) AS first_value, "
        "max(step) AS last_step, arg_max(value, step) AS last_value, count(*) AS raw_points "
        f"FROM s WHERE step BETWEEN {rng.lo} AND {rng.hi} AND value IS NOT NULL AND isfinite(value) "
        f"GROUP BY ALL ORDER BY {key_cols}bucket",
        params,
    ).rows
    n = len(keys)
    points: dict[tuple[Any, ...], dict[int, float]] = {}
    raw: dict[tuple[Any, ...], int] = {}
    for i, row in enumerate(rows):
        key = tuple(row[:n])
        (
            _bucket,
            min_step,
            min_value,
            max_step,
            max_value,
            first_step,
            first_value,
            last_step,
            last_value,
            count,
        ) = row[n:]
        kept = points.setdefault(key, {})
        if not kept:  # the key's first bucket
            kept[first_step] = first_value
        kept[min_step] = min_value
        kept[max_step] = max_value
        if i + 1 == len(rows) or tuple(rows[i + 1][:n]) != key:  # its last bucket
            kept[last_step] = last_value
        raw[key] = raw.get(key, 0) + int(count)
    out: Reduced = {}
    for key, kept in points.items():
        steps = sorted(kept)
        out[key] = ([int(step) for step in steps], [_num(kept[step]) for step in steps], raw[key])
    return out


def reduce_series(
    reader: Reader, run_id: str, names: Sequence[str], rng: StepRange, buckets: int = DEFAULT_BUCKETS
) -> dict[str, list[dict[str, Any]]]:
    """Per metric: its segments, one per (attempt, superseded) with their min/max points per bucket.

    Superseded steps (an earlier attempt's steps after the checkpoint a later attempt resumed from)
    are their own segments, so they are drawn distinctly, never hidden and never overwriting.
    """
    marks = ", ".join("?" for _ in names)
    reduced = _minmax(
        reader,
        f"SELECT name, attempt, superseded, step, value FROM metrics_all WHERE run_id = ? AND name IN ({marks})",
        [run_id, *names],
        ("name", "attempt", "superseded"),
        rng,
        buckets,
    )
    out: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for (name, attempt, superseded), (steps, values, raw_points) in reduced.items():
        out[name].append(
            {
                "attempt": attempt,
                "superseded": bool(superseded),
                "x": steps,
                "y": values,
                "raw_points": raw_points,
            }
        )
    return out


def _single(reduced: Reduced) -> dict[str, list[Any]]:
    steps, values, _raw_points = reduced.get((), ([], [], 0))
    return {"x": steps, "y": values}


# ---------------------------------------------------------------------------------------- the run
def step_range(reader: Reader, run_id: str, from_step: int | None, to_step: int | None) -> StepRange:
    # Steps of the run's events and of its metric rows: the curves' range even where no event has a step.
    first, last = reader.sql(
        "SELECT min(step), max(step) FROM (SELECT step FROM events WHERE stream = ? "
        "UNION ALL SELECT step FROM _metrics WHERE run_id = ?)",
        [run_id, run_id],
    ).rows[0]
    first, last = first or 0, last or 0
    lo = first if from_step is None else from_step
    hi = last if to_step is None else to_step
    if lo > hi:
        raise ReportError(f"--from-step {lo} is after --to-step {hi}")
    if hi < first or lo > last:
        raise ReportError(f"steps {lo}..{hi} are outside run {run_id} (steps {first}..{last})")
    return StepRange(max(lo, first), min(hi, last))  # the part of the range the run has


def _superseded_after(reader: Reader, run_id: str) -> dict[int, int | None]:
    rows = reader.sql("SELECT attempt, superseded_after FROM attempts WHERE run_id = ?", [run_id]).rows
    return {attempt: after for attempt, after in rows}


def run_markers(reader: Reader, run_id: str, rng: StepRange) -> list[dict[str, Any]]:
    """Every event of the run inside the range, exactly (never reduced), with the text `history` gives it.

    GitHub merges and pushes of the run's repository during the run are placed at the step the run
    had reached at their time (the last step logged at or before it).
    """
    cutoff = _superseded_after(reader, run_id)
    markers: list[dict[str, Any]] = []
    for item in reader.history(run_id, lineage=False):  # the markers of this run id's own curves
        if item.kind == "github" or item.step is None:
            continue
        after = cutoff.get(item.attempt or 1)
        markers.append(
            {
                "kind": item.kind,
                "step": item.step,
                "attempt": item.attempt,
                "time": item.time.isoformat(),
                "text": item.text,
                "superseded": after is not None and item.step > after,
            }
        )
    markers.extend(_github_markers(reader, run_id))
    markers = [m for m in markers if rng.lo <= m["step"] <= rng.hi]
    markers.sort(key=lambda m: (m["step"], m["time"]))
    return markers


def _github_markers(reader: Reader, run_id: str) -> list[dict[str, Any]]:
    repository = reader.sql(
        "SELECT arg_max(repository, attempt) FILTER (WHERE repository IS NOT NULL) FROM attempts WHERE run_id = ?",
        [run_id],
    ).rows[0][0]
    if not repository:
        return []
    rows = reader.sql(
        "WITH g AS (SELECT * FROM github WHERE lower(repo) = lower(?) "
        "  AND ((kind = 'pull_request' AND merged) OR kind = 'push')), "
        "m AS (SELECT time, step FROM metrics WHERE run_id = ? AND name = 'loss') "
        "SELECT g.time, g.kind, g.action, g.number, g.title, g.state, g.actor, g.merged, g.sha, g.head_sha, "
        "g.url, g.body, m.step AS run_step FROM g ASOF JOIN m ON g.time >= m.time ORDER BY g.time",
        [repository, run_id],
    ).records()
    markers = []
    for g in rows:
        markers.append(
            {
                "kind": "github." + ("merge" if g["kind"] == "pull_request" else "push"),
                "step": int(g["run_step"]),
                "attempt": None,
                "time": g["time"].isoformat(),
                "text": github_item(g).text,
                "superseded": False,
            }
        )
    return markers


def attempts_table(reader: Reader, run_id: str) -> list[dict[str, Any]]:
    rows = reader.sql(
        "SELECT a.attempt, a.kind, a.start_step, a.started_at, a.git_commit, a.git_dirty, a.host, a.job_id, "
        "a.superseded_after, "
        "(SELECT max(step) FROM _metrics m WHERE m.run_id = a.run_id AND m.attempt = a.attempt) AS end_step, "
        "(SELECT max(time) FROM events e WHERE e.stream = a.run_id AND e.attempt = a.attempt) AS ended_at, "
        "(SELECT arg_max(c.kind || coalesce(': ' || c.exc_type, '') || coalesce(' ' || c.message, ''), c.stream_seq) "
        "   FROM crashes c WHERE c.run_id = a.run_id AND c.attempt = a.attempt) AS crash, "
        "(SELECT arg_max(e.status, e.stream_seq) FROM run_ends e WHERE e.run_id = a.run_id AND e.attempt = a.attempt) AS status "
        "FROM attempts a WHERE a.run_id = ? ORDER BY a.attempt",
        [run_id],
    ).records()
    out = []
    for r in rows:
        ended = f"crashed ({r['crash']})" if r["crash"] else (r["status"] or "no end recorded")
        out.append(
            {
                "attempt": r["attempt"],
                "kind": r["kind"],
                "start_step": r["start_step"],
                "end_step": r["end_step"] if r["end_step"] is not None else r["start_step"],
                "started_at": r["started_at"].isoformat() if r["started_at"] else None,
                "ended_at": r["ended_at"].isoformat() if r["ended_at"] else None,
                "ended": ended,
                "commit": (r["git_commit"] or "unknown")[:12] + (" (dirty)" if r["git_dirty"] else ""),
                "host": r["host"],
                "job": r["job_id"],
                "superseded_after": r["superseded_after"],
            }
        )
    return out


def lineage_table(reader: Reader, run_id: str) -> list[dict[str, Any]]:
    """The run's lineage across run ids (``runledger.ledger.lineage``), eldest first: each member's
    run id, the run and step it went on from, and the steps it supplies; one row where it has none."""
    return [
        {
            "run_id": m.run_id,
            "parent_run": m.parent_run,
            "fork_step": m.fork_step,
            "from_step": m.from_step,
            "to_step": m.to_step,
            "started_at": m.started_at.isoformat(),
        }
        for m in reader.lineage(run_id)
    ]


def lineage_title(run_id: str, lineage: Sequence[dict[str, Any]]) -> str:
    """``C (lineage A → B (from step 60) → C (from step 120))``; the run id alone without a lineage."""
    if len(lineage) <= 1:
        return run_id
    members = [
        m["run_id"] if i == 0 or m["fork_step"] is None else f"{m['run_id']} (from step {m['fork_step']:,})"
        for i, m in enumerate(lineage)
    ]
    return f"{run_id} (lineage {' → '.join(members)})"


def config_changes_table(reader: Reader, run_id: str, rng: StepRange) -> list[dict[str, Any]]:
    rows = reader.sql(
        "SELECT step, attempt, accepted, patch, cause_kind, cause_detail, actor, commit_sha, reason "
        "FROM config_changes WHERE run_id = ? AND step BETWEEN ? AND ? ORDER BY step, stream_seq",
        [run_id, rng.lo, rng.hi],
    ).records()
    for r in rows:
        r["patch"] = json.dumps(_json_value(r["patch"]), separators=(",", ":"), default=str)
    return rows


def _json_value(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def router_view(
    reader: Reader, run_id: str, rng: StepRange, buckets: int, expert_step: int | None
) -> dict[str, Any]:
    """Per-layer drop rate (layer × step), mean drop rate, the capacity factor / dispatcher live at each
    step, expert load (layer × expert) at a few logged steps and the load imbalance (max/mean) over time."""
    heat_buckets = min(buckets, HEATMAP_BUCKETS, rng.span)  # never more cells than steps
    between = f"run_id = ? AND step BETWEEN {rng.lo} AND {rng.hi}"
    cells = reader.sql(
        f"SELECT layer, (step - {rng.lo}) * {heat_buckets} // {rng.span} AS bucket, avg(token_drop_rate), count(*) "
        f"FROM moe_layer_stats WHERE {between} GROUP BY ALL ORDER BY layer, bucket",
        [run_id],
    ).rows
    mean_drop = _single(
        _minmax(
            reader,
            f"SELECT step, avg(token_drop_rate) AS value FROM moe_layer_stats WHERE {between} GROUP BY step",
            [run_id],
            (),
            rng,
            buckets,
        )
    )
    imbalance = _single(
        _minmax(
            reader,
            "SELECT step, avg(list_max(expert_counts) / list_avg(expert_counts)) AS value "
            f"FROM moe_layer_stats WHERE {between} AND len(expert_counts) > 0 GROUP BY step",
            [run_id],
            (),
            rng,
            buckets,
        )
    )
    logged = [
        s
        for (s,) in reader.sql(
            f"SELECT DISTINCT step FROM moe_layer_stats WHERE {between} AND len(expert_counts) > 0 ORDER BY step",
            [run_id],
        ).rows
    ]
    chosen = _chosen_steps(logged, expert_step)
    loads: dict[str, list[list[int]]] = {}
    if chosen:
        marks = ", ".join(str(int(s)) for s in chosen)
        for step, layer, counts in reader.sql(
            f"SELECT step, layer, expert_counts FROM moe_layer_stats WHERE run_id = ? AND step IN ({marks}) "
            "ORDER BY step, layer",
            [run_id],
        ).rows:
            loads.setdefault(str(step), []).append([int(layer), *[int(c) for c in counts]])
    return {
        "heat_bucket_steps": [
            rng.lo + (b * rng.span + heat_buckets - 1) // heat_buckets for b in range(heat_buckets)
        ],
        "drop_cells": [[int(b), int(layer), _num(v)] for layer, b, v, _n in cells],
        "layers": sorted({int(layer) for layer, _b, _v, _n in cells}),
        "layer_rows": sum(int(n) for _layer, _b, _v, n in cells),
        "mean_drop": mean_drop,
        "capacity": _capacity_steps(reader, run_id, rng),
        "expert_steps": chosen,
        "expert_step": expert_step if expert_step in chosen else (chosen[-1] if chosen else None),
        "expert_load": loads,
        "logged_expert_steps": len(logged),
        "imbalance": imbalance,
    }


def _chosen_steps(logged: list[int], expert_step: int | None) -> list[int]:
    if expert_step is not None and expert_step not in logged:
        near = ", ".join(str(s) for s in logged[:5]) + (" …" if len(logged) > 5 else "")
        raise ReportError(f"step {expert_step} has no logged expert counts (logged steps: {near or 'none'})")
    if len(logged) <= EXPERT_LOAD_STEPS:
        return logged
    picks = {logged[i * (len(logged) - 1) // (EXPERT_LOAD_STEPS - 1)] for i in range(EXPERT_LOAD_STEPS - 1)}
    picks.add(logged[-1])
    if expert_step is not None:
        picks.add(expert_step)
    return sorted(picks)


def _capacity_steps(reader: Reader, run_id: str, rng: StepRange) -> dict[str, list[Any]]:
    """The capacity factor and dispatcher live from each launch or accepted change on, on the final lineage."""
    rows = reader.sql(
        "SELECT coalesce(c.step, 0) AS step, "
        "TRY_CAST(json_extract(c.config, '$.moe.capacity_factor') AS DOUBLE) AS capacity_factor, "
        "json_extract_string(c.config, '$.moe.dispatcher') AS dispatcher "
        "FROM configs c JOIN attempts a ON a.run_id = c.run_id AND a.attempt = c.attempt "
        "WHERE c.run_id = ? AND (a.superseded_after IS NULL OR coalesce(c.step, 0) <= a.superseded_after) "
        "ORDER BY coalesce(c.step, 0), c.stream_seq",
        [run_id],
    ).rows
    steps: list[int] = []
    factors: list[float | None] = []
    dispatchers: list[str | None] = []
    for step, factor, dispatcher in rows:
        step = max(int(step), rng.lo)
        if step > rng.hi:
            break
        if steps and steps[-1] == step:  # a later event at the same step wins
            factors[-1], dispatchers[-1] = _num(factor), dispatcher
            continue
        steps.append(step)
        factors.append(_num(factor))
        dispatchers.append(dispatcher)
    if steps:  # the step function runs on to the end of the range
        steps.append(rng.hi)
        factors.append(factors[-1])
        dispatchers.append(dispatchers[-1])
    return {"x": steps, "capacity_factor": factors, "dispatcher": dispatchers}


# ---------------------------------------------------------------------------------------- the record
def record_status(reader: Reader, public_key: str | None, public_key_path: Path | None) -> dict[str, Any]:
    """Each stream's size and Merkle root as of the reader (a lake: its snapshot), and whether its
    latest signed checkpoint matches the record (its signature checked when a public key is given)."""
    head = reader.head
    streams = [
        _stream_status(reader, head.ledger_id, stream, stream_head, public_key)
        for stream, stream_head in sorted(head.streams.items())
    ]
    key = f" --public-key {public_key_path}" if public_key_path else " --public-key KEY.pub"
    return {
        "ledger": str(reader.root.resolve()),
        "streams": streams,
        "command": f"ledger verify --ledger {reader.root.resolve()}{key}",
        "verifier": "python -m runledger.ledger.verifier (stand-alone: checks inclusion proofs and checkpoints)",
    }


def _stream_status(
    reader: Reader, ledger_id: str, stream: str, head: StreamHead, public_key: str | None
) -> dict[str, Any]:
    """One stream's row of the record status: its head, and its signed checkpoint (in the ledger's
    folder) checked against the record at the checkpoint's size."""
    row: dict[str, Any] = {
        "stream": stream,
        "size": head.size,
        "root": head.tree.root().hex(),
        "signed_size": None,
        "checkpoint": "not signed",
    }
    path = checkpoint_path(reader.root, stream)
    if not path.exists():
        return row
    text = path.read_text()
    try:
        if public_key is not None:
            cp = parse_and_verify_checkpoint(text, public_key, origin=f"runledger/{ledger_id}/{stream}")
        else:
            cp = parse_checkpoint(text.split("\n\n", 1)[0] + "\n")
    except ValueError as exc:
        row["checkpoint"] = f"FAILS: {exc}"
        return row
    row["signed_size"] = cp.size
    try:  # (the usual case, signed at the head, reads nothing more)
        root = reader.stream_root(stream, cp.size)
    except QueryError as exc:
        row["checkpoint"] = f"not checked: {exc}"
        return row
    signed = "signature verified" if public_key is not None else "signature not checked (no key)"
    row["checkpoint"] = (
        f"matches the record ({signed})" if root == cp.root else "FAILS: the record no longer matches it"
    )
    return row


# ---------------------------------------------------------------------------------------- all of it
def build_report(
    reader: Reader,
    run_ids: Sequence[str],
    *,
    from_step: int | None = None,
    to_step: int | None = None,
    buckets: int = DEFAULT_BUCKETS,
    expert_step: int | None = None,
    public_key_path: Path | None = None,
) -> dict[str, Any]:
    """The report's data for one or more runs (several runs are overlaid on the same curves)."""
    if not run_ids:
        raise ReportError("name at least one run")
    if buckets < 10:
        raise ReportError(f"--buckets must be at least 10 (got {buckets})")
    public_key = public_key_path.read_text().strip() if public_key_path else None
    runs = []
    titles = []  # each run id, with its lineage where it has one
    for run_id in run_ids:
        reader.require_run(run_id)
        rng = step_range(reader, run_id, from_step, to_step)
        series = reduce_series(reader, run_id, [name for name, _ in CURVES], rng, buckets)
        router = router_view(reader, run_id, rng, buckets, expert_step)
        lineage = lineage_table(reader, run_id)
        titles.append(lineage_title(run_id, lineage))
        runs.append(
            {
                "run_id": run_id,
                "range": [rng.lo, rng.hi],
                # How many points the page would hold unreduced: the curves' rows and the router rows.
                "raw_points": {
                    "metric_rows": sum(seg["raw_points"] for segs in series.values() for seg in segs),
                    "layer_rows": router["layer_rows"],
                },
                "series": series,
                "markers": run_markers(reader, run_id, rng),
                "attempts": attempts_table(reader, run_id),
                "lineage": lineage,
                "config_changes": config_changes_table(reader, run_id, rng),
                "router": router,
            }
        )
    return {
        "title": "runledger report: " + ", ".join(titles),
        "generated_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "buckets": buckets,
        "curves": [{"name": name, "label": label} for name, label in CURVES],
        "kinds": MARKER_KINDS,
        "superseded_color": SUPERSEDED_COLOR,
        "runs": runs,
        "record": record_status(reader, public_key, public_key_path),
    }


def _asset(name: str) -> str:
    return resources.files("runledger.ledger").joinpath("report_assets", name).read_text(encoding="utf-8")


def _script_json(value: Any) -> str:
    """JSON safe inside a <script> element: "<" only occurs inside JSON strings, where \\u003c reads back
    the same, so no "</script>" or "<!--" in the data can end the element early."""
    return json.dumps(value, separators=(",", ":"), default=str).replace("<", "\\u003c")


# Public names for the pages that reuse the report's assets (``runledger.ledger.live_page``); the old ones still work.
asset = _asset
script_json = _script_json


def render_html(report: dict[str, Any]) -> str:
    """The page: the template with the chart library, the app and the data inlined (one pass, so
    nothing inserted is ever read as a placeholder)."""
    parts = {
        "TITLE": html.escape(report["title"]),
        "ECHARTS": _asset("echarts.min.js").replace("</script", "<\\/script"),
        "APP": _asset("report.js"),
        "DATA": _script_json(report),
    }
    return re.sub(r"\{\{(TITLE|ECHARTS|APP|DATA)\}\}", lambda m: parts[m.group(1)], _asset("report.html"))


def write_report(
    ledger: Path,
    run_ids: Sequence[str],
    output: Path,
    **options: Any,
) -> tuple[Path, dict[str, Any]]:
    """Build the report of ``run_ids`` and write it to ``output``; returns the path and the data."""
    with Reader(ledger) as reader:
        report = build_report(reader, run_ids, **options)
    write_durably(output, render_html(report))
    return output, report


def write_plot(
    ledger: Path,
    run_id: str,
    metrics: Sequence[str],
    output: Path,
    *,
    from_step: int | None = None,
    to_step: int | None = None,
    buckets: int = DEFAULT_BUCKETS,
) -> Path:
    """``ledger plot``: the metrics against step as a PNG or SVG, with the report's event markers."""
    import io

    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    with Reader(ledger) as reader:
        reader.require_run(run_id)
        known = {
            n for (n,) in reader.sql("SELECT DISTINCT name FROM metrics_all WHERE run_id = ?", [run_id]).rows
        }
        missing = [m for m in metrics if m not in known]
        if missing:
            raise ReportError(
                f"run {run_id} has no metric {', '.join(missing)} (it has: {', '.join(sorted(known)) or 'none'})"
            )
        rng = step_range(reader, run_id, from_step, to_step)
        series = reduce_series(reader, run_id, metrics, rng, buckets)
        markers = run_markers(reader, run_id, rng)
    fig, axes = plt.subplots(
        len(metrics), 1, sharex=True, figsize=(10, 0.8 + 2.4 * len(metrics)), squeeze=False
    )
    for ax, name in zip(axes[:, 0], metrics, strict=True):
        for seg in series[name]:
            ys = [math.nan if v is None else v for v in seg["y"]]
            if seg["superseded"]:
                ax.plot(seg["x"], ys, color=SUPERSEDED_COLOR, lw=1, ls="--", zorder=1)
            else:
                ax.plot(seg["x"], ys, color="#2f6fde", lw=1.3, zorder=2)
        top = ax.get_xaxis_transform()  # x in steps, y in 0..1 of the axes
        for m in markers:
            kind = MARKER_KINDS.get(m["kind"], {"color": "#667085", "mpl": "o", "row": 0.7})
            alpha = 0.45 if m["superseded"] else 0.8
            ax.axvline(
                m["step"], color=kind["color"], lw=0.8, alpha=alpha, ls=":" if m["superseded"] else "-"
            )
            ax.scatter(
                [m["step"]],
                [kind["row"]],
                transform=top,
                marker=kind["mpl"],
                color=kind["color"],
                alpha=alpha,
                s=28,
                zorder=3,
                clip_on=False,
            )
        ax.set_ylabel(name)
        ax.set_xlim(rng.lo, rng.hi)
        ax.grid(alpha=0.25)
    axes[-1, 0].set_xlabel("step")
    present = list(dict.fromkeys(m["kind"] for m in markers))
    handles = [
        Line2D(
            [],
            [],
            color=MARKER_KINDS[k]["color"],
            marker=MARKER_KINDS[k]["mpl"],
            lw=0.8,
            label=MARKER_KINDS[k]["label"],
        )
        for k in present
        if k in MARKER_KINDS
    ]
    if any(seg["superseded"] for segs in series.values() for seg in segs):
        handles.append(Line2D([], [], color=SUPERSEDED_COLOR, ls="--", label="superseded (earlier attempt)"))
    rows = math.ceil(len(handles) / 6)
    if handles:  # under the plots, so it never covers a curve or the title
        fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 6), fontsize=8, frameon=False)
    fig.suptitle(f"{run_id} · steps {rng.lo:,}–{rng.hi:,}", fontsize=10)
    fig.tight_layout(rect=(0, 0.03 * rows + 0.01, 1, 1))
    buffer = io.BytesIO()
    fig.savefig(buffer, format=output.suffix.lower().lstrip("."), dpi=120)
    plt.close(fig)
    write_durably(output, buffer.getvalue())
    return output
