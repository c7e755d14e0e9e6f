"""The doors of a published copy (issue 40): a reader takes only what it expects. Each test goes
through the real entrance (the `ledger` CLI, or the library function it calls) against a real HTTP
server on 127.0.0.1 in a thread: manifest paths outside the cache or outside the allow-list, a body
longer than the manifest says, a server that drips, a redirect to another server, a manifest of the
wrong shape, and a copy rolled back under the same URL."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import http.server
import json
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.cli.output import DEFAULT_FETCH_TIMEOUT_S
from runledger.ledger import publish as publish_mod
from runledger.ledger.live_page import PublishedWatch
from runledger.ledger.monitor import DEFAULT_DEADLINE_S, MonitorError, check_manifest_path
from runledger.ledger.remote import RemoteError, fetch_copy
from runledger.schemas.note import parse_private_key
from tests.merkle.test_publish import Site

ENV = {"COLUMNS": "300"}
MAX_SENT_BYTES = 64 << 20  # an endless body stops here at the latest (the test's own bound)
DRIP_EVERY_S = 0.25
TEST_BOUND_S = 60.0  # a generous bound on a deadline test itself, never a speed claim


# --------------------------------------------------------------------------------- a server with doors


@dataclass
class Doors:
    """What the server does besides serving its folder: paths whose body never ends, paths that
    drip one byte at a time, and a redirect rule (path -> URL, or None)."""

    endless: set[str] = field(default_factory=set)
    drip: set[str] = field(default_factory=set)
    redirect: Callable[[str], str | None] = lambda path: None
    bytes_sent: int = 0
    stop: threading.Event = field(default_factory=threading.Event)


class _Handler(http.server.SimpleHTTPRequestHandler):
    doors: Doors

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        target = self.doors.redirect(self.path)
        if target is not None:
            self.send_response(302)
            self.send_header("Location", target)
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path.lstrip("/") in self.doors.endless:
            self._send_forever()
        elif self.path.lstrip("/") in self.doors.drip:
            self._drip()
        else:
            super().do_GET()

    def _send_forever(self) -> None:
        self.send_response(200)
        self.end_headers()  # no length: the body ends when the server says so
        block = b"\0" * (64 << 10)
        with contextlib.suppress(OSError):
            while self.doors.bytes_sent < MAX_SENT_BYTES and not self.doors.stop.is_set():
                self.wfile.write(block)
                self.doors.bytes_sent += len(block)
        self.close_connection = True

    def _drip(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "100000")
        self.end_headers()
        with contextlib.suppress(OSError):
            for _ in range(int(TEST_BOUND_S / DRIP_EVERY_S)):
                if self.doors.stop.wait(DRIP_EVERY_S):
                    break
                self.wfile.write(b"x")
                self.wfile.flush()
                self.doors.bytes_sent += 1
        self.close_connection = True


@contextlib.contextmanager
def serving(folder: Path, doors: Doors | None = None) -> Iterator[tuple[str, Doors]]:
    """``folder`` on a real HTTP server on 127.0.0.1 (a thread), with ``doors``."""
    doors = doors or Doors()
    handler_class = type("Handler", (_Handler,), {"doors": doors})
    handler = functools.partial(handler_class, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/", doors
    finally:
        doors.stop.set()
        server.shutdown()
        server.server_close()


# --------------------------------------------------------------------------------- copies and manifests


@pytest.fixture()
def site(tmp_path: Path) -> Site:
    site = Site(tmp_path)
    site.add(20)
    site.publish()
    return site


def _manifest(dest: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((dest / "manifest.json").read_bytes())
    return doc


def _resign(site: Site, dest: Path, manifest: bytes) -> None:
    """Replace the copy's manifest with ``manifest``, signed with the log's own key: what an
    operator who turned hostile can publish (the checkpoint is untouched)."""
    size = int((dest / "manifest.sig").read_text().split("\n")[1])
    origin = _manifest(dest)["origin"]
    signer = parse_private_key(site.skey)
    (dest / "manifest.json").write_bytes(manifest)
    (dest / "manifest.sig").write_text(publish_mod._manifest_note(origin, size, manifest, signer))


def _with_file(dest: Path, path: str, body: bytes) -> bytes:
    doc = _manifest(dest)
    entry = {"path": path, "table": "metrics", "bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    doc["files"].append(entry)
    return json.dumps(doc).encode()


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _one_line(output: str) -> str:
    assert "Traceback" not in output, output
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1, output
    return lines[0]


def _query(url: str, site: Site, cache: Path, *more: str) -> tuple[int, str]:
    args = ["query", "--remote", url, "--log-key", site.vkey, "--cache", str(cache), *more]
    result = CliRunner().invoke(app, [*args, "SELECT count(*) FROM metrics"], env=ENV)
    return result.exit_code, result.output


def _verify(url: str, site: Site, state: Path, *more: str) -> tuple[int, str]:
    args = ["verify", "--remote", url, "--log-key", site.vkey, "--state", str(state), *more]
    result = CliRunner().invoke(app, args, env=ENV)
    return result.exit_code, result.output


# --------------------------------------------------------------------------------- paths


def test_an_absolute_manifest_path_writes_nothing_outside_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A publisher turned hostile names ``data//<anywhere>/owned.sh`` in a manifest it signs and
    logs (its snapshot entry names it): query --remote, the live page's fetch and verify --remote
    refuse it, and nothing is written outside the cache."""
    outside = tmp_path / "outside"
    outside.mkdir()
    owned = outside / "owned.sh"
    body = b"#!/bin/sh\necho owned\n"
    hostile = "data/" + str(owned)  # data//…/outside/owned.sh
    real_manifest = publish_mod._manifest

    def hostile_manifest(*args: Any) -> bytes:
        doc = json.loads(real_manifest(*args))
        doc["files"].append(
            {
                "path": hostile,
                "table": "metrics",
                "bytes": len(body),
                "sha256": hashlib.sha256(body).hexdigest(),
            }
        )
        return json.dumps(doc).encode()

    monkeypatch.setattr(publish_mod, "_manifest", hostile_manifest)
    site = Site(tmp_path)
    site.add(20)
    site.publish()
    served = site.dest / "data" / str(owned).lstrip("/")  # where the server answers data//…/owned.sh
    served.parent.mkdir(parents=True)
    served.write_bytes(body)
    before = _snapshot(outside)
    with serving(site.dest) as (url, _):
        code, out = _query(url, site, tmp_path / "cache")
        assert code == 1 and "manifest path" in _one_line(out) and "empty segment" in out, out
        watch = PublishedWatch(url, site.vkey, tmp_path / "page-cache", poll_s=60.0)
        watch._open()
        assert watch.refused is not None and "manifest path" in watch.refused, watch.refused
        code, out = _verify(url, site, tmp_path / "verify.json")
        assert code == 1 and "FAILED bad-manifest: manifest path" in _one_line(out), out
    assert _snapshot(outside) == before == {} and not owned.exists()


@pytest.mark.parametrize(
    "path",
    [
        "data/metrics/run_id=a/../../../escaped.parquet",
        "data/metrics/run_id=a\\..\\..\\x.parquet",
        "data/metrics//part-1.parquet",
        "data//metrics/run_id=a/part-1.parquet",
        "data/nosuch/run_id=a/part-1.parquet",
        "data/metrics/run_id=a b/part-1.parquet",
        "data/metrics/run_id=ä/part-1.parquet",
        "data/metrics/run_id=a/part-1.sh",
        "data/metrics/stream_type=run/part-1.parquet",
        "data/metrics/run_id=a/x/part-1.parquet",
        "data/metrics/run_id=*/part-1.parquet",
        "checkpoint",
    ],
)
def test_query_remote_refuses_a_path_outside_the_allow_list(site: Site, tmp_path: Path, path: str) -> None:
    body = b"PAR1 not really"
    _resign(site, site.dest, _with_file(site.dest, path, body))
    with serving(site.dest) as (url, _), pytest.raises(RemoteError, match="manifest path") as refused:
        fetch_copy(url, site.vkey, tmp_path / "cache")
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").rglob("*.parquet"))
    with pytest.raises(MonitorError, match="bad-manifest"):  # verify --remote's check: the same one
        check_manifest_path(path)


def test_the_paths_a_publish_writes_pass_the_allow_list(site: Site) -> None:
    paths = [item["path"] for item in _manifest(site.dest)["files"]]
    assert paths
    for path in paths:
        check_manifest_path(path)
    check_manifest_path("data/metrics/run_id=a%2Fb/ducklake-0190f5e2-7c1a-7000-8000-000000000000.parquet")
    check_manifest_path("data/quarantine/day=2026-01-02/part-0000000001-x001.parquet")


# --------------------------------------------------------------------------------- bounded downloads


def _first_data_file(dest: Path) -> dict[str, Any]:
    item: dict[str, Any] = _manifest(dest)["files"][0]
    return item


def test_an_endless_body_stops_at_the_manifest_bytes(site: Site, tmp_path: Path) -> None:
    item = _first_data_file(site.dest)
    cache = tmp_path / "cache"
    with serving(site.dest, Doors(endless={item["path"]})) as (url, doors):
        with pytest.raises(
            RemoteError, match=f"longer than its {item['bytes']} bytes in the signed manifest"
        ):
            fetch_copy(url, site.vkey, cache)
        # Stopped at once: the server sent at most a few socket buffers past the promise, not 64 MiB.
        assert doors.bytes_sent < MAX_SENT_BYTES
        on_disk = sum(
            p.stat().st_size for p in cache.rglob("*") if p.is_file() and p.suffix in {".parquet", ".part"}
        )
        assert on_disk <= sum(i["bytes"] for i in _manifest(site.dest)["files"])
        assert not list(cache.rglob("*.part"))
        code, out = _query(url, site, tmp_path / "cli-cache")
        assert code == 1 and "longer than its" in _one_line(out), out
        code, out = _verify(url, site, tmp_path / "verify.json")
        assert code == 1 and "FAILED bad-data:" in _one_line(out) and "longer than its" in out, out


def test_a_dripping_server_is_cut_off_at_the_deadline(site: Site, tmp_path: Path) -> None:
    began = time.monotonic()
    with serving(site.dest, Doors(drip={"checkpoint"})) as (url, _):
        with pytest.raises(RemoteError, match=r"2 s deadline") as refused:
            fetch_copy(url, site.vkey, tmp_path / "cache", deadline_s=2.0)
        assert url + "checkpoint" in str(refused.value)
        code, out = _verify(url, site, tmp_path / "verify.json", "--fetch-timeout", "2")
        assert code == 1 and f"{url}checkpoint: not done within the 2 s deadline" in _one_line(out), out
    assert time.monotonic() - began < TEST_BOUND_S


def test_a_dripping_data_file_is_cut_off_by_verify_remote(site: Site, tmp_path: Path) -> None:
    item = _first_data_file(site.dest)
    with serving(site.dest, Doors(drip={item["path"]})) as (url, _):
        code, out = _verify(url, site, tmp_path / "verify.json", "--fetch-timeout", "2")
    assert code == 1 and "not done within the 2 s deadline" in _one_line(out) and item["path"] in out, out


def test_a_fetch_timeout_that_is_not_a_positive_number_is_refused(site: Site, tmp_path: Path) -> None:
    code, out = _verify("http://127.0.0.1:9/", site, tmp_path / "verify.json", "--fetch-timeout", "0")
    assert code == 2 and "--fetch-timeout" in _one_line(out), out
    args = [
        "serve",
        "page",
        "--remote",
        "http://127.0.0.1:9/",
        "--log-key",
        site.vkey,
        "--fetch-timeout",
        "-1",
    ]
    result = CliRunner().invoke(app, args, env=ENV)
    assert result.exit_code == 2 and "--fetch-timeout" in _one_line(result.output), result.output
    assert DEFAULT_FETCH_TIMEOUT_S == DEFAULT_DEADLINE_S  # the CLI's default is the library's


# --------------------------------------------------------------------------------- redirects


def test_a_redirect_to_another_origin_is_refused(site: Site, tmp_path: Path) -> None:
    with contextlib.ExitStack() as stack:
        real, _ = stack.enter_context(serving(site.dest))
        url, _ = stack.enter_context(serving(tmp_path, Doors(redirect=lambda path: real + path.lstrip("/"))))
        with pytest.raises(RemoteError, match="redirects to another origin") as refused:
            fetch_copy(url, site.vkey, tmp_path / "cache")
        assert "\n" not in str(refused.value)
        code, out = _verify(url, site, tmp_path / "verify.json")
        assert code == 1 and "redirects to another origin" in _one_line(out), out
    assert not (tmp_path / "cache").exists()


def test_a_redirect_on_the_same_origin_is_followed(site: Site, tmp_path: Path) -> None:
    def moved(path: str) -> str | None:
        return "/" + path.removeprefix("/old/") if path.startswith("/old/") else None

    with serving(site.dest, Doors(redirect=moved)) as (url, _):
        copy = fetch_copy(url + "old/", site.vkey, tmp_path / "cache")
        assert copy.downloaded == len(_manifest(site.dest)["files"])
        code, out = _verify(url + "old/", site, tmp_path / "verify.json")
        assert code == 0 and out.startswith("OK"), out


# --------------------------------------------------------------------------------- malformed manifests


def _first(doc: dict[str, Any], **changes: Any) -> bytes:
    doc["files"][0].update(changes)
    return json.dumps(doc).encode()


MALFORMED: dict[str, Callable[[dict[str, Any]], bytes]] = {
    "not JSON": lambda doc: b'{"files": [',
    "not UTF-8": lambda doc: b"\xff\xfe{}",
    "a list": lambda doc: b"[]",
    "files not a list": lambda doc: json.dumps(doc | {"files": {"a": 1}}).encode(),
    "a file not an object": lambda doc: json.dumps(doc | {"files": ["data/x"]}).encode(),
    "path a number": lambda doc: _first(doc, path=7),
    "sha256 a number": lambda doc: _first(doc, sha256=7),
    "sha256 not hex": lambda doc: _first(doc, sha256="zz" * 32),
    "sha256 too short": lambda doc: _first(doc, sha256="ab" * 16),
    "bytes a string": lambda doc: _first(doc, bytes="12"),
    "bytes negative": lambda doc: _first(doc, bytes=-1),
    "bytes missing": lambda doc: json.dumps(
        doc | {"files": [{k: v for k, v in doc["files"][0].items() if k != "bytes"}]}
    ).encode(),
    "a path twice": lambda doc: json.dumps(doc | {"files": [doc["files"][0]] * 2}).encode(),
}


@pytest.mark.parametrize("what", sorted(MALFORMED))
def test_a_malformed_manifest_is_one_line(site: Site, tmp_path: Path, what: str) -> None:
    _resign(site, site.dest, MALFORMED[what](_manifest(site.dest)))
    with serving(site.dest) as (url, _):
        code, out = _query(url, site, tmp_path / "cache")
    assert code == 1 and "bad-manifest" in _one_line(out), out


def test_verify_remote_says_a_malformed_logged_manifest_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manifest the log's snapshot entry names is not of the manifest's shape."""
    monkeypatch.setattr(publish_mod, "_manifest", lambda *args: b'{"origin": "x", "files": 3}')
    site = Site(tmp_path)
    site.add(5)
    site.publish()
    with serving(site.dest) as (url, _):
        code, out = _verify(url, site, tmp_path / "verify.json")
    assert code == 1 and "FAILED bad-manifest: manifest.json is not an object with a list" in _one_line(
        out
    ), out


def test_a_malformed_checkpoint_is_one_line(site: Site, tmp_path: Path) -> None:
    (site.dest / "checkpoint").write_bytes(b"\xff\x00 not a note")
    with serving(site.dest) as (url, _):
        code, out = _query(url, site, tmp_path / "cache")
        assert code == 1 and "bad signature" in _one_line(out), out
        code, out = _verify(url, site, tmp_path / "verify.json")
        assert code == 1 and "FAILED bad-signature" in _one_line(out), out


# --------------------------------------------------------------------------------- rollback


def test_query_remote_refuses_a_rolled_back_copy(site: Site, tmp_path: Path) -> None:
    """Publish, keep that copy, publish more, query; then serve the older copy at the same URL:
    query --remote refuses it, as verify --remote and monitor do."""
    older = tmp_path / "older"
    shutil.copytree(site.dest, older)
    site.add(10)
    site.publish()
    served = tmp_path / "served"
    shutil.copytree(site.dest, served)
    cache = tmp_path / "cache"
    with serving(served) as (url, _):
        code, out = _query(url, site, cache)
        assert code == 0, out
        shutil.rmtree(served)
        shutil.copytree(older, served)
        code, out = _query(url, site, cache)
        assert code == 1 and "rollback: the log shrank" in _one_line(out), out
        with pytest.raises(RemoteError, match="rollback"):
            fetch_copy(url, site.vkey, cache)  # refused again: the trusted checkpoint stays


@pytest.mark.parametrize("what", ["tile", "bundle"])
def test_a_malformed_tile_or_bundle_is_one_line(site: Site, tmp_path: Path, what: str) -> None:
    """verify --remote walks the tiles and the entry bundles: garbage in either is one line."""
    folder = "tile/0" if what == "tile" else "tile/entries"
    target = sorted(p for p in (site.dest / folder).rglob("*") if p.is_file())[0]
    target.write_bytes(b"garbage")
    with serving(site.dest) as (url, _):
        code, out = _verify(url, site, tmp_path / "verify.json")
    assert code == 1 and "FAILED" in _one_line(out), out
