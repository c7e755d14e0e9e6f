"""A second host joins a lake (issue 39): the keys live with the ledger, and a host that joins gets the
ledger's own log key or is told exactly which key to bring.

Host A and host B are two folders on one catalog (SQLite file, PostgreSQL). A inits (its log key in
A/.keys, recorded in the lake), ingests and checkpoints; B's init makes no key and names the key to
bring and where; with the key file copied, B inits, ingests more, checkpoints and publishes, and the
published log verifies with A's public key. Each command runs from a temporary current directory,
so nothing is written into the checkout; the one-line outputs are checked whole."""

from __future__ import annotations

import re
import shutil
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ingest.spool import SpoolWriter
from runledger.ledger.log_key import KEYS_DIR, fingerprint, recorded_log_key
from runledger.ledger.store import Ledger
from tests.lake.conftest import Backend
from tests.support.factory import RunBuilder

runner = CliRunner()
ENV = {"RUNLEDGER_PROGRESS_S": "off", "COLUMNS": "200", "RUNLEDGER_KEYS": None, "RUNLEDGER_LEDGER": None}


def _cli(*args: str | Path, code: int = 0) -> tuple[str, str]:
    """(stdout, stderr) of one `ledger` command, its exit status checked."""
    result = runner.invoke(app, [str(a) for a in args], env=ENV)
    assert result.exit_code == code, result.output
    return result.stdout, result.stderr


def _spool(folder: Path, run_id: str, steps: int) -> int:
    run = RunBuilder(run_id=run_id)
    run.start()
    for s in range(1, steps + 1):
        run.step(s)
    with SpoolWriter(folder) as writer:
        for raw in run.events:
            writer.append(raw)
    return len(run.events)


@pytest.fixture
def cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A current directory of the test's own: a default written relative to it lands here."""
    here = tmp_path / "cwd"
    here.mkdir()
    monkeypatch.chdir(here)
    return here


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_second_host_brings_the_ledgers_log_key_and_publishes(
    backend: Backend, tmp_path: Path, cwd: Path
) -> None:
    if not backend.many_processes:
        pytest.skip("a DuckDB-file catalog is one process's: no second host joins it")
    host_a, host_b = tmp_path / "host-a", tmp_path / "host-b"
    on_lake = ["--catalog", backend.catalog, "--data", str(backend.data), "--allow-unsigned", "*"]
    # A sets the ledger up: its log key goes to A/.keys (owner-only), never to the current directory.
    out, _ = _cli("init", "--ledger", host_a, *on_lake)
    keys_a = host_a / KEYS_DIR
    assert out.startswith(f"created ledger {host_a} (id ")
    assert f"; log key {keys_a / 'runledger.pub'} (new); registry started" in out
    assert _mode(keys_a) == 0o700 and _mode(keys_a / "runledger.key") == 0o600
    assert not (cwd / ".runledger").exists()
    vkey = (keys_a / "runledger.pub").read_text().strip()
    ledger_id = out.split("(id ", 1)[1].split(")", 1)[0]
    n_a = _spool(tmp_path / "spool-a", "run-a", 30)
    _cli("ingest", "spool", "--spool", tmp_path / "spool-a", "--ledger", host_a, "--batch-size", "10")
    assert _cli("checkpoint", "--ledger", host_a)[0].startswith("signed ")

    # B joins without the key: told which key and where it goes, in one line; no key is made.
    keys_b = host_b / KEYS_DIR
    out, err = _cli("init", "--ledger", host_b, *on_lake, code=1)
    assert (out, err) == (
        "",
        f"error: ledger {ledger_id} signs with log key {fingerprint(vkey)} (public key {vkey}), which is "
        f"not in {keys_b}: copy its private key file from a host that has it to {keys_b / 'runledger.key'} "
        "(mode 0600), or pass --keys DIR holding it\n",
    )
    assert not keys_b.exists() and not (cwd / ".runledger").exists()

    # With the private key file copied (only it), B's init finds it and changes nothing.
    keys_b.mkdir(mode=0o700)
    shutil.copy2(keys_a / "runledger.key", keys_b / "runledger.key")
    out, err = _cli("init", "--ledger", host_b, *on_lake)
    # (the registry part: runledger.ledger.registry.registry_entries reads part files only so far, "no registry yet")
    line = (
        re.escape(f"a ledger already exists at {host_b} (id {ledger_id}, ")
        + "(its registry started|no registry yet)"
    )
    line += re.escape(f"; log key {keys_b / 'runledger.key'}, the ledger's): nothing changed")
    assert re.fullmatch(line + "\n", out) and err == "", (out, err)
    assert sorted(p.name for p in keys_b.iterdir()) == ["runledger.key"]

    # B ingests more, checkpoints and publishes with the ledger's key: the published log verifies.
    n_b = _spool(tmp_path / "spool-b", "run-b", 20)
    _cli("ingest", "spool", "--spool", tmp_path / "spool-b", "--ledger", host_b, "--batch-size", "10")
    assert _cli("checkpoint", "--ledger", host_b)[0].startswith("signed ")
    site = tmp_path / "site"
    assert _cli("publish", site, "--ledger", host_b)[0].startswith("published ")
    out, _ = _cli("verify", "--ledger", host_b)
    assert out.startswith("OK: ") and f"{n_a + n_b + 1} events" in out, out  # + the registry's event
    remote = ["--remote", f"file://{site}", "--state", tmp_path / "remote-state.json"]
    out, _ = _cli("verify", *remote, "--log-key", keys_a / "runledger.pub")
    assert out.startswith(f"OK runledger/{ledger_id}: size "), out

    # The key folder is never published: no .keys folder, no key file, no private key's bytes.
    private = (keys_a / "runledger.key").read_bytes().strip()
    published = [p for p in site.rglob("*")]
    assert published and not [p for p in published if p.name == KEYS_DIR or p.suffix == ".key"]
    assert not [p for p in published if p.is_file() and private in p.read_bytes()]
    # Nor can the ledger's SQL read it, though it lives in the ledger's folder (only the data is allowed).
    peek = runner.invoke(
        app,
        ["query", f"SELECT * FROM read_text('{keys_a / 'runledger.key'}')", "--ledger", str(host_a)],
        env=ENV,
    )
    assert peek.exit_code == 1 and private.decode() not in peek.output, peek.output
    assert not (cwd / ".runledger").exists()


def test_a_key_that_is_not_the_ledgers_is_named_beside_the_ledgers(
    backend: Backend, tmp_path: Path, cwd: Path
) -> None:
    if not backend.many_processes:
        pytest.skip("a DuckDB-file catalog is one process's: no second host joins it")
    host_a, host_c = tmp_path / "host-a", tmp_path / "host-c"
    on_lake = ["--catalog", backend.catalog, "--data", str(backend.data), "--allow-unsigned", "*"]
    out, _ = _cli("init", "--ledger", host_a, *on_lake)
    ledger_id = out.split("(id ", 1)[1].split(")", 1)[0]
    vkey = (host_a / KEYS_DIR / "runledger.pub").read_text().strip()
    # C brings its own key first (a new key of the same name): init does not take it for the ledger's.
    keys_c = host_c / KEYS_DIR
    _cli("keys", "init", "--ledger", host_c)
    other = (keys_c / "runledger.pub").read_text().strip()
    assert other != vkey and _mode(keys_c) == 0o700
    out, err = _cli("init", "--ledger", host_c, *on_lake, code=1)
    assert err.startswith(f"error: ledger {ledger_id} signs with log key {fingerprint(vkey)} ")
    # Signing with it is refused in one line naming both fingerprints; nothing is signed.
    wrong = (
        f"error: the log key in {keys_c} is {fingerprint(other)}, not ledger {ledger_id}'s log key "
        f"{fingerprint(vkey)}: copy that key's private file from a host that has it to "
        f"{keys_c / 'runledger.key'}, or pass --keys DIR holding it\n"
    )
    assert _cli("checkpoint", "--ledger", host_c, code=1) == ("", wrong)
    assert _cli("publish", tmp_path / "site", "--ledger", host_c, code=1) == ("", wrong)
    assert not (host_c / "_checkpoints").exists() and not (tmp_path / "site").exists()
    # An explicit --keys still wins: A's folder signs C's checkpoint.
    assert _cli("checkpoint", "--ledger", host_c, "--keys", host_a / KEYS_DIR)[0].startswith("signed ")
    # D brings the ledger's key before its first init (the key folder may come first): it joins.
    host_d = tmp_path / "host-d"
    (host_d / KEYS_DIR).mkdir(parents=True, mode=0o700)
    shutil.copy2(host_a / KEYS_DIR / "runledger.key", host_d / KEYS_DIR / "runledger.key")
    out, err = _cli("init", "--ledger", host_d, *on_lake)
    commits = out.split(" commit", 1)[0].rsplit("(", 1)[1]
    assert (out, err) == (
        f"joined ledger {ledger_id} on {backend.catalog} from {host_d} ({commits} commit"
        f"{'' if commits == '1' else 's'} so far): nothing changed; log key "
        f"{host_d / KEYS_DIR / 'runledger.key'} (the ledger's)\n",
        "",
    )


def test_a_ledger_of_the_layout_before_keeps_its_keys_beside_it(tmp_path: Path, cwd: Path) -> None:
    """`.runledger/ledger` beside `.runledger/keys` (the defaults before): its key is used, said once."""
    ledger, old = Path(".runledger/ledger"), Path(".runledger/keys")
    _cli("init", "--ledger", ledger, "--keys", old, "--allow-unsigned", "*")
    out, err = _cli("checkpoint")
    assert out.startswith("signed ") and err == (
        f"note: using the key folder {old} beside the ledger (where keys were kept before); move its "
        f"files to {ledger / KEYS_DIR} to keep them with the ledger\n"
    )
    assert not (ledger / KEYS_DIR).exists()
    # Once the ledger's own folder holds a key, it is the one used, and nothing is said.
    (ledger / KEYS_DIR).mkdir(mode=0o700)
    for name in ("runledger.key", "runledger.pub"):
        (old / name).rename(ledger / KEYS_DIR / name)
    assert _cli("checkpoint")[1] == ""


def test_a_lake_that_records_no_key_records_the_first_it_signs_with(tmp_path: Path, cwd: Path) -> None:
    """A ledger made by an ingest (no `ledger init`) records its log key at its first checkpoint; then
    a redaction with another key file is refused in one line naming both keys."""
    ledger = tmp_path / "made-by-ingest"
    with Ledger.create(ledger) as made:
        ledger_id = made.ledger_id
    _cli("keys", "init", "--ledger", ledger)
    with Ledger.open(ledger) as opened:
        assert recorded_log_key(opened) is None
    assert _cli("checkpoint", "--ledger", ledger)[0].startswith("signed ")
    vkey = (ledger / KEYS_DIR / "runledger.pub").read_text().strip()
    with Ledger.open(ledger) as opened:
        assert recorded_log_key(opened) == vkey
    _cli("keys", "init", "--name", "mallory", "--keys", tmp_path / "other")
    other = (tmp_path / "other" / "mallory.pub").read_text().strip()
    redact = ["redact", "no-such-event", "--reason", "leak", "--actor", "alice", "--ledger", ledger]
    assert _cli(*redact, "--key", tmp_path / "other" / "mallory.key", code=1) == (
        "",
        f"error: the log key in {tmp_path / 'other'} is {fingerprint(other)}, not ledger {ledger_id}'s log "
        f"key {fingerprint(vkey)}: copy that key's private file from a host that has it to "
        f"{tmp_path / 'other' / 'runledger.key'}, or pass --keys DIR holding it\n",
    )
