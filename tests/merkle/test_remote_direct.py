"""DuckDB over HTTP and S3 directly: ``ledger query --remote URL --direct`` (``runledger.ledger.remote.query_direct``)
reads the published Parquet files by URL with httpfs, the list taken from the verified, signed
manifest; nothing is downloaded first. The HTTP server is a real one that answers Range requests
(nginx-light, started by scripts/http.sh in the test's tmp dir); the S3 server is versitygw
(scripts/s3.sh). Also: a plain DuckDB user queries the published copy with its views.sql, by URL."""

from __future__ import annotations

import base64
import contextlib
import functools
import http.server
import json
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer.main

from runledger.cli.main import app
from runledger.ledger import duck
from runledger.ledger.publish_dest import S3Dest
from runledger.ledger.query import QueryError
from runledger.ledger.remote import RemoteError, fetch_copy, query_direct
from runledger.schemas.note import write_keypair
from tests.merkle.test_publish import Site
from tests.merkle.test_remote_s3 import S3Server, answer, mirror, one_line, s3, s3_server  # noqa: F401

REPO = Path(__file__).resolve().parents[2]
HTTP_SH = REPO / "scripts" / "http.sh"
ENV = {"COLUMNS": "300"}

SQL = [
    "SELECT count(*) AS n FROM events WHERE stream_type = 'run'",
    "SELECT run_id, last_step, attempts FROM runs",
    "SELECT name, count(*) AS n, round(avg(value), 6) AS mean FROM metrics GROUP BY name ORDER BY name",
    "SELECT step, value FROM metrics WHERE name = 'loss' AND step % 50 = 0 ORDER BY step",
]


def _query_has_direct() -> bool:
    command = typer.main.get_command(app)
    query = command.commands["query"]  # type: ignore[attr-defined]
    return any("--direct" in p.opts for p in query.params)


needs_cli_direct = pytest.mark.skipif(
    not _query_has_direct(), reason="`ledger query` has no --direct option yet (cli/ledger_cmd.py)"
)


class Nginx:
    """nginx-light serving a folder, started and stopped by scripts/http.sh."""

    def __init__(self, folder: Path, root: Path, ranges: bool = True) -> None:
        self.folder = folder
        started = subprocess.run(
            [str(HTTP_SH), "start" if ranges else "start-norange", str(folder), str(root)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert started.returncode == 0, started.stderr
        self.url = started.stdout.strip().splitlines()[-1]

    def stop(self) -> None:
        subprocess.run([str(HTTP_SH), "stop", str(self.folder)], capture_output=True, timeout=30, check=True)

    def requests(self) -> list[tuple[str, int]]:
        """(path, status) of each request answered so far (nginx's access log)."""
        out = []
        for line in (self.folder / "access.log").read_text().splitlines():
            request = line.split('"')[1].split()
            out.append((request[1], int(line.split('"')[2].split()[0])))
        return out


@contextlib.contextmanager
def serving(folder: Path, root: Path, ranges: bool = True) -> Iterator[Nginx]:
    if shutil.which("nginx") is None and not Path("/usr/sbin/nginx").exists():
        pytest.skip("needs nginx: run scripts/http.sh install (apt-get install nginx-light)")
    server = Nginx(folder, root, ranges)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture()
def site(tmp_path: Path) -> Site:
    site = Site(tmp_path)
    site.add(140)
    site.add(60)
    site.publish()
    return site


@pytest.fixture()
def nginx(site: Site, tmp_path: Path) -> Iterator[Nginx]:
    with serving(tmp_path / "nginx", site.dest) as server:
        yield server


def _as_of(site: Site, files: int) -> str:
    size, root = site.checkpoint()
    return (
        f"as of runledger/pub-test checkpoint size {size} root {base64.b64encode(root).decode()} "
        f"(signed manifest at log size {size - 1}; read directly from {files} files, their bytes not "
        "checked against the manifest)"
    )


def test_direct_over_http_answers_what_the_verified_download_answers(
    nginx: Nginx, site: Site, tmp_path: Path
) -> None:
    copy = fetch_copy(nginx.url, site.vkey, tmp_path / "cache")
    manifest = json.loads((site.dest / "manifest.json").read_text())
    before = len(nginx.requests())
    for sql in SQL:
        direct = query_direct(nginx.url, site.vkey, sql)
        assert direct.result.rows == copy.sql(sql).rows and direct.result.rows, sql
        assert direct.result.columns == copy.sql(sql).columns
        assert direct.files == len(manifest["files"])
        assert (
            direct.checkpoint.size == site.checkpoint()[0]
            and direct.manifest_log_size == direct.checkpoint.size - 1
        )
    data = [(path, status) for path, status in nginx.requests()[before:] if path.startswith("/data/")]
    # DuckDB read the data files by Range (206) or a HEAD (200): nothing was fetched whole with a GET.
    assert data and all(status == 206 or status == 200 for _, status in data)
    log = (nginx.folder / "access.log").read_text().splitlines()[before:]
    assert not [line for line in log if '"GET /data/' in line and '" 200 ' in line], log
    assert any('"GET /data/' in line and '" 206 ' in line for line in log)


def test_direct_keeps_the_walls_of_a_local_query(nginx: Nginx, site: Site, tmp_path: Path) -> None:
    """Only the files the signed manifest names can be read (exact paths, not a URL prefix), and only
    by a read-only statement."""
    (site.dest / "notes.txt").write_text("served, but not in the manifest")
    denied = "file system operations are disabled by configuration"
    not_allowed = "table function read_text() is not allowed here"  # refused before DuckDB's own wall
    for sql, said in [
        ("SELECT * FROM read_text('/etc/passwd')", not_allowed),
        (f"SELECT * FROM read_text('{nginx.url}notes.txt')", not_allowed),
        (f"SELECT * FROM read_text('{nginx.url}manifest.json')", not_allowed),
        (f"SELECT * FROM read_parquet('{nginx.url}data/../data/x.parquet')", denied),
        ("SELECT * FROM read_parquet('http://127.0.0.1:9/x.parquet')", denied),
        ("COPY (SELECT 1) TO 'x.csv'", "COPY statements are not allowed"),
        ("SELECT 1; SELECT 2", "2 statements given"),
        ("INSTALL httpfs", "not allowed"),
        ("SET enable_external_access = true", "SET statements are not allowed"),
    ]:
        with pytest.raises(QueryError, match=re.escape(said)):
            query_direct(nginx.url, site.vkey, sql)
    assert not (tmp_path / "x.csv").exists() and not Path("x.csv").exists()


def test_direct_refuses_a_copy_that_does_not_verify(nginx: Nginx, site: Site, tmp_path: Path) -> None:
    other = write_keypair(tmp_path / "k2", "runledger-log")[1].read_text().strip()
    with pytest.raises(RemoteError, match="bad signature"):
        query_direct(nginx.url, other, SQL[0])
    manifest = site.dest / "manifest.json"
    good = manifest.read_bytes()
    manifest.write_bytes(good.replace(b'"bytes": ', b'"bytes":  ', 1))
    with pytest.raises(RemoteError, match=r"not the manifest signed in manifest\.sig"):
        query_direct(nginx.url, site.vkey, SQL[0])
    manifest.write_bytes(good)


def test_direct_says_in_one_line_that_a_server_does_not_do_range(site: Site, tmp_path: Path) -> None:
    """nginx with Range turned off, and Python's http.server (which has none): one clear line, not a
    silent download of every file whole for each read."""
    with (
        serving(tmp_path / "norange", site.dest, ranges=False) as server,
        pytest.raises(RemoteError) as raised,
    ):
        query_direct(server.url, site.vkey, SQL[0])
    assert str(raised.value) == (
        f"{server.url} does not answer Range requests (DuckDB needs them to read Parquet by URL): "
        "query without --direct, or serve the copy with a server that does (scripts/http.sh)"
    )
    handler = functools.partial(_Quiet, directory=str(site.dest))
    plain = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=plain.serve_forever, daemon=True).start()
    try:
        with pytest.raises(RemoteError, match="does not answer Range requests"):
            query_direct(f"http://127.0.0.1:{plain.server_address[1]}/", site.vkey, SQL[0])
    finally:
        plain.shutdown()
        plain.server_close()


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@needs_cli_direct
def test_cli_query_direct_names_its_checkpoint(nginx: Nginx, site: Site, tmp_path: Path) -> None:
    files = len(json.loads((site.dest / "manifest.json").read_text())["files"])
    args = ["query", "--remote", nginx.url, "--log-key", site.vkey, "--direct", "--format", "json"]
    code, out, err = answer(*args, SQL[0])
    assert code == 0 and json.loads(out) == [{"n": 201}], out + err
    assert one_line(err) == _as_of(site, files)
    code, out, err = answer(*args, "COPY (SELECT 1) TO 'x.csv'")
    assert code == 1 and one_line(out + err).startswith("error: "), out + err
    code, out, err = answer("query", "--direct", SQL[0])
    assert code == 2 and "--direct needs --remote" in one_line(out + err)
    with serving(tmp_path / "norange", site.dest, ranges=False) as server:
        code, out, err = answer(*[server.url if a == nginx.url else a for a in args], SQL[0])
    assert code == 1 and one_line(out + err).startswith("error: REFUSED ") and "Range" in out + err


def test_direct_over_s3(s3: S3Server, site: Site, tmp_path: Path) -> None:  # noqa: F811
    url = f"s3://{s3.new_bucket()}/runledger"
    mirror(site.dest, S3Dest(url))
    copy = fetch_copy(url, site.vkey, tmp_path / "cache")
    for sql in SQL:
        rows = query_direct(url, site.vkey, sql).result.rows
        assert rows == copy.sql(sql).rows and rows, sql
    for sql in [
        f"SELECT * FROM read_parquet('{url}/../other/x.parquet')",
        "SELECT * FROM read_parquet('s3://elsewhere/x.parquet')",
        "SELECT * FROM read_text('/etc/hostname')",
    ]:
        with pytest.raises(QueryError):
            query_direct(url, site.vkey, sql)


def _plain_views(site: Site, base: str) -> str:
    """The published views.sql as a plain DuckDB user would use it: each path prefixed by the URL."""
    return (site.dest / "views.sql").read_text().replace("'data/", f"'{base}data/")


def test_a_plain_duckdb_user_queries_the_copy_by_url(nginx: Nginx, s3: S3Server, site: Site) -> None:  # noqa: F811
    """No runledger code on the read path: DuckDB, httpfs, the published views.sql and a URL."""
    con = duck.connect(extensions=["httpfs"])
    con.execute(_plain_views(site, nginx.url))
    assert con.execute("SELECT count(*) FROM events WHERE stream_type = 'run'").fetchall() == [(201,)]
    assert con.execute("SELECT count(DISTINCT step) FROM metrics").fetchall() == [(200,)]
    con.close()
    url = f"s3://{s3.new_bucket()}/copy"
    mirror(site.dest, S3Dest(url))
    endpoint = s3.env["AWS_ENDPOINT_URL"].removeprefix("http://")
    con = duck.connect(extensions=["httpfs"])
    con.execute(
        f"CREATE SECRET (TYPE s3, KEY_ID '{s3.env['AWS_ACCESS_KEY_ID']}', SECRET '{s3.env['AWS_SECRET_ACCESS_KEY']}', "
        f"ENDPOINT '{endpoint}', URL_STYLE 'path', USE_SSL false, REGION 'us-east-1')"
    )
    con.execute(_plain_views(site, url + "/"))
    assert con.execute("SELECT count(*) FROM events WHERE stream_type = 'run'").fetchall() == [(201,)]
    con.close()
