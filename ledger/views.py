"""DuckDB views over the ledger's Parquet files: the names an analyst can rely on.

**One meaning per name.** Every place that answers SQL defines its names with ``named_views``: the
stored tables under their stored names (``_metrics``, ``_moe_layer_stats``, ``_github``; the rest
under their own, and each as ``lake.<table>``), then the same de-duplicated and derived views over
them (``DERIVED_VIEWS``, ``CODE_VIEWS``). Only where the rows come from differs: ``ledger query``
(a pinned lake snapshot's files, or part files), ``ledger views`` (``lake_init_sql``: the lake
attached read-only), a published copy's ``views.sql`` and ``ledger query --remote`` (the signed
manifest's files). A table with no rows (no files) is an empty relation of its schema everywhere.

``views_sql(root)`` is plain SQL, also written to ``<ledger>/views.sql`` so that
``duckdb -init views.sql`` gives the same names without runledger installed. The file names the
Parquet files relative to the ledger folder (``metrics/*/*.parquet``), so it reads the ledger it
sits in, wherever that folder was copied: run duckdb from inside the ledger folder
(``cd LEDGER && duckdb -init views.sql``). ``connect`` and ``ledger shell`` use absolute paths.

**One run recorded twice** (bridged live from W&B and later imported; two processes claiming one
run id): each launch is stored (admission records the second launch of an attempt as a
``duplicate-launch`` incident), but ``attempts`` keeps the first launch of each (run, attempt) and
``metrics`` returns each (run, attempt, step, name) once, the first recorded; ``launches`` and
``metrics_recorded`` keep every record.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb

from runledger.ledger import duck
from runledger.ledger.fold import SOURCES_APART
from runledger.ledger.parquet_schemas import ADDED_COLUMNS, SIDE_TABLES, TABLES, Table, tables_of
from runledger.ledger.redaction_marker import REDACTED_PREFIX
from runledger.schemas import catalogue as c
from runledger.schemas.durable import write_durably

if TYPE_CHECKING:
    import pyarrow as pa

    from runledger.ledger.lake import LakeFolder, TableFiles

# Physical tables whose public name is a derived view (the physical one gets a leading underscore).
_DERIVED = {"metrics", "moe_layer_stats", "github"}

DERIVED_VIEWS = """
-- One row per (run, attempt): its first launch (a second one is a duplicate-launch incident).
CREATE OR REPLACE VIEW attempts AS
SELECT l.run_id, l.attempt, l.kind, coalesce(l.from_checkpoint_step, 0) AS start_step,
       l.time AS started_at, l.git_commit, l.git_dirty, l.git_branch, l.repository, l.config_hash,
       l.host, l.cluster, l.job_id, l.world_size, l.parent_run, l.fork_step,
       l.external,  -- JSON object: a mirror's ids (wandb_run_id, wandb_project, …) or wandb_error
       (SELECT min(b.from_checkpoint_step) FROM launches b
         WHERE b.run_id = l.run_id AND b.attempt > l.attempt) AS superseded_after
FROM launches l
QUALIFY row_number() OVER (PARTITION BY l.run_id, l.attempt ORDER BY l.stream_seq) = 1;

-- Attempts launched more than once (two producers recorded the same run): their metric rows are
-- deduplicated below; every other attempt's rows pass as they are, at no cost.
CREATE OR REPLACE VIEW _launched_twice AS
SELECT run_id, attempt FROM launches GROUP BY run_id, attempt HAVING count(*) > 1;

-- Every metric row as recorded, a twice-recorded run's copies included.
CREATE OR REPLACE VIEW metrics_recorded AS SELECT * FROM _metrics;

CREATE OR REPLACE VIEW _metrics_once AS
SELECT m.* FROM _metrics m ANTI JOIN _launched_twice t ON t.run_id = m.run_id AND t.attempt = m.attempt
UNION ALL BY NAME
SELECT m.* FROM _metrics m SEMI JOIN _launched_twice t ON t.run_id = m.run_id AND t.attempt = m.attempt
QUALIFY row_number() OVER (PARTITION BY m.run_id, m.attempt, m.step, m.name ORDER BY m.stream_seq) = 1;

CREATE OR REPLACE VIEW metrics_all AS
SELECT m.run_id, m.attempt, m.step, m.time, m.name, m.value,
       coalesce(m.step > a.superseded_after, false) AS superseded, m.stream, m.stream_seq
FROM _metrics_once m LEFT JOIN attempts a ON a.run_id = m.run_id AND a.attempt = m.attempt;

CREATE OR REPLACE VIEW metrics AS
SELECT * EXCLUDE (superseded) FROM metrics_all WHERE NOT superseded;

CREATE OR REPLACE VIEW moe_layer_stats_all AS
SELECT m.* EXCLUDE (stream, stream_seq),
       coalesce(m.step > a.superseded_after, false) AS superseded, m.stream, m.stream_seq
FROM _moe_layer_stats m LEFT JOIN attempts a ON a.run_id = m.run_id AND a.attempt = m.attempt;

CREATE OR REPLACE VIEW moe_layer_stats AS
SELECT * EXCLUDE (superseded) FROM moe_layer_stats_all WHERE NOT superseded;

-- Every GitHub observation: each webhook delivery's events and each backfill's snapshots.
CREATE OR REPLACE VIEW github_all AS SELECT * FROM _github;

-- One row per GitHub fact (repository or organisation, fact key): the webhook's observation when
-- there is one, else the earliest; `observations` counts them and `observed_via` names their producers.
-- Rows written before events carried a fact are each their own fact.
CREATE OR REPLACE VIEW github AS
WITH o AS (
  SELECT g.*,
         lower(coalesce(g.repo, g.org, g.stream)) AS _scope,
         coalesce(g.fact, 'row/' || g.stream || '/' || g.stream_seq) AS _fact
  FROM _github g
)
SELECT o.* EXCLUDE (_scope, _fact),
       count(*) OVER f AS observations,
       array_sort(list_distinct(list(o.via) OVER f)) AS observed_via
FROM o
WINDOW f AS (PARTITION BY _scope, _fact)
QUALIFY row_number() OVER (
  PARTITION BY _scope, _fact ORDER BY o.via = 'webhook' DESC NULLS LAST, o.time, o.stream, o.stream_seq
) = 1;

CREATE OR REPLACE VIEW crashes AS SELECT * FROM incidents WHERE kind <> 'skipped';

CREATE OR REPLACE VIEW runs AS
SELECT a.run_id,
       min(a.started_at) AS started_at,
       count(*) AS attempts,
       arg_max(a.git_commit, a.attempt) AS git_commit,
       arg_max(a.config_hash, a.attempt) AS config_hash,
       (SELECT max(m.step) FROM _metrics m WHERE m.run_id = a.run_id) AS last_step,
       (SELECT count(*) FROM crashes c WHERE c.run_id = a.run_id) AS crashes,
       (SELECT arg_max(e.status, e.attempt) FROM run_ends e WHERE e.run_id = a.run_id) AS last_status
FROM attempts a GROUP BY a.run_id;

-- The config live at step s of run r, on the run's final lineage.
CREATE OR REPLACE MACRO config_at(r, s) AS TABLE
WITH covering AS (
  SELECT coalesce(max(attempt) FILTER (WHERE start_step < s), min(attempt)) AS attempt
  FROM attempts WHERE run_id = r
)
SELECT c.run_id, c.attempt, c.step, c.config_hash, c.config
FROM configs c, covering
WHERE c.run_id = r AND c.attempt = covering.attempt AND coalesce(c.step, 0) <= s
ORDER BY c.stream_seq DESC LIMIT 1;
"""


def stored_name(table: str) -> str:
    """The name a stored table's rows go by wherever SQL is answered: its own, or ``_<table>`` where
    the public name is a de-duplicated view (``metrics``, ``moe_layer_stats``, ``github``)."""
    return f"_{table}" if table in _DERIVED else table


def named_views(stored: Mapping[str, str], *, stored_schema: bool = True) -> str:
    """Every name SQL is answered with, one meaning each, for every place that answers SQL: ``ledger
    query`` (``Reader``, over part files or a pinned lake snapshot), ``<ledger>/views.sql`` (``ledger
    views``), a published copy's ``views.sql`` (``ledger publish``) and ``ledger query --remote`` (with
    or without ``--direct``). ``stored``: each stored table -> a SELECT of its rows (files, the lake,
    or an empty relation). ``stored_schema``: also name each stored table ``lake.<table>``, as it is
    where the lake itself is attached as ``lake`` (there, leave it out: the lake's own names stand)."""
    from runledger.ledger.code_views import CODE_VIEWS  # GitHub <-> run joins, over the views below
    from runledger.ledger.lake import ALIAS

    # The stored rows, under their stored names; then the views every analyst name means.
    base = [f"CREATE OR REPLACE VIEW {stored_name(name)} AS {rows};" for name, rows in stored.items()]
    parts = ["\n".join(base), DERIVED_VIEWS, CODE_VIEWS]
    # ``lake.<table>``: the stored rows, as a lake attached as ``lake`` names them.
    if stored_schema:
        parts.append(f"CREATE SCHEMA IF NOT EXISTS {ALIAS};")
        parts += [
            f'CREATE OR REPLACE VIEW {ALIAS}."{name}" AS SELECT * FROM main."{stored_name(name)}";'
            for name in stored
        ]
    return "\n".join(parts)


def parquet_rows(table: str, files: Sequence[str] | str) -> str:
    """A stored table's rows read from Parquet ``files`` (a list of paths or URLs, or one glob) laid
    out as ``<table>/<column>=<value>/<file>``: the partition column from the folder, as text (a part
    file lacks it; a lake file holds the same text), columns matched by name across files."""
    partition = _table_spec(table).partition
    listed = files if isinstance(files, str) else None
    source = _sql_literal(listed) if listed is not None else _sql_list(list(files))
    return (
        f"SELECT * FROM read_parquet({source}, hive_partitioning = true, "
        f"hive_types = {{'{partition}': VARCHAR}}, union_by_name = true)"
    )


def empty_rows(table: str) -> str:
    """A stored table with no rows, with the columns and types it has where it has files (its file
    columns, then its partition column): a table without files still answers, with 0 rows."""
    from runledger.ledger.lake import lake_schema

    empty = _empty_relation(lake_schema(table))
    if empty is None:
        raise ValueError(f"table {table} has a column type the views cannot name")
    return empty


def files_or_empty(table: str, files: Sequence[str]) -> str:
    """A stored table's rows from ``files``; with none, an empty relation of its schema."""
    return parquet_rows(table, files) if files else empty_rows(table)


def _table_spec(table: str) -> Table:
    spec = TABLES.get(table) or SIDE_TABLES.get(table)
    if spec is None:
        raise ValueError(f"{table} is not a ledger table")
    return spec


def _part_rows(root: Path, name: str, *, relative: bool) -> str:
    """A part-file table's rows by its folder's glob (new files are read as they come); a table with
    no file yet (a remote copy's table that published no rows) is an empty relation."""
    if not any((root / name).glob("*/*.parquet")):
        return empty_rows(name)
    folder = Path(name) if relative else root / name
    return parquet_rows(name, (folder / "*" / "*.parquet").as_posix())


def views_sql(root: Path, *, relative: bool = False) -> str:
    """The views over the ledger of part files at ``root`` (an old ledger, or a published copy
    fetched by ``runledger.ledger.remote``); ``relative``: its files named from the ledger folder (for
    ``views.sql``, read by a duckdb started in that folder, wherever it was copied). A lake is read
    through ``runledger.ledger.query.Reader`` at one snapshot."""
    root = root.resolve()
    if not (root / "LEDGER.json").is_file():
        raise ValueError(
            f"{root} is not a folder of part files (a lake is read by runledger.ledger.query.Reader)"
        )
    return named_views({name: _part_rows(root, name, relative=relative) for name in tables_of(root)})


def _empty_relation(schema: pa.Schema) -> str | None:
    """A table with no rows, typed as ``schema``: a lake table without files at the snapshot is read
    without binding a DuckLake scan (~5 ms of every reader's open, per such table)."""
    columns = []
    for f in schema:
        kind = duck.column_type(f.type)
        if kind is None:
            return None
        columns.append(f'CAST(NULL AS {kind}) AS "{f.name}"')
    return f"SELECT {', '.join(columns)} LIMIT 0"


def lake_rows(name: str, alias: str = "lake", files: Mapping[str, TableFiles | None] | None = None) -> str:
    """A lake table's rows at a pinned snapshot (the lake attached as ``alias``). ``files``: each
    table's data files at that snapshot (``runledger.ledger.lake.snapshot_files``): the table reads them as a
    table of part files does (DuckLake's scan asks the catalog for them again in every statement, ~2x
    a statement's time here), its partition column from the folder names where the catalog's values
    are those (a filter on it then opens only its files, as over part files); a table without files
    is an empty relation; a table with deletions or inlined rows (None), or without ``files``, is read
    through DuckLake."""
    from runledger.ledger.lake import lake_schema

    through_lake = f'SELECT * FROM {alias}.main."{name}"'
    if files is None or name not in files:
        return through_lake if files is None else _empty_relation(lake_schema(name)) or through_lake
    listed = files[name]
    if listed is None:
        return through_lake
    schema = lake_schema(name)
    columns = ", ".join(f'"{c}"' for c in schema.names)  # (not a merge's lineage columns)
    hive = "hive_partitioning = false"
    if listed.partition is not None and duck.column_type(schema.field(listed.partition).type) == "VARCHAR":
        # (the folder's value is the catalog's, checked by snapshot_files, and the file's column)
        hive = f"hive_partitioning = true, hive_types = {{'{listed.partition}': VARCHAR}}"
    scan = f"read_parquet({_sql_list(listed.paths)}, {hive})"
    if name in ADDED_COLUMNS:  # files written before a column was added lack it: NULL there
        widened = scan.removesuffix(")") + ", union_by_name = true)"
        return f"SELECT {columns} FROM (SELECT * FROM {widened} UNION ALL BY NAME ({empty_rows(name)}))"
    return f"SELECT {columns} FROM {scan}"


def lake_views_sql(
    tables: Iterable[str],
    alias: str = "lake",
    files: Mapping[str, TableFiles | None] | None = None,
    *,
    rows: Mapping[str, str] | None = None,
    stored_schema: bool = False,
) -> str:
    """The same views over a lake attached as ``alias`` (``runledger.ledger.lake.open_snapshot``: pinned at one
    snapshot, so every view and every statement over them sees one moment): each table's rows as
    ``lake_rows`` reads them, or as ``rows`` gives them (a reader's own reading of a table)."""
    given = rows or {}
    return named_views(
        {name: given.get(name) or lake_rows(name, alias, files) for name in tables},
        stored_schema=stored_schema,
    )


def _sql_list(texts: Sequence[str]) -> str:
    return "[" + ", ".join(_sql_literal(t) for t in texts) + "]"


def _sql_literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def connect(root: Path) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with every view defined over the ledger at ``root``."""
    con = duck.connect()
    con.execute("SET TimeZone = 'UTC'")
    # Each Parquet footer is read once per connection, not once per query (a ledger's file is never
    # rewritten under its name: every commit and merge writes new names; DuckDB also checks mtimes).
    # `state` on the full reference run asks 4 queries of the same files: 36 -> 31 ms.
    con.execute("SET parquet_metadata_cache = true")
    con.execute(views_sql(root))
    return con


def write_views_file(root: Path) -> Path:
    """``<ledger>/views.sql``: paths relative to the ledger folder, so a copied ledger reads itself
    (``cd LEDGER && duckdb -init views.sql``)."""
    from runledger.ledger.lake import LakeFolder

    lake = LakeFolder.read(root)
    if lake is not None:
        return write_durably(root / "views.sql", lake_init_sql(lake, relative=True))
    header = "-- runledger views: run duckdb from this folder: duckdb -init views.sql\n"
    return write_durably(root / "views.sql", header + views_sql(root, relative=True))


def lake_init_sql(lake: LakeFolder, *, relative: bool = False) -> str:
    """A DuckDB shell's init file for a ledger on a lake: its extensions, the catalog attached
    read-only as ``lake``, and the views. Each statement in that shell reads one snapshot (the newest
    when it starts: DuckLake's own transactions); ``ledger query --snapshot N`` pins one for all.
    ``relative``: the catalog and data named from the ledger folder, when they are inside it."""
    from runledger.ledger.lake import ALIAS, Catalog

    catalog, data = Catalog.parse(lake.catalog), lake.data_path
    if relative:
        catalog, data = lake.relative_catalog(), lake.relative_data_path()
    loads = " ".join(f"LOAD {_extension_named(name, portable=relative)};" for name in catalog.extensions)
    attach = (
        f"ATTACH '{_sql_text(catalog.uri())}' AS {ALIAS} "
        f"(READ_ONLY, DATA_PATH '{_sql_text(data)}', OVERRIDE_DATA_PATH true);"
    )
    return (
        "-- runledger views over a lake: run duckdb from this folder: duckdb -init views.sql\n"
        f"-- DuckDB {duckdb.__version__} with the extensions {', '.join(catalog.extensions)} "
        "(INSTALL each once, or LOAD the files of the duckdb-extension-* wheels)\n"
        f"{loads}\n{attach}\nSET TimeZone = 'UTC';\n{lake_views_sql(lake.tables)}\n"
    )


def _extension_named(name: str, *, portable: bool) -> str:
    """How an init file loads an extension: by name in a file that travels with the ledger (the
    reader's DuckDB has it installed), else from the wheel this install carries (a shell started here
    never downloads)."""
    from runledger.ledger.duck import ExtensionMissing, extension_file

    if portable:
        return name
    try:
        return f"'{_sql_text(str(extension_file(name)))}'"
    except ExtensionMissing:
        return name


def _sql_text(text: str) -> str:
    return text.replace("'", "''")


# -- ingest's incidents, read in summary ---------------------------------------------------------
# One ``ledger.incident`` is recorded per event whose source skipped or repeated its seq (the record),
# so a producer that skips on every event makes one per event. Readers fold them here, as
# ``runledger.ledger.fold.fold_incidents`` folds the decoded events: one range per (kind, source), and of a kind
# with many sources the ``SOURCES_APART - 1`` with the most incidents apart and the rest in one range.
# A state or a history then lists the same few lines with 30,000 incidents as with 3, and costs one
# scan of their rows in DuckDB, not a decode of each in Python.
# The phases: each incident's typed row (``typed``: the ``ingest_incidents`` table's columns, or on a
# ledger made before it, each ``state_events``/``events`` row's JSON parsed once); one range per source
# (``per_source``); the sources of a kind ranked by incidents, those past ``SOURCES_APART - 1`` sharing
# the last place (``ranked``); one row per place.
_INCIDENT_COLUMNS = "attempt, step, time, stream_seq, kind, source, expected_seq, got_seq, missing"
_INCIDENT_FIELDS = (
    "['$.data.kind', '$.data.source', '$.data.expected_seq', '$.data.got_seq', '$.data.missing']"
)
_INCIDENT_JSON = f"""
SELECT attempt, step, time, stream_seq, d[1] AS kind, d[2] AS source,
       CAST(d[3] AS BIGINT) AS expected_seq, CAST(d[4] AS BIGINT) AS got_seq,
       CAST(d[5] AS BIGINT) AS missing
FROM (SELECT attempt, step, time, stream_seq, json_extract_string(canonical, {_INCIDENT_FIELDS}) AS d
      FROM {{table}} WHERE {{where}})
"""
_INCIDENT_RANGES = """
WITH typed AS ({typed}), per_source AS (
  SELECT kind, source, min(attempt) AS attempt, count(*) AS incidents,
         sum(CASE WHEN kind = 'gap' THEN missing ELSE 1 END) AS count,
         min(CASE WHEN kind = 'gap' THEN expected_seq ELSE got_seq END) AS first_seq,
         max(CASE WHEN kind = 'gap' THEN got_seq - 1 ELSE got_seq END) AS last_seq,
         min(step) AS first_step, max(step) AS last_step,
         min(time) AS first_time, max(time) AS last_time, min(stream_seq) AS first_stream_seq,
         min(expected_seq) AS expected_seq
  FROM typed
  GROUP BY kind, source
), ranked AS (
  SELECT *, least({apart}, row_number() OVER (
           PARTITION BY kind ORDER BY incidents DESC, first_stream_seq)) AS place
  FROM per_source
)
SELECT kind, min(source) AS source, max(source) AS last_source, count(*) AS sources,
       min(attempt) AS attempt, sum(incidents) AS incidents, sum(count) AS count,
       min(first_seq) AS first_seq, max(last_seq) AS last_seq,
       min(first_step) AS first_step, max(last_step) AS last_step,
       min(first_time) AS first_time, max(last_time) AS last_time,
       min(first_stream_seq) AS first_stream_seq,
       CASE WHEN sum(incidents) = 1 THEN min(expected_seq) END AS expected_seq
FROM ranked
GROUP BY kind, place
ORDER BY first_time, first_stream_seq
"""


def incident_ranges_query(
    run_id: str,
    *,
    state_table: bool,
    attempt: int | None = None,
    step: int | None = None,
    at: datetime | None = None,
    typed_table: bool = False,
) -> tuple[str, list[Any]]:
    """The statement (and its parameters) that folds run ``run_id``'s ingest incidents into ranges,
    read from ``ingest_incidents`` (``typed_table``: the ledger keeps it; typed columns, no JSON), else
    from ``state_events`` (``state_table``) or ``events``, each event's JSON parsed. With ``attempt``
    (the state's live attempt): as ``runledger.ledger.fold.fold_run`` counts them, every earlier
    attempt's, the live one's up to ``step``, none of a later one; with ``at``, those up to that time.
    Without: every incident of the run (its history). Redacted ones are left to their redaction (their
    typed rows are deleted with their payload)."""
    where: list[str] = ["stream = ?"]
    params: list[Any] = [run_id]
    if not typed_table:  # an events table holds every type, and keeps a redacted event's row
        where += ["type = ?", "NOT starts_with(canonical, ?)"]
        params += [c.LEDGER_INCIDENT, REDACTED_PREFIX]
    if state_table or typed_table:  # the run's partition (and run-less events on its stream) only
        where.insert(0, "run_id IN (?, '_')")
        params.insert(0, run_id)
    if attempt is not None:
        live = "coalesce(attempt, 1) = ?" + ("" if step is None else " AND (step IS NULL OR step <= ?)")
        where.append(f"(coalesce(attempt, 1) < ? OR ({live}))")
        params += [attempt, attempt] + ([] if step is None else [step])
    if at is not None:
        where.append("time <= ?")
        params.append(at)
    if typed_table:
        typed = f"SELECT {_INCIDENT_COLUMNS} FROM ingest_incidents WHERE {' AND '.join(where)}"
    else:
        table = "state_events" if state_table else "events"
        typed = _INCIDENT_JSON.format(table=table, where=" AND ".join(where))
    return _INCIDENT_RANGES.format(typed=typed, apart=SOURCES_APART), params


def incident_range_facts(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``incident_ranges_query``'s rows as the state lists incidents (``runledger.ledger.fold.range_fact``)."""
    return [
        {
            "step": row["first_step"],
            "attempt": row["attempt"],
            "time": row["first_time"],
            "kind": row["kind"],
            "count": int(row["count"]),
            "first_seq": row["first_seq"],
            "last_seq": row["last_seq"],
            "source": row["source"],
            "reason": None,  # a gap or fork says no more than its numbers
            "expected_seq": row["expected_seq"],  # one incident's own (a fork's sentence names it)
            "incidents": row["incidents"],
            "first_step": row["first_step"],
            "last_step": row["last_step"],
            "first_time": row["first_time"],
            "last_time": row["last_time"],
            "sources": row["sources"],
            "last_source": row["last_source"],
        }
        for row in rows
    ]
