"""A lake whose data path is ``s3://bucket/prefix`` on a real S3-compatible server: versitygw
(scripts/s3.sh, built from the Go module proxy into .go/), on 127.0.0.1 with generated credentials.

``ledger init --data s3://…`` then ``ledger ingest`` write the lake's Parquet files as objects; the
read commands answer as a ledger of part files from the same spool does; each commit record's
SHA-256 is the object's bytes as fetched on their own; wrong credentials or a dead server are one
line; user SQL reads nothing outside the lake's prefix."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ledger.publish_dest import S3Config
from runledger.ledger.query import QueryError, Reader
from runledger.ledger.store import COMMITS
from tests.lake.support import Postgres
from tests.support.s3 import AWS_CLEARED, running_s3_server

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--steps", "200", "--rank-stats-every", "100000", "--expert-counts-every", "100000"]
ENV = {"RUNLEDGER_PROGRESS_S": "off", "COLUMNS": "300"}
BUCKET = "runs"
OTHER = "other"
COMPARED = ["metrics", "launches", "attempts", "runs", "configs", "checkpoints"]
runner = CliRunner()


def _cli(*args: str | Path, code: int = 0, env: dict[str, str] | None = None) -> str:
    result = runner.invoke(app, [str(a) for a in args], env={**ENV, **(env or {})})
    assert result.exit_code == code, result.output
    return result.output


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """versitygw built and started in a tmp folder (stopped at the end), two buckets made through
    the S3 API, its AWS_* variables set for the module (the CLI reads them as a shell would)."""
    for server in running_s3_server(tmp_path_factory):
        for bucket in (BUCKET, OTHER):
            server.make_bucket(bucket)
        with pytest.MonkeyPatch.context() as mp:
            for name in AWS_CLEARED:
                mp.delenv(name, raising=False)
            for name, value in server.env.items():
                mp.setenv(name, value)
            yield server.env


def _fs(env: dict[str, str]) -> pa.fs.S3FileSystem:
    return S3Config.from_env(env).filesystem()


@pytest.fixture(scope="module")
def ledgers(s3: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """One spool ingested into a local ledger (its folder's embedded catalog) and into a lake on S3."""
    root = tmp_path_factory.mktemp("s3-lake")
    _cli("simulate", "reference-535b", "--spool", root / "spool", *SMALL)
    lake = root / "lake"
    init: list[str | Path] = ["init", "--keys", root / "keys", "--allow-unsigned", "*"]  # both: one policy
    _cli(*init, "--ledger", root / "old")
    _cli("ingest", "spool", "--spool", root / "spool", "--ledger", root / "old", "--batch-size", "250")
    catalog = f"sqlite:{root / 'catalog.sqlite'}"
    _cli(*init, "--ledger", lake, "--catalog", catalog, "--data", f"s3://{BUCKET}/lake")
    _cli("ingest", "spool", "--spool", root / "spool", "--ledger", lake, "--batch-size", "250")
    return root / "old", lake


def _rows(reader: Reader, view: str) -> list[str]:
    result = reader.sql(f"SELECT * FROM {view}")
    return sorted(json.dumps(r, default=str, sort_keys=True) for r in result.records())


def test_an_s3_lake_answers_as_the_ledger_of_part_files(ledgers: tuple[Path, Path]) -> None:
    old, lake = ledgers
    marker = json.loads((lake / "LAKE.json").read_bytes())
    assert marker["data_path"] == f"s3://{BUCKET}/lake"
    assert not (lake / "data").exists()  # nothing of the data on the local disk
    part_files, on_s3 = Reader(old), Reader(lake)
    try:
        assert on_s3.sql("SELECT count(*) FROM metrics").rows[0][0] > 100
        for view in COMPARED:
            assert _rows(on_s3, view) == _rows(part_files, view), view
    finally:
        part_files.close()
        on_s3.close()
    query = ["query", "SELECT count(*) AS n FROM metrics", "--format", "json"]
    assert _cli(*query, "--ledger", lake) == _cli(*query, "--ledger", old)
    assert _cli("state", "latest", "--ledger", lake) == _cli("state", "latest", "--ledger", old)


def test_each_commit_record_names_the_objects_sha256(ledgers: tuple[Path, Path], s3: dict[str, str]) -> None:
    _, lake = ledgers
    s3fs = _fs(s3)
    checked = 0
    for path in sorted((lake / COMMITS).glob("*.json")):
        for item in json.loads(path.read_bytes()).get("lake_files") or []:
            assert item["path"].startswith(f"s3://{BUCKET}/lake/"), item
            with s3fs.open_input_stream(item["path"].removeprefix("s3://")) as stream:
                body = stream.read()
            assert item["sha256"] == hashlib.sha256(body).hexdigest(), item["path"]
            assert item["bytes"] == len(body)
            checked += 1
    assert checked >= 3


def _one_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1, output
    assert "Traceback" not in output
    return lines[0]


def test_wrong_credentials_or_a_dead_server_is_one_line(
    ledgers: tuple[Path, Path], s3: dict[str, str], tmp_path: Path
) -> None:
    _, lake = ledgers
    wrong = {"AWS_SECRET_ACCESS_KEY": "not-the-secret"}
    result = runner.invoke(app, ["query", "SELECT 1", "--ledger", str(lake)], env={**ENV, **wrong})
    assert result.exit_code != 0
    assert "refused the credentials" in _one_line(result.output)
    spool = lake.parent / "spool"
    ingest = ["ingest", "spool", "--spool", str(spool), "--ledger", str(lake)]
    result = runner.invoke(app, ingest, env={**ENV, **wrong})
    assert result.exit_code != 0
    assert "refused the credentials" in _one_line(result.output)
    missing: dict[str, str | None] = {**ENV, "AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None}
    result = runner.invoke(app, ["runs", "--ledger", str(lake)], env=missing)
    assert result.exit_code != 0
    assert "set AWS_ACCESS_KEY_ID" in _one_line(result.output)
    dead = {"AWS_ENDPOINT_URL": "http://127.0.0.1:1"}
    result = runner.invoke(app, ["runs", "--ledger", str(lake)], env={**ENV, **dead})
    assert result.exit_code != 0
    assert "unreachable" in _one_line(result.output)
    fresh = ["init", "--ledger", str(tmp_path / "l"), "--keys", str(tmp_path / "k")]
    fresh += ["--catalog", f"sqlite:{tmp_path / 'c.sqlite'}", "--data", "s3://no-such-bucket/lake"]
    result = runner.invoke(app, fresh, env=ENV)
    assert result.exit_code != 0
    assert "no such bucket" in _one_line(result.output)


def test_sql_reads_nothing_outside_the_lake_prefix(ledgers: tuple[Path, Path], s3: dict[str, str]) -> None:
    _, lake = ledgers
    s3fs = _fs(s3)
    table = pa.table({"secret": ["x"]})
    for key in (f"{OTHER}/x.parquet", f"{BUCKET}/secret.parquet", f"{BUCKET}/lake2/x.parquet"):
        with s3fs.open_output_stream(key) as out:
            pq.write_table(table, out)
    refused = [
        f"SELECT * FROM read_parquet('s3://{OTHER}/x.parquet')",
        f"SELECT * FROM read_parquet('s3://{BUCKET}/secret.parquet')",
        f"SELECT * FROM read_parquet('s3://{BUCKET}/lake2/x.parquet')",
        f"SELECT * FROM read_parquet('s3://{BUCKET}/lake/../secret.parquet')",  # the server refuses it
        "SELECT * FROM read_text('/etc/passwd')",
        f"SELECT * FROM read_text('{REPO / 'pyproject.toml'}')",
        f"COPY (SELECT 1 AS a) TO 's3://{BUCKET}/lake/evil.parquet'",
        f"COPY (SELECT 1 AS a) TO 's3://{OTHER}/evil.parquet'",
        "SET allowed_directories = ['s3://other/']",
        "SELECT * FROM duckdb_secrets(redact = false)",
    ]
    reader = Reader(lake)
    try:
        for statement in refused:
            with pytest.raises(QueryError) as caught:
                reader.sql(statement)
            assert "\n" not in str(caught.value).strip() or "LINE" in str(caught.value), statement
        # the lake's own objects stay readable by name, under its prefix
        own = reader.sql(f"SELECT count(*) FROM glob('s3://{BUCKET}/lake/**/*.parquet')").rows[0][0]
        assert own >= 3
    finally:
        reader.close()
    for statement in refused[:8]:
        result = runner.invoke(app, ["query", statement, "--ledger", str(lake)], env=ENV)
        assert result.exit_code != 0, statement
        assert "Traceback" not in result.output
        first = result.output.splitlines()[0]
        # DuckDB's own refusal (its caret line may follow), the statement check's, or the server's 403
        assert any(w in first for w in ("Permission Error", "refused", "403")), result.output
    names = {info.path for info in s3fs.get_file_info(pa.fs.FileSelector(BUCKET, recursive=True))}
    assert f"{BUCKET}/lake/evil.parquet" not in names
    assert not any(name.endswith("evil.parquet") for name in names)


@pytest.fixture(scope="module")
def pg(postgres: Postgres | str) -> Postgres:
    if isinstance(postgres, str):
        pytest.skip(postgres)
    return postgres


def test_a_second_folder_joins_the_s3_lake(
    ledgers: tuple[Path, Path], pg: Postgres, tmp_path: Path, s3: dict[str, str]
) -> None:
    spool = ledgers[1].parent / "spool"
    catalog = f"postgres:{pg.database()}"
    data = f"s3://{BUCKET}/pg-{os.getpid()}"
    first, second = tmp_path / "first", tmp_path / "second"
    init: list[str | Path] = ["--keys", tmp_path / "keys", "--allow-unsigned", "*"]
    init += ["--catalog", catalog, "--data", data]
    _cli("init", "--ledger", first, *init)
    _cli("ingest", "spool", "--spool", spool, "--ledger", first, "--batch-size", "250")
    assert "joined ledger" in _cli("init", "--ledger", second, *init)
    query = [
        "query",
        "SELECT count(*) AS n, sum(step) AS s, max(value) AS m FROM metrics",
        "--format",
        "json",
    ]
    assert _cli(*query, "--ledger", second) == _cli(*query, "--ledger", first)
    assert json.loads(_cli(*query, "--ledger", second))[0]["n"] > 100


def test_publish_fetches_each_object_and_refuses_one_not_recorded(
    ledgers: tuple[Path, Path], tmp_path: Path, s3: dict[str, str]
) -> None:
    """``ledger publish`` of an S3 lake: each object fetched once and checked against its commit
    record's SHA-256; the published Parquet holds what the local ledger holds. An object
    changed on the server since its commit is refused in one line, and nothing is published."""
    spool = ledgers[1].parent / "spool"
    lake, keys = tmp_path / "lake", tmp_path / "keys"
    data = f"s3://{BUCKET}/publish-{os.getpid()}"
    init: list[str | Path] = ["init", "--keys", keys, "--allow-unsigned", "*", "--ledger", lake]
    _cli(*init, "--catalog", f"sqlite:{tmp_path / 'catalog.sqlite'}", "--data", data)
    _cli("ingest", "spool", "--spool", spool, "--ledger", lake, "--batch-size", "250")
    out = _cli("publish", tmp_path / "site", "--ledger", lake, "--keys", keys)
    assert "published" in out, out
    published = pq.read_table(
        sorted(str(p) for p in (tmp_path / "site" / "data" / "metrics").rglob("*.parquet")),
        partitioning=None,  # a lake's files hold their partition column themselves
    )
    # The same rows as the local ledger the same spool made (the stored rows, not the view).
    local = Reader(ledgers[0])
    values = [row[0] for row in local.sql("SELECT value FROM _metrics").rows]
    local.close()
    assert published.num_rows == len(values) > 1000
    assert sorted(published["value"].to_pylist()) == sorted(values)

    _cli("verify", "--ledger", lake)  # exit 0: every object fetched and hashed against its record

    # An object rewritten on the server (same name, other bytes): the next publish refuses it.
    record = json.loads(sorted((lake / COMMITS).glob("*.json"))[-1].read_bytes())
    item = next(i for i in record["lake_files"] if i["table"] == "metrics")
    s3fs = _fs(s3)
    key = item["path"].removeprefix("s3://")
    with s3fs.open_input_stream(key) as stream:
        table = pq.read_table(pa.BufferReader(stream.read()))
    values = table.column("value").to_pylist()
    changed = table.set_column(
        table.schema.get_field_index("value"), "value", pa.array([v + 1 for v in values], pa.float64())
    )
    sink = pa.BufferOutputStream()
    pq.write_table(changed, sink)
    with s3fs.open_output_stream(key) as stream:
        stream.write(sink.getvalue().to_pybytes())
    before = (tmp_path / "site" / "checkpoint").read_bytes()
    for copy in (lake / "_publish" / "lake-files").rglob(Path(key).name):
        copy.unlink()  # as on a host that has not fetched it yet
    result = runner.invoke(
        app, ["publish", str(tmp_path / "site2"), "--ledger", str(lake), "--keys", str(keys)], env=ENV
    )
    assert result.exit_code == 1, result.output
    line = _one_line(result.output)
    assert line.startswith(f"error: lake object {item['path']} is not the bytes its commit recorded"), line
    assert not (tmp_path / "site2" / "checkpoint").exists()
    assert (tmp_path / "site" / "checkpoint").read_bytes() == before
    verified = runner.invoke(app, ["verify", "--ledger", str(lake)], env=ENV)
    assert verified.exit_code == 1, verified.output
    shown = item["path"].removeprefix(data + "/")
    assert (
        f"modified: stream ?: {shown}: its bytes are not the SHA-256 its commit record names"
        in verified.output
    )


def test_a_merged_s3_lake_publishes_its_files_without_their_lineage(
    tmp_path: Path, s3: dict[str, str]
) -> None:
    """A compacted lake on S3: the merge's files (written by DuckDB, lineage column last) are fetched,
    checked, and published with their footer rewritten (still DuckDB's bytes); no download is left."""
    spool = tmp_path / "spool"
    _cli("simulate", "reference-535b", "--spool", spool, *SMALL)
    lake, keys = tmp_path / "lake", tmp_path / "keys"
    data = f"s3://{BUCKET}/merged-{os.getpid()}"
    init: list[str | Path] = ["init", "--keys", keys, "--allow-unsigned", "*", "--ledger", lake]
    _cli(*init, "--catalog", f"sqlite:{tmp_path / 'catalog.sqlite'}", "--data", data)
    _cli("ingest", "spool", "--spool", spool, "--ledger", lake, "--batch-size", "100")
    assert "merged" in _cli("compact", "--ledger", lake)
    _cli("publish", tmp_path / "site", "--ledger", lake, "--keys", keys)
    files = sorted((tmp_path / "site" / "data").rglob("*.parquet"))
    writers = {pq.ParquetFile(f).metadata.created_by.split(" version")[0] for f in files}
    assert "DuckDB" in writers, writers  # the merge's files, their footers rewritten (not re-encoded)
    assert not [f for f in files if any(n.startswith("_ducklake_") for n in pq.read_schema(f).names)]
    published = pq.read_table(
        [str(p) for p in files if p.parent.parent.name == "metrics"], partitioning=None
    ).column("value")
    with Reader(lake) as reader:
        values = [row[0] for row in reader.sql("SELECT value FROM _metrics").rows]
    assert sorted(published.to_pylist()) == sorted(values) and len(values) > 1000
    left = [p.name for p in (lake / "_publish" / "lake-files").rglob("*") if p.suffix in (".fetched", ".tmp")]
    assert not left, left
