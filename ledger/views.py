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
from runledger.ledger.parquet_schemas import (
    ADDED_COLUMNS,
    SIDE_TABLES,
    TABLES,
    Columns,
    Table,
    lake_columns,
    tables_of,
)
from runledger.ledger.redaction_marker import REDACTED_PREFIX
from runledger.schemas import catalogue as c
from runledger.schemas.durable import write_durably

if TYPE_CHECKING:
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
       -- the step a later attempt resumed from (a window, not a correlated subquery: ~5 ms less in
       -- a one-shot command, whose first correlated join is DuckDB code not yet paged in)
       CASE WHEN l.attempt IS NOT NULL THEN
         min(l.from_checkpoint_step) FILTER (WHERE l.attempt IS NOT NULL) OVER (
           PARTITION BY l.run_id ORDER BY l.attempt RANGE BETWEEN 1 FOLLOWING AND UNBOUNDED FOLLOWING)
       END AS superseded_after
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

-- The detectors' findings (`ledger.anomaly` events, runledger.ledger.anomalies), one typed row each:
-- the rule and version that found it, what it watched and saw against what baseline, and the event
-- that tripped it (`cause_id`). A redacted one has no payload left: it is not listed.
CREATE OR REPLACE VIEW anomalies AS
SELECT * FROM (
  SELECT run_id, attempt, step, time,
         json_extract_string(canonical, '$.data.rule') AS rule,
         CAST(json_extract(canonical, '$.data.rule_version') AS INTEGER) AS rule_version,
         json_extract_string(canonical, '$.data.metric') AS metric,
         CAST(json_extract(canonical, '$.data.value') AS DOUBLE) AS value,
         CAST(json_extract(canonical, '$.data.baseline') AS DOUBLE) AS baseline,
         CAST(json_extract(canonical, '$.data.score') AS DOUBLE) AS score,
         json_extract(canonical, '$.data.params') AS params,
         json_extract_string(canonical, '$.data.event_id') AS cause_id,
         stream, stream_seq, id
  FROM events WHERE type = 'ledger.anomaly'
) WHERE rule IS NOT NULL;

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

-- Questions across many runs (`ledger runs` filters this): one row per run with its newest attempt's
-- status (crashed: its last end is a crash or a `failed` finish; finished; else running), its name,
-- where it came from (parent_run, fork_step of its first attempt), its latest config (JSON) and the
-- tags of its notes. Each part is one grouped scan, so the view grows with rows, not runs × rows.
CREATE OR REPLACE VIEW run_status AS
WITH newest AS (
  SELECT run_id, max(attempt) AS attempt, min(started_at) AS started_at, count(*) AS attempts,
         arg_max(git_commit, attempt) AS git_commit, arg_max(config_hash, attempt) AS config_hash,
         arg_min(parent_run, attempt) AS parent_run, arg_min(fork_step, attempt) AS fork_step
  FROM attempts GROUP BY run_id
),
named AS (SELECT run_id, arg_max(name, stream_seq) AS name FROM launches WHERE name IS NOT NULL GROUP BY run_id),
ended AS (
  SELECT run_id, attempt, max(stream_seq) AS seq, arg_max(status, stream_seq) AS status
  FROM run_ends GROUP BY run_id, attempt
),
crashed AS (SELECT run_id, attempt, max(stream_seq) AS seq FROM crashes GROUP BY run_id, attempt),
crash_count AS (SELECT run_id, count(*) AS crashes FROM crashes GROUP BY run_id),
latest_config AS (SELECT run_id, arg_max(config, stream_seq) AS config FROM configs GROUP BY run_id),
tagged AS (
  SELECT run_id, list_sort(list_distinct(flatten(list(tags)))) AS tags FROM annotations GROUP BY run_id
),
steps AS (SELECT run_id, max(step) AS last_step FROM _metrics GROUP BY run_id)
SELECT n.run_id, nm.name,
       CASE WHEN c.seq IS NOT NULL AND (e.seq IS NULL OR c.seq > e.seq) THEN 'crashed'
            WHEN e.status = 'failed' THEN 'crashed'
            WHEN e.seq IS NOT NULL THEN 'finished'
            ELSE 'running' END AS status,
       n.started_at, n.attempts, st.last_step, coalesce(cc.crashes, 0) AS crashes,
       n.parent_run, n.fork_step, n.git_commit, n.config_hash, lc.config,
       coalesce(t.tags, []::VARCHAR[]) AS tags
FROM newest n
LEFT JOIN named nm ON nm.run_id = n.run_id
LEFT JOIN ended e ON e.run_id = n.run_id AND e.attempt = n.attempt
LEFT JOIN crashed c ON c.run_id = n.run_id AND c.attempt = n.attempt
LEFT JOIN crash_count cc ON cc.run_id = n.run_id
LEFT JOIN latest_config lc ON lc.run_id = n.run_id
LEFT JOIN tagged t ON t.run_id = n.run_id
LEFT JOIN steps st ON st.run_id = n.run_id;

-- run_status with the final and best (lowest finite) `loss` and `eval/loss` of each run, from the
-- canonical series, in one scan of the two names: "best eval loss of every run with
-- moe.capacity_factor = 1.25 since June" is one WHERE over this view.
CREATE OR REPLACE VIEW run_summary AS
WITH main AS (
  SELECT run_id,
         arg_max(value, step) FILTER (WHERE name = 'loss') AS final_loss,
         min(value) FILTER (WHERE name = 'loss' AND isfinite(value)) AS best_loss,
         arg_max(value, step) FILTER (WHERE name = 'eval/loss') AS final_eval_loss,
         min(value) FILTER (WHERE name = 'eval/loss' AND isfinite(value)) AS best_eval_loss
  FROM metrics WHERE name IN ('loss', 'eval/loss') GROUP BY run_id
)
SELECT s.*, m.final_loss, m.best_loss, m.final_eval_loss, m.best_eval_loss
FROM run_status s LEFT JOIN main m ON m.run_id = s.run_id;

-- Lineage across run ids (issue 44): a relaunch under a new run id names the run it continues and
-- the step it forked or resumed from (run.started's parent_run, fork_step; its first attempt's). A
-- claim is kept only where the parent started before the child (ties: by run id): a run cannot go on
-- from one launched after it, and the order makes every chain end, so a hostile cycle of claims (or
-- a run naming itself) is cut at the claim it cannot have made. A parent the ledger lacks is none.
CREATE OR REPLACE VIEW _run_parent AS
WITH firsts AS (  -- (one grouped scan of the launches: `attempts` costs a subquery per row)
  SELECT run_id, min(time) AS started_at,
         arg_min({'parent_run': parent_run, 'fork_step': fork_step}, [attempt, stream_seq]) AS claim
  FROM launches GROUP BY run_id
)
SELECT f.run_id, f.started_at,
       CASE WHEN p.started_at < f.started_at OR (p.started_at = f.started_at AND p.run_id < f.run_id)
            THEN p.run_id END AS parent_run,
       CASE WHEN parent_run IS NOT NULL THEN f.claim.fork_step END AS fork_step
FROM firsts f LEFT JOIN firsts p ON p.run_id = f.claim.parent_run;

-- Every run's place in its family tree, walked down once from the runs without a parent: its depth,
-- its path from the root, and `off_line`: the depth of the last step of that path that was not to
-- the child started last (0: none). "The run" follows, at each generation, the child started last,
-- as a later attempt supersedes the earlier ones within a run: a run is on the line of its ancestor
-- at depth d where off_line <= d.
CREATE OR REPLACE VIEW _lineage_tree AS
WITH RECURSIVE children AS MATERIALIZED (
  SELECT parent_run, run_id, fork_step,
         row_number() OVER (PARTITION BY parent_run ORDER BY started_at DESC, run_id DESC) = 1 AS newest
  FROM _run_parent WHERE parent_run IS NOT NULL
),
walk(run_id, depth, path, off_line) AS (
  SELECT run_id, 0, [run_id], 0 FROM _run_parent WHERE parent_run IS NULL
  UNION ALL
  SELECT k.run_id, w.depth + 1, list_append(w.path, k.run_id),
         CASE WHEN k.newest THEN w.off_line ELSE w.depth + 1 END
  FROM walk w JOIN children k ON k.parent_run = w.run_id
)
SELECT * FROM walk;

-- For every run (`run_id`), each member of its lineage: its ancestors (depth < 0), itself (0) and its
-- descendants (depth > 0, every fork). "The run" is one line through them (`on_line`): its ancestors,
-- itself, then the child started last at each generation. A member on the line supplies the steps
-- from_step..to_step (NULL: from its first, to its last): as `superseded_after` does for attempts, a
-- member is superseded after the lowest fork step of the members after it on the line.
CREATE OR REPLACE VIEW lineage AS
WITH pairs AS (  -- (each run, each run on its path from the root; their depths)
  SELECT run_id AS younger, depth AS younger_depth, off_line,
         unnest(path) AS elder, generate_subscripts(path, 1) - 1 AS elder_depth
  FROM _lineage_tree
),
members AS (
  SELECT younger AS run_id, elder AS member, elder_depth - younger_depth AS depth, true AS on_line
  FROM pairs
  UNION ALL
  SELECT elder AS run_id, younger AS member, younger_depth - elder_depth AS depth,
         off_line <= elder_depth AS on_line
  FROM pairs WHERE younger_depth > elder_depth
),
ranged AS (
  SELECT m.*, p.parent_run, p.fork_step, p.started_at,
         min(p.fork_step) FILTER (WHERE m.on_line) OVER (
           PARTITION BY m.run_id ORDER BY m.depth ROWS BETWEEN 1 FOLLOWING AND UNBOUNDED FOLLOWING
         ) AS superseded_after
  FROM members m JOIN _run_parent p ON p.run_id = m.member
)
SELECT run_id, member, depth, on_line, started_at, parent_run, fork_step,
       CASE WHEN on_line AND parent_run IS NOT NULL THEN fork_step + 1 END AS from_step,
       CASE WHEN on_line THEN superseded_after END AS to_step
FROM ranged;

-- "The run" as one series: for every run, one row per step per metric of its lineage's line, from
-- the member that supplies the step (the youngest whose range holds it); `member` names its run id.
-- (A GROUP BY, not a row_number() window over the join: DuckDB 1.5 answered that one wrongly here.)
CREATE OR REPLACE VIEW lineage_metrics AS
WITH supplied AS (
  SELECT l.run_id, m.step, m.name,
         arg_max({'member': m.run_id, 'attempt': m.attempt, 'time': m.time, 'value': m.value,
                  'stream': m.stream, 'stream_seq': m.stream_seq}, l.depth) AS row
  FROM lineage l JOIN metrics m ON m.run_id = l.member
  WHERE l.on_line AND (l.to_step IS NULL OR m.step <= l.to_step)
  GROUP BY l.run_id, m.name, m.step
)
SELECT run_id, row.member AS member, row.attempt AS attempt, step, row.time AS time, name,
       row.value AS value, row.stream AS stream, row.stream_seq AS stream_seq
FROM supplied;

-- `lineage` of one run (its rows with run_id = r), walking only its own family: what a reader asks
-- of one run (`ledger history`, `state`, `blame`, `diff`) costs the family, not the whole lab.
CREATE OR REPLACE MACRO lineage_of(r) AS TABLE
WITH RECURSIVE parents AS MATERIALIZED (SELECT * FROM _run_parent),
children AS MATERIALIZED (
  SELECT parent_run, run_id,
         row_number() OVER (PARTITION BY parent_run ORDER BY started_at DESC, run_id DESC) = 1 AS newest
  FROM parents WHERE parent_run IS NOT NULL
),
up(member, depth) AS (
  SELECT run_id, 0 FROM parents WHERE run_id = r
  UNION ALL
  SELECT p.parent_run, u.depth - 1 FROM up u JOIN parents p ON p.run_id = u.member WHERE p.parent_run IS NOT NULL
),
down(member, depth, on_line) AS (
  SELECT run_id, 0, true FROM parents WHERE run_id = r
  UNION ALL
  SELECT k.run_id, d.depth + 1, d.on_line AND k.newest FROM down d JOIN children k ON k.parent_run = d.member
),
members AS (
  SELECT member, depth, true AS on_line FROM up
  UNION ALL
  SELECT member, depth, on_line FROM down WHERE depth > 0
),
ranged AS (
  SELECT m.*, p.parent_run, p.fork_step, p.started_at,
         min(p.fork_step) FILTER (WHERE m.on_line) OVER (
           ORDER BY m.depth ROWS BETWEEN 1 FOLLOWING AND UNBOUNDED FOLLOWING
         ) AS superseded_after
  FROM members m JOIN parents p ON p.run_id = m.member
)
SELECT r AS run_id, member, depth, on_line, started_at, parent_run, fork_step,
       CASE WHEN on_line AND parent_run IS NOT NULL THEN fork_step + 1 END AS from_step,
       CASE WHEN on_line THEN superseded_after END AS to_step
FROM ranged;
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
    return _empty_relation(lake_columns(table))


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


def _empty_relation(columns: Columns) -> str:
    """A table with no rows, typed as ``columns``: a lake table without files at the snapshot is read
    without binding a DuckLake scan (~5 ms of every reader's open, per such table)."""
    typed = ", ".join(f'CAST(NULL AS {kind}) AS "{name}"' for name, kind in columns)
    return f"SELECT {typed} LIMIT 0"


def lake_rows(name: str, alias: str = "lake", files: Mapping[str, TableFiles | None] | None = None) -> str:
    """A lake table's rows at a pinned snapshot (the lake attached as ``alias``). ``files``: each
    table's data files at that snapshot (``runledger.ledger.lake.snapshot_files``): the table reads them as a
    table of part files does (DuckLake's scan asks the catalog for them again in every statement, ~2x
    a statement's time here), its partition column from the folder names where the catalog's values
    are those (a filter on it then opens only its files, as over part files); a table without files
    is an empty relation; a table with deletions or inlined rows (None), or without ``files``, is read
    through DuckLake."""
    through_lake = f'SELECT * FROM {alias}.main."{name}"'
    if files is None or name not in files:
        return through_lake if files is None else _empty_relation(lake_columns(name))
    listed = files[name]
    if listed is None:
        return through_lake
    types = dict(lake_columns(name))
    columns = ", ".join(f'"{c}"' for c in types)  # (not a merge's lineage columns)
    hive = "hive_partitioning = false"
    if listed.partition is not None and types.get(listed.partition) == "VARCHAR":
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
# the last place (``ranked``); one row per place. Times are grouped as microseconds (DuckDB 1.5's
# min/max of a TIMESTAMPTZ in a GROUP BY cost ~2x the rest of it at 30,000 incidents).
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
         min(epoch_us(time)) AS first_us, max(epoch_us(time)) AS last_us, min(stream_seq) AS first_stream_seq,
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
       make_timestamptz(min(first_us)) AS first_time, make_timestamptz(max(last_us)) AS last_time,
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
