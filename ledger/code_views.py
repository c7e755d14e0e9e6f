"""DuckDB views joining GitHub events to runs: what code each attempt ran, and what landed in between.

Defined over the views of ``runledger.ledger.views`` (``attempts``, ``github``, ``events``); install them on a
connection from ``runledger.ledger.views.connect`` with ``install(con)``, or append ``CODE_VIEWS`` to the SQL.

  attempt_windows                each attempt with the start of the next one (NULL for the latest)
  github_pull_requests           one row per pull request: its latest state, merge time and commits
  commit_pull_requests           (repo, sha) → pull requests: 'merge_commit' (the merge/squash commit of
                                 a merged PR) or 'head' (a head commit the PR had at some event)
  commit_introduced_by           one PR per (repo, sha): a merge beats a head, then earliest merge
  attempt_commits                the commit each attempt ran, its message and the PR that introduced it
  code_landed_between_attempts   merged PRs and pushes after an attempt started and up to the next
                                 attempt's start (next_attempt NULL: up to now)
  code_between(run, a, b)        the same for any two attempts of a run (a table macro)

Repositories are compared case-insensitively (GitHub names are) and an attempt's ``git_commit`` may
be an abbreviated SHA. Commits and pushes come from the ``github`` view, which shows each GitHub fact
once however many producers observed it (a commit seen by a push webhook and by a backfill is one
row); pull requests are folded from every observation in ``events``. Merge times come from each pull request event's own JSON (``merged_at``), so a
later edit of a merged PR does not move its merge. A PR's intermediate commits are known only as the
head SHAs its events carried (webhook ``synchronize`` events carry each pushed head).
"""

from __future__ import annotations

import duckdb

_NULL_SHA = "0000000000000000000000000000000000000000"

CODE_VIEWS = f"""
CREATE OR REPLACE VIEW attempt_windows AS
SELECT run_id, attempt, started_at, repository, git_commit, git_branch,
       lead(attempt) OVER w AS next_attempt,
       lead(started_at) OVER w AS next_started_at
FROM attempts
WINDOW w AS (PARTITION BY run_id ORDER BY attempt);

CREATE OR REPLACE VIEW _github_pull_events AS
SELECT stream AS repo,
       CAST(json_extract(canonical, '$.data.number') AS BIGINT) AS number,
       time,
       stream_seq,
       json_extract_string(canonical, '$.data.title') AS title,
       json_extract_string(canonical, '$.data.state') AS state,
       json_extract_string(canonical, '$.data.author') AS author,
       json_extract_string(canonical, '$.data.url') AS url,
       json_extract_string(canonical, '$.data.head_sha') AS head_sha,
       json_extract_string(canonical, '$.data.base_ref') AS base_ref,
       json_extract_string(canonical, '$.data.merge_commit_sha') AS merge_commit_sha,
       CAST(json_extract_string(canonical, '$.data.merged_at') AS TIMESTAMPTZ) AS merged_at
FROM events
WHERE stream_type = 'repo' AND type = 'github.pull_request';  -- the partition: no run's events are read

CREATE OR REPLACE VIEW github_pull_requests AS
SELECT repo, number,
       arg_max(title, (time, stream_seq)) AS title,
       arg_max(state, (time, stream_seq)) AS state,
       arg_max(author, (time, stream_seq)) AS author,
       arg_max(url, (time, stream_seq)) AS url,
       arg_max(base_ref, (time, stream_seq)) AS base_ref,
       arg_max(head_sha, (time, stream_seq)) AS head_sha,
       min(merged_at) AS merged_at,
       arg_max(merge_commit_sha, (time, stream_seq)) FILTER (WHERE merged_at IS NOT NULL) AS merge_commit_sha,
       -- sorted: the same list whatever order the files are scanned in
       list(DISTINCT head_sha ORDER BY head_sha) FILTER (WHERE head_sha IS NOT NULL) AS head_shas,
       max(time) AS updated_at
FROM _github_pull_events
GROUP BY repo, number;

CREATE OR REPLACE VIEW commit_pull_requests AS
SELECT p.repo, p.merge_commit_sha AS sha, p.number, p.title, 'merge_commit' AS relation, p.merged_at
FROM github_pull_requests p
WHERE p.merged_at IS NOT NULL AND p.merge_commit_sha IS NOT NULL
UNION ALL
SELECT p.repo, h.sha, p.number, p.title, 'head' AS relation, p.merged_at
FROM github_pull_requests p, unnest(p.head_shas) AS h(sha);

CREATE OR REPLACE VIEW commit_introduced_by AS
SELECT repo, sha, number, title, relation, merged_at
FROM commit_pull_requests
QUALIFY row_number() OVER (
  PARTITION BY lower(repo), sha
  ORDER BY relation = 'merge_commit' DESC, merged_at NULLS LAST, number
) = 1;

CREATE OR REPLACE VIEW _github_commits AS
SELECT repo, sha, arg_max(title, (time, stream_seq)) AS title, arg_max(actor, (time, stream_seq)) AS author,
       min(time) AS committed_at, arg_max(shas, (time, stream_seq)) AS parents
FROM github
WHERE kind = 'commit'
GROUP BY repo, sha;

CREATE OR REPLACE VIEW attempt_commits AS
WITH resolved AS (
  SELECT w.run_id, w.attempt, w.started_at, w.repository, w.git_commit,
         coalesce(c.sha, w.git_commit) AS commit_sha,
         c.title AS commit_title, c.author AS commit_author, c.committed_at
  FROM attempt_windows w
  LEFT JOIN _github_commits c
    ON lower(c.repo) = lower(w.repository) AND w.git_commit IS NOT NULL AND w.git_commit <> ''
   AND starts_with(c.sha, w.git_commit)
)
SELECT r.run_id, r.attempt, r.started_at, r.repository, r.git_commit, r.commit_sha,
       r.commit_title, r.commit_author, r.committed_at,
       i.number AS pr_number, i.title AS pr_title, i.relation AS pr_relation, i.merged_at AS pr_merged_at
FROM resolved r
LEFT JOIN commit_introduced_by i
  ON lower(i.repo) = lower(r.repository) AND r.commit_sha IS NOT NULL AND r.commit_sha <> ''
 AND starts_with(i.sha, r.commit_sha);

CREATE OR REPLACE VIEW _code_landings AS
SELECT repo, 'pull_request' AS kind, number, title, base_ref AS ref, merge_commit_sha AS sha,
       author AS actor, merged_at AS time, url
FROM github_pull_requests
WHERE merged_at IS NOT NULL
UNION ALL
SELECT repo, 'push' AS kind, NULL AS number, title AS title, title AS ref, sha, actor, time, url
FROM github
WHERE kind = 'push' AND sha <> '{_NULL_SHA}';

CREATE OR REPLACE VIEW code_landed_between_attempts AS
SELECT w.run_id, w.attempt, w.next_attempt, w.repository, l.kind, l.number, l.title, l.ref, l.sha,
       l.actor, l.time, l.url,
       CASE WHEN l.kind = 'push' THEN l.ref = 'refs/heads/' || w.git_branch
            ELSE l.ref = w.git_branch END AS on_run_branch
FROM attempt_windows w
JOIN _code_landings l
  ON lower(l.repo) = lower(w.repository) AND l.time > w.started_at
 AND (w.next_started_at IS NULL OR l.time <= w.next_started_at);

CREATE OR REPLACE MACRO code_between(r, a, b) AS TABLE
SELECT l.*
FROM _code_landings l,
     (SELECT repository, started_at FROM attempts WHERE run_id = r AND attempt = a) AS x,
     (SELECT started_at FROM attempts WHERE run_id = r AND attempt = b) AS y
WHERE lower(l.repo) = lower(x.repository) AND l.time > x.started_at AND l.time <= y.started_at
ORDER BY l.time, l.kind, l.number;
"""


def install(con: duckdb.DuckDBPyConnection) -> None:
    """Define the code views on a connection that already has ``runledger.ledger.views``' views."""
    con.execute(CODE_VIEWS)
