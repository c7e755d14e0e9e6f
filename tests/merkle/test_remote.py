"""A published copy checked by anyone with its URL: `ledger verify --remote` (only what is new),
offline C2SP tlog-proof proofs, and `ledger query --remote` over a verified download. A real
http.server on 127.0.0.1 serves the copy; it counts what it sends, so "only what is new" is measured."""

from __future__ import annotations

import base64
import contextlib
import functools
import http.server
import json
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ledger.tiles import entries_path
from runledger.schemas.note import write_keypair
from tests.merkle.test_publish import Site

ENV = {"COLUMNS": "300"}


class Served:
    """The site's DEST on a real HTTP server that counts the requests and bytes it answers."""

    def __init__(self) -> None:
        self.url = ""
        self.requests: list[str] = []
        self.bytes_sent = 0

    def reset(self) -> None:
        self.requests.clear()
        self.bytes_sent = 0


class _CountingHandler(http.server.SimpleHTTPRequestHandler):
    served: Served

    def log_message(self, format: str, *args: object) -> None:
        pass

    def copyfile(self, source, outputfile) -> None:  # type: ignore[no-untyped-def]
        data = source.read()
        self.served.requests.append(self.path)
        self.served.bytes_sent += len(data)
        outputfile.write(data)


@contextlib.contextmanager
def _serving(folder: Path) -> Iterator[Served]:
    folder.mkdir(parents=True, exist_ok=True)
    served = Served()
    handler_class = type("Handler", (_CountingHandler,), {"served": served})
    handler = functools.partial(handler_class, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    served.url = f"http://127.0.0.1:{server.server_address[1]}/"
    try:
        yield served
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture()
def site(tmp_path: Path) -> Site:
    return Site(tmp_path)


@pytest.fixture()
def served(site: Site) -> Iterator[Served]:
    with _serving(site.dest) as s:
        yield s


def _verify(served: Served, key: str, state: Path) -> tuple[int, str]:
    args = ["verify", "--remote", served.url, "--log-key", key, "--state", str(state)]
    result = CliRunner().invoke(app, args, env=ENV)
    return result.exit_code, result.output


def _flipped(path: Path, pos: int) -> bytes:
    good = path.read_bytes()
    path.write_bytes(good[:pos] + bytes([good[pos] ^ 0x01]) + good[pos + 1 :])
    return good


# ------------------------------------------------------------------------ ledger verify --remote


def test_verify_remote_checks_only_what_is_new(served: Served, site: Site, tmp_path: Path) -> None:
    state = tmp_path / "remote.json"
    site.add(300)
    first = site.publish()
    code, out = _verify(served, site.vkey, state)
    assert code == 0 and f"size {first.size}; {first.size} new entries" in out and "from nothing" in out, out
    whole = served.bytes_sent
    # Nothing new: the checkpoint, and nothing else.
    served.reset()
    code, out = _verify(served, site.vkey, state)
    assert code == 0 and "nothing new" in out, out
    assert served.requests == ["/checkpoint"]
    # After more ingest and a publish: only the new entries, their tiles and the new data files.
    site.add(20)
    grown = site.publish()
    served.reset()
    code, out = _verify(served, site.vkey, state)
    new = grown.size - first.size
    assert code == 0 and f"{new} new entries and {grown.files_copied} data files checked" in out, out
    assert f"since size {first.size}" in out
    assert not any(r.startswith("/tile/entries/000") for r in served.requests)  # the old full bundle
    assert served.bytes_sent < whole / 3, (served.bytes_sent, whole)
    assert json.loads(state.read_text())["size"] == grown.size


@pytest.mark.parametrize("what", ["tile", "bundle", "data"])
def test_verify_remote_refuses_a_flipped_byte(served: Served, site: Site, tmp_path: Path, what: str) -> None:
    site.add(300)
    site.publish()
    size = site.checkpoint()[0]
    manifest = json.loads((site.dest / "manifest.json").read_text())
    data = max((f for f in manifest["files"] if f["table"] == "events"), key=lambda f: f["bytes"])
    rel = {"tile": "tile/0/000", "bundle": entries_path(size // 256, size % 256), "data": data["path"]}[what]
    _flipped(site.dest / rel, 40)
    code, out = _verify(served, site.vkey, tmp_path / "remote.json")
    lines = [line for line in out.splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1 and lines[0].startswith("error: FAILED"), out
    assert {"tile": "bad-entries", "bundle": "bad-entries", "data": "bad-data"}[what] in out
    assert not (tmp_path / "remote.json").exists()  # a refused copy is never remembered


def test_verify_remote_refuses_a_wrong_key(served: Served, site: Site, tmp_path: Path) -> None:
    site.add(30)
    site.publish()
    other = write_keypair(tmp_path / "k2", "runledger-log")[1]
    code, out = _verify(served, str(other), tmp_path / "remote.json")
    assert code == 1 and "bad-signature" in out, out
    code, out = _verify(served, "not-a-key", tmp_path / "remote.json")
    assert code == 2 and "bad key" in out, out
    result = CliRunner().invoke(app, ["verify", "--remote", served.url], env=ENV)
    assert result.exit_code == 2 and "--log-key" in result.output


def test_verify_remote_given_a_path_says_so_in_one_line(site: Site, tmp_path: Path) -> None:
    """A folder path where a URL is wanted (urllib's ValueError was a traceback); file:// reads it."""
    site.add(5)
    site.publish()
    key = site.vkey
    args = ["verify", "--remote", str(site.dest), "--log-key", key, "--state", str(tmp_path / "s.json")]
    result = CliRunner().invoke(app, args, env=ENV)
    assert result.exit_code == 1, result.output
    assert result.output.strip().splitlines() == [
        f"error: FAILED unreachable: {site.dest}/checkpoint: not a URL: "
        "give http://, https://, file:///path or s3://bucket/prefix"
    ]
    args[2] = f"file://{site.dest}"
    assert CliRunner().invoke(app, args, env=ENV).output.startswith("OK ")


# ------------------------------------------------------------------------ offline tlog-proof


def _b64_flip(line: str, prefix: str = "") -> str:
    raw = bytearray(base64.b64decode(line.removeprefix(prefix)))
    raw[len(raw) // 2] ^= 0x01
    return prefix + base64.b64encode(bytes(raw)).decode()


def _corruptions(text: str) -> dict[str, str]:
    """One copy of the proof per field, that field changed (and nothing else)."""
    head, _, checkpoint = text.partition("\n\n")
    lines = head.split("\n")
    cp = checkpoint.split("\n")  # origin, size, root, "", signature, ""
    out = {
        "header": "\n".join(["c2sp.org/tlog-proof@v2", *lines[1:]]) + "\n\n" + checkpoint,
        "extra": "\n".join([lines[0], _b64_flip(lines[1], "extra "), *lines[2:]]) + "\n\n" + checkpoint,
        "no extra": "\n".join([lines[0], *lines[2:]]) + "\n\n" + checkpoint,
        "index+1": "\n".join([*lines[:2], f"index {int(lines[2][6:]) + 1}", *lines[3:]])
        + "\n\n"
        + checkpoint,
        "index leading zero": "\n".join([*lines[:2], "index 0" + lines[2][6:], *lines[3:]])
        + "\n\n"
        + checkpoint,
        "a hash dropped": "\n".join(lines[:-1]) + "\n\n" + checkpoint,
        "a hash added": "\n".join([*lines, lines[-1]]) + "\n\n" + checkpoint,
        "a short hash": "\n".join([*lines[:-1], base64.b64encode(b"x" * 31).decode()]) + "\n\n" + checkpoint,
        "checkpoint origin": head + "\n\n" + "\n".join([cp[0] + "x", *cp[1:]]),
        "checkpoint size": head + "\n\n" + "\n".join([cp[0], str(int(cp[1]) + 1), *cp[2:]]),
        "checkpoint root": head + "\n\n" + "\n".join([*cp[:2], _b64_flip(cp[2]), *cp[3:]]),
        "checkpoint signature": head + "\n\n" + "\n".join([*cp[:4], cp[4][:-8] + "AAAAAAA=", *cp[5:]]),
        "no blank line": head + "\n" + checkpoint,
    }
    for n in range(3, len(lines)):
        out[f"hash {n - 2}"] = (
            "\n".join([*lines[:n], _b64_flip(lines[n]), *lines[n + 1 :]]) + "\n\n" + checkpoint
        )
    return out


def test_tlog_proof_is_checked_offline_and_every_corrupted_field_is_refused(
    site: Site, tmp_path: Path
) -> None:
    site.add(300)
    site.publish()
    proof, leaf = tmp_path / "e.tlog-proof", tmp_path / "leaf.json"
    event_id = json.loads(site.run.events[150])["id"]
    made = CliRunner().invoke(
        app,
        [
            "prove",
            "inclusion",
            event_id,
            "--ledger",
            str(site.root),
            "--format",
            "tlog-proof",
            "--published",
            str(site.dest),
            "-o",
            str(proof),
            "--leaf-out",
            str(leaf),
            "--salt-out",
            str(tmp_path / "salt.hex"),
        ],
        env=ENV,
    )
    assert made.exit_code == 0, made.output
    text = proof.read_text()
    assert text.startswith("c2sp.org/tlog-proof@v1\nextra ") and "\nindex 15" in text
    assert text.endswith((site.dest / "checkpoint").read_text())  # the checkpoint, verbatim
    check = ["verify-proof", str(proof), "--log-key", site.vkey, "--origin", "runledger/pub-test"]
    without = CliRunner().invoke(app, [*check, "--leaf", str(leaf)], env=ENV)  # the salt is needed
    assert without.exit_code == 1 and "not the event" in without.output
    check = [*check, "--salt", str(tmp_path / "salt.hex")]
    ok = CliRunner().invoke(app, [*check, "--leaf", str(leaf)], env=ENV)
    assert ok.exit_code == 0 and f"event {event_id}" in ok.output, ok.output
    corruptions = _corruptions(text)
    assert len([k for k in corruptions if k.startswith("hash ")]) >= 8  # an audit path of 300 leaves
    for field, bad in corruptions.items():
        proof.write_text(bad)
        result = CliRunner().invoke(app, check, env=ENV)
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert result.exit_code == 1 and len(lines) == 1 and "FAILED" in lines[0], (field, result.output)
    proof.write_text(text)
    other = write_keypair(tmp_path / "k4", "runledger-log")[1]
    wrong_key = CliRunner().invoke(app, ["verify-proof", str(proof), "--log-key", str(other)], env=ENV)
    assert wrong_key.exit_code == 1 and "FAILED" in wrong_key.output
    leaf.write_bytes(leaf.read_bytes().replace(b'"', b" ", 1))
    wrong_leaf = CliRunner().invoke(app, [*check, "--leaf", str(leaf)], env=ENV)
    assert wrong_leaf.exit_code == 1 and "not the event" in wrong_leaf.output
    unpublished = CliRunner().invoke(
        app, ["prove", "inclusion", event_id, "--ledger", str(site.root), "--format", "tlog-proof"], env=ENV
    )
    assert unpublished.exit_code == 2 and "--published" in unpublished.output


# ------------------------------------------------------------------------ ledger query --remote


def _query(served: Served, site: Site, cache: Path, sql: str, key: str | None = None) -> tuple[int, str]:
    args = ["query", "--remote", served.url, "--log-key", key or site.vkey, "--cache", str(cache), sql]
    result = CliRunner().invoke(app, [*args, "--format", "json"], env=ENV)
    return result.exit_code, result.output


def test_query_remote_answers_over_a_verified_download(served: Served, site: Site, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    site.add(140)
    site.add(60)
    site.publish()
    size, root = site.checkpoint()
    sql = "SELECT count(*) AS n FROM events WHERE stream_type = 'run'"
    code, out = _query(served, site, cache, sql)
    assert code == 0 and '"n": 201' in out, out
    assert f"checkpoint size {size} root {base64.b64encode(root).decode()}" in out
    # Again: nothing downloaded (the cached files' digests are rechecked); then only the new files.
    served.reset()
    code, out = _query(served, site, cache, sql)
    assert (
        code == 0 and "0 files downloaded" in out and not any(r.startswith("/data/") for r in served.requests)
    )
    site.add(30)
    grown = site.publish()
    code, out = _query(served, site, cache, sql)
    assert code == 0 and '"n": 231' in out and f"{grown.files_copied} files downloaded" in out, out
    # The same walls as a local ledger: writes and reads outside the copy are refused.
    code, out = _query(served, site, cache, "COPY (SELECT 1) TO 'x.csv'")
    assert code == 1 and "error" in out
    code, out = _query(served, site, cache, "SELECT * FROM read_text('/etc/passwd')")
    assert code == 1 and "error" in out
    # A changed data file, a changed manifest, or the wrong key: refused, nothing answered.
    manifest = json.loads((site.dest / "manifest.json").read_text())
    newest = max((f for f in manifest["files"] if f["table"] == "events"), key=lambda f: f["path"])
    good = _flipped(site.dest / newest["path"], 100)
    code, out = _query(served, site, tmp_path / "cache2", sql)
    assert code == 1 and "SHA-256" in out and '"n"' not in out, out
    (site.dest / newest["path"]).write_bytes(good)
    good = _flipped(site.dest / "manifest.json", 10)
    code, out = _query(served, site, cache, sql)
    assert code == 1 and "manifest" in out, out
    (site.dest / "manifest.json").write_bytes(good)
    other = write_keypair(tmp_path / "k5", "runledger-log")[1]
    code, out = _query(served, site, cache, sql, key=str(other))
    assert code == 1 and "signature" in out, out


# ------------------------------------------------------------------------ a tlog-proof reader nobody here wrote

GO_PROOF_DIR = Path(__file__).resolve().parent / "go_proof"
GO_HOME = Path(__file__).resolve().parents[2] / ".go"  # shared with test_publish's Go builds (ignored by git)


@pytest.fixture(scope="session")
def goproof() -> Path:
    if shutil.which("go") is None:
        pytest.skip("needs the Go toolchain (go) to build the tlog-proof checker")
    binary = GO_HOME / "bin" / "goproof"
    env = os.environ | {
        "GOPATH": str(GO_HOME / "path"),
        "GOMODCACHE": str(GO_HOME / "mod"),
        "GOCACHE": str(GO_HOME / "cache"),
        "GOFLAGS": "-modcacherw",
    }
    built = subprocess.run(
        ["go", "build", "-o", str(binary), "."],
        cwd=GO_PROOF_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if built.returncode != 0:
        pytest.fail(f"go build of tests/merkle/go_proof failed:\n{built.stderr[-3000:]}")
    return binary


def test_go_reads_and_checks_the_tlog_proof(goproof: Path, site: Site, tmp_path: Path) -> None:
    """transparency-dev/formats' tlog-proof parser, x/mod's note and tlog check our proof unchanged."""
    site.add(300)
    site.publish()
    event_id = json.loads(site.run.events[200])["id"]
    proof = tmp_path / "e.tlog-proof"
    made = CliRunner().invoke(
        app,
        [
            "prove",
            "inclusion",
            event_id,
            "--ledger",
            str(site.root),
            "--format",
            "tlog-proof",
            "--published",
            str(site.dest),
            "-o",
            str(proof),
        ],
        env=ENV,
    )
    assert made.exit_code == 0, made.output

    def go() -> subprocess.CompletedProcess[str]:
        args = [str(goproof), "-proof", str(proof), "-vkey", site.vkey, "-origin", "runledger/pub-test"]
        return subprocess.run(args, capture_output=True, text=True, timeout=60)

    ok = go()
    assert ok.returncode == 0, ok.stderr
    summary = json.loads(ok.stdout)
    assert summary["entry"]["id"] == event_id and summary["size"] == site.checkpoint()[0]
    text = proof.read_text()
    corruptions = _corruptions(text)
    for field in [
        "extra",
        "index+1",
        "a hash dropped",
        "hash 1",
        "hash 5",
        "checkpoint root",
        "checkpoint signature",
    ]:
        proof.write_text(corruptions[field])
        assert go().returncode == 1, field


def test_query_remote_names_the_addresses_it_reads(served: Served, site: Site, tmp_path: Path) -> None:
    """An address that is neither HTTP(S) nor S3 is one line; http.server (no Range) still serves the
    verified download, which never needs Range."""
    site.add(10)
    site.publish()
    code, out = _query(served, site, tmp_path / "cache", "SELECT count(*) AS n FROM runs")
    assert code == 0 and '"n": 1' in out, out
    for address in ("ftp://127.0.0.1/log", "file:///etc", "/just/a/folder"):
        args = ["query", "--remote", address, "--log-key", site.vkey, "--cache", str(tmp_path / "c")]
        result = CliRunner().invoke(app, [*args, "SELECT 1"], env=ENV)
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert result.exit_code == 1 and lines == [
            f"error: REFUSED --remote {address!r}: give an http://, https:// or s3://bucket/prefix address"
        ], result.output
