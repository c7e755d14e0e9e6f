"""How accepted events fill the typed tables: one projector per event type.

A projector is a small function of one event (its envelope, its ``stream_seq`` and the fold state)
that returns the rows the event contributes: ``Row`` (one row) or ``Columns`` (several rows given
column-wise). ``PROJECTORS`` maps each event type to its projector; ``rows_for_event`` looks the
event's type up and adds what it returns to a ``RowBuffer``. The tables themselves (names, schemas,
partitioning) are in ``runledger.ledger.parquet_schemas``.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

import msgspec
import numpy as np
import pyarrow as pa

from runledger.ledger.fold import STATE_TYPES
from runledger.ledger.parquet_schemas import TABLES
from runledger.schemas import catalogue as c
from runledger.schemas import github as gh
from runledger.schemas import payloads as p
from runledger.schemas.canonical import canonical_bytes, config_hash
from runledger.schemas.codec import Event
from runledger.schemas.config_patch import ConfigPatchError, apply_config_patch
from runledger.schemas.envelope import Envelope

CHUNK_ROWS = 32_768  # a group's rows are made Arrow this many at a time, not all at the commit


@dataclass
class RowBuffer:
    """Rows waiting to be written, grouped by (table, partition value), stored column-wise.

    A group's newest rows are Python lists (``columns``); every ``CHUNK_ROWS`` of them are turned into
    an Arrow table (``chunks``) as they come, so a commit of 20,000 reference-run events (~500,000
    router-stat rows) holds ~8 bytes a value, not a Python object and a list slot (~32)."""

    columns: dict[tuple[str, str], dict[str, list[Any]]] = field(default_factory=dict)
    chunks: dict[tuple[str, str], list[pa.Table]] = field(default_factory=dict)

    def add(self, table: str, partition: str, row: dict[str, Any]) -> None:
        key = (table, partition)
        cols = self.columns.get(key)
        if cols is None:
            cols = self.columns[key] = {name: [] for name in TABLES[table].schema.names}
        for name, values in cols.items():
            values.append(row.get(name))
        if len(values) >= CHUNK_ROWS:
            self._chunk(key, cols)

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
        if len(values) >= CHUNK_ROWS:
            self._chunk(key, cols)

    def rows(self, table: str) -> int:
        """How many rows ``table`` has in this buffer, over all its partitions."""
        listed = sum(len(next(iter(c.values()))) for (t, _), c in self.columns.items() if t == table)
        return listed + sum(
            c.num_rows for (t, _), chunks in self.chunks.items() if t == table for c in chunks
        )

    def tables(self) -> list[tuple[str, str, pa.Table]]:
        out = []
        for key, cols in self.columns.items():
            pieces = self.chunks.get(key, [])
            if not pieces or len(next(iter(cols.values()))):
                pieces = [*pieces, _table(key[0], cols)]
            out.append((*key, pieces[0] if len(pieces) == 1 else pa.concat_tables(pieces)))
        return out

    def _chunk(self, key: tuple[str, str], cols: dict[str, list[Any]]) -> None:
        """Move a group's listed rows into an Arrow chunk (raises what Arrow raises; nothing moves)."""
        self.chunks.setdefault(key, []).append(_table(key[0], cols))
        for values in cols.values():
            values.clear()


def _table(table: str, cols: dict[str, list[Any]]) -> pa.Table:
    schema = TABLES[table].schema
    arrays = [_arrow(cols[name], field.type) for name, field in zip(schema.names, schema, strict=True)]
    return pa.Table.from_arrays(arrays, schema=schema)


def _arrow(values: list[Any], type_: pa.DataType) -> pa.Array:
    """One column as Arrow. A string column given as UTF-8 ``bytes`` (the events' canonical JSON,
    KBs per row) becomes one buffer and its offsets: converting each str costs ~15 µs an event."""
    if type_ == pa.string() and values and all(type(v) is bytes for v in values):
        offsets = np.zeros(len(values) + 1, dtype=np.int64)
        np.cumsum([len(v) for v in values], out=offsets[1:])
        if offsets[-1] < 2**31:
            data = pa.py_buffer(b"".join(values))
            array = pa.StringArray.from_buffers(len(values), pa.py_buffer(offsets.astype(np.int32)), data)
            array.validate(full=True)  # UTF-8 checked once, in C
            return array
    if type_ == _COUNTS and values and all(type(v) is list for v in values):
        # Expert counts (48 × 384 a step): flattened through NumPy, 3x quicker than nested lists.
        offsets = np.zeros(len(values) + 1, dtype=np.int64)
        np.cumsum([len(v) for v in values], out=offsets[1:])
        if offsets[-1] < 2**31:
            try:
                flat = np.fromiter(
                    itertools.chain.from_iterable(values), dtype=np.int64, count=int(offsets[-1])
                )
            except (OverflowError, TypeError, ValueError):
                pass  # not all int64: Arrow's own conversion says why
            else:
                return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(flat))
    return pa.array(values, type_)


_COUNTS = pa.list_(pa.int64())


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


class Row(NamedTuple):
    """One row for ``table`` in hive partition ``partition``."""

    table: str
    partition: str
    values: dict[str, Any]


class Columns(NamedTuple):
    """Several rows for ``table`` in ``partition``, column-wise (absent columns are nulls)."""

    table: str
    partition: str
    values: dict[str, list[Any]]


Projector = Callable[[Envelope, int, FoldState], list[Row | Columns]]


def rows_for_event(event: Event, stream_seq: int, buf: RowBuffer, state: FoldState) -> None:
    """Append the typed rows one accepted event contributes."""
    env = event.envelope
    if env.type in STATE_TYPES:  # the fold's input, apart from the run's metrics (query.Reader.events)
        row = {**_key(env, stream_seq), "type": env.type, "canonical": event.canonical}
        buf.add("state_events", _run(env), row)
    projector = PROJECTORS.get(env.type)
    if projector is None:
        return
    for out in projector(env, stream_seq, state):
        if isinstance(out, Columns):
            buf.add_many(out.table, out.partition, out.values)
        else:
            buf.add(out.table, out.partition, out.values)


# ------------------------------------------------------------------------------------ helpers


def _json(value: Any) -> str:
    return canonical_bytes(value).decode()


def _run(env: Envelope) -> str:
    """The partition value of a run's tables."""
    return env.run_id or ""


def _key(env: Envelope, stream_seq: int) -> dict[str, Any]:
    """The columns every run table row starts with: where in the run, and which event."""
    return {
        "attempt": env.attempt,
        "step": env.step,
        "time": env.time,
        "stream": env.stream,
        "stream_seq": stream_seq,
    }


# StepMetrics' typed fields, in the order their metric rows are written (then the named scalars).
STEP_SCALARS = (
    "loss",
    "grad_norm",
    "lr",
    "tokens",
    "total_tokens",
    "tokens_per_second",
    "mfu",
    "step_time_s",
)


def _flatten_metrics(m: p.StepMetrics) -> tuple[list[str], list[float | None]]:
    names = [name for name in STEP_SCALARS if getattr(m, name) is not None]
    values: list[float | None] = [float(getattr(m, name)) for name in names]
    names.extend(m.scalars)
    values.extend(m.scalars.values())
    return names, values


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


# --------------------------------------------------------------------------------- projectors


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)


def _micros(time: datetime) -> int:
    """A time as microseconds since the epoch: Arrow converts these ~6x faster than datetimes, and
    the per-step tables repeat one event's time on every row."""
    return (time - _EPOCH) // _MICROSECOND


def _step_metrics(env: Envelope, stream_seq: int, state: FoldState) -> list[Row | Columns]:
    names, values = _flatten_metrics(env.data)
    n = len(names)
    columns: dict[str, list[Any]] = {
        "attempt": [env.attempt] * n,
        "step": [env.step] * n,
        "time": [_micros(env.time)] * n,
        "name": names,
        "value": values,
        "stream": [env.stream] * n,
        "stream_seq": [stream_seq] * n,
    }
    return [Columns("metrics", _run(env), columns)]


_LAYER_FIELDS = p.MoeLayerStats.__struct_fields__
# Fields added later with an UNSET default (left out of events that lack them): null in their rows.
_LAYER_UNSET_FIELDS = frozenset(
    f.name for f in msgspec.structs.fields(p.MoeLayerStats) if f.default is msgspec.UNSET
)


def _moe_router_stats(env: Envelope, stream_seq: int, state: FoldState) -> list[Row | Columns]:
    # Column-wise: a reference-shape step has 48 layers, and a row at a time is most of ingest's cost.
    layers = env.data.layers
    n = len(layers)
    columns: dict[str, list[Any]] = {name: [value] * n for name, value in _key(env, stream_seq).items()}
    columns["time"] = [_micros(env.time)] * n
    for name, values in zip(
        _LAYER_FIELDS, zip(*map(msgspec.structs.astuple, layers), strict=True), strict=False
    ):
        columns[name] = _nulls_for_unset(values) if name in _LAYER_UNSET_FIELDS else list(values)
    return [Columns("moe_layer_stats", _run(env), columns)]


def _nulls_for_unset(values: tuple[Any, ...]) -> list[Any]:
    return [None if value is msgspec.UNSET else value for value in values]


_LAUNCH_COLUMNS = frozenset(TABLES["launches"].schema.names)


def _launch(env: Envelope, stream_seq: int, state: FoldState) -> list[Row | Columns]:
    """A start or a resume: its launch row, and the config it launched with."""
    data, run, key = env.data, _run(env), _key(env, stream_seq)
    kind = "start" if env.type == c.RUN_STARTED else "resume"
    launch = {k: v for k, v in msgspec.structs.asdict(data).items() if k in _LAUNCH_COLUMNS}
    row = {**key, **launch, "kind": kind, "software": _json(data.software), "external": _json(data.external)}
    state.configs[(run, env.attempt or 1)] = data.config
    config = {**key, "config_hash": data.config_hash, "config": _json(data.config), "cause": kind}
    return [Row("launches", run, row), Row("configs", run, config)]


def _config_changed(env: Envelope, stream_seq: int, state: FoldState) -> list[Row | Columns]:
    """An accepted change: the patched config (when the previous one is known) and the change."""
    data, run, key = env.data, _run(env), _key(env, stream_seq)
    out: list[Row | Columns] = []
    previous = state.config_of(run, env.attempt or 1)
    hash_matches = None
    if previous is not None:
        try:
            new = apply_config_patch(previous, data.patch)
        except ConfigPatchError:
            hash_matches = False
        else:
            new_hash = config_hash(new)
            hash_matches = new_hash == data.config_hash
            state.configs[(run, env.attempt or 1)] = new
            out.append(
                Row(
                    "configs",
                    run,
                    {**key, "config_hash": new_hash, "config": _json(new), "cause": data.cause.kind},
                )
            )
    out.append(Row("config_changes", run, _change_row(key, data, True, hash_matches)))
    return out


def _config_rejected(env: Envelope, stream_seq: int, state: FoldState) -> list[Row | Columns]:
    return [Row("config_changes", _run(env), _change_row(_key(env, stream_seq), env.data, False, None))]


def _checkpoint_saved(env: Envelope, stream_seq: int, state: FoldState) -> list[Row | Columns]:
    return [Row("checkpoints", _run(env), {**_key(env, stream_seq), **msgspec.structs.asdict(env.data)})]


def _run_crashed(env: Envelope, stream_seq: int, state: FoldState) -> list[Row | Columns]:
    return [Row("incidents", _run(env), {**_key(env, stream_seq), **msgspec.structs.asdict(env.data)})]


def _step_skipped(env: Envelope, stream_seq: int, state: FoldState) -> list[Row | Columns]:
    data = env.data
    row = {**_key(env, stream_seq), "kind": "skipped", "message": f"{data.reason} ({data.value})"}
    return [Row("incidents", _run(env), row)]


def _run_finished(env: Envelope, stream_seq: int, state: FoldState) -> list[Row | Columns]:
    data = env.data
    row = {
        **_key(env, stream_seq),
        "status": data.status,
        "total_tokens": data.total_tokens,
        "duration_s": data.duration_s,
    }
    return [Row("run_ends", _run(env), row)]


def _rank_stats(env: Envelope, stream_seq: int, state: FoldState) -> list[Row | Columns]:
    data = env.data
    row = {
        **_key(env, stream_seq),
        "rank": data.rank,
        "host": data.host,
        "step_time_s": data.step_time_s,
        "values": _json(data.values),
    }
    return [Row("rank_stats", _run(env), row)]


def _annotation(env: Envelope, stream_seq: int, state: FoldState) -> list[Row | Columns]:
    data = env.data
    row = {**_key(env, stream_seq), "author": data.author, "text": data.text, "tags": data.tags}
    return [Row("annotations", _run(env), row)]


def _run_summary(env: Envelope, stream_seq: int, state: FoldState) -> list[Row | Columns]:
    return [Row("summaries", _run(env), {**_key(env, stream_seq), "values": _json(env.data.values)})]


_OWNER_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")  # a GitHub login, as a directory name


def _github(env: Envelope, stream_seq: int, state: FoldState) -> list[Row | Columns]:
    """Every GitHub event: one row, partitioned by the repository's owner (org-level events: the org)."""
    row = github_row(env.type, env.data, env.time, event_id=env.id)
    origin = {"stream": env.stream, "stream_seq": stream_seq}
    owner = row["repo"].split("/")[0] if row["repo"] else (row["org"] or "")
    # A name the payload gave is a directory level here: anything but a plain login goes to "_".
    partition = owner if _OWNER_RE.fullmatch(owner) else ""
    return [Row("github", partition, {**row, **origin})]


def _ledger_incident(env: Envelope, stream_seq: int, state: FoldState) -> list[Row | Columns]:
    """Ingest's gap, fork or duplicate launch, typed: state and history fold these rows into ranges
    (``runledger.ledger.views.incident_ranges_query``) without decoding each event's JSON."""
    return [Row("ingest_incidents", _run(env), {**_key(env, stream_seq), **msgspec.structs.asdict(env.data)})]


def _no_rows(env: Envelope, stream_seq: int, state: FoldState) -> list[Row | Columns]:
    """Producer and ledger records (registry, policy, drops): the events table holds them."""
    return []


PROJECTORS: dict[str, Projector] = {
    c.STEP_METRICS: _step_metrics,
    c.MOE_ROUTER_STATS: _moe_router_stats,
    c.RUN_STARTED: _launch,
    c.RUN_RESUMED: _launch,
    c.CONFIG_CHANGED: _config_changed,
    c.CONFIG_REJECTED: _config_rejected,
    c.CHECKPOINT_SAVED: _checkpoint_saved,
    c.RUN_CRASHED: _run_crashed,
    c.STEP_SKIPPED: _step_skipped,
    c.RUN_FINISHED: _run_finished,
    c.RANK_STATS: _rank_stats,
    c.ANNOTATION: _annotation,
    c.RUN_SUMMARY: _run_summary,
    **{name: _github for name in c.CATALOGUE if name.startswith("github.")},
    **{name: _no_rows for name in (*sorted(c.LEDGER_TYPES), c.PRODUCER_DROPPED, c.BUS_POSITIONS_MISSING)},
    c.LEDGER_INCIDENT: _ledger_incident,
}


def _login_of(value: Any) -> str | None:
    if isinstance(value, dict):
        login = value.get("login")
        return login if isinstance(login, str) and login else None
    return None


def _raw_repo(payload: dict[str, Any]) -> str | None:
    repository = payload.get("repository")
    if isinstance(repository, dict):
        name = repository.get("full_name")
        return name if isinstance(name, str) and name else None
    return None


def github_row(type_name: str, data: Any, time: datetime, event_id: str | None = None) -> dict[str, Any]:
    """The ``github`` table row of one GitHub event (``event_id`` stands in for the ``fact`` of
    events logged before payloads carried one)."""
    kind = type_name.removeprefix("github.")
    row: dict[str, Any] = {
        "repo": getattr(data, "repo", None) or None,
        "time": time,
        "kind": kind,
        "action": getattr(data, "action", None),
        "fact": getattr(data, "fact", None) or event_id,
        "via": getattr(data, "via", None),
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
        # Untyped events name their repository (and organisation) only inside the payload; an
        # org-level event (no repository) has repo NULL and its organisation in ``org``.
        payload = data.payload
        row |= {
            "kind": f"raw:{data.event}",
            "repo": _raw_repo(payload),
            "org": _login_of(payload.get("organization")),
            "actor": _login_of(payload.get("sender")),
            "via": "webhook",
            "body": _json(payload),
        }
    return row
