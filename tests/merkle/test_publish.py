"""`ledger publish`: one C2SP tlog-tiles log for the whole ledger, incremental, kill-safe, never
inconsistent; read back by Python and by a Go verifier built on torchwood that nobody here wrote."""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import http.server
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ledger import publish as publish_mod
from runledger.ledger.log_checkpoint import parse_and_verify_checkpoint
from runledger.ledger.merkle import verify_consistency
from runledger.ledger.publish import PublishError, log_origin, publish
from runledger.ledger.publish_dest import FolderDest
from runledger.ledger.query import Reader
from runledger.ledger.store import Ledger, SourceRecord
from runledger.ledger.tiles import (
    consistency_proof_from_tiles,
    entries_path,
    parse_tile_path,
    tile_path,
    walk_entries,
)
from runledger.ledger.witness import load_policy, parse_cosignature_key, verify_cosignatures
from runledger.schemas.note import open_note, write_keypair
from tests.support.factory import RunBuilder

REPO_ROOT = Path(__file__).resolve().parents[2]
GO_DIR = REPO_ROOT / "tests" / "merkle" / "go_verify"
GO_HOME = REPO_ROOT / ".go"  # module cache and build cache, kept between runs (ignored by git)


class Site:
    """A ledger, its log key and a DEST folder."""

    def __init__(self, tmp: Path, key_name: str = "runledger-log") -> None:
        self.root = tmp / "ledger"
        self.dest = tmp / "site"
        self.ledger = Ledger.create(self.root, ledger_id="pub-test")
        private, public = write_keypair(tmp / "keys", key_name)
        self.skey, self.vkey = private.read_text().strip(), public.read_text().strip()
        self.run = RunBuilder()
        self.position = 0

    def add(self, steps: int) -> None:
        first = len(self.run.events)
        if not first:
            self.run.start()
        for step in range(first + 1, first + 1 + steps):
            self.run.step(step)
        new = self.run.events[first:]
        self.ledger.commit([SourceRecord("spool:t", self.position + i, raw) for i, raw in enumerate(new)])
        self.position += len(new)

    def publish(self) -> publish_mod.PublishResult:
        return publish(self.root, self.dest, self.skey)

    def read_tile(self, level: int, index: int, width: int) -> bytes:
        return (self.dest / tile_path(level, index, width)).read_bytes()

    def read_bundle(self, index: int, width: int) -> bytes:
        return (self.dest / entries_path(index, width)).read_bytes()

    def checkpoint(self) -> tuple[int, bytes]:
        cp = parse_and_verify_checkpoint(
            (self.dest / "checkpoint").read_text(), self.vkey, log_origin("pub-test")
        )
        return cp.size, cp.root

    def entries(self) -> list[dict]:
        size, root = self.checkpoint()
        return [json.loads(e) for e in walk_entries(self.read_tile, self.read_bundle, size, root)]

    def files(self) -> dict[str, bytes]:
        return {
            str(p.relative_to(self.dest)): p.read_bytes() for p in sorted(self.dest.rglob("*")) if p.is_file()
        }


@pytest.fixture()
def site(tmp_path: Path) -> Site:
    return Site(tmp_path)


def test_publish_writes_one_tile_log_of_every_event(site: Site) -> None:
    site.add(140)
    site.add(200)  # 341 events in 2 commits: a full tile and a partial one
    result = site.publish()
    entries = site.entries()
    assert result.size == len(entries) == 341 + 2 + 1 and result.events == 341
    assert [e["t"] for e in entries].count("commit") == 2 and entries[-1]["t"] == "snapshot"
    stored = {
        (r["stream"], r["stream_seq"]): r["canonical"]
        for r in Reader(site.root).sql("SELECT stream, stream_seq, canonical FROM events").records()
    }
    salts = {}
    for path in (site.dest / "data" / "salts").rglob("*.parquet"):  # the published copies
        t = pq.read_table(path)
        keys = zip(t["stream"].to_pylist(), t["stream_seq"].to_pylist(), strict=True)
        salts |= dict(zip(keys, t["salt"].to_pylist(), strict=True))
    events = [e for e in entries if e["t"] == "event"]
    assert [(e["stream"], e["stream_seq"]) for e in events] == sorted(stored)  # ledger order
    for e in events:
        key = (e["stream"], e["stream_seq"])
        assert "sha256" not in e  # salted (docs/publish.md; tests/merkle/test_redaction.py)
        assert e["salted_sha256"] == hashlib.sha256(salts[key] + stored[key].encode()).hexdigest()
        assert len(json.dumps(e)) < 65536
    # The signed manifest names every data file with its bytes and digest, and the log names it.
    manifest = (site.dest / "manifest.json").read_bytes()
    text = open_note((site.dest / "manifest.sig").read_text(), site.vkey)
    assert text.split("\n")[2] == base64.b64encode(hashlib.sha256(manifest).digest()).decode()
    assert entries[-1]["manifest_sha256"] == hashlib.sha256(manifest).hexdigest()
    doc = json.loads(manifest)
    for f in doc["files"]:
        data = (site.dest / f["path"]).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (f["bytes"], f["sha256"])
    event_files = [f for f in doc["files"] if f["table"] == "events" and f["leaf_range"]]
    assert sorted(f["leaf_range"] for f in event_files) == [[0, 140], [142, 341]]
    for path in site.files():
        if path.startswith("tile/"):
            parse_tile_path(path)  # canonical C2SP paths only
    # DuckDB reads the published copy through its views.sql, nothing else.
    views = duckdb.connect()
    with contextlib.chdir(site.dest):
        views.execute((site.dest / "views.sql").read_text())
        assert views.execute("SELECT count(*) FROM events WHERE stream_type = 'run'").fetchall() == [(341,)]


def test_publish_is_incremental_and_idempotent(site: Site) -> None:
    site.add(300)
    first = site.publish()
    before = site.files()
    again = site.publish()
    assert again.entries == 0 and site.files() == before  # nothing new: nothing touched
    old_size, old_root = site.checkpoint()
    site.add(5)
    grown = site.publish()
    assert (grown.old_size, grown.entries, grown.events) == (first.size, 5 + 1 + 1, 5)
    after = site.files()
    for path, data in before.items():  # full tiles and old partial tiles stay byte for byte
        if path.startswith("tile/"):
            assert after[path] == data, path
    size, root = site.checkpoint()
    proof = consistency_proof_from_tiles(site.read_tile, old_size, size)
    verify_consistency(old_size, size, old_root, root, proof)
    assert len(site.entries()) == size


def test_publish_in_groups_writes_the_log_one_pass_writes(
    site: Site, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A publish reads and stages its commits a group at a time (bounded memory); the tiles, bundles
    and checkpoint are byte for byte those of one pass, with no partial tile of a size in between."""
    for steps in (30, 90, 7, 150, 1, 200, 60):  # commits that end inside and across tiles
        site.add(steps)
    one_pass = site.publish()
    monkeypatch.setattr(publish_mod, "EVENTS_PER_PASS", 40)  # a group per commit
    grouped = publish(site.root, tmp_path / "grouped", site.skey)
    assert (grouped.size, grouped.events) == (one_pass.size, one_pass.events)

    def tiles(dest: Path) -> dict[str, bytes]:
        return {
            p.relative_to(dest).as_posix(): p.read_bytes() for p in (dest / "tile").rglob("*") if p.is_file()
        }

    assert tiles(tmp_path / "grouped") == tiles(site.dest)
    assert (tmp_path / "grouped" / "checkpoint").read_bytes() == (site.dest / "checkpoint").read_bytes()
    # Grown in groups from a published size too.
    site.add(300)
    site.add(3)
    site.publish()
    publish(site.root, tmp_path / "grouped", site.skey)
    assert tiles(tmp_path / "grouped") == tiles(site.dest)
    assert len(site.entries()) == site.checkpoint()[0]


def test_killed_before_the_swap_publishes_nothing_and_reruns(
    site: Site, monkeypatch: pytest.MonkeyPatch
) -> None:
    site.add(50)
    site.publish()
    old = (site.dest / "checkpoint").read_bytes()
    site.add(300)

    def killed(*args: object) -> None:
        raise KeyboardInterrupt  # the process dies right before its commit point

    monkeypatch.setattr(publish_mod, "_save_state", killed)
    with pytest.raises(KeyboardInterrupt):
        site.publish()
    monkeypatch.undo()
    assert (site.dest / "checkpoint").read_bytes() == old
    result = site.publish()
    assert not result.repaired and len(site.entries()) == result.size


def test_killed_during_the_upload_is_finished_by_the_next_publish(
    site: Site, monkeypatch: pytest.MonkeyPatch
) -> None:
    site.add(50)
    site.publish()
    old = (site.dest / "checkpoint").read_bytes()
    site.add(600)
    real_put = FolderDest.put_file
    calls = {"n": 0}

    def dies_on_the_third(self: FolderDest, rel: str, source: Path) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        real_put(self, rel, source)

    monkeypatch.setattr(FolderDest, "put_file", dies_on_the_third)
    with pytest.raises(KeyboardInterrupt):
        site.publish()
    monkeypatch.undo()
    assert (site.dest / "checkpoint").read_bytes() == old  # the checkpoint goes up last
    result = site.publish()
    assert result.repaired and result.entries == 0
    size, _ = site.checkpoint()
    assert size == result.size and len(site.entries()) == size


@pytest.mark.parametrize(
    ("steps", "rel"),
    [(100, "tile/0/000.p/103"), (100, "tile/entries/000.p/103"), (300, "tile/1/000.p/1")],
)
def test_a_changed_published_file_stops_the_next_publish(site: Site, steps: int, rel: str) -> None:
    site.add(steps)
    site.publish()
    old = (site.dest / "checkpoint").read_bytes()
    _flipped(site.dest / rel, 5)
    site.add(10)
    with pytest.raises(PublishError, match=r"does not extend|not consistent|does not match"):
        site.publish()
    assert (site.dest / "checkpoint").read_bytes() == old


def test_a_dest_holding_another_log_is_refused(site: Site, tmp_path: Path) -> None:
    site.add(10)
    site.dest.mkdir()
    (site.dest / "checkpoint").write_text("someone else's log\n1\nAAAA\n")
    with pytest.raises(PublishError, match="did not publish"):
        site.publish()


def test_cli_publish(site: Site, tmp_path: Path) -> None:
    site.add(20)
    args = ["publish", str(site.dest), "--ledger", str(site.root), "--keys", str(tmp_path / "keys")]
    first = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert first.exit_code == 0, first.output
    assert "published 23 entries (21 events" in first.output
    second = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert second.exit_code == 0 and "up to date" in second.output
    # Mistakes get one line and a non-zero exit, never a traceback.
    (tmp_path / "a-file").write_text("")
    ledger = ["--ledger", str(site.root)]
    for words, code in [
        ([*args[:4], "--keys", str(tmp_path / "nokeys")], 1),
        (["publish", str(tmp_path / "a-file"), *args[2:]], 1),
        (["witness", "add", "w1", "http://127.0.0.1:9/", "not-a-key", *ledger], 1),
        (["witness", "add", "w1", "ftp://x", "w+00000000+BAAA", *ledger], 1),
        (["witness", "quorum", "3", *ledger], 1),
        (["monitor", "http://127.0.0.1:9/", "--log-key", "not-a-key"], 2),
    ]:
        result = CliRunner().invoke(app, words)
        assert result.exit_code == code, (words, result.output)
        assert result.exception is None or isinstance(result.exception, SystemExit), (words, result.exception)


# ------------------------------------------------------------------------ a Go verifier nobody here wrote


@pytest.fixture(scope="session")
def goverify() -> Path:
    if shutil.which("go") is None:
        pytest.skip("needs the Go toolchain (go) to build the torchwood verifier")
    binary = GO_HOME / "bin" / "goverify"
    env = os.environ | {
        "GOPATH": str(GO_HOME / "path"),
        "GOMODCACHE": str(GO_HOME / "mod"),
        "GOCACHE": str(GO_HOME / "cache"),
        "GOFLAGS": "-modcacherw",
    }
    built = subprocess.run(
        ["go", "build", "-o", str(binary), "."],
        cwd=GO_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if built.returncode != 0:
        pytest.fail(f"go build of tests/merkle/go_verify failed:\n{built.stderr[-3000:]}")
    return binary


@pytest.fixture()
def served(site: Site) -> Iterator[str]:
    with _serving(site.dest) as url:
        yield url


@contextlib.contextmanager
def _serving(folder: Path) -> Iterator[str]:
    folder.mkdir(parents=True, exist_ok=True)
    handler = functools.partial(_QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def _go(binary: Path, url: str, site: Site, *extra: str) -> subprocess.CompletedProcess[str]:
    args = [str(binary), "-url", url, "-vkey", site.vkey, "-origin", log_origin("pub-test"), *extra]
    return subprocess.run(args, capture_output=True, text=True, timeout=120)


def _flipped(path: Path, pos: int) -> bytes:
    good = path.read_bytes()
    path.write_bytes(good[:pos] + bytes([good[pos] ^ 0x01]) + good[pos + 1 :])
    return good


def test_go_torchwood_reads_and_checks_the_published_log(
    goverify: Path, served: str, site: Site, tmp_path: Path
) -> None:
    site.add(300)
    site.publish()
    ok = _go(goverify, served, site)
    assert ok.returncode == 0, ok.stderr
    summary = json.loads(ok.stdout)
    assert (summary["size"], summary["events"], summary["commits"], summary["snapshots"]) == (303, 301, 1, 1)
    old = tmp_path / "old-checkpoint"
    old.write_bytes((site.dest / "checkpoint").read_bytes())
    site.add(400)
    site.publish()
    grown = _go(goverify, served, site, "-old", str(old))
    assert grown.returncode == 0, grown.stderr
    assert json.loads(grown.stdout)["consistent_from"] == 303
    # One flipped byte anywhere in a tile or a bundle, and the Go verifier refuses the log.
    for rel, pos in [
        ("tile/0/000", 40),
        ("tile/entries/000", 77),
        ("tile/entries/002.p/193", 3),
        ("tile/1/000.p/2", 1),
    ]:
        good = _flipped(site.dest / rel, pos)
        bad = _go(goverify, served, site)
        (site.dest / rel).write_bytes(good)
        assert bad.returncode == 1, f"{rel} byte {pos} flipped, yet: {bad.stdout}"
    wrong_key = _go(
        goverify, served, site, "-vkey", write_keypair(tmp_path / "k2", "other")[1].read_text().strip()
    )
    assert wrong_key.returncode == 1 and "signature" in wrong_key.stderr


# ------------------------------------------------------------------------ ledger monitor


def _monitor(url: str, site: Site, state: Path) -> tuple[int, str]:
    result = CliRunner().invoke(
        app, ["monitor", url, "--log-key", site.vkey, "--state", str(state)], env={"COLUMNS": "300"}
    )
    return result.exit_code, result.output


def test_monitor_follows_growth_and_refuses_a_rollback(served: str, site: Site, tmp_path: Path) -> None:
    state = tmp_path / "monitor.json"
    site.add(30)
    site.publish()
    old = (site.dest / "checkpoint").read_bytes()
    assert _monitor(served, site, state)[0] == 0
    site.add(300)
    site.publish()
    code, out = _monitor(served, site, state)
    assert code == 0 and "33 -> 335" in out
    (site.dest / "checkpoint").write_bytes(old)  # the operator serves an older head
    code, out = _monitor(served, site, state)
    assert code == 1 and "rollback" in out
    assert json.loads(state.read_text())["size"] == 335  # a refused head is never remembered


def test_monitor_refuses_a_fork(served: str, site: Site, tmp_path: Path) -> None:
    state = tmp_path / "monitor.json"
    site.add(30)
    site.publish()
    assert _monitor(served, site, state)[0] == 0
    # Another history under the same log key and origin: a ledger of other events, published over it.
    fork = Site(tmp_path / "fork")
    fork.skey, fork.vkey = site.skey, site.vkey
    fork.run = RunBuilder(run_id="run-b")
    fork.add(60)
    fork.publish()
    shutil.rmtree(site.dest)
    shutil.copytree(fork.dest, site.dest)
    code, out = _monitor(served, site, state)
    assert code == 1 and "fork" in out


def test_monitor_refuses_a_bad_signature(served: str, site: Site, tmp_path: Path) -> None:
    state = tmp_path / "monitor.json"
    site.add(30)
    site.publish()
    assert _monitor(served, site, state)[0] == 0
    site.add(10)
    site.publish()
    lines = (site.dest / "checkpoint").read_text().split("\n")
    lines[1] = str(int(lines[1]) + 1)  # a size the key never signed
    (site.dest / "checkpoint").write_text("\n".join(lines))
    code, out = _monitor(served, site, state)
    assert code == 1 and "bad-signature" in out
    # Another key of the same name (the log's key swapped): refused from the first look.
    other = write_keypair(tmp_path / "k3", "runledger-log")[1].read_text().strip()
    result = CliRunner().invoke(app, ["monitor", served, "--log-key", other, "--state", str(tmp_path / "s2")])
    assert result.exit_code == 1 and "bad-signature" in result.output


# ------------------------------------------------------------------------ a real witness: litewitness


@pytest.fixture(scope="session")
def litewitness_built() -> None:
    if shutil.which("go") is None or shutil.which("ssh-agent") is None:
        pytest.skip("needs go (to build litewitness from filippo.io/torchwood v0.6.1) and ssh-agent")
    built = subprocess.run(
        ["bash", str(REPO_ROOT / "scripts" / "witness.sh"), "build"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if built.returncode != 0:
        pytest.fail(f"scripts/witness.sh build failed:\n{built.stderr[-3000:]}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture()
def witness(litewitness_built: None, tmp_path: Path) -> Iterator[tuple[str, str, Path]]:
    """(URL, vkey, dir) of a litewitness on 127.0.0.1 that knows no log yet."""
    directory = tmp_path / "witness"
    port = _free_port()
    script = str(REPO_ROOT / "scripts" / "witness.sh")
    proc = subprocess.Popen(["bash", script, "run", str(directory), str(port), "witness.test/w1"])
    log = directory / "litewitness.log"
    try:
        vkey = ""
        for _ in range(300):  # up to 30 s for the agent, the key and the listener
            text = log.read_text() if log.exists() else ""
            found = re.search(r'vkey="?([^"\s]+)', text)
            if found and _listening(port):
                vkey = found.group(1)
                break
            assert proc.poll() is None, f"litewitness exited: {text[-2000:]}"
            time.sleep(0.1)
        assert vkey, "litewitness did not come up"
        yield f"http://127.0.0.1:{port}", vkey, directory
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _witness_knows(directory: Path, site: Site) -> None:
    script = str(REPO_ROOT / "scripts" / "witness.sh")
    added = subprocess.run(
        ["bash", script, "add-log", str(directory), log_origin("pub-test"), site.vkey],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert added.returncode == 0, added.stderr


def test_litewitness_cosigns_and_refuses_a_fork(
    witness: tuple[str, str, Path], tmp_path: Path, goverify: Path
) -> None:
    url, vkey, directory = witness
    site = Site(tmp_path / "a", key_name=log_origin("pub-test"))  # a witness wants key name = origin
    _witness_knows(directory, site)
    added = CliRunner().invoke(app, ["witness", "add", "w1", url, vkey, "--ledger", str(site.root)])
    assert added.exit_code == 0 and "quorum 1" in added.output, added.output
    site.add(30)
    assert site.publish().witnesses == {"w1": "cosigned"}
    site.add(300)
    assert site.publish().witnesses == {"w1": "cosigned"}  # from size 33, with a consistency proof
    published = (site.dest / "checkpoint").read_text()
    assert verify_cosignatures(published, [parse_cosignature_key(vkey)]) == ["witness.test/w1"]
    # The witness's size forgotten here: it answers 409 with its size, and is asked again from there.
    state_file = publish_mod.state_dir(site.root, site.dest) / "state.json"
    state = json.loads(state_file.read_text())
    state["witness_sizes"] = {}
    state_file.write_text(json.dumps(state))
    site.add(5)
    assert site.publish().witnesses == {"w1": "cosigned"}
    # A verifier nobody here wrote checks the cosignature too.
    with _serving(site.dest) as served_url:
        go = _go(goverify, served_url, site, "-witness", vkey)
    assert go.returncode == 0 and json.loads(go.stdout)["cosigned"], go.stderr
    # Another history under the same key and origin: the witness answers 422 and nothing is published.
    fork = Site(tmp_path / "fork", key_name="unused")
    fork.skey, fork.vkey = site.skey, site.vkey
    fork.run = RunBuilder(run_id="run-b")
    fork.add(400)
    CliRunner().invoke(app, ["witness", "add", "w1", url, vkey, "--ledger", str(fork.root)])
    refused = CliRunner().invoke(
        app, ["publish", str(fork.dest), "--ledger", str(fork.root), "--keys", str(tmp_path / "a" / "keys")]
    )
    assert refused.exit_code == 1 and "REFUSED BY A WITNESS" in refused.output and "422" in refused.output
    assert not (fork.dest / "checkpoint").exists()
    # A quorum the witnesses cannot meet publishes nothing either.
    CliRunner().invoke(
        app, ["witness", "add", "w2", f"http://127.0.0.1:{_free_port()}", vkey, "--ledger", str(site.root)]
    )
    assert load_policy(site.root).quorum == 2
    before = (site.dest / "checkpoint").read_bytes()
    site.add(5)
    with pytest.raises(ValueError, match="only 1 of the quorum of 2"):
        site.publish()
    assert (site.dest / "checkpoint").read_bytes() == before
    # A monitor that wants this witness's cosignature accepts the log; one that wants another's refuses it.
    with _serving(site.dest) as served_url:
        base = ["monitor", served_url, "--log-key", site.vkey]
        ok = CliRunner().invoke(app, [*base, "--state", str(tmp_path / "m1"), "--witness", vkey])
        other = _cosignature_vkey("witness.test/other")
        short = CliRunner().invoke(app, [*base, "--state", str(tmp_path / "m2"), "--witness", other])
    assert ok.exit_code == 0, ok.output
    assert short.exit_code == 1 and "quorum" in short.output, short.output


def _cosignature_vkey(name: str) -> str:
    key = Ed25519PrivateKey.generate().public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    key_hash = hashlib.sha256(name.encode() + b"\n\x04" + key).digest()[:4].hex()
    blob = base64.b64encode(b"\x04" + key).decode()
    return f"{name}+{key_hash}+{blob}"


def test_monitor_entries_checks_only_what_is_new(served: str, site: Site, tmp_path: Path) -> None:
    state = tmp_path / "monitor.json"
    args = ["monitor", served, "--log-key", site.vkey, "--state", str(state), "--entries"]
    site.add(30)
    first = site.publish()
    result = CliRunner().invoke(app, args, env={"COLUMNS": "300"})
    assert result.exit_code == 0 and f"{first.size} new entries" in result.output, result.output
    files_first = len(json.loads(state.read_text())["files"])
    site.add(300)
    grown = site.publish()
    result = CliRunner().invoke(app, args, env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    assert f"{grown.size - first.size} new entries, {grown.files_copied} data files checked" in result.output
    assert len(json.loads(state.read_text())["files"]) > files_first
    # A new data file or a new bundle changed in DEST after publishing: refused.
    site.add(10)
    site.publish()
    manifest = json.loads((site.dest / "manifest.json").read_text())
    newest = max((f for f in manifest["files"] if f["table"] == "events"), key=lambda f: f["path"])
    good = _flipped(site.dest / newest["path"], 100)
    result = CliRunner().invoke(app, args, env={"COLUMNS": "300"})
    assert result.exit_code == 1 and "bad-data" in result.output, result.output
    (site.dest / newest["path"]).write_bytes(good)
    size = site.checkpoint()[0]
    _flipped(site.dest / entries_path(size // 256, size % 256), 30)
    result = CliRunner().invoke(app, args, env={"COLUMNS": "300"})
    assert result.exit_code == 1 and "bad-entries" in result.output, result.output
