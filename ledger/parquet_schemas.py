"""The ledger's Parquet tables: their names, columns and hive partition keys.

Every table but ``events`` and ``quarantine`` is a projection of ``events`` (which holds each event's
canonical bytes): ``runledger.ledger.projectors`` says how events fill them, so ``ledger verify`` can
rebuild any table from the events and compare. Rows carry ``stream`` and ``stream_seq``: the event
they came from.

A column's type is written as DuckDB names it (as DuckDB reads it from the files): the readers need
only these names (issue 41: reading a ledger imports no pyarrow); a table's pyarrow schema, for the
writers, is made from them on first use (``Table.schema``).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    import pyarrow as pa

Columns = tuple[tuple[str, str], ...]  # (name, DuckDB type) of each column, in order

_ORIGIN = (("stream", "VARCHAR"), ("stream_seq", "BIGINT"))
_RUN_KEY = (("attempt", "BIGINT"), ("step", "BIGINT"), ("time", "TIMESTAMPTZ"))
PARTITION_TYPE = "VARCHAR"  # a hive partition column, as the folder names give it


class Table(msgspec.Struct, frozen=True):
    name: str
    partition: str  # hive partition column (a directory level, not stored inside the files)
    columns: Columns  # columns stored in the files
    doc: str

    @property
    def names(self) -> tuple[str, ...]:
        """The stored columns' names, in order."""
        return tuple(name for name, _ in self.columns)

    @property
    def lake_columns(self) -> Columns:
        """The columns in the lake (and as a hive-partitioned glob reader sees the files): the file
        columns, then the partition column unless the files hold it."""
        if self.partition in self.names:
            return self.columns
        return (*self.columns, (self.partition, PARTITION_TYPE))

    @property
    def schema(self) -> pa.Schema:
        """The stored columns as a pyarrow schema (the writers': built once, on first use)."""
        return arrow_schema(self.columns)


def _columns(*cols: tuple[str, str]) -> Columns:
    return tuple(cols)


@functools.cache
def arrow_schema(columns: Columns) -> pa.Schema:
    """``columns`` as a pyarrow schema."""
    import pyarrow as pa

    return pa.schema([(name, arrow_type(kind)) for name, kind in columns])


def arrow_type(kind: str) -> pa.DataType:
    """The Arrow type of a column DuckDB types ``kind`` (the ledger's types only)."""
    import pyarrow as pa

    if kind.endswith("[]"):
        return pa.list_(arrow_type(kind.removesuffix("[]")))
    types = {
        "VARCHAR": pa.string(),
        "BIGINT": pa.int64(),
        "INTEGER": pa.int32(),
        "DOUBLE": pa.float64(),
        "BOOLEAN": pa.bool_(),
        "BLOB": pa.binary(),
        "TIMESTAMPTZ": pa.timestamp("us", tz="UTC"),
    }
    if kind not in types:
        raise ValueError(f"column type {kind} is not one the ledger's tables use")
    return types[kind]


TABLES: dict[str, Table] = {
    t.name: t
    for t in [
        Table(
            "events",
            "stream_type",
            _columns(
                *_ORIGIN,
                ("source", "VARCHAR"),
                ("id", "VARCHAR"),
                ("type", "VARCHAR"),
                ("schema_version", "INTEGER"),
                ("time", "TIMESTAMPTZ"),
                ("subject", "VARCHAR"),
                ("run_id", "VARCHAR"),
                ("attempt", "BIGINT"),
                ("step", "BIGINT"),
                ("seq", "BIGINT"),
                ("commit", "BIGINT"),
                ("ingest_source", "VARCHAR"),
                ("ingest_position", "BIGINT"),
                ("canonical", "VARCHAR"),
                # How admission let it in: True signed and verified, False unsigned by the policy,
                # null no registry then (and every row written before this column existed).
                ("authenticated", "BOOLEAN"),
            ),
            "Every accepted event, in stream order, with its canonical JSON (the Merkle leaf).",
        ),
        Table(
            "metrics",
            "run_id",
            _columns(*_RUN_KEY, ("name", "VARCHAR"), ("value", "DOUBLE"), *_ORIGIN),
            "Long metrics, every attempt: one row per (attempt, step, name).",
        ),
        Table(
            "moe_layer_stats",
            "run_id",
            _columns(
                *_RUN_KEY,
                ("layer", "INTEGER"),
                ("tokens", "BIGINT"),
                ("top_k", "INTEGER"),
                ("dropped", "BIGINT"),
                ("token_drop_rate", "DOUBLE"),
                ("sender_drops", "BIGINT"),
                ("receiver_drops", "BIGINT"),
                ("expert_counts", "BIGINT[]"),
                ("aux_loss", "DOUBLE"),
                ("z_loss", "DOUBLE"),
                ("routing_entropy", "DOUBLE"),
                ("max_load", "DOUBLE"),  # added in issue 39: null in rows of events without it
                *_ORIGIN,
            ),
            "Router statistics per step and layer; expert_counts is one list per row.",
        ),
        Table(
            "launches",
            "run_id",
            _columns(
                *_RUN_KEY,
                ("kind", "VARCHAR"),
                ("from_checkpoint_step", "BIGINT"),
                ("checkpoint_path", "VARCHAR"),
                ("config_hash", "VARCHAR"),
                ("git_commit", "VARCHAR"),
                ("git_dirty", "BOOLEAN"),
                ("git_branch", "VARCHAR"),
                ("repository", "VARCHAR"),
                ("host", "VARCHAR"),
                ("cluster", "VARCHAR"),
                ("job_id", "VARCHAR"),
                ("world_size", "BIGINT"),
                ("parent_run", "VARCHAR"),
                ("fork_step", "BIGINT"),
                ("name", "VARCHAR"),
                ("software", "VARCHAR"),
                ("external", "VARCHAR"),
                *_ORIGIN,
            ),
            "One row per attempt: the start or a resume, with code, place and config hash.",
        ),
        Table(
            "configs",
            "run_id",
            _columns(
                *_RUN_KEY,
                ("config_hash", "VARCHAR"),
                ("config", "VARCHAR"),
                ("cause", "VARCHAR"),
                *_ORIGIN,
            ),
            "The full resolved config after every launch and every accepted change.",
        ),
        Table(
            "config_changes",
            "run_id",
            _columns(
                *_RUN_KEY,
                ("accepted", "BOOLEAN"),
                ("patch", "VARCHAR"),
                ("previous_hash", "VARCHAR"),
                ("config_hash", "VARCHAR"),
                ("hash_matches", "BOOLEAN"),
                ("reason", "VARCHAR"),
                ("cause_kind", "VARCHAR"),
                ("cause_detail", "VARCHAR"),
                ("actor", "VARCHAR"),
                ("commit_sha", "VARCHAR"),
                *_ORIGIN,
            ),
            "Live config changes (accepted or refused) with their RFC 6902 patch.",
        ),
        Table(
            "checkpoints",
            "run_id",
            _columns(
                *_RUN_KEY,
                ("path", "VARCHAR"),
                ("bytes", "BIGINT"),
                ("duration_s", "DOUBLE"),
                ("reason", "VARCHAR"),
                *_ORIGIN,
            ),
            "Checkpoints saved.",
        ),
        Table(
            "incidents",
            "run_id",
            _columns(
                *_RUN_KEY,
                ("kind", "VARCHAR"),
                ("exc_type", "VARCHAR"),
                ("message", "VARCHAR"),
                ("traceback", "VARCHAR"),
                ("signal", "BIGINT"),
                ("exit_code", "BIGINT"),
                ("rank", "BIGINT"),
                ("host", "VARCHAR"),
                *_ORIGIN,
            ),
            "Crashes (kind exception/nonfinite_loss/signal/oom) and skipped steps (kind skipped).",
        ),
        Table(
            "run_ends",
            "run_id",
            _columns(
                *_RUN_KEY,
                ("status", "VARCHAR"),
                ("total_tokens", "BIGINT"),
                ("duration_s", "DOUBLE"),
                *_ORIGIN,
            ),
            "Attempts that finished without crashing.",
        ),
        Table(
            "rank_stats",
            "run_id",
            _columns(
                *_RUN_KEY,
                ("rank", "BIGINT"),
                ("host", "VARCHAR"),
                ("step_time_s", "DOUBLE"),
                ("values", "VARCHAR"),
                *_ORIGIN,
            ),
            "Each rank's own step time and host.",
        ),
        Table(
            "annotations",
            "run_id",
            _columns(
                *_RUN_KEY,
                ("author", "VARCHAR"),
                ("text", "VARCHAR"),
                ("tags", "VARCHAR[]"),
                *_ORIGIN,
            ),
            "People's notes on a run and step.",
        ),
        Table(
            "state_events",
            "run_id",
            _columns(*_RUN_KEY, ("type", "VARCHAR"), ("canonical", "VARCHAR"), *_ORIGIN),
            "A run's state events (launches, config changes, checkpoints, crashes, ends, notes) with "
            "their canonical JSON: the few events the fold reads, kept apart from the run's millions.",
        ),
        Table(
            "ingest_incidents",
            "run_id",
            _columns(
                *_RUN_KEY,
                ("kind", "VARCHAR"),  # gap | fork | duplicate-launch
                ("source", "VARCHAR"),  # the source whose order broke (not the ledger's own)
                ("expected_seq", "BIGINT"),
                ("got_seq", "BIGINT"),
                ("missing", "BIGINT"),
                ("expected_prev", "VARCHAR"),
                ("got_prev", "VARCHAR"),
                ("event_id", "VARCHAR"),
                *_ORIGIN,
            ),
            "Ingest's incidents (ledger.incident: a source's gap, fork or duplicate launch), one row per "
            "event, typed: state and history fold them into ranges without decoding their JSON.",
        ),
        Table(
            "summaries",
            "run_id",
            _columns(*_RUN_KEY, ("values", "VARCHAR"), *_ORIGIN),
            "Run summaries (for example imported from W&B).",
        ),
        Table(
            "github",
            "repo_owner",
            _columns(
                ("repo", "VARCHAR"),  # owner/name; NULL for an org-level event
                ("org", "VARCHAR"),  # the organisation an untyped (raw) event names, if any
                ("time", "TIMESTAMPTZ"),
                ("kind", "VARCHAR"),
                ("action", "VARCHAR"),
                ("fact", "VARCHAR"),  # what it is, whoever observed it (runledger.ingest.github_events)
                ("via", "VARCHAR"),  # the producer that observed it: webhook | backfill
                ("number", "BIGINT"),
                ("title", "VARCHAR"),
                ("state", "VARCHAR"),
                ("actor", "VARCHAR"),
                ("merged", "BOOLEAN"),
                ("sha", "VARCHAR"),
                ("head_sha", "VARCHAR"),
                ("base_sha", "VARCHAR"),
                ("shas", "VARCHAR[]"),
                ("url", "VARCHAR"),
                ("body", "VARCHAR"),
                *_ORIGIN,
            ),
            "GitHub issues, PRs, reviews, comments, pushes and commits, one row per event (observation).",
        ),
        Table(
            "quarantine",
            "day",
            _columns(
                ("time", "TIMESTAMPTZ"),
                ("ingest_source", "VARCHAR"),
                ("ingest_position", "BIGINT"),
                ("reason", "VARCHAR"),
                ("event_source", "VARCHAR"),
                ("event_id", "VARCHAR"),
                ("event_type", "VARCHAR"),
                ("stream", "VARCHAR"),
                ("raw", "BLOB"),
                ("commit", "BIGINT"),
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
    (("stream", "VARCHAR"), ("stream_seq", "BIGINT"), ("commit", "BIGINT"), ("salt", "BLOB")),
    "Each event's random salt: its public log entry carries SHA-256(salt ‖ canonical bytes).",
)
# Tables the ledger's commits write besides TABLES' (compacted with them; not among the SQL views).
SIDE_TABLES: dict[str, Table] = {SALTS.name: SALTS}


def table_spec(name: str) -> Table:
    """The ledger table ``name`` (of ``TABLES`` or ``SIDE_TABLES``)."""
    spec = TABLES.get(name) or SIDE_TABLES.get(name)
    if spec is None:
        raise ValueError(f"{name} is not a ledger table")
    return spec


def lake_columns(name: str) -> Columns:
    """The columns of the ledger table ``name`` in a lake: its file columns, then its partition column."""
    return table_spec(name).lake_columns


def tables_of(root: Path) -> list[str]:
    """The tables the ledger at ``root`` keeps complete: all of TABLES but those it was created without."""
    listed = json.loads((root / "LEDGER.json").read_bytes()).get("tables") or []
    return [name for name in TABLES if name not in ADDED_TABLES or name in listed]
