"""The published copy in an S3 bucket on a real S3-compatible server: versitygw (scripts/s3.sh, built
from the Go module proxy into .go/), serving a folder of the test's tmp dir on 127.0.0.1 with
generated credentials. ``runledger.ledger.publish_dest``'s folder and S3 destinations keep one contract;
``ledger query --remote s3://…`` and ``ledger verify --remote s3://…`` read the bucket; wrong
credentials, a missing bucket, a dead server and a flipped byte in an object are each one line."""

from __future__ import annotations

import base64
import dataclasses
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

import runledger.ledger.monitor
import runledger.ledger.publish
from runledger.cli.main import app
from runledger.ledger.publish_dest import Dest, DestError, FolderDest, S3Dest, open_dest
from runledger.ledger.tiles import entries_path
from runledger.schemas.note import write_keypair
from tests.merkle.test_publish import Site
from tests.support.s3 import AWS_CLEARED, S3Server, running_s3_server

REPO = Path(__file__).resolve().parents[2]
ENV = {"COLUMNS": "300"}


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    yield from running_s3_server(tmp_path_factory)


@pytest.fixture()
def s3(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The server, its AWS_* variables set for this test (the CLI reads them as a user's shell would)."""
    for name in AWS_CLEARED:
        monkeypatch.delenv(name, raising=False)
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    return s3_server


@pytest.fixture()
def site(tmp_path: Path) -> Site:
    return Site(tmp_path)


def mirror(folder: Path, dest: Dest) -> int:
    """Copy a published folder into ``dest`` file by file (what `aws s3 sync` would do)."""
    count = 0
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        dest.put_file(path.relative_to(folder).as_posix(), path)
        count += 1
    return count


def flip_object(dest: Dest, rel: str, pos: int) -> bytes:
    """One bit of an object changed through the store's own API; returns the good bytes."""
    good = dest.read(rel)
    dest.put(rel, good[:pos] + bytes([good[pos] ^ 0x01]) + good[pos + 1 :])
    return good


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env=ENV)
    return result.exit_code, result.output


def answer(*args: str) -> tuple[int, str, str]:
    """Exit status, stdout and stderr of a command (the checkpoint line goes to stderr)."""
    result = CliRunner().invoke(app, list(args), env=ENV)
    return result.exit_code, result.stdout, result.stderr


def one_line(out: str) -> str:
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, out
    return lines[0]


# ------------------------------------------------------------------------ runledger.ledger.publish_dest


@pytest.fixture(params=["folder", "s3"])
def dest(request: pytest.FixtureRequest, tmp_path: Path) -> Dest:
    if request.param == "folder":
        return FolderDest(tmp_path / "site")
    server: S3Server = request.getfixturevalue("s3")
    return S3Dest(f"s3://{server.new_bucket()}/runs/log")


def test_both_destinations_keep_one_contract(dest: Dest, tmp_path: Path) -> None:
    assert not dest.exists("checkpoint")
    with pytest.raises(FileNotFoundError):
        dest.read("checkpoint")
    dest.put("checkpoint", b"size 1\n")
    assert dest.exists("checkpoint") and dest.read("checkpoint") == b"size 1\n"
    dest.put("checkpoint", b"size 2\n")  # replaced whole
    assert dest.read("checkpoint") == b"size 2\n"
    big = tmp_path / "big.parquet"
    big.write_bytes(os.urandom(3 << 20) + b"end")  # past one block, and a multipart upload on S3
    dest.put_file("data/events/stream_type=run/part-1.parquet", big)
    assert dest.read("data/events/stream_type=run/part-1.parquet") == big.read_bytes()
    assert [len(b) for b in dest.stream("data/events/stream_type=run/part-1.parquet")][:3] == [1 << 20] * 3
    dest.delete("data/events/stream_type=run/part-1.parquet")
    dest.delete("data/events/stream_type=run/part-1.parquet")  # already gone: nothing happens
    assert not dest.exists("data/events/stream_type=run/part-1.parquet")
    for bad in ("../outside", "/etc/passwd", "tile/../../x", ""):
        with pytest.raises(DestError, match="not a path inside"):
            dest.put(bad, b"x")
    assert open_dest(dest) is dest


def test_s3_dest_names_its_bucket_and_server(s3: S3Server) -> None:
    bucket = s3.new_bucket()
    dest = open_dest(f"s3://{bucket}/a/b/")
    assert isinstance(dest, S3Dest)
    assert dest.name == f"s3://{bucket}/a/b" and dest.url_of("checkpoint") == f"s3://{bucket}/a/b/checkpoint"
    assert dest.key == f"{s3.env['AWS_ENDPOINT_URL']}/{bucket}/a/b"
    dest.put("checkpoint", b"x")  # lands under the prefix, in the server's folder
    assert (s3.folder / "buckets" / bucket / "a" / "b" / "checkpoint").read_bytes() == b"x"


def test_s3_failures_are_one_line_each(s3: S3Server) -> None:
    bucket = s3.new_bucket()
    config = s3.config
    cases = {
        "a wrong secret": (f"s3://{bucket}/log", dataclasses.replace(config, secret_key="wrong" * 8)),
        "an unknown key": (f"s3://{bucket}/log", dataclasses.replace(config, access_key="RLNOSUCHKEY")),
        "no key at all": (f"s3://{bucket}/log", dataclasses.replace(config, access_key="", secret_key="")),
        "a missing bucket": ("s3://no-such-bucket/log", config),
        "a dead server": (f"s3://{bucket}/log", dataclasses.replace(config, endpoint="http://127.0.0.1:9")),
    }
    said = {}
    for what, (url, cfg) in cases.items():
        with pytest.raises(DestError) as raised:
            S3Dest(url, cfg)
        said[what] = str(raised.value)
        assert "\n" not in said[what], (what, said[what])
    assert "refused the credentials" in said["a wrong secret"]
    assert "refused the credentials" in said["an unknown key"]
    assert "refused the credentials" in said["no key at all"]
    assert said["a missing bucket"] == f"s3://no-such-bucket/log: no such bucket at {config.endpoint}"
    assert said["a dead server"].startswith(f"s3://{bucket}/log: http://127.0.0.1:9 is unreachable")
    for bad in ("s3://", "http://x/y", "s3:///prefix"):
        with pytest.raises(DestError):
            open_dest(bad) if bad.startswith("http") else S3Dest(bad, config)


# ------------------------------------------------------------------------ reads from S3


def _published_in_s3(site: Site, s3: S3Server, steps: int = 140) -> tuple[str, S3Dest]:
    """A publish of the site's ledger, in a fresh bucket (mirrored from the folder publish)."""
    site.add(steps)
    site.publish()
    url = f"s3://{s3.new_bucket()}/runledger"
    dest = S3Dest(url)
    mirror(site.dest, dest)
    return url, dest


def test_query_remote_reads_a_bucket_verified(
    s3: S3Server, site: Site, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, dest = _published_in_s3(site, s3)
    cache = tmp_path / "cache"
    sql = "SELECT count(DISTINCT step) AS n, max(step) AS last FROM metrics"
    args = ["query", "--remote", url, "--log-key", site.vkey, "--cache", str(cache), "--format", "json"]
    code, out, err = answer(*args, sql)
    size, root = site.checkpoint()
    files = len(json.loads((site.dest / "manifest.json").read_text())["files"])
    assert code == 0, out + err
    assert json.loads(out) == [{"n": 140, "last": 140}]
    assert one_line(err) == (
        f"as of runledger/pub-test checkpoint size {size} root {base64.b64encode(root).decode()} "
        f"(signed manifest at log size {size - 1}; {files} files downloaded)"
    )
    # A flipped byte in one object of the bucket: refused (the SHA-256 of the signed manifest).
    manifest = json.loads(dest.read("manifest.json"))
    victim = max((f for f in manifest["files"] if f["table"] == "metrics"), key=lambda f: f["bytes"])
    good = flip_object(dest, victim["path"], 100)
    code, out = invoke(*args[:-3], str(tmp_path / "fresh"), "--format", "json", sql)
    assert code == 1 and one_line(out) == (
        f"error: REFUSED {url}/{victim['path']} does not match its SHA-256 in the signed manifest"
    ), out
    dest.put(victim["path"], good)
    # Wrong credentials and a missing bucket: one line, nothing answered.
    with monkeypatch.context() as env:
        env.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
        code, out = invoke(*args, sql)
    assert code == 1 and "refused the credentials" in one_line(out), out
    code, out = invoke(*[url.replace("s3://pub", "s3://gone") if a == url else a for a in args], sql)
    assert code == 1 and one_line(out).endswith(f"no such bucket at {s3.env['AWS_ENDPOINT_URL']}"), out
    other = write_keypair(tmp_path / "k2", "runledger-log")[1]
    code, out = invoke(*[str(other) if a == site.vkey else a for a in args], sql)
    assert code == 1 and "bad signature" in one_line(out), out


@pytest.mark.parametrize("what", ["none", "bundle", "data"])
def test_verify_remote_reads_a_bucket(s3: S3Server, site: Site, tmp_path: Path, what: str) -> None:
    url, dest = _published_in_s3(site, s3, 300)
    size = site.checkpoint()[0]
    state = tmp_path / "verified.json"
    args = ["verify", "--remote", url, "--log-key", site.vkey, "--state", str(state)]
    if what == "none":
        code, out = invoke(*args)
        files = len(json.loads(dest.read("manifest.json"))["files"])
        assert code == 0 and one_line(out) == (
            f"OK runledger/pub-test: size {size}; {size} new entries and {files} data files checked from nothing"
        ), out
        code, out = invoke(*args)
        assert code == 0 and one_line(out) == f"OK runledger/pub-test: size {size}, nothing new", out
        return
    manifest = json.loads(dest.read("manifest.json"))
    data = max((f for f in manifest["files"] if f["table"] == "events"), key=lambda f: f["bytes"])
    flip_object(dest, {"bundle": entries_path(size // 256, size % 256), "data": data["path"]}[what], 40)
    code, out = invoke(*args)
    assert code == 1 and one_line(out).startswith("error: FAILED"), out
    assert {"bundle": "bad-entries", "data": "bad-data"}[what] in out
    assert not state.exists()


def test_verify_remote_says_what_is_wrong_with_the_bucket(s3: S3Server, site: Site, tmp_path: Path) -> None:
    url, _ = _published_in_s3(site, s3, 20)
    args = ["--log-key", site.vkey, "--state", str(tmp_path / "v.json")]
    code, out = invoke("verify", "--remote", url.replace("s3://pub", "s3://gone"), *args)
    assert code == 1 and one_line(out).startswith("error: FAILED"), out
    assert "no such bucket" in out


# ------------------------------------------------------------------------ ledger publish s3://


def test_publish_to_s3_writes_what_a_folder_publish_writes(s3: S3Server, site: Site, tmp_path: Path) -> None:
    """The same ledger published to a folder and to a bucket: the same files, byte for byte (the
    log's Ed25519 signatures are deterministic), then incrementally; read back verified."""
    keys = tmp_path / "keys"
    url = f"s3://{s3.new_bucket()}/log"
    site.add(140)
    for step in range(2):
        if step:
            site.add(30)
        code, out = invoke("publish", url, "--ledger", str(site.root), "--keys", str(keys))
        assert code == 0 and out.startswith("published ") and out.rstrip().endswith(f"{url}/checkpoint"), out
        site.publish()
        in_bucket = {
            p.relative_to(s3.folder / "buckets" / url[5:]).as_posix(): p.read_bytes()
            for p in (s3.folder / "buckets" / url[5:]).rglob("*")
            if p.is_file()
        }
        assert in_bucket == site.files()
    code, out = invoke("publish", url, "--ledger", str(site.root), "--keys", str(keys))
    assert code == 0 and one_line(out).startswith("up to date: "), out
    code, out = invoke(
        "query",
        "--remote",
        url,
        "--log-key",
        site.vkey,
        "--cache",
        str(tmp_path / "c"),
        "SELECT count(DISTINCT step) FROM metrics",
    )
    assert code == 0 and "170" in out, out


def test_publish_to_s3_refuses_bad_credentials_and_a_missing_bucket(
    s3: S3Server, site: Site, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site.add(10)
    keys = ["--ledger", str(site.root), "--keys", str(tmp_path / "keys")]
    code, out = invoke("publish", "s3://no-such-bucket/log", *keys)
    assert code == 1 and one_line(out).endswith(f"no such bucket at {s3.env['AWS_ENDPOINT_URL']}"), out
    bucket = s3.new_bucket()
    with monkeypatch.context() as env:
        env.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
        code, out = invoke("publish", f"s3://{bucket}/log", *keys)
    assert code == 1 and "refused the credentials" in one_line(out), out
    assert not list((s3.folder / "buckets" / bucket).iterdir())  # nothing written
    code, out = invoke("publish", "ftp://host/log", *keys)
    assert code == 2 and "s3://bucket/prefix" in one_line(out), out


class _DyingDest(S3Dest):
    """The real bucket, whose server is stopped (scripts/s3.sh stop) after ``after`` uploads."""

    def __init__(self, url: str, server: S3Server, after: int) -> None:
        super().__init__(url)
        self.server, self.after = server, after

    def put_file(self, rel: str, source: Path) -> None:
        if self.after == 0:
            self.server.stop()
        self.after -= 1
        super().put_file(rel, source)


def test_a_publish_cut_short_by_a_dead_server_is_finished_by_the_next(
    s3: S3Server, site: Site, tmp_path: Path
) -> None:
    url = f"s3://{s3.new_bucket()}/log"
    site.add(300)
    try:
        with pytest.raises(DestError, match="unreachable"):
            runledger.ledger.publish.publish(site.root, _DyingDest(url, s3, after=5), site.skey)
    finally:
        s3.start()  # the same folder: the same port, keys and objects
    assert not S3Dest(url).exists("checkpoint")  # the checkpoint goes last: none yet
    keys = ["--ledger", str(site.root), "--keys", str(tmp_path / "keys")]
    code, out = invoke("publish", url, *keys)
    assert code == 0 and "finished the upload an earlier publish left half done" in out, out
    code, out = invoke("verify", "--remote", url, "--log-key", site.vkey, "--state", str(tmp_path / "v.json"))
    assert code == 0 and out.startswith("OK runledger/pub-test"), out
