"""The ledger's tables: their Parquet schemas, their hive partition key, and how events fill them.

Every table is a projection of the ``events`` table (which holds each event's canonical bytes), so
``ledger verify`` can rebuild any table from the events and compare. Rows carry ``stream`` and
``stream_seq``: the event they came from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import jsonpatch
import msgspec
import pyarrow as pa

from runledger.schemas import catalogue as c
from runledger.schemas import github as gh
from runledger.schemas import payloads as p
from runledger.schemas.canonical import canonical_bytes, config_hash
from runledger.schemas.codec import Event

TS = pa.timestamp("us", tz="UTC")
_ORIGIN = [("stream", pa.string()), ("stream_seq", pa.int64())]
_RUN_KEY = [("attempt", pa.int64()), ("step", pa.int64()), ("time", TS)]


@dataclass(frozen=True)
class Table:
    name: str
    partition: str  # hive partition column (a directory level, not stored inside the files)
    schema: pa.Schema  # columns stored in the files
    doc: str


def _schema(*cols: tuple[str, pa.DataType]) -> pa.Schema:
    return pa.schema(list(cols))


TABLES: dict[str, Table] = {
    t.name: t
    for t in [
        Table(
            "events",
            "stream_type",
            _schema(
                *_ORIGIN,
                ("source", pa.string()),
                ("id", pa.string()),
                ("type", pa.string()),
                ("schema_version", pa.int32()),
                ("time", TS),
                ("subject", pa.string()),
                ("run_id", pa.string()),
                ("attempt", pa.int64()),
                ("step", pa.int64()),
                ("seq", pa.int64()),
                ("commit", pa.int64()),
                ("ingest_source", pa.string()),
                ("ingest_position", pa.int64()),
                ("canonical", pa.string()),
            ),
            "Every accepted event, in stream order, with its canonical JSON (the Merkle leaf).",
        ),
        Table(
            "metrics",
            "run_id",
            _schema(*_RUN_KEY, ("name", pa.string()), ("value", pa.float64()), *_ORIGIN),
            "Long metrics, every attempt: one row per (attempt, step, name).",
        ),
        Table(
            "moe_layer_stats",
            "run_id",
            _schema(
                *_RUN_KEY,
                ("layer", pa.int32()),
                ("tokens", pa.int64()),
                ("top_k", pa.int32()),
                ("dropped", pa.int64()),
                ("token_drop_rate", pa.float64()),
                ("sender_drops", pa.int64()),
                ("receiver_drops", pa.int64()),
                ("expert_counts", pa.list_(pa.int64())),
                ("aux_loss", pa.float64()),
                ("z_loss", pa.float64()),
                ("routing_entropy", pa.float64()),
                *_ORIGIN,
            ),
            "Router statistics per step and layer; expert_counts is one list per row.",
        ),
        Table(
            "launches",
            "run_id",
            _schema(
                *_RUN_KEY,
                ("kind", pa.string()),
                ("from_checkpoint_step", pa.int64()),
                ("checkpoint_path", pa.string()),
                ("config_hash", pa.string()),
                ("git_commit", pa.string()),
                ("git_dirty", pa.bool_()),
                ("git_branch", pa.string()),
                ("repository", pa.string()),
                ("host", pa.string()),
                ("cluster", pa.string()),
                ("job_id", pa.string()),
                ("world_size", pa.int64()),
                ("parent_run", pa.string()),
                ("fork_step", pa.int64()),
                ("name", pa.string()),
                ("software", pa.string()),
                ("external", pa.string()),
                *_ORIGIN,
            ),
            "One row per attempt: the start or a resume, with code, place and config hash.",
        ),
        Table(
            "configs",
            "run_id",
            _schema(
                *_RUN_KEY,
                ("config_hash", pa.string()),
                ("config", pa.string()),
                ("cause", pa.string()),
                *_ORIGIN,
            ),
            "The full resolved config after every launch and every accepted change.",
        ),
        Table(
            "config_changes",
            "run_id",
            _schema(
                *_RUN_KEY,
                ("accepted", pa.bool_()),
                ("patch", pa.string()),
                ("previous_hash", pa.string()),
                ("config_hash", pa.string()),
                ("hash_matches", pa.bool_()),
                ("reason", pa.string()),
                ("cause_kind", pa.string()),
                ("cause_detail", pa.string()),
                ("actor", pa.string()),
                ("commit_sha", pa.string()),
                *_ORIGIN,
            ),
            "Live config changes (accepted or refused) with their RFC 6902 patch.",
        ),
        Table(
            "checkpoints",
            "run_id",
            _schema(
                *_RUN_KEY,
                ("path", pa.string()),
                ("bytes", pa.int64()),
                ("duration_s", pa.float64()),
                ("reason", pa.string()),
                *_ORIGIN,
            ),
            "Checkpoints saved.",
        ),
        Table(
            "incidents",
            "run_id",
            _schema(
                *_RUN_KEY,
                ("kind", pa.string()),
                ("exc_type", pa.string()),
                ("message", pa.string()),
                ("traceback", pa.string()),
                ("signal", pa.int64()),
                ("exit_code", pa.int64()),
                ("rank", pa.int64()),
                ("host", pa.string()),
                *_ORIGIN,
            ),
            "Crashes (kind exception/nonfinite_loss/signal/oom) and skipped steps (kind skipped).",
        ),
        Table(
            "run_ends",
            "run_id",
            _schema(
                *_RUN_KEY,
                ("status", pa.string()),
                ("total_tokens", pa.int64()),
                ("duration_s", pa.float64()),
                *_ORIGIN,
            ),
            "Attempts that finished without crashing.",
        ),
        Table(
            "rank_stats",
            "run_id",
            _schema(
                *_RUN_KEY,
                ("rank", pa.int64()),
                ("host", pa.string()),
                ("step_time_s", pa.float64()),
                ("values", pa.string()),
                *_ORIGIN,
            ),
            "Each rank's own step time and host.",
        ),
        Table(
            "annotations",
            "run_id",
            _schema(
                *_RUN_KEY,
                ("author", pa.string()),
                ("text", pa.string()),
                ("tags", pa.list_(pa.string())),
                *_ORIGIN,
            ),
            "People's notes on a run and step.",
        ),
        Table(
            "summaries",
            "run_id",
            _schema(*_RUN_KEY, ("values", pa.string()), *_ORIGIN),
            "Run summaries (for example imported from W&B).",
        ),
        Table(
            "github",
            "repo_owner",
            _schema(
                ("repo", pa.string()),
                ("time", TS),
                ("kind", pa.string()),
                ("action", pa.string()),
                ("number", pa.int64()),
                ("title", pa.string()),
                ("state", pa.string()),
                ("actor", pa.string()),
                ("merged", pa.bool_()),
                ("sha", pa.string()),
                ("head_sha", pa.string()),
                ("base_sha", pa.string()),
                ("shas", pa.list_(pa.string())),
                ("url", pa.string()),
                ("body", pa.string()),
                *_ORIGIN,
            ),
            "GitHub issues, PRs, reviews, comments, pushes and commits, one row per event.",
        ),
        Table(
            "quarantine",
            "day",
            _schema(
                ("time", TS),
                ("ingest_source", pa.string()),
                ("ingest_position", pa.int64()),
                ("reason", pa.string()),
                ("event_source", pa.string()),
                ("event_id", pa.string()),
                ("event_type", pa.string()),
                ("stream", pa.string()),
                ("raw", pa.binary()),
                ("commit", pa.int64()),
            ),
            "Everything that could not be accepted: raw bytes and the reason. Nothing is dropped.",
        ),
    ]
}


@dataclass
class RowBuffer:
    """Rows waiting to be written, grouped by (table, partition value), stored column-wise."""

    columns: dict[tuple[str, str], dict[str, list[Any]]] = field(default_factory=dict)

    def add(self, table: str, partition: str, row: dict[str, Any]) -> None:
        key = (table, partition)
        cols = self.columns.get(key)
        if cols is None:
            cols = self.columns[key] = {name: [] for name in TABLES[table].schema.names}
        for name, values in cols.items():
            values.append(row.get(name))

    def add_many(self, table: str, partition: str, rows: dict[str, list[Any]]) -> None:
        """Add several rows given column-wise (missing columns become nulls)."""
        key = (table, partition)
        cols = self.columns.get(key)
        if cols is None:
            cols = self.columns[key] = {name: [] for name in TABLES[table].schema.names}
        n = len(next(iter(rows.values())))
        for name, values in cols.items():
            given = rows.get(name)
            values.extend(given if given is not None else [None] * n)

    def tables(self) -> list[tuple[str, str, pa.Table]]:
        out = []
        for (table, partition), cols in self.columns.items():
            out.append((table, partition, pa.table(cols, schema=TABLES[table].schema)))
        return out


@dataclass
class FoldState:
    """What filling the tables needs to remember between events: each attempt's live config."""

    configs: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    load_config: Callable[[str, int], dict[str, Any] | None] = lambda run, attempt: None

    def config_of(self, run_id: str, attempt: int) -> dict[str, Any] | None:
        key = (run_id, attempt)
        if key not in self.configs:
            loaded = self.load_config(run_id, attempt)
            if loaded is None:
                return None
            self.configs[key] = loaded
        return self.configs[key]


def _json(value: Any) -> str:
    return canonical_bytes(value).decode()


def _flatten_metrics(m: p.StepMetrics) -> tuple[list[str], list[float | None]]:
    names: list[str] = []
    values: list[float | None] = []
    for name in (
        "loss",
        "grad_norm",
        "lr",
        "tokens",
        "total_tokens",
        "tokens_per_second",
        "mfu",
        "step_time_s",
    ):
        value = getattr(m, name)
        if value is not None:
            names.append(name)
            values.append(float(value))
    for name, value in m.scalars.items():
        names.append(name)
        values.append(value)
    return names, values


def rows_for_event(event: Event, stream_seq: int, buf: RowBuffer, state: FoldState) -> None:
    """Append the typed rows one accepted event contributes."""
    env = event.envelope
    data = env.data
    origin = {"stream": env.stream, "stream_seq": stream_seq}
    run = env.run_id or ""
    key = {"attempt": env.attempt, "step": env.step, "time": env.time, **origin}
    t = env.type
    if t == c.STEP_METRICS:
        names, values = _flatten_metrics(data)
        n = len(names)
        buf.add_many(
            "metrics",
            run,
            {
                "attempt": [env.attempt] * n,
                "step": [env.step] * n,
                "time": [env.time] * n,
                "name": names,
                "value": values,
                "stream": [env.stream] * n,
                "stream_seq": [stream_seq] * n,
            },
        )
    elif t == c.MOE_ROUTER_STATS:
        for layer in data.layers:
            buf.add("moe_layer_stats", run, {**key, **msgspec.structs.asdict(layer)})
    elif t in (c.RUN_STARTED, c.RUN_RESUMED):
        launch = msgspec.structs.asdict(data)
        row = {
            **key,
            **{k: v for k, v in launch.items() if k in TABLES["launches"].schema.names},
            "kind": "start" if t == c.RUN_STARTED else "resume",
            "software": _json(data.software),
            "external": _json(data.external),
        }
        buf.add("launches", run, row)
        state.configs[(run, env.attempt or 1)] = data.config
        buf.add(
            "configs",
            run,
            {
                **key,
                "config_hash": data.config_hash,
                "config": _json(data.config),
                "cause": "start" if t == c.RUN_STARTED else "resume",
            },
        )
    elif t == c.CONFIG_CHANGED:
        previous = state.config_of(run, env.attempt or 1)
        hash_matches = None
        if previous is not None:
            try:
                new = jsonpatch.apply_patch(previous, msgspec.to_builtins(data.patch))
                hash_matches = config_hash(new) == data.config_hash
                state.configs[(run, env.attempt or 1)] = new
                buf.add(
                    "configs",
                    run,
                    {**key, "config_hash": config_hash(new), "config": _json(new), "cause": data.cause.kind},
                )
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException):
                hash_matches = False
        buf.add("config_changes", run, _change_row(key, data, True, hash_matches))
    elif t == c.CONFIG_REJECTED:
        buf.add("config_changes", run, _change_row(key, data, False, None))
    elif t == c.CHECKPOINT_SAVED:
        buf.add("checkpoints", run, {**key, **msgspec.structs.asdict(data)})
    elif t == c.RUN_CRASHED:
        buf.add("incidents", run, {**key, **msgspec.structs.asdict(data)})
    elif t == c.STEP_SKIPPED:
        buf.add("incidents", run, {**key, "kind": "skipped", "message": f"{data.reason} ({data.value})"})
    elif t == c.RUN_FINISHED:
        buf.add(
            "run_ends",
            run,
            {**key, "status": data.status, "total_tokens": data.total_tokens, "duration_s": data.duration_s},
        )
    elif t == c.RANK_STATS:
        buf.add(
            "rank_stats",
            run,
            {
                **key,
                "rank": data.rank,
                "host": data.host,
                "step_time_s": data.step_time_s,
                "values": _json(data.values),
            },
        )
    elif t == c.ANNOTATION:
        buf.add("annotations", run, {**key, "author": data.author, "text": data.text, "tags": data.tags})
    elif t == c.RUN_SUMMARY:
        buf.add("summaries", run, {**key, "values": _json(data.values)})
    elif t.startswith("github."):
        row = github_row(t, data, env.time)
        buf.add("github", row["repo"].split("/")[0], {**row, **origin})


def _change_row(key: dict[str, Any], data: Any, accepted: bool, hash_matches: bool | None) -> dict[str, Any]:
    return {
        **key,
        "accepted": accepted,
        "patch": _json(data.patch),
        "previous_hash": getattr(data, "previous_hash", None),
        "config_hash": getattr(data, "config_hash", None),
        "hash_matches": hash_matches,
        "reason": getattr(data, "reason", None),
        "cause_kind": data.cause.kind,
        "cause_detail": data.cause.detail,
        "actor": data.cause.actor,
        "commit_sha": data.cause.commit,
    }


def github_row(type_name: str, data: Any, time: datetime) -> dict[str, Any]:
    kind = type_name.removeprefix("github.")
    row: dict[str, Any] = {
        "repo": getattr(data, "repo", ""),
        "time": time,
        "kind": kind,
        "action": getattr(data, "action", None),
    }
    if isinstance(data, gh.GitHubIssue | gh.GitHubPullRequest):
        row |= {
            "number": data.number,
            "title": data.title,
            "state": data.state,
            "actor": data.actor or data.author,
            "url": data.url,
            "body": data.body,
        }
    if isinstance(data, gh.GitHubPullRequest):
        row |= {
            "merged": data.merged,
            "sha": data.merge_commit_sha,
            "head_sha": data.head_sha,
            "base_sha": data.base_sha,
        }
    elif isinstance(data, gh.GitHubReview):
        row |= {
            "number": data.pr_number,
            "state": data.state,
            "actor": data.author,
            "sha": data.commit_id,
            "url": data.url,
            "body": data.body,
        }
    elif isinstance(data, gh.GitHubComment):
        row |= {
            "number": data.number,
            "actor": data.author,
            "sha": data.commit_id,
            "url": data.url,
            "body": data.body,
        }
    elif isinstance(data, gh.GitHubPush):
        row |= {
            "title": data.ref,
            "actor": data.pusher,
            "sha": data.after,
            "base_sha": data.before,
            "shas": [commit.sha for commit in data.commits],
        }
    elif isinstance(data, gh.GitHubCommit):
        row |= {
            "sha": data.sha,
            "title": data.message.split("\n", 1)[0],
            "actor": data.author,
            "shas": data.parents,
        }
    elif isinstance(data, gh.GitHubRaw):
        row |= {"kind": f"raw:{data.event}", "body": _json(data.payload)}
    return row
