"""The CLI as people use it: it never destroys what it did not make, never claims more than it checked.

The demo's work folder (only its own outputs are ever removed), `ledger verify` without a public key
(UNVERIFIED, not OK), inclusion proofs bound to the leaf the verifier hashes (docs/merkle.md's check
run as written), `ledger blame` naming the event that last changed a value, and a signal stop's text.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ledger.merkle import leaf_hash
from runledger.ledger.query import Reader
from runledger.ledger.store import Ledger, SourceRecord
from runledger.schemas import payloads as p
from tests.support.factory import RunBuilder

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]


def invoke(*args: str | Path) -> tuple[int, str]:
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, result.output


def _ledger(root: Path, run: RunBuilder) -> Path:
    Ledger.create(root).commit([SourceRecord("spool:t", i, raw) for i, raw in enumerate(run.events)])
    return root


def _run(steps: int = 12) -> RunBuilder:
    run = RunBuilder()
    run.start()
    for s in range(1, steps + 1):
        run.step(s, loss=5 - s * 0.1)
    return run


# --------------------------------------------------------------------------------------------------
# 1. The demo removes only what it created


@pytest.fixture(autouse=True)
def no_tree_removal(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A regression must fail these tests, never run: no recursive delete during the refusal tests."""
    if "refuses" not in request.node.name:
        return

    def forbidden(path: object, *args: object, **kwargs: object) -> None:
        raise AssertionError(f"shutil.rmtree({path!r}) called")

    monkeypatch.setattr(shutil, "rmtree", forbidden)


def _one_error_line(out: str) -> str:
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, out
    assert "Traceback" not in out
    return lines[0]


def test_demo_refuses_a_non_empty_folder_it_did_not_make(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    precious = work / "thesis.tex"
    precious.write_text("three years of work")
    code, out = invoke("demo", "--workdir", work, "--steps", "4")
    assert code == 2
    assert "not empty" in _one_error_line(out) and "--force" in out
    assert precious.read_text() == "three years of work"
    assert sorted(p.name for p in work.iterdir()) == ["thesis.tex"]


# "/" is an ancestor of every cwd, so ".." covers its rule; no test ever hands "/" to a command that deletes.
@pytest.mark.parametrize("where", [".", "..", "home"])
def test_demo_refuses_the_current_folder_its_ancestors_home_and_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    cwd = tmp_path / "home" / "project"
    cwd.mkdir(parents=True)
    (cwd / "notes.txt").write_text("keep me")
    monkeypatch.chdir(cwd)
    (tmp_path / "myhome").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "myhome"))
    workdir = str(tmp_path / "myhome") if where == "home" else where
    for extra in ([], ["--force"]):
        code, out = invoke("demo", "--workdir", workdir, "--steps", "4", *extra)
        assert code == 2, out
        assert "refusing --workdir" in _one_error_line(out)
    assert (cwd / "notes.txt").read_text() == "keep me"
    assert not (cwd / ".runledger-demo").exists()


def test_demo_folder_reuse_and_force_remove_only_the_demos_outputs(tmp_path: Path) -> None:
    from runledger.workflows.demo import DEMO_OUTPUTS, MARKER, prepare_workdir

    # A folder the demo made (marked) is reused: its outputs go, anything else stays.
    work = tmp_path / "demo"
    prepare_workdir(work)
    assert (work / MARKER).is_file()
    for name in DEMO_OUTPUTS:
        (work / name).mkdir() if "." not in name else (work / name).write_text("old")
    (work / "ledger" / "old.parquet").write_text("old")
    (work / "mine.txt").write_text("a file the user put there")
    prepare_workdir(work)
    assert sorted(p.name for p in work.iterdir()) == [MARKER, "mine.txt"]
    # --force takes a non-empty folder the demo did not make, still removing only its outputs.
    other = tmp_path / "other"
    (other / "ledger").mkdir(parents=True)
    (other / "report.pdf").write_text("keep")
    (other / "notes").mkdir()
    prepare_workdir(other, force=True)
    assert sorted(p.name for p in other.iterdir()) == [MARKER, "notes", "report.pdf"]


def test_demo_does_not_follow_a_symlinked_output(tmp_path: Path) -> None:
    from runledger.workflows.demo import prepare_workdir

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "data.bin").write_text("keep")
    work = tmp_path / "demo"
    prepare_workdir(work)
    (work / "ledger").symlink_to(outside, target_is_directory=True)
    prepare_workdir(work)
    assert (outside / "data.bin").read_text() == "keep"
    assert not (work / "ledger").exists()


# --------------------------------------------------------------------------------------------------
# 3. `ledger verify` says UNVERIFIED when signed checkpoints were not checked


@pytest.fixture
def signed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A ledger with a signed log checkpoint; the key is in tmp/keys, not at the default location."""
    monkeypatch.chdir(tmp_path)  # so the default key folder (.runledger/keys) does not exist
    monkeypatch.delenv("RUNLEDGER_KEYS", raising=False)
    monkeypatch.delenv("RUNLEDGER_LEDGER", raising=False)
    _ledger(tmp_path / "l", _run())
    assert invoke("keys", "init", "--keys", tmp_path / "keys")[0] == 0
    code, out = invoke("checkpoint", "--ledger", tmp_path / "l", "--keys", tmp_path / "keys")
    assert code == 0, out
    return tmp_path


def test_verify_without_a_key_is_unverified_not_ok(signed: Path) -> None:
    code, out = invoke("verify", "--ledger", signed / "l")
    assert code == 3, out
    assert not re.search(r"^OK", out, re.M), out
    assert "UNVERIFIED: 1 signed checkpoint" in out and "not checked" in out
    assert "--public-key" in out and "no public key" in out


def test_verify_with_the_key_is_ok(signed: Path) -> None:
    for how in (["--public-key", signed / "keys" / "runledger.pub"], ["--keys", signed / "keys"]):
        code, out = invoke("verify", "--ledger", signed / "l", *how)
        assert code == 0, out
        assert "1 signed checkpoint checked" in out and "UNVERIFIED" not in out


def test_verify_with_no_checkpoints_says_none_were_signed(tmp_path: Path) -> None:
    _ledger(tmp_path / "l", _run())
    code, out = invoke("verify", "--ledger", tmp_path / "l", "--keys", tmp_path / "none")
    assert code == 0, out
    assert "1 stream, 13 events" in out and "no signed checkpoints" in out


def test_verify_a_wrong_key_fails(signed: Path, tmp_path: Path) -> None:
    assert invoke("keys", "init", "--name", "mallory", "--keys", tmp_path / "other")[0] == 0
    code, out = invoke("verify", "--ledger", signed / "l", "--public-key", tmp_path / "other" / "mallory.pub")
    assert code == 1, out


# --------------------------------------------------------------------------------------------------
# 2. Inclusion proofs bind what the verifier prints to the leaf it hashes


def _doc_block(heading: str) -> str:
    text = (ROOT / "docs" / "merkle.md").read_text()
    after = text[text.index(heading) :]
    return re.search(r"```sh\n(.*?)```", after, re.S).group(1)


def _verifier(*args: str | Path, cwd: Path) -> tuple[int, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "runledger.ledger.verifier", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc.returncode, proc.stdout.strip()


def test_docs_end_to_end_check_runs_as_written(tmp_path: Path) -> None:
    run = _run()
    ledger = _ledger(tmp_path / "ledger", run)
    script = _doc_block("Checking one event of a ledger, end to end")
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "LEDGER": str(ledger),
        "EVENT_ID": "run-a-7",
        "STREAM": "run-a",
    }
    env.pop("RUNLEDGER_KEYS", None)
    proc = subprocess.run(
        ["bash", "-eo", "pipefail", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("OK: event 'run-a-7' from 'trainer/run-a/rank0' of stream 'run-a' is leaf 7 "), (
        last
    )
    # The leaf file holds the event's canonical bytes, and the proof carries the same bytes.
    proof = json.loads((tmp_path / "proof.json").read_text())
    leaf = (tmp_path / "event.json").read_bytes()
    assert proof["leaf"].encode() == leaf and json.loads(leaf)["id"] == "run-a-7"
    assert leaf_hash(leaf) == base64.b64decode(proof["leaf_hash"])
    # The case: the proof's event_id edited to another event's id no longer says OK.
    proof["event_id"] = "run-a-3"
    (tmp_path / "edited.json").write_text(json.dumps(proof))
    checkpoint = ledger / "_checkpoints" / "run-a.txt"
    pub = tmp_path / "keys" / "runledger.pub"
    args = ["inclusion", "--checkpoint", checkpoint, "--public-key", pub]
    code, out = _verifier(*args, "--proof", tmp_path / "edited.json", cwd=tmp_path)
    assert code == 1 and out.startswith("FAIL: ") and "run-a-3" in out, out
    code, out = _verifier(
        *args, "--proof", tmp_path / "proof.json", "--leaf", tmp_path / "event.json", cwd=tmp_path
    )
    assert code == 0 and "'run-a-7'" in out, out


def _flip(b64: str) -> str:
    raw = bytearray(base64.b64decode(b64))
    raw[0] ^= 0x01
    return base64.b64encode(bytes(raw)).decode()


def _edit(doc: dict[str, Any], field: str, other: dict[str, Any]) -> None:
    """Edit one field of a proof: to the other event's value, or a flipped bit for a hash."""
    match field:
        case "event_id" | "source" | "stream" | "leaf" | "leaf_index":
            doc[field] = other[field]
        case "leaf and leaf_hash":
            doc["leaf"], doc["leaf_hash"] = other["leaf"], other["leaf_hash"]
        case "leaf_hash" | "root_hash":
            doc[field] = _flip(doc[field])
        case "tree_size":
            doc[field] += 1
        case _:
            i = int(field.removeprefix("audit_path[").rstrip("]"))
            doc["audit_path"][i] = _flip(doc["audit_path"][i])


def test_cli_proof_every_edited_field_fails(signed: Path) -> None:
    ledger = signed / "l"
    docs = {}
    for event in ("run-a-6", "run-a-5"):
        code, out = invoke("prove", "inclusion", event, "--ledger", ledger, "-o", signed / f"{event}.json")
        assert code == 0, out
        docs[event] = json.loads((signed / f"{event}.json").read_text())
    good, other = docs["run-a-6"], docs["run-a-5"]
    other = {**other, "source": "trainer/run-b/rank0", "stream": "run-b"}
    args = ["inclusion", "--checkpoint", ledger / "_checkpoints" / "run-a.txt"]
    args += ["--public-key", signed / "keys" / "runledger.pub"]
    code, out = _verifier(*args, "--proof", signed / "run-a-6.json", cwd=signed)
    assert code == 0 and "'run-a-6'" in out, out
    fields = ["event_id", "source", "stream", "leaf", "leaf and leaf_hash", "leaf_hash", "root_hash"]
    fields += ["leaf_index", "tree_size", *[f"audit_path[{i}]" for i in range(len(good["audit_path"]))]]
    for field in fields:
        doc = json.loads(json.dumps(good))
        _edit(doc, field, other)
        assert doc != good, field
        (signed / "edited.json").write_text(json.dumps(doc))
        code, out = _verifier(*args, "--proof", signed / "edited.json", cwd=signed)
        assert code == 1 and out.startswith("FAIL: "), (field, out)


def test_prove_names_an_unknown_event_in_one_line(signed: Path) -> None:
    code, out = invoke("prove", "inclusion", "nope", "--ledger", signed / "l")
    assert code == 1 and "no event with id 'nope'" in out and "Traceback" not in out


# --------------------------------------------------------------------------------------------------
# 4. `ledger blame` names the event that last changed the value


def _blame_run(resume_config: dict[str, Any] | None = None, superseded_change: bool = False) -> RunBuilder:
    run = RunBuilder(config={"lr": 0.001, "moe": {"capacity_factor": 1.0, "top_k": 2}})
    run.start()
    for s in range(1, 13):
        if s == 6:
            run.change(6, "moe/capacity_factor", 1.25)  # a live change: first trained at step 6
        if s == 10 and superseded_change:
            run.change(10, "moe/capacity_factor", 2.0)  # after the resume point: superseded
        run.step(s)
        if s == 8:
            run.checkpoint(8)
    run.crash(12)
    carried = json.loads(json.dumps(run.config))
    if superseded_change:
        carried["moe"]["capacity_factor"] = 1.25  # what the checkpoint of step 8 ran with
    run.resume(8, resume_config or carried)
    for s in range(9, 21):
        run.step(s)
    return run


def test_blame_skips_a_resume_that_only_carried_the_value(tmp_path: Path) -> None:
    for superseded in (False, True):
        root = _ledger(tmp_path / f"l{superseded}", _blame_run(superseded_change=superseded))
        reader = Reader(root)
        cf = reader.blame("run-a", "moe.capacity_factor")
        assert cf["value"] == 1.25 and cf["step"] == 20
        assert (cf["set_by"]["kind"], cf["set_by"]["step"], cf["set_by"]["attempt"]) == (
            "config.changed",
            6,
            1,
        )
        assert cf["set_by"]["cause"]["kind"] == "file_edit"
        top_k = reader.blame("run-a", "moe.top_k")
        assert (top_k["set_by"]["kind"], top_k["set_by"]["step"], top_k["set_by"]["attempt"]) == (
            "start",
            0,
            1,
        )
        assert top_k["commit"] == "a" * 40  # the code the start ran, not the resume's
        # Before the change, at an earlier step, the start set it.
        assert reader.blame("run-a", "moe.capacity_factor", step=5)["set_by"]["kind"] == "start"
    code, out = invoke("blame", "run-a", "moe.capacity_factor", "--ledger", tmp_path / "lFalse")
    assert code == 0 and "set by config.changed at step 6 (attempt 1" in out and "resume" not in out


def test_blame_names_a_resume_that_changed_the_value(tmp_path: Path) -> None:
    changed = {"lr": 0.001, "moe": {"capacity_factor": 1.5, "top_k": 2}}
    reader = Reader(_ledger(tmp_path / "l", _blame_run(resume_config=changed)))
    cf = reader.blame("run-a", "moe.capacity_factor")
    assert cf["value"] == 1.5
    assert (cf["set_by"]["kind"], cf["set_by"]["step"], cf["set_by"]["attempt"]) == ("resume", 8, 2)
    assert cf["commit"] == "b" * 40
    assert reader.blame("run-a", "lr")["set_by"]["kind"] == "start"


# --------------------------------------------------------------------------------------------------
# 5. A signal stop reads as one, without "None" or empty fields


def test_signal_stop_text_in_history(tmp_path: Path) -> None:
    run = _run(5)
    run._emit(
        p.RunCrashed(
            kind="signal",
            signal=2,
            exit_code=130,
            message="SIGINT: stopped at a step boundary after step 5",
            host="node-0",
            last_step=5,
        ),
        5,
    )
    run._emit(p.RunCrashed(kind="signal", exc_type="SignalStop", signal=15, message="signal 15"), 5)
    run.crash(5)
    texts = [i.text for i in Reader(_ledger(tmp_path / "l", run)).history("run-a") if i.kind == "run.crashed"]
    assert texts == [
        "interrupted by SIGINT: stopped at a step boundary after step 5 on rank 0 node-0",
        "interrupted by SIGTERM: stopped at once, mid-step (a second signal) on rank 0",
        "crash (exception): RuntimeError boom on rank 0",
    ]
    assert not any("None" in t or "  " in t for t in texts)


# --------------------------------------------------------------------------------------------------
# Lower priority: --version, `state --at` before the run began


def test_version() -> None:
    code, out = invoke("--version")
    assert code == 0 and re.fullmatch(r"runledger \S+\n", out), out


def test_state_at_before_the_run_began_is_an_error(tmp_path: Path) -> None:
    ledger = _ledger(tmp_path / "l", _run())
    result = runner.invoke(app, ["state", "run-a", "--at", "2000-01-01T00:00:00", "--ledger", str(ledger)])
    assert result.exit_code == 1
    assert "before run run-a began" in result.output and "Traceback" not in result.output
    code, out = invoke("state", "run-a", "--at", "2026-11-01T00:00:05", "--ledger", ledger, "-f", "json")
    assert code == 0 and json.loads(out)["attempt"] == 1
