"""The ledger's Parquet tables: their names, pyarrow schemas and hive partition keys.

Every table but ``events`` and ``quarantine`` is a projection of ``events`` (which holds each event's
canonical bytes): ``runledger.ledger.projectors`` says how events fill them, so ``ledger verify`` can
rebuild any table from the events and compare. Rows carry ``stream`` and ``stream_seq``: the event
they came from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

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
                # How admission let it in: True signed and verified, False unsigned by the policy,
                # null no registry then (and every row written before this column existed).
                ("authenticated", pa.bool_()),
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
                ("max_load", pa.float64()),  # added in issue 39: null in rows of events without it
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
            "state_events",
            "run_id",
            _schema(*_RUN_KEY, ("type", pa.string()), ("canonical", pa.string()), *_ORIGIN),
            "A run's state events (launches, config changes, checkpoints, crashes, ends, notes) with "
            "their canonical JSON: the few events the fold reads, kept apart from the run's millions.",
        ),
        Table(
            "ingest_incidents",
            "run_id",
            _schema(
                *_RUN_KEY,
                ("kind", pa.string()),  # gap | fork | duplicate-launch
                ("source", pa.string()),  # the source whose order broke (not the ledger's own)
                ("expected_seq", pa.int64()),
                ("got_seq", pa.int64()),
                ("missing", pa.int64()),
                ("expected_prev", pa.string()),
                ("got_prev", pa.string()),
                ("event_id", pa.string()),
                *_ORIGIN,
            ),
            "Ingest's incidents (ledger.incident: a source's gap, fork or duplicate launch), one row per "
            "event, typed: state and history fold them into ranges without decoding their JSON.",
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
                ("repo", pa.string()),  # owner/name; NULL for an org-level event
                ("org", pa.string()),  # the organisation an untyped (raw) event names, if any
                ("time", TS),
                ("kind", pa.string()),
                ("action", pa.string()),
                ("fact", pa.string()),  # what it is, whoever observed it (runledger.ingest.github_events)
                ("via", pa.string()),  # the producer that observed it: webhook | backfill
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
            "GitHub issues, PRs, reviews, comments, pushes and commits, one row per event (observation).",
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


# Tables added after ledgers were made without them. A ledger has one only if its LEDGER.json lists
# it: in an older ledger the table would hold only what was committed since the upgrade.
# Columns a table gained after ledgers were written with it. A file written before lacks them (read
# as NULL; ``LakeTables`` adds the column to a lake's catalog when a writer opens it, and a migrated
# row keeps NULL there), so verify compares such rows without them.
ADDED_COLUMNS: dict[str, frozenset[str]] = {
    "github": frozenset({"org", "fact", "via"}),
    "moe_layer_stats": frozenset({"max_load"}),
}

# ``ingest_incidents`` (issue 42): an older lake's marker does not list it, and its readers fold the
# incidents from ``state_events``' JSON; ``ledger migrate`` derives it from the old ledger's events.
ADDED_TABLES = frozenset({"state_events", "ingest_incidents"})

# Each accepted event's random salt, beside the event: its public log entry commits to
# SHA-256(salt ‖ canonical bytes), so a low-entropy payload cannot be found from the published digest;
# ``ledger redact`` erases the salt with the payload. Events stored before salts are "unsalted".
SALTS = Table(
    "salts",
    "stream_type",
    pa.schema(
        [("stream", pa.string()), ("stream_seq", pa.int64()), ("commit", pa.int64()), ("salt", pa.binary())]
    ),
    "Each event's random salt: its public log entry carries SHA-256(salt ‖ canonical bytes).",
)
# Tables the ledger's commits write besides TABLES' (compacted with them; not among the SQL views).
SIDE_TABLES: dict[str, Table] = {SALTS.name: SALTS}


def tables_of(root: Path) -> list[str]:
    """The tables the ledger at ``root`` keeps complete: all of TABLES but those it was created without."""
    listed = json.loads((root / "LEDGER.json").read_bytes()).get("tables") or []
    return [name for name in TABLES if name not in ADDED_TABLES or name in listed]
