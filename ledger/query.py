"""Read-side library: SQL over the views, a run's events, its state, history and diffs.

The history's rows are read here and told as sentences by ``runledger.ledger.history``.

The CLI is a thin shell over these functions; tests and other programs call them directly.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import duckdb
import msgspec

from runledger.ledger import duck
from runledger.ledger.fold import (
    FOLD_TYPES,
    STATE_TYPES,
    RunState,
    attempts_of,
    fold_run,
    on_lineage,
    with_incident_ranges,
)
from runledger.ledger.history import (
    MISSING,
    HistoryItem,
    config_after,
    github_item,
    history_item,
    history_range,
    incident_items,
    op_text,
    value_at,
)
from runledger.ledger.lake import (
    ALIAS,
    Catalog,
    ColumnBounds,
    LakeError,
    LakeFolder,
    MaintenanceLock,
    TableFiles,
    attached_ledger_id,
    checkpoint_snapshot,
    file_bounds,
    file_bounds_sql,
    is_s3,
    live_at_snap,
    open_snapshot,
    plain_file_under,
    replaced_catalog,
    retry_locked,
    snapshot_files,
)
from runledger.ledger.lake import COMMITS as LAKE_COMMITS
from runledger.ledger.lake import STATE as LAKE_STATE
from runledger.ledger.lazy_views import LazyViews
from runledger.ledger.lineage import (
    CLAIMS_QUERY,
    LINE_QUERY,
    LineageMember,
    member_at_step,
    member_at_time,
    members_of_rows,
)
from runledger.ledger.merkle import CompactRange
from runledger.ledger.parquet_schemas import lake_columns, tables_of
from runledger.ledger.records import LedgerError, StreamHead, commit_record_paths
from runledger.ledger.redaction_marker import REDACTED_PREFIX, is_redacted, read_marker
from runledger.ledger.sql_guard import (
    QueryLimits,
    RefusedStatement,
    SpillFolder,
    StatementStopped,
    StatementTimer,
    limit_error,
    lock_connection,
    lock_sql,
    read_only_statement,
)
from runledger.ledger.views import (
    connect,
    empty_rows,
    incident_range_facts,
    incident_ranges_query,
    lake_rows,
    lake_views_sql,
    stored_name,
)
from runledger.schemas import Envelope, decode_event
from runledger.schemas import catalogue as c
from runledger.schemas.config_patch import ConfigPatchError, apply_config_patch

if TYPE_CHECKING:  # issue 41: a read never loads the writer (a published copy's opens it) nor pyarrow
    import pyarrow as pa

    from runledger.ledger.run_search import RunFilter
    from runledger.ledger.store import Ledger

_T = TypeVar("_T")
SPILL_AREA = ".spill"  # under a ledger's folder: its readers' spill folders (``runledger.ledger.sql_guard.SpillFolder``)


class QueryError(LedgerError):
    pass


# A GitHub event's columns as a state and a history show them.
GITHUB_COLUMNS = "time, kind, action, number, title, state, actor, merged, sha, head_sha, url, body"


class Result(msgspec.Struct):
    columns: list[str]
    rows: list[tuple[Any, ...]]

    def records(self) -> list[dict[str, Any]]:
        """The rows as dicts keyed by column name."""
        return [dict(zip(self.columns, row, strict=True)) for row in self.rows]


class RecordHead(msgspec.Struct, frozen=True):
    """The ledger's record as one reader sees it: the ledger's id, the number of its newest commit
    (-1 before the first) and each stream's head (size and Merkle tree), from that commit's record.
    The same object for a lake (at the reader's snapshot) and a ledger of part files."""

    ledger_id: str
    commit: int
    streams: dict[str, StreamHead]

    @classmethod
    def of_record(cls, ledger_id: str, record: Any) -> RecordHead:
        """From a commit record (a dict as ``runledger.ledger.store`` writes it; None: no commit yet)."""
        if record is None:
            return cls(ledger_id, -1, {})
        try:
            streams = {str(s): StreamHead.from_json(h) for s, h in record["streams"].items()}
            return cls(ledger_id, int(record["commit"]), streams)
        except (TypeError, KeyError, ValueError, AttributeError) as exc:
            raise QueryError(
                f"ledger {ledger_id}: a commit record without its stream heads ({exc!r})"
            ) from None


class Reader:
    """Read-only access to one ledger: a published copy's folder of part files (``runledger.ledger.remote``), or
    a folder whose tables are in a DuckLake (``LAKE.json``), read at one snapshot (``snapshot``: that
    one, default the newest when the reader opens). Every statement runs under ``limits`` (default
    ``QueryLimits()``: 300 s, 2 GiB or a quarter of the memory, 10 GB of spill in ``<ledger>/.spill``)."""

    def __init__(
        self,
        root: str | Path,
        *,
        snapshot: int | None = None,
        at_checkpoint: str | None = None,
        limits: QueryLimits | None = None,
        sqlite3_catalog: bool = False,
    ) -> None:
        self.root = Path(root)
        # issue 41: read a SQLite catalog's file list with Python's sqlite3 (``_open_lake``): only in a
        # process holding no other connection to the catalog (``runledger.ledger.lake_snapshot_files``).
        self._sqlite3_catalog = sqlite3_catalog
        self.snapshot: int | None = None  # the lake snapshot every statement sees (a lake only)
        self._ledger: Ledger | None = None  # a published copy only
        self._lake: LakeFolder | None = None  # a lake only
        self._head: RecordHead | None = None  # read when first asked for (a lake: ~20 ms)
        self._views: LazyViews | None = None  # a lake's views not made yet (None: all are made)
        # The tables with a data file (or rows read another way) at a lake's snapshot: a statement
        # over any other answers nothing, so the reader's own is not run (None: a published copy).
        self._tables_with_rows: frozenset[str] | None = None
        # A lake's files at the snapshot, and the catalog's bounds of ``BOUNDED_COLUMNS`` in each
        # (``_rows_within``: the reader's own statements open only the files that can hold their rows).
        self._files: dict[str, TableFiles | None] = {}
        self._bounds: dict[int, dict[str, ColumnBounds]] = {}
        self.limits = limits if limits is not None else QueryLimits()
        try:
            lake = LakeFolder.read(self.root)
        except LakeError as exc:
            raise QueryError(str(exc)) from None
        if lake is not None:
            self._open_lake(lake, snapshot, at_checkpoint)
            return
        from runledger.ledger.store import Ledger  # (the writer's module: only a published copy's reads)

        self._ledger = Ledger.open(root)  # a published copy (a ledger of the old format: refused)
        if snapshot is not None or at_checkpoint is not None:
            option = "--snapshot" if snapshot is not None else "--at-checkpoint"
            raise QueryError(f"{option}: {self.root} is a published copy, which keeps no snapshots")
        heads = self._ledger.stream_heads()  # (loads the newest record: ``last_commit`` is that one's)
        self._head = RecordHead(self._ledger.ledger_id, self._ledger.last_commit, heads)
        self._spill = spill_folder(self.root / SPILL_AREA)
        self._con = connect(self.root)
        self._timer = StatementTimer(self._con)
        # DuckDB itself refuses to reach outside the ledger's tables, and nothing can undo that
        # (``runledger.ledger.sql_guard``); the statement check in ``_run`` is the second wall.
        lock_connection(
            self._con,
            [self.root / name for name in tables_of(self.root)],
            limits=self.limits,
            spill=self._spill.path,
        )
        # The fold's events are read from their own small table where the ledger keeps one.
        self._state_table = "state_events" in tables_of(self.root)

    def _open_lake(self, lake: LakeFolder, snapshot: int | None, at_checkpoint: str | None) -> None:
        """Every view over the lake's files at one snapshot: no statement, and no two statements of
        this reader, see two moments; a commit that did not finish is not there. ``at_checkpoint``:
        a signed stream checkpoint's text, answered as of the snapshot it pins.

        The snapshot's file list is read on a connection of its own (the catalog attached through
        DuckLake's extensions), closed before any statement runs: the statements' connection loads
        no catalog scanner and no DuckLake (their functions open files with their own I/O, past
        DuckDB's lock), only views over the listed Parquet files (and httpfs for S3)."""
        # -- issue 41: with ``sqlite3_catalog``, a SQLite catalog's plain file list is read with
        # Python's sqlite3 (``runledger.ledger.lake_snapshot_files``: no extension loaded); else DuckLake's.
        listed = None
        if self._sqlite3_catalog and at_checkpoint is None:
            from runledger.ledger.lake_snapshot_files import sqlite_snapshot_files

            listed = sqlite_snapshot_files(lake, snapshot)
        if listed is not None:
            self.snapshot = listed.snapshot
            views = lake_views_sql(lake.tables, files=dict(listed.files), rows={}, stored_schema=True)
            self._tables_with_rows = frozenset(name for name in lake.tables if name in listed.files)
            self._files, self._bounds = dict(listed.files), listed.bounds
        else:
            views = self._ducklake_views(lake, snapshot, at_checkpoint)
        # -- end issue 41
        self._lake = lake
        self._spill = spill_folder(self.root / SPILL_AREA)
        self._con = _plain_connection(lake.data_path)
        self._timer = StatementTimer(self._con)
        self._con.execute("SET TimeZone = 'UTC'")
        self._con.execute("SET parquet_metadata_cache = true")  # (as over part files: names never reused)
        # Each view is made when a statement first needs it (issue 41: binding all ~60 is ~70 ms).
        self._views = LazyViews(views)
        # Only the data files.
        if is_s3(lake.data_path):
            self._con.execute(_s3_lock_sql(lake.data_path, self.limits, self._spill.path))
        else:
            lock_connection(
                self._con,
                [Path(lake.data_path)] if "://" not in lake.data_path else [],
                limits=self.limits,
                spill=self._spill.path,
            )
        self._state_table = "state_events" in lake.tables
        self._maintenance = MaintenanceLock(Catalog.parse(lake.catalog))

    def _ducklake_views(self, lake: LakeFolder, snapshot: int | None, at_checkpoint: str | None) -> str:
        """The views at the pinned snapshot (``self.snapshot``), listed on a connection with the
        catalog attached through DuckLake's extensions."""
        try:
            if at_checkpoint is not None:
                if snapshot is not None:
                    raise LakeError("give --snapshot or --at-checkpoint, not both")
                newest, _ = open_snapshot(lake.catalog, lake.data_path)
                try:
                    snapshot = checkpoint_snapshot(newest, lake.ledger_id, at_checkpoint)
                finally:
                    newest.close()
            pinned, self.snapshot = open_snapshot(lake.catalog, lake.data_path, snapshot)
        except LakeError as exc:
            raise QueryError(str(exc)) from None
        # A catalog replaced by another ledger's would answer with that ledger's rows: its own
        # ledger id (a catalog row, no data file read) must be the one LAKE.json names.
        try:
            _same_ledger(pinned, lake)
            views, self._tables_with_rows, self._files = _pinned_views(pinned, lake, self.snapshot)
            self._bounds = _pinned_bounds(pinned, self.snapshot)
        except (
            duckdb.Error
        ) as exc:  # a damaged SQLite catalog loads, and fails here (DuckDB's file: at attach)
            raise QueryError(f"lake catalog {lake.catalog}: {str(exc).strip().splitlines()[0]}") from None
        finally:
            pinned.close()
        return views

    @property
    def con(self) -> duckdb.DuckDBPyConnection:
        """The reader's connection with every view made (for a caller that runs SQL on it directly:
        the shell's parsing; the reader's own statements make only the views they name)."""
        if self._views is not None:
            self._make_views(self._views.make_all)
        return self._con

    def _make_views(self, make: Callable[[duckdb.DuckDBPyConnection], object]) -> None:
        """``make(connection)``; a view that cannot be made (a listed file missing, or not Parquet:
        binding a view opens its files) is this snapshot's error, in one line."""
        try:
            make(self._con)
        except duckdb.Error as exc:
            raise QueryError(f"lake snapshot {self.snapshot}: {str(exc).strip().splitlines()[0]}") from None

    def _views_for(self, statement: str) -> None:
        if self._views is not None:
            views = self._views
            self._make_views(lambda con: views.make_for(con, statement))

    def _rowless(self, table: str) -> bool:
        """Whether ``table`` is known to hold no row at this reader's snapshot (no data file)."""
        return self._tables_with_rows is not None and table not in self._tables_with_rows

    def close(self) -> None:
        """Let go of the connection, and of its spill folder."""
        self._timer.close()
        self._con.close()
        self._spill.remove()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def head(self) -> RecordHead:
        """The ledger's id, newest commit and stream heads as of this reader (a lake: its snapshot;
        part files: when the reader opened)."""
        if self._head is None:
            assert self._lake is not None and self.snapshot is not None  # (part files: set on opening)
            self._head = _lake_head(self._lake, self.snapshot)
        return self._head

    def stream_root(self, stream: str, size: int) -> bytes | None:
        """The Merkle root of ``stream``'s first ``size`` leaves as the record stored it when a
        commit brought the stream to that size (a signed checkpoint's size); None when no commit
        up to this reader's head did."""
        head = self.head.streams.get(stream)
        if head is None or size > head.size:
            return None
        if size == head.size:
            return head.tree.root()
        if self._lake is not None:
            return _lake_stream_root(self._lake, stream, size)
        return _folder_stream_root(self.root, stream, size)

    def sql(self, statement: str, params: Sequence[Any] | None = None) -> Result:
        """Run one read-only statement and return its rows. Writes are refused, and so are several
        statements (one result each would have to be dropped but the last's).

        DuckDB's errors keep their line breaks, so a parser error's caret points at the mistake.
        """

        def rows(query: str, params: Sequence[Any] | None) -> Result:
            rel = self._con.execute(query, params) if params else self._con.execute(query)
            return Result([d[0] for d in rel.description or []], rel.fetchall())

        return self._run(statement, params, rows)

    def arrow(self, statement: str, params: Sequence[Any] | None = None) -> pa.Table:
        """``sql``, answered as an Arrow table: a long series without a Python object per value
        (390,000 points: ~40 ms, against ~115 ms as tuples)."""

        def table(query: str, params: Sequence[Any] | None) -> pa.Table:
            return self._con.sql(query, params=params or None).to_arrow_table()

        return self._run(statement, params, table)

    def _run(
        self, statement: str, params: Sequence[Any] | None, fetch: Callable[[str, Sequence[Any] | None], _T]
    ) -> _T:
        """One read-only statement, answered by ``fetch(query, params)`` under the reader's limits."""
        self._views_for(statement)  # (before the check: it knows the views' macros by the connection)
        try:
            query = read_only_statement(self._con, statement)
        except RefusedStatement as exc:
            raise QueryError(str(exc)) from None

        def bounded(query: str, params: Sequence[Any] | None) -> _T:
            try:
                return self._timer.run(self.limits.timeout_s, lambda: fetch(query, params))
            finally:
                self._spill.clear()  # (DuckDB deleted its spill files; nothing of a statement stays)

        try:
            return self._answer(query, params, bounded)
        except StatementStopped as exc:
            raise QueryError(str(exc)) from None

    def _answer(
        self, query: str, params: Sequence[Any] | None, fetch: Callable[[str, Sequence[Any] | None], _T]
    ) -> _T:
        if self._ledger is None:  # a lake snapshot: nothing moves under it
            self._views_for(query)
            try:
                with self._maintenance.shared():
                    return retry_locked(lambda: fetch(query, params))
            except duckdb.CatalogException as exc:
                # A name the statement's words did not show (or a mistyped one): again with every
                # view made, so it answers, or DuckDB's "did you mean" is told from all of them.
                if self._views is None or not self._views.make_all(self._con):
                    raise QueryError(_duckdb_error(exc, self.limits)) from None
                return self._answer(query, params, fetch)
            except duckdb.Error as exc:
                raise QueryError(_duckdb_error(exc, self.limits)) from None
            except (OSError, LakeError) as exc:  # the lock beside the catalog (a folder moved away)
                raise QueryError(f"the lake of {self.root}: {exc}") from None
        try:  # a published copy: its files change only when a fetch replaces them
            return fetch(query, params)
        except duckdb.Error as exc:
            raise QueryError(_duckdb_error(exc, self.limits)) from None

    def runs(self, filt: RunFilter | None = None) -> Result:
        """Every run (the ``runs`` view), or, given a filter, the runs it selects in its order
        (``runledger.ledger.run_search``: the columns of ``run_search.answer_columns``)."""
        if filt is None:
            return self.sql("SELECT * FROM runs ORDER BY started_at")
        from runledger.ledger.run_search import search_runs

        return search_runs(self, filt)

    def run_exists(self, run_id: str) -> bool:
        return bool(self.sql("SELECT count(*) FROM launches WHERE run_id = ?", [run_id]).rows[0][0])

    def require_run(self, run_id: str) -> None:
        if not self.run_exists(run_id):
            self._refuse_redacted_launch(run_id)
            known = [r[0] for r in self.sql("SELECT DISTINCT run_id FROM launches ORDER BY 1").rows]
            hint = f" (known runs: {', '.join(known[:10])})" if known else " (the ledger has no runs yet)"
            raise QueryError(f"unknown run {run_id!r}{hint}")

    def _refuse_redacted_launch(self, run_id: str) -> None:
        """A run whose every launch was redacted has no launch row: say so, not "unknown run"."""
        rows = self.sql(
            "SELECT canonical FROM events WHERE stream = ? AND type = ? AND starts_with(canonical, ?) LIMIT 1",
            [run_id, c.RUN_STARTED, REDACTED_PREFIX],
        ).rows
        if rows:
            reason = read_marker(rows[0][0]).get("reason", "")
            raise QueryError(f"run {run_id!r}: its launch was redacted ({reason})")

    def events(self, run_id: str, types: Sequence[str] = FOLD_TYPES) -> list[Envelope]:
        """A run's events of the given types, in stream order.

        State events come from ``state_events`` (a few hundred rows for a run of millions of events),
        read from the run's partition (and ``_``: run-less events on the run's stream) only."""
        marks = ", ".join("?" for _ in types)
        if self._state_table and set(types) <= set(STATE_TYPES):
            source = "state_events WHERE run_id IN (?, '_') AND"
            params = [run_id, run_id, *types]
        else:
            source, params = "events WHERE", [run_id, *types]
        rows = self.sql(
            f"SELECT canonical FROM {source} stream = ? AND type IN ({marks}) ORDER BY stream_seq", params
        ).rows
        out = []
        for (canonical,) in rows:
            if is_redacted(canonical):  # erased (`ledger redact`): its redaction record tells of it
                continue
            decoded = decode_event(canonical.encode())
            if not hasattr(decoded, "envelope"):
                raise QueryError(f"stored event of run {run_id} no longer decodes: {decoded.reason}")
            out.append(decoded.envelope)
        return out

    def unauthenticated(self, run_id: str) -> frozenset[tuple[str, str]]:
        """(source, id) of the run's events admitted unsigned under the ledger's policy (the events
        table's ``authenticated`` column: only the files whose bounds hold a false are read, and
        Parquet statistics skip their row groups with none)."""
        rows_from = self._rows_within("events", "authenticated", _may_hold_false)
        if rows_from is None:
            return frozenset()  # (no file holds one: nothing to read)
        try:
            rows = self.sql(
                f"SELECT source, id FROM {rows_from} WHERE stream = ? AND authenticated = false", [run_id]
            ).rows
        except QueryError:  # a ledger from before the column: nothing was admitted unsigned by policy
            return frozenset()
        return frozenset((source, ident) for source, ident in rows)

    def github_rows(self, repository: str | None, *, text: bool = True) -> list[dict[str, Any]]:
        """The repository's GitHub events (the ``github`` view: one row per fact), in time order.
        ``text=False``: each row's ``time`` alone, for a summary that counts them (a one-shot ``ledger
        state``: ~9 ms less on the reference run's 512, most of it DuckDB's window carrying the text)."""
        if not repository or self._rowless("github"):
            return []
        columns = GITHUB_COLUMNS if text else "time"
        res = self.sql(
            f"SELECT {columns} FROM github WHERE lower(repo) = lower(?) ORDER BY time, stream_seq",
            [repository],
        )
        return res.records()

    def step_window(self, run_id: str, from_step: int, to_step: int) -> tuple[datetime, datetime] | None:
        """When the run was at steps ``from_step``..``to_step``: the time of the first of its events in
        that range and of the last (every attempt's), or None when it logged none there."""
        first, last = self.sql(
            "SELECT min(time), max(time) FROM events WHERE stream = ? AND step BETWEEN ? AND ?",
            [run_id, from_step, to_step],
        ).rows[0]
        return None if first is None else (first, last)

    def last_step(self, run_id: str, *, reached: int | None = None) -> int | None:
        """The run's highest step. ``reached``: a step one of its events is known to hold (a state
        event's): only rows at or above it are read, so Parquet statistics skip the row groups of
        every step before it (the whole run's events otherwise: ~1.1M rows for the reference run)."""
        if reached is None:
            return self.sql("SELECT max(step) FROM events WHERE stream = ?", [run_id]).rows[0][0]
        rows_from = self._rows_within("events", "step", lambda bounds: _may_reach(bounds, reached))
        if rows_from is None:
            return reached
        found = self.sql(
            f"SELECT max(step) FROM {rows_from} WHERE stream = ? AND step >= ?", [run_id, reached]
        ).rows[0][0]
        return reached if found is None else found

    def _rows_within(self, table: str, column: str, may_hold: Callable[[ColumnBounds], bool]) -> str | None:
        """What a statement of the reader's own reads ``table``'s rows from when it wants only rows
        whose ``column`` ``may_hold`` allows by a file's bounds (the catalog's, read with the
        snapshot's file list): its view where the reader knows no bounds (a published copy, a table
        with deletions) or every file may hold such rows; the rows of the files that may, as a
        subquery; None when no file may (a file without bounds always may)."""
        listed = self._files.get(table)
        if listed is None or len(listed.ids) != len(listed.paths):
            return stored_name(table)
        kept = [
            path
            for path, file_id in zip(listed.paths, listed.ids, strict=True)
            if (bounds := self._bounds.get(file_id, {}).get(column)) is None or may_hold(bounds)
        ]
        if not kept:
            return None
        if len(kept) == len(listed.paths):
            return stored_name(table)
        return f"({lake_rows(table, ALIAS, {table: TableFiles(kept, listed.partition)})})"

    def state(
        self,
        run_id: str,
        *,
        step: int | None = None,
        at: datetime | None = None,
        lineage: bool = True,
        github_text: bool = True,
    ) -> RunState:
        """The run's state at ``step`` or ``at`` (neither: its last step). ``lineage``: "the run" is
        its lineage across run ids (``runledger.ledger.lineage``): the state is that of the run id
        that supplies the step (or was live at the time), named by the state's ``run_id``.
        ``github_text=False``: the state's GitHub rows hold their ``time`` alone (a summary counts
        them; ``github_rows``)."""
        if lineage:
            run_id = self._lineage_member(run_id, step, at)
        events = self.events(run_id)
        if not any(e.type in (c.RUN_STARTED, c.RUN_RESUMED) and e.run_id == run_id for e in events):
            self.require_run(run_id)  # a launch among its state events is a launch row: no query then
        return self._state(run_id, events, step=step, at=at, github_text=github_text)

    def _state(
        self,
        run_id: str,
        events: Sequence[Envelope],
        *,
        step: int | None = None,
        at: datetime | None = None,
        github: Sequence[dict[str, Any]] | None = None,
        github_text: bool = True,
    ) -> RunState:
        """``state`` over the run's state events (and its repository's GitHub rows), read once by the caller."""
        # A step at or below a state event's is in range without scanning the run's last step.
        known = max((e.step for e in events if e.step is not None), default=None)
        if step is not None and (step < 0 or known is None or step > known):
            last = self.last_step(run_id, reached=known)
            if step < 0 or (last is not None and step > last):
                raise QueryError(f"step {step} is out of range for run {run_id} (steps 0..{last})")
        attempts = attempts_of(events)
        repository = next((a.repository for a in attempts.values() if a.repository), None)
        if step is None and at is None:
            step = self.last_step(run_id, reached=known)
        if github is None:
            github = self.github_rows(repository, text=github_text)
        state = fold_run(
            run_id, events, step=step, at=at, github=github, unauthenticated=self.unauthenticated(run_id)
        )
        if state.attempt is not None and not any(e.type == c.LEDGER_INCIDENT for e in events):
            ranges = self.incident_ranges(run_id, attempt=state.attempt, step=state.step, at=at)
            state.incidents = with_incident_ranges(state.incidents, ranges)
        return state

    def lineage(self, run_id: str) -> list[LineageMember]:
        """The run ids of ``run_id``'s line across relaunches, eldest first (``runledger.ledger.lineage``);
        empty for an unknown run. A reader pinned at a lake snapshot asks once per run: nothing moves
        under it (the cache lives on the reader). Fixed statements of the reader's own: not put through
        the guard of a user's SQL (its parse of the macro costs more than the answer)."""
        cache: dict[str, list[LineageMember]] = self.__dict__.setdefault("_lineage_cache", {})
        if run_id in cache:
            return cache[run_id]

        def rows(query: str, params: Sequence[Any] | None) -> list[Any]:
            return self._con.execute(query, params).fetchall()

        # Most runs name no parent and none names them: one scan of the launches says so, and the
        # line is the run alone (the family walk is for the runs that have a family).
        started_at, claims = self._answer(CLAIMS_QUERY, [run_id] * 5, rows)[0]
        if started_at is None or not claims:
            line = (
                [] if started_at is None else [LineageMember(run_id, 0, started_at, None, None, None, None)]
            )
        else:
            line = members_of_rows(self._answer(LINE_QUERY, [run_id], rows))
        if self._ledger is None:  # a lake snapshot
            cache[run_id] = line
        return line

    def _lineage_member(self, run_id: str, step: int | None, at: datetime | None) -> str:
        """The run id of ``run_id``'s lineage that supplies ``step`` (or was live at ``at``)."""
        line = self.lineage(run_id)
        if len(line) <= 1:  # no lineage (or an unknown run: the caller names it)
            return run_id
        return (member_at_time(line, at) if at is not None else member_at_step(line, step)).run_id

    def incident_ranges(
        self, run_id: str, *, attempt: int | None = None, step: int | None = None, at: datetime | None = None
    ) -> list[dict[str, Any]]:
        """The run's ingest incidents (gaps, forks) folded per source and kind in one GROUP BY
        (``runledger.ledger.views.incident_ranges_query``): as the state counts them at ``attempt``/``step``/
        ``at``, or (none given) all of them."""
        # Typed rows where the ledger keeps ``ingest_incidents`` (a lake made before it: the JSON).
        kept = self._lake.tables if self._lake is not None else tables_of(self.root)
        if "ingest_incidents" in kept and self._rowless("ingest_incidents"):
            return []  # (its statement is ~5 ms in a one-shot ``ledger state``)
        query, params = incident_ranges_query(
            run_id,
            state_table=self._state_table,
            attempt=attempt,
            step=step,
            at=at,
            typed_table="ingest_incidents" in kept,
        )
        return incident_range_facts(self.sql(query, params).records())

    def _run_github(self, events: Sequence[Envelope]) -> list[dict[str, Any]]:
        """The GitHub rows of the repository the run's attempts name."""
        return self.github_rows(
            next((a.repository for a in attempts_of(events).values() if a.repository), None)
        )

    def diff(self, run_id: str, from_step: int, to_step: int, *, lineage: bool = True) -> dict[str, Any]:
        """Config diff between two steps and everything that happened in between. ``lineage``: the
        steps are the lineage's (as ``state`` reads them); ``from``/``to`` name each one's run id."""
        self.require_run(run_id)
        line = self.lineage(run_id) if lineage else []
        if len(line) > 1:
            return self._lineage_diff(run_id, line, from_step, to_step)
        events = self.events(run_id)
        github = self._run_github(events)
        before = self._state(run_id, events, step=from_step, github=github)
        after = self._state(run_id, events, step=to_step, github=github)
        lo, hi = sorted((from_step, to_step))
        # Every event after step lo up to hi, and the GitHub events from step lo's time to hi's.
        happened = history_range(
            self._history(run_id, events, github), lo + 1, hi, self.step_window(run_id, lo, hi)
        )
        return _diff_answer(before, after, happened)

    def _lineage_diff(
        self, run_id: str, line: Sequence[LineageMember], from_step: int, to_step: int
    ) -> dict[str, Any]:
        """``diff`` across a lineage: each step's state from the member that supplies it, and every
        member's events between them (within the times the members were at those steps)."""
        before = self.state(run_id, step=from_step)
        after = self.state(run_id, step=to_step)
        lo, hi = sorted((from_step, to_step))
        window = self.lineage_window(line, lo, hi)
        happened = history_range(self._lineage_history(run_id, line), lo + 1, hi, window)
        return _diff_answer(before, after, happened)

    def lineage_window(
        self, line: Sequence[LineageMember], from_step: int, to_step: int
    ) -> tuple[datetime, datetime] | None:
        """``step_window`` of a lineage: when its members were at the steps of from..to each supplies."""
        spans = [(m.run_id, m.steps_within(from_step, to_step)) for m in line]
        windows = [self.step_window(run, *steps) for run, steps in spans if steps is not None]
        found = [w for w in windows if w is not None]
        return (min(w[0] for w in found), max(w[1] for w in found)) if found else None

    def blame(
        self, run_id: str, key: str, step: int | None = None, *, lineage: bool = True
    ) -> dict[str, Any]:
        """``_run_blame`` of the run id that supplies ``step``; with ``lineage``, a value the run's
        launch only inherited from the run it forked from (the same value there at the fork step)
        is blamed there, up the line. ``value_from`` names the run id the value was read in and
        ``set_by.run_id`` the one whose event set it."""
        line = self.lineage(run_id) if lineage else []
        if len(line) <= 1:
            return self._run_blame(run_id, key, step)
        member = member_at_step(line, step)
        found = self._run_blame(member.run_id, key, step)
        answer = dict(found, run_id=run_id, value_from=member.run_id)
        answer["set_by"] = dict(found["set_by"], run_id=member.run_id)
        # Up the line while the value was set by a member's own start at the step it forked from.
        members = {m.run_id: m for m in line}
        while (
            found["set_by"]["kind"] == "start"
            and member.parent_run in members
            and member.fork_step is not None
        ):
            parent = members[member.parent_run]
            try:
                inherited = self._run_blame(parent.run_id, key, member.fork_step)
            except QueryError:  # the key, or the fork step, is not in the parent: the start set it
                break
            if not _same_value(inherited["value"], found["value"]):
                break
            member, found = parent, inherited
            setter = dict(found["set_by"], run_id=member.run_id)
            answer.update({k: v for k, v in found.items() if k not in ("run_id", "key", "value", "step")})
            answer["set_by"] = setter
        return answer

    def _run_blame(self, run_id: str, key: str, step: int | None = None) -> dict[str, Any]:
        """Which event last changed ``key`` (dotted path) to its value live at ``step``, and who is behind it.

        Like ``git blame``: the run's lineage up to ``step`` is walked in order (its launch, the
        accepted config changes, each resume's config) and the event named is the last one that
        changed the key's value. A resume that only carried the value over is not named.
        """
        self.require_run(run_id)
        events = self.events(run_id)
        state = self._state(run_id, events, step=step)
        path = "/" + "/".join(part.replace("~", "~0").replace("/", "~1") for part in key.split("."))
        value: Any = state.config
        for part in key.split("."):
            if not isinstance(value, dict) or part not in value:
                raise QueryError(f"config key {key!r} is not in run {run_id}'s config at step {state.step}")
            value = value[part]
        attempts = attempts_of(events)
        if state.attempt is None:  # the fold found no launch of the run up to that step
            raise QueryError(f"run {run_id} has no attempt at step {state.step}")
        live = attempts[state.attempt]
        found = _last_change(events, attempts, state.attempt, state.step, path)
        unauthenticated = self.unauthenticated(run_id)
        if found is not None and found.type == c.CONFIG_CHANGED:
            setter_attempt = attempts.get(found.attempt or 1, live)
            cause = msgspec.to_builtins(found.data.cause)
            change = next(
                (
                    ch
                    for ch in state.config_changes
                    if ch["accepted"] and (ch["step"], ch["time"]) == (found.step, found.time)
                ),
                {},
            )
            setter: dict[str, Any] = {
                "kind": "config.changed",
                "step": found.step,
                "attempt": found.attempt,
                "time": found.time,
                "cause": cause,
                "hash_matches": change.get("hash_matches"),
                "authenticated": (found.source, found.id) not in unauthenticated,
            }
        else:  # a launch: the run's start, or a resume that changed the value
            setter_attempt = attempts.get(found.attempt or 1, live) if found is not None else live
            cause = None
            setter = {
                "kind": setter_attempt.kind,
                "step": setter_attempt.start_step,
                "attempt": setter_attempt.attempt,
                "time": setter_attempt.started_at,
                "cause": None,
                "hash_matches": setter_attempt.hash_matches,
                "authenticated": found is None or (found.source, found.id) not in unauthenticated,
            }
        # The code behind the value: the change's own commit, else what the setting attempt ran.
        commit = (cause or {}).get("commit") or setter_attempt.git_commit
        repository = setter_attempt.repository or next(
            (a.repository for a in attempts.values() if a.repository), None
        )
        info = self.commit_info(commit, repository)
        prs = self.prs_for_commit(info.get("sha") or commit)
        # The person: who made the change. A change is never put on the code's author unless the
        # change *is* that commit; a change without a known actor is "unknown". A launch: who wrote
        # the commit it ran, else who authored its PR.
        if cause is not None and cause.get("kind") != "commit":
            person = cause.get("actor") or "unknown"
        else:
            person = (
                (cause or {}).get("actor") or info.get("author") or next((pr["author"] for pr in prs), None)
            )
        return {
            "run_id": run_id,
            "key": key,
            "value": value,
            "step": state.step,
            "set_by": setter,
            "commit": info.get("sha") or commit,
            "commit_title": info.get("title"),
            "commit_author": info.get("author"),
            "git_dirty": setter_attempt.git_dirty if commit == setter_attempt.git_commit else None,
            "person": person,
            "pull_requests": prs,
        }

    def prs_for_commit(self, sha: str | None) -> list[dict[str, Any]]:
        """The PRs that introduced ``sha`` (prefixes allowed): merged as it, or had it as a head commit."""
        return self.prs_for_commits([sha]).get(sha, []) if sha else []

    def prs_for_commits(self, shas: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
        """``prs_for_commit`` of several commits in one query (the GitHub views cost per query, not per row)."""
        if not shas:
            return {}
        res = self.sql(
            "SELECT q.prefix, p.repo, p.number, p.title, p.author, p.state, "
            "p.merged_at IS NOT NULL AS merged, p.merged_at, p.url, c.relation "
            "FROM commit_pull_requests c JOIN github_pull_requests p USING (repo, number), "
            "(SELECT DISTINCT unnest(?::VARCHAR[]) AS prefix) q "
            "WHERE starts_with(c.sha, q.prefix) "
            "QUALIFY row_number() OVER "
            "(PARTITION BY q.prefix, p.repo, p.number ORDER BY c.relation = 'merge_commit' DESC) = 1 "
            "ORDER BY q.prefix, c.relation = 'merge_commit' DESC, p.number",
            [list(shas)],
        )
        out: dict[str, list[dict[str, Any]]] = {}
        for row in res.records():
            out.setdefault(row.pop("prefix"), []).append(row)
        return out

    def commit_info(self, sha: str | None, repository: str | None) -> dict[str, Any]:
        """The full SHA, first line and author of a (possibly abbreviated) commit GitHub told us about."""
        if not sha or not repository:
            return {}
        found = self.sql(
            "SELECT sha, title, author FROM _github_commits WHERE lower(repo) = lower(?) AND starts_with(sha, ?)",
            [repository, sha],
        ).records()
        return found[0] if len(found) == 1 else {}  # an ambiguous prefix names no commit

    def history(self, run_id: str, *, lineage: bool = True) -> list[HistoryItem]:
        """The run's story in time order, its code woven in.

        Each launch names the commit it ran and the PR that introduced that commit; a resume lists
        the config keys that differ from what the previous attempt last ran; a config change shows
        old → new values and its cause; GitHub events of the run's repository during the run (and
        the merges that introduced the commits it ran) appear in between. ``lineage``: every run id
        of the run's lineage is told (``runledger.ledger.lineage``), each item of another run id
        naming it (``HistoryItem.run_id``).
        """
        self.require_run(run_id)
        line = self.lineage(run_id) if lineage else []
        if len(line) > 1:
            return self._lineage_history(run_id, line)
        return self._history(run_id, self.events(run_id))

    def _lineage_history(self, run_id: str, line: Sequence[LineageMember]) -> list[HistoryItem]:
        """Each member's history in one time order; a GitHub event two members saw is told once."""
        items: list[HistoryItem] = []
        told: set[tuple[datetime, str]] = set()
        for member in line:
            for item in self._history(member.run_id, self.events(member.run_id)):
                if item.kind == "github":
                    if (item.time, item.text) in told:
                        continue
                    told.add((item.time, item.text))
                elif member.run_id != run_id:
                    item.run_id = member.run_id
                items.append(item)
        items.sort(key=lambda i: i.time)
        return items

    def _history(
        self, run_id: str, events: Sequence[Envelope], github: Sequence[dict[str, Any]] | None = None
    ) -> list[HistoryItem]:
        code = self._attempt_code(run_id)
        items: list[HistoryItem] = []
        config: dict[str, Any] | None = None
        causes = [e.data.cause.commit for e in events if e.type == c.CONFIG_CHANGED and e.data.cause.commit]
        prs = self.prs_for_commits(causes)  # one query for every change's commit
        unauthenticated = self.unauthenticated(run_id)
        for e in events:
            item = history_item(e, config, code.get(e.attempt or 1), lambda sha: prs.get(sha or "", []))
            if (e.source, e.id) in unauthenticated:
                item.text += " (unauthenticated)"
            items.append(item)
            config = config_after(e, config)
        if not any(e.type == c.LEDGER_INCIDENT for e in events):  # read in summary: one line a source
            items.extend(incident_items(self.incident_ranges(run_id)))
        if events:
            start, end = events[0].time, events[-1].time
            introducing = {row["pr_number"] for row in code.values() if row["pr_number"] is not None}
            for g in self._run_github(events) if github is None else github:
                ran_here = g["kind"] == "pull_request" and g["merged"] and g["number"] in introducing
                if g["time"] <= end and (g["time"] >= start or ran_here):
                    items.append(github_item(g))
        items.sort(key=lambda i: i.time)
        return items

    def _attempt_code(self, run_id: str) -> dict[int, dict[str, Any]]:
        """Per attempt: the full commit it ran (when GitHub knows it) and the PR that introduced it."""
        rows = self.sql(
            "SELECT attempt, commit_sha, commit_title, commit_author, pr_number, pr_title, pr_relation "
            "FROM attempt_commits WHERE run_id = ? ORDER BY attempt",
            [run_id],
        ).records()
        return {row["attempt"]: row for row in rows}


def _s3_lock_sql(data_path: str, limits: QueryLimits, spill: Path) -> str:
    """``runledger.ledger.sql_guard``'s lock with the lake's ``s3://bucket/prefix/`` the one place DuckDB may
    read (objects under it; not another bucket or prefix, not a local file). A prefix, as the lake's
    files are many and change with every commit; DuckDB compares the text, so ``…/prefix/../x`` passes
    it and the server's key handling decides (versitygw refuses such a key)."""
    lock = lock_sql([], limits=limits, spill=spill)
    empty = "SET allowed_directories = [];"
    if empty not in lock:
        raise QueryError("internal: sql_guard.lock_sql changed its allowed_directories line")
    prefix = data_path.rstrip("/") + "/"
    return lock.replace(empty, "SET allowed_directories = ['" + prefix.replace("'", "''") + "'];", 1)


def spill_folder(area: Path) -> SpillFolder:
    """A reader's spill folder under ``area`` (a ledger's ``.spill``), or under the system's temp
    folder where ``area`` cannot be made (a ledger on a read-only mount). The ledger's folder
    itself is never made: a ledger moved away while its reader opened is said, not recreated."""
    if not area.parent.is_dir():
        raise QueryError(f"no ledger at {area.parent} (moved or removed)")
    try:
        return SpillFolder.under(area)
    except OSError:
        import tempfile

        return SpillFolder.under(Path(tempfile.gettempdir()) / "runledger-spill")


def _plain_connection(data_path: str) -> duckdb.DuckDBPyConnection:
    """The statements' connection over a lake's files: no extension, but httpfs and the S3 secret
    for an ``s3://`` data path."""
    if not is_s3(data_path):
        return duck.connect()
    from runledger.ledger.duck_s3 import create_s3_secret
    from runledger.ledger.lake import S3_SECRET, _s3_config

    try:
        con = duck.connect(extensions=["httpfs"])
    except duck.ExtensionMissing as exc:
        raise QueryError(f"lake data {data_path}: {exc}") from None
    try:
        create_s3_secret(con, _s3_config(data_path), S3_SECRET)
    except LakeError as exc:
        con.close()
        raise QueryError(str(exc)) from None
    return con


def _newest_lake_record(pinned: duckdb.DuckDBPyConnection) -> Any:
    """The newest ledger commit's record at the snapshot ``pinned`` holds (None: no ledger commit
    yet; the commit that named the lake has no number). One row read: the filter on the commit
    number skips the other records' files by their statistics."""
    table = f"{ALIAS}.{LAKE_COMMITS}"
    row = duck.one_row(
        pinned.execute(
            f"SELECT info FROM {table} WHERE ledger_commit = (SELECT max(ledger_commit) FROM {table})"
        )
    )
    if row is None:
        return None
    try:
        return json.loads(row[0])["record"]
    except (TypeError, KeyError, ValueError) as exc:
        raise QueryError(f"the lake's newest commit record is unreadable ({exc!r})") from None


def _lake_head(lake: LakeFolder, snapshot: int) -> RecordHead:
    """``Reader.head`` on a lake, from the catalog at the reader's snapshot (not the folder's copies
    of the records: they lag behind another host's commits). Only the report and the page ask, so
    a reader opens without it."""
    try:
        con, _ = open_snapshot(lake.catalog, lake.data_path, snapshot)
    except LakeError as exc:
        raise QueryError(str(exc)) from None
    try:
        return RecordHead.of_record(lake.ledger_id, _newest_lake_record(con))
    except duckdb.Error as exc:
        raise QueryError(f"lake catalog {lake.catalog}: {str(exc).strip().splitlines()[0]}") from None
    finally:
        con.close()


def _lake_stream_root(lake: LakeFolder, stream: str, size: int) -> bytes | None:
    """``Reader.stream_root`` on a lake: the stream's heads are state rows in the catalog, one per
    commit that moved it (never changed once written, so the newest snapshot holds every one)."""
    try:
        con, _ = open_snapshot(lake.catalog, lake.data_path)
    except LakeError as exc:
        raise QueryError(str(exc)) from None
    try:
        rows = con.execute(
            f"SELECT value FROM {ALIAS}.{LAKE_STATE} WHERE key = ?", [f"stream:{stream}"]
        ).fetchall()
    except duckdb.Error as exc:
        raise QueryError(f"lake catalog {lake.catalog}: {str(exc).strip().splitlines()[0]}") from None
    finally:
        con.close()
    for (value,) in rows:
        head = StreamHead.from_json(json.loads(value))
        if head.size == size:
            return head.tree.root()
    return None


def _folder_stream_root(root: Path, stream: str, size: int) -> bytes | None:
    """``Reader.stream_root`` on part files: the newest commit record whose head of ``stream`` has
    ``size`` leaves (records from the newest back, until the stream is shorter)."""
    for path in reversed(commit_record_paths(root)):
        heads = json.loads(path.read_bytes()).get("streams", {})
        head = heads.get(stream)
        if head is None or head["size"] < size:
            return None
        if head["size"] == size:
            return CompactRange.from_json(head["tree"]).root()
    return None


def _same_ledger(pinned: duckdb.DuckDBPyConnection, lake: LakeFolder) -> None:
    """QueryError when the catalog attached on ``pinned`` names another ledger than ``lake``'s."""
    stored = attached_ledger_id(pinned)
    if stored is not None and stored != lake.ledger_id:
        raise QueryError(
            f"{lake.folder}: {replaced_catalog(lake.catalog, lake.folder, stored, lake.ledger_id)}"
        )


def _pinned_bounds(pinned: duckdb.DuckDBPyConnection, snapshot: int) -> dict[int, dict[str, ColumnBounds]]:
    """The ``BOUNDED_COLUMNS``' bounds in each file at ``snapshot``, read on ``pinned`` (the catalog
    attached as ``lake``); none where the catalog does not answer them (bounds only spare reads:
    without them every file is read)."""
    try:
        sql = file_bounds_sql(f"__ducklake_metadata_{ALIAS}.")
        return file_bounds(pinned.execute(sql, {"snap": int(snapshot)}).fetchall())
    except duckdb.Error:
        return {}


def _may_reach(bounds: ColumnBounds, step: int) -> bool:
    """Whether a file whose ``step`` column has ``bounds`` may hold ``step`` or a later one."""
    if bounds.all_null():
        return False
    try:
        return bounds.max_value is None or int(bounds.max_value) >= step
    except ValueError:  # (not a number the catalog wrote: the file is read)
        return True


def _may_hold_false(bounds: ColumnBounds) -> bool:
    """Whether a file whose boolean column has ``bounds`` may hold a false (false sorts first)."""
    return not bounds.all_null() and bounds.min_value not in ("true", "1")


def _pinned_views(
    pinned: duckdb.DuckDBPyConnection, lake: LakeFolder, snapshot: int
) -> tuple[str, frozenset[str], dict[str, TableFiles | None]]:
    """The views over the lake's Parquet files at ``snapshot``, listed on ``pinned`` (the catalog
    attached as ``lake``): each table's files by name; a table whose files carry deletions (a
    redaction's, until its erasure ends) reads them without the deleted rows; a table with rows
    inlined in the catalog (another writer's setting) refuses to be read rather than drop them. The
    names and their meanings are every reader's (``runledger.ledger.views.named_views``), ``lake.<table>``
    the stored rows as when the lake itself is attached as ``lake``. With them, the tables that have
    rows at the snapshot (files, or rows read another way), and each table's files."""
    files = snapshot_files(pinned, lake.data_path, snapshot)
    whole = {name: listed for name, listed in files.items() if listed is not None}
    # Only the ledger's own table names become views: a name is the catalog's text, not ours.
    partial = sorted(name for name, listed in files.items() if listed is None and name in lake.tables)
    deletions = _files_with_deletions(pinned, lake.data_path, snapshot, partial)
    # Every path is the catalog's text: each must name one file inside the data path before any view
    # opens it (views are bound, so their files opened, before the connection is locked).
    for name, listed in whole.items():
        for path in listed.paths:
            _check_lake_file(lake.data_path, snapshot, name, "ducklake_data_file", path)
    for name, pairs in deletions.items():
        for path, deletes in pairs:
            _check_lake_file(lake.data_path, snapshot, name, "ducklake_data_file", path)
            for deleted in deletes:
                _check_lake_file(lake.data_path, snapshot, name, "ducklake_delete_file", deleted)
    rows = {
        name: _without_deleted_rows(name, deletions[name]) if name in deletions else _refused_inlined(name)
        for name in partial
    }
    views = lake_views_sql(lake.tables, files=whole, rows=rows, stored_schema=True)
    return views, frozenset(name for name in lake.tables if name in whole or name in rows), files


# Characters a path read by read_parquet must not hold: glob patterns DuckDB expands, and controls.
def _check_lake_file(data_path: str, snapshot: int, table: str, catalog_table: str, path: str) -> None:
    """Refuse the snapshot unless ``path`` (a data or delete file's full path, joined from the
    catalog's rows) is a plain path under ``data_path`` (a local folder or an ``s3://`` prefix): no
    ``.``/``..``/empty folder, no glob or control character. The catalog's operator is not trusted."""
    if not plain_file_under(data_path, path):
        raise QueryError(
            f"lake catalog, snapshot {snapshot}: a {catalog_table} row of table {table!r} names "
            f"{path!r}, not a plain file under the data path {data_path}; refusing to read it"
        )


def _files_with_deletions(
    pinned: duckdb.DuckDBPyConnection, data_path: str, snapshot: int, tables: Sequence[str]
) -> dict[str, list[tuple[str, list[str]]]]:
    """Each of ``tables``' data files at ``snapshot`` with its delete files (full paths), read from
    the catalog's own tables; a table with inlined rows is left out (``_pinned_views`` refuses it)."""
    if not tables:
        return {}
    meta = f"__ducklake_metadata_{ALIAS}"

    rows = pinned.execute(
        f"SELECT t.table_name, s.path, s.path_is_relative, t.path, t.path_is_relative, f.path, "
        f"f.path_is_relative, d.path, d.path_is_relative "
        f"FROM {meta}.ducklake_data_file f "
        f"JOIN {meta}.ducklake_table t ON t.table_id = f.table_id AND {live_at_snap('t')} "
        f"JOIN {meta}.ducklake_schema s ON s.schema_id = t.schema_id AND {live_at_snap('s')} "
        f"LEFT JOIN {meta}.ducklake_delete_file d ON d.data_file_id = f.data_file_id AND {live_at_snap('d')} "
        f"WHERE {live_at_snap('f')} AND t.table_name IN (SELECT unnest($tables)) "
        f"AND t.table_id NOT IN (SELECT table_id FROM {meta}.ducklake_inlined_data_tables) "
        f"ORDER BY t.table_name, f.data_file_id, d.delete_file_id",
        {"snap": int(snapshot), "tables": list(tables)},
    ).fetchall()
    out: dict[str, dict[str, list[str]]] = {}
    for table, schema, schema_rel, folder, folder_rel, path, path_rel, deleted, deleted_rel in rows:
        base = _lake_path(data_path, (schema, schema_rel), (folder, folder_rel))
        deletes = out.setdefault(table, {}).setdefault(_lake_path(base, (path, path_rel)), [])
        if deleted is not None:
            deletes.append(_lake_path(base, (deleted, deleted_rel)))
    return {table: list(files.items()) for table, files in out.items()}


def _lake_path(base: str, *parts: tuple[str, bool]) -> str:
    """A path DuckLake's catalog keeps in parts, each relative to the one before or not."""
    full = base.rstrip("/") + "/"
    for part, relative in parts:
        full = full + part if relative else part
    return full


def _without_deleted_rows(name: str, files: Sequence[tuple[str, Sequence[str]]]) -> str:
    """A table's rows from its files, less the positions its DuckLake delete files list (Parquet,
    ``file_path``/``pos``: each delete file here belongs to one data file, by the catalog)."""
    columns = ", ".join(f'"{c}"' for c, _ in lake_columns(name))
    parts = []
    for path, deletes in files:
        read = f"read_parquet({_quoted(path)}, hive_partitioning = false, file_row_number = true)"
        if deletes:
            gone = ", ".join(_quoted(d) for d in deletes)
            parts.append(
                f"SELECT {columns} FROM {read} WHERE file_row_number NOT IN "
                f"(SELECT pos FROM read_parquet([{gone}]))"
            )
        else:
            parts.append(f"SELECT {columns} FROM {read}")
    return " UNION ALL ".join(parts) if parts else empty_rows(name)


def _refused_inlined(name: str) -> str:
    """A view that fails when read: the table's rows are inlined in the catalog, which the statements'
    connection does not open (dropping them silently would answer wrong)."""
    columns = ", ".join(f'CAST(NULL AS VARCHAR) AS "{c}"' for c, _ in lake_columns(name))
    message = f"table {name} has rows inlined in the lake catalog, which `ledger query` does not read"
    return f"SELECT {columns} WHERE error({_quoted(message)}) IS NULL"


def _quoted(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _duckdb_error(error: duckdb.Error, limits: QueryLimits | None = None) -> str:
    """A DuckDB error as the user reads it."""
    stopped = limit_error(error, limits) if limits is not None else None
    if stopped is not None:
        return stopped
    if isinstance(error, duckdb.PermissionException) or "configuration has been locked" in str(error):
        # The first wall, DuckDB's own refusal: its first line says what was refused.
        reason = str(error).strip().splitlines()[0].split(" Error: ", 1)[-1]
        return f"refused: SQL here reads only the ledger's tables ({reason})"
    return str(error).strip()


def _last_change(
    events: Sequence[Envelope], attempts: dict[int, Any], live: int, step: int | None, path: str
) -> Envelope | None:
    """The event on the run's lineage (up to ``step`` of attempt ``live``) that last changed ``path``.

    Launches (start, resume) replace the config and accepted changes patch it; an event counts as a
    change only if the value at ``path`` differs from the one live just before it (the first launch
    sets it). Earlier attempts count up to where the lineage left them, as in the fold.
    """
    config: dict[str, Any] | None = None
    value: Any = MISSING
    setter: Envelope | None = None
    for e in events:
        attempt = e.attempt or 1
        if attempt > live:
            continue
        if attempt == live:
            if e.type == c.CONFIG_CHANGED and step is not None and e.step is not None and e.step > step:
                continue
        elif not on_lineage(attempts, attempt, e.step):
            continue
        if e.type in (c.RUN_STARTED, c.RUN_RESUMED):
            new = e.data.config
        elif e.type == c.CONFIG_CHANGED and config is not None:
            try:
                new = apply_config_patch(config, e.data.patch)
            except ConfigPatchError:
                continue  # the fold reports a patch that does not apply
        else:
            continue
        new_value = value_at(new, path)
        if setter is None or not _same_value(new_value, value):
            setter = e
        config, value = new, new_value
    return setter


def _same_value(a: Any, b: Any) -> bool:
    """Equal as JSON values (1 and 1.0, or true and 1, are different values)."""
    if a is MISSING or b is MISSING:
        return a is b
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def _diff_answer(before: RunState, after: RunState, happened: list[HistoryItem]) -> dict[str, Any]:
    """``diff``'s answer: the two states' config patch, its text, the events between them."""
    import jsonpatch  # (diff's alone)

    patch = jsonpatch.make_patch(before.config, after.config).patch
    return {
        "from": {
            "step": before.step,
            "run_id": before.run_id,
            "attempt": before.attempt,
            "config_hash": before.config_hash,
            "git_commit": before.git_commit,
        },
        "to": {
            "step": after.step,
            "run_id": after.run_id,
            "attempt": after.attempt,
            "config_hash": after.config_hash,
            "git_commit": after.git_commit,
        },
        "config_patch": patch,
        # The patch as history and blame say it: ``moe.capacity_factor 1.0 → 1.25``.
        "changes": [op_text(op, before.config) for op in patch],
        "events": happened,
        # Where the recomputed config and the producer's hash disagree, up to the later step.
        "hash_mismatches": after.hash_mismatches,
    }
