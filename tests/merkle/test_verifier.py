"""The stand-alone verifier, run as a real subprocess on good and tampered inputs."""

from __future__ import annotations

import ast
import base64
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from runledger.ledger import verifier
from runledger.ledger.log_checkpoint import sign_checkpoint
from runledger.ledger.merkle import MerkleTree, leaf_hash
from runledger.schemas.note import write_keypair

REPO_ROOT = Path(__file__).resolve().parents[2]
VERIFIER_FILE = REPO_ROOT / "ledger" / "verifier.py"
ORIGIN = "runledger.example/run-7"
OLD_SIZE, NEW_SIZE, INDEX = 13, 21, 9
SOURCE = "trainer/run-7/rank0"


@dataclass
class Fixture:
    dir: Path
    private_key: str
    public_key_path: Path
    events: list[bytes]
    tree: MerkleTree

    def write(self, name: str, content: str | bytes | dict[str, Any]) -> Path:
        path = self.dir / name
        if isinstance(content, dict):
            content = json.dumps(content)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
        return path

    def checkpoint(self, size: int, name: str) -> Path:
        return self.write(name, sign_checkpoint(ORIGIN, size, self.tree.root(size), self.private_key))

    def inclusion_doc(self, index: int = INDEX, size: int = NEW_SIZE, *, leaf: bool = True) -> dict[str, Any]:
        """The proof as ``ledger prove inclusion`` writes it: with the leaf's bytes (``leaf=False``: without)."""
        doc = verifier.inclusion_proof_document(
            stream="metrics",
            event_id=f"evt-{index}",
            leaf_index=index,
            tree_size=size,
            leaf_hash=self.tree.leaf_hash(index),
            audit_path=self.tree.inclusion_proof(index, size),
            root_hash=self.tree.root(size),
            leaf=self.events[index] if leaf else None,
        )
        doc["source"] = SOURCE
        return doc

    def consistency_doc(self, old: int = OLD_SIZE, new: int = NEW_SIZE) -> dict[str, Any]:
        return verifier.consistency_proof_document(
            stream="metrics",
            first=old,
            second=new,
            consistency=self.tree.consistency_proof(old, new),
            first_root=self.tree.root(old),
            second_root=self.tree.root(new),
        )


@pytest.fixture(scope="module")
def fx(tmp_path_factory: pytest.TempPathFactory) -> Fixture:
    d = tmp_path_factory.mktemp("verifier")
    private_path, public_path = write_keypair(d / "keys", ORIGIN)
    # Leaves shaped like a runledger event's canonical bytes: sorted keys, no whitespace, UTF-8.
    events = [
        json.dumps(
            {
                "id": f"evt-{i}",
                "source": SOURCE,
                "stream": "metrics",
                "data": {"loss": 1.0 / (i + 1), "note": "é"},
            },
            sort_keys=True,
            separators=(",", ":"),
            ensure_ascii=False,
        ).encode()
        for i in range(NEW_SIZE)
    ]
    tree = MerkleTree.from_leaf_hashes([leaf_hash(e) for e in events])
    fixture = Fixture(d, private_path.read_text().strip(), public_path, events, tree)
    fixture.checkpoint(NEW_SIZE, "new.checkpoint")
    fixture.checkpoint(OLD_SIZE, "old.checkpoint")
    fixture.write("leaf.bin", events[INDEX])
    return fixture


def run(*args: str | Path, cwd: Path = REPO_ROOT, script: Path | None = None) -> tuple[int, str]:
    cmd = [
        sys.executable,
        *(["-I", str(script)] if script else ["-m", "runledger.ledger.verifier"]),
        *map(str, args),
    ]
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=60, check=False)
    out = proc.stdout.strip()
    assert len(out.splitlines()) == 1, (out, proc.stderr)  # exactly one OK/FAIL line
    assert proc.stderr == ""
    return proc.returncode, out


def inclusion(
    fx: Fixture, proof: Path, checkpoint: str = "new.checkpoint", *extra: str | Path
) -> tuple[int, str]:
    return run(
        "inclusion",
        "--proof",
        proof,
        "--checkpoint",
        fx.dir / checkpoint,
        "--public-key",
        fx.public_key_path,
        *extra,
    )


def consistency(fx: Fixture, proof: Path, *extra: str | Path) -> tuple[int, str]:
    return run(
        "consistency",
        "--proof",
        proof,
        "--checkpoint",
        fx.dir / "new.checkpoint",
        "--public-key",
        fx.public_key_path,
        *extra,
    )


def flip_b64(value: str) -> str:
    raw = bytearray(base64.b64decode(value))
    raw[0] ^= 0x01
    return base64.b64encode(bytes(raw)).decode()


# --------------------------------------------------------------------------------------------------
# Inclusion


def test_inclusion_ok(fx: Fixture) -> None:
    proof = fx.write("incl.json", fx.inclusion_doc())
    rc, out = inclusion(fx, proof, "new.checkpoint", "--origin", ORIGIN, "--leaf", fx.dir / "leaf.bin")
    assert rc == 0, out
    assert out.startswith("OK: event 'evt-9' from 'trainer/run-7/rank0' of stream 'metrics' is leaf 9 "), out
    # The leaf in the proof alone is enough: the verifier hashes it and reads the id from it.
    rc, out = inclusion(fx, proof)
    assert rc == 0 and out.startswith("OK: event 'evt-9' "), out


def test_inclusion_without_leaf_bytes_does_not_claim_the_event(fx: Fixture) -> None:
    # An older proof (no leaf): only the leaf hash is verified; the labels are not printed as verified.
    doc = fx.inclusion_doc(leaf=False)
    doc["event_id"] = "evt-3"  # a lie the hash cannot catch: so it must not be repeated as verified
    rc, out = inclusion(fx, fx.write("noleaf.json", doc))
    assert rc == 0, out
    assert "evt-3" not in out and "evt-9" not in out
    assert "leaf 9" in out and "NOT checked: event_id, source, stream" in out and "--leaf" in out
    # With --leaf the event is read from the bytes, and the lying label fails.
    rc, out = inclusion(fx, fx.write("noleaf.json", doc), "new.checkpoint", "--leaf", fx.dir / "leaf.bin")
    assert rc == 1 and "'evt-3'" in out and "'evt-9'" in out, out
    doc["event_id"] = "evt-9"
    rc, out = inclusion(fx, fx.write("noleaf.json", doc), "new.checkpoint", "--leaf", fx.dir / "leaf.bin")
    assert rc == 0 and out.startswith("OK: event 'evt-9' "), out


def _mutate_binding(name: str, doc: dict[str, Any], fx: Fixture) -> None:
    other = fx.events[INDEX + 1]
    match name:
        case "event_id edited":
            doc["event_id"] = f"evt-{INDEX + 1}"
        case "source edited":
            doc["source"] = "trainer/run-8/rank0"
        case "stream edited":
            doc["stream"] = "other"
        case "leaf edited":
            doc["leaf"] = doc["leaf"].replace("evt-9", "evt-8")
        case "leaf of another event":
            doc["leaf"] = other.decode()
        case "leaf and leaf_hash of another event":
            doc["leaf"], doc["leaf_hash"] = other.decode(), base64.b64encode(leaf_hash(other)).decode()
        case "leaf and leaf_hash forged":
            forged = fx.events[INDEX].replace(b'"loss":0.1', b'"loss":0.0')
            assert forged != fx.events[INDEX]
            doc["leaf"], doc["leaf_hash"] = forged.decode(), base64.b64encode(leaf_hash(forged)).decode()
        case "leaf not a string":
            doc["leaf"] = json.loads(doc["leaf"])
        case "leaf with a repeated id":
            doc["leaf"] = doc["leaf"].replace("{", '{"id":"evt-9",', 1)
            doc.pop("leaf_hash")
        case "leaf_hash removed, leaf edited":
            doc.pop("leaf_hash")
            doc["leaf"] = doc["leaf"].replace("evt-9", "evt-8")
        case "leaf and leaf_hash removed":
            doc.pop("leaf")
            doc.pop("leaf_hash")


BINDING_MUTATIONS = [
    "event_id edited",
    "source edited",
    "stream edited",
    "leaf edited",
    "leaf of another event",
    "leaf and leaf_hash of another event",
    "leaf and leaf_hash forged",
    "leaf not a string",
    "leaf with a repeated id",
    "leaf_hash removed, leaf edited",
    "leaf and leaf_hash removed",
]


@pytest.mark.parametrize("mutation", BINDING_MUTATIONS)
def test_inclusion_every_field_is_bound_to_the_leaf(fx: Fixture, mutation: str) -> None:
    doc = fx.inclusion_doc()
    _mutate_binding(mutation, doc, fx)
    rc, out = inclusion(fx, fx.write(f"bound-{mutation}.json", doc))
    assert rc == 1 and out.startswith("FAIL: "), out


def test_inclusion_leaf_file_must_match_the_proofs_leaf(fx: Fixture) -> None:
    other = fx.write("other-leaf.bin", fx.events[INDEX + 1])
    rc, out = inclusion(fx, fx.write("incl.json", fx.inclusion_doc()), "new.checkpoint", "--leaf", other)
    assert rc == 1 and "differs from the proof's leaf" in out


def test_inclusion_ok_with_inline_key_and_every_leaf(fx: Fixture) -> None:
    vkey = fx.public_key_path.read_text().strip()
    for index in range(NEW_SIZE):
        doc = fx.inclusion_doc(index)
        ckpt = sign_checkpoint(ORIGIN, NEW_SIZE, fx.tree.root(), fx.private_key)
        proof, cp = fx.write("i.json", doc), fx.write("i.checkpoint", ckpt)
        # In-process for speed; the CLI path is the same function.
        assert (
            verifier.main(["inclusion", "--proof", str(proof), "--checkpoint", str(cp), "--public-key", vkey])
            == 0
        )


def _mutate_inclusion(name: str) -> Callable[[dict[str, Any]], None]:
    def apply(doc: dict[str, Any]) -> None:
        path = doc["audit_path"]
        match name:
            case "index+1":
                doc["leaf_index"] += 1
            case "index-1":
                doc["leaf_index"] -= 1
            case "size+1":
                doc["tree_size"] += 1
            case "size-1":
                doc["tree_size"] -= 1
            case "hash added":
                path.append(path[0])
            case "hash removed":
                path.pop()
            case "paths reversed":
                path.reverse()
            case "wrong leaf":
                doc["leaf_hash"] = base64.b64encode(leaf_hash(b"forged event")).decode()
            case "root_hash altered":
                doc["root_hash"] = flip_b64(doc["root_hash"])
            case "index as bool":
                doc["leaf_index"] = True
            case "non-canonical base64":
                path[0] = path[0].rstrip("=")
            case _:
                i = int(name.removeprefix("flip path[").rstrip("]"))
                path[i] = flip_b64(path[i])

    return apply


INCLUSION_MUTATIONS = [
    "index+1",
    "index-1",
    "size+1",
    "size-1",
    "hash added",
    "hash removed",
    "paths reversed",
    "wrong leaf",
    "root_hash altered",
    "index as bool",
    "non-canonical base64",
    *[f"flip path[{i}]" for i in range(5)],
]


def test_inclusion_path_length(fx: Fixture) -> None:
    assert len(fx.inclusion_doc()["audit_path"]) == 5


@pytest.mark.parametrize("with_leaf", [True, False], ids=["with leaf", "hash only"])
@pytest.mark.parametrize("mutation", INCLUSION_MUTATIONS)
def test_inclusion_tampered_proof_fails(fx: Fixture, mutation: str, with_leaf: bool) -> None:
    doc = fx.inclusion_doc(leaf=with_leaf)
    _mutate_inclusion(mutation)(doc)
    rc, out = inclusion(fx, fx.write(f"bad-{mutation}.json", doc))
    assert rc == 1, out
    assert out.startswith("FAIL: ")


def test_inclusion_proof_for_other_tree_size_fails(fx: Fixture) -> None:
    # A valid proof, but against the older checkpoint: the signed size binds it.
    rc, out = inclusion(fx, fx.write("incl.json", fx.inclusion_doc()), "old.checkpoint")
    assert rc == 1 and "tree size" in out


def test_inclusion_wrong_leaf_file_fails(fx: Fixture) -> None:
    other = fx.write("other-leaf.bin", fx.events[INDEX + 1])
    doc = fx.inclusion_doc(leaf=False)
    rc, out = inclusion(fx, fx.write("incl.json", doc), "new.checkpoint", "--leaf", other)
    assert rc == 1 and "leaf" in out


@pytest.mark.parametrize(
    "what", ["size", "root", "origin", "signature", "unsigned", "other key", "63-byte sig"]
)
def test_inclusion_bad_checkpoint_fails(fx: Fixture, what: str) -> None:
    good = (fx.dir / "new.checkpoint").read_text()
    body, sig_line = good.split("\n\n")
    head, blob = sig_line.rsplit(" ", 1)
    raw = base64.b64decode(blob)
    root64 = base64.b64encode(fx.tree.root()).decode()
    match what:
        case "size":
            text = good.replace(f"\n{NEW_SIZE}\n", f"\n{NEW_SIZE + 1}\n")
        case "root":
            text = good.replace(root64, flip_b64(root64))
        case "origin":
            text = good.replace(ORIGIN, ORIGIN + "x", 1)
        case "signature":
            text = (
                body + "\n\n" + head + " " + base64.b64encode(raw[:-1] + bytes([raw[-1] ^ 1])).decode() + "\n"
            )
        case "unsigned":
            text = body + "\n"
        case "other key":
            other_priv, _ = write_keypair(fx.dir / "other-keys", ORIGIN)
            text = sign_checkpoint(ORIGIN, NEW_SIZE, fx.tree.root(), other_priv.read_text().strip())
        case _:
            text = body + "\n\n" + head + " " + base64.b64encode(raw[:-1]).decode() + "\n"
    fx.write("bad.checkpoint", text)
    rc, out = inclusion(fx, fx.write("incl.json", fx.inclusion_doc()), "bad.checkpoint")
    assert rc == 1 and out.startswith("FAIL: "), out


def test_inclusion_wrong_origin_flag_fails(fx: Fixture) -> None:
    rc, out = inclusion(
        fx, fx.write("incl.json", fx.inclusion_doc()), "new.checkpoint", "--origin", "other/run"
    )
    assert rc == 1 and "origin" in out


@pytest.mark.parametrize("content", ["not json", "[1, 2]", "{}", '{"leaf_index": 1}'])
def test_malformed_proof_file_fails(fx: Fixture, content: str) -> None:
    rc, out = inclusion(fx, fx.write("junk.json", content))
    assert rc == 1 and out.startswith("FAIL: ")


def test_missing_files_and_bad_usage_fail(fx: Fixture) -> None:
    rc, out = inclusion(fx, fx.dir / "does-not-exist.json")
    assert rc == 1 and "cannot read" in out
    rc, out = run("inclusion", "--proof", "x.json")
    assert rc == 1 and out.startswith("FAIL: bad arguments")
    rc, out = run("frobnicate")
    assert rc == 1 and out.startswith("FAIL: ")


# --------------------------------------------------------------------------------------------------
# Consistency


def test_consistency_ok_with_old_checkpoint(fx: Fixture) -> None:
    proof = fx.write("cons.json", fx.consistency_doc())
    rc, out = consistency(fx, proof, "--old-checkpoint", fx.dir / "old.checkpoint", "--origin", ORIGIN)
    assert rc == 0, out
    assert out.startswith("OK: ") and "size 13" in out and "size 21" in out and "compare" not in out


def test_consistency_ok_with_old_size_and_root(fx: Fixture) -> None:
    proof = fx.write("cons.json", fx.consistency_doc())
    old_root = base64.b64encode(fx.tree.root(OLD_SIZE)).decode()
    rc, out = consistency(fx, proof, "--old-size", str(OLD_SIZE), "--old-root", old_root)
    assert rc == 0, out


def test_consistency_ok_without_trusted_old_tree_says_so(fx: Fixture) -> None:
    rc, out = consistency(fx, fx.write("cons.json", fx.consistency_doc()))
    assert rc == 0, out
    assert "compare it with a checkpoint you kept" in out


def test_consistency_every_old_size_in_process(fx: Fixture) -> None:
    for old in range(NEW_SIZE + 1):
        proof = fx.write("c.json", fx.consistency_doc(old))
        args = ["consistency", "--proof", str(proof), "--checkpoint", str(fx.dir / "new.checkpoint")]
        args += ["--public-key", str(fx.public_key_path)]
        assert verifier.main(args) == 0, old


CONSISTENCY_MUTATIONS = [
    "first+1",
    "first-1",
    "second+1",
    "roots swapped",
    "hash added",
    "hash removed",
    "first_root altered",
    "second_root altered",
    *[f"flip path[{i}]" for i in range(6)],
]


@pytest.mark.parametrize("mutation", CONSISTENCY_MUTATIONS)
def test_consistency_tampered_proof_fails(fx: Fixture, mutation: str) -> None:
    doc = fx.consistency_doc()
    path = doc["consistency"]
    match mutation:
        case "first+1":
            doc["first"] += 1
        case "first-1":
            doc["first"] -= 1
        case "second+1":
            doc["second"] += 1
        case "roots swapped":
            doc["first_root"], doc["second_root"] = doc["second_root"], doc["first_root"]
        case "hash added":
            path.append(path[-1])
        case "hash removed":
            path.pop()
        case "first_root altered":
            doc["first_root"] = flip_b64(doc["first_root"])
        case "second_root altered":
            doc["second_root"] = flip_b64(doc["second_root"])
        case _:
            i = int(mutation.removeprefix("flip path[").rstrip("]"))
            path[i] = flip_b64(path[i])
    rc, out = consistency(fx, fx.write(f"bad-{mutation}.json", doc))
    assert rc == 1 and out.startswith("FAIL: "), out


def test_consistency_path_length(fx: Fixture) -> None:
    assert len(fx.consistency_doc()["consistency"]) == 6


def test_consistency_detects_forked_history(fx: Fixture) -> None:
    # The operator rewrote event 3 after publishing the old checkpoint and proves from its new tree.
    forked_events = [*fx.events]
    forked_events[3] = b'{"loss": 0.0, "step": 3}'
    forked = MerkleTree.from_leaf_hashes([leaf_hash(e) for e in forked_events])
    fx.write("forked.checkpoint", sign_checkpoint(ORIGIN, NEW_SIZE, forked.root(), fx.private_key))
    doc = verifier.consistency_proof_document(
        stream="metrics",
        first=OLD_SIZE,
        second=NEW_SIZE,
        consistency=forked.consistency_proof(OLD_SIZE),
        first_root=forked.root(OLD_SIZE),
        second_root=forked.root(),
    )
    proof = fx.write("forked.json", doc)
    rc, out = run(
        "consistency",
        "--proof",
        proof,
        "--checkpoint",
        fx.dir / "forked.checkpoint",
        "--public-key",
        fx.public_key_path,
        "--old-checkpoint",
        fx.dir / "old.checkpoint",
    )
    assert rc == 1 and "old root" in out, out


def test_consistency_old_checkpoint_mismatch_fails(fx: Fixture) -> None:
    fx.checkpoint(OLD_SIZE + 1, "old14.checkpoint")
    rc, out = consistency(
        fx, fx.write("cons.json", fx.consistency_doc()), "--old-checkpoint", fx.dir / "old14.checkpoint"
    )
    assert rc == 1 and "tree size" in out
    rc, out = consistency(fx, fx.write("cons.json", fx.consistency_doc()), "--old-size", "13")
    assert rc == 1 and "go together" in out


# --------------------------------------------------------------------------------------------------
# Stand-alone property


def test_verifier_imports_nothing_from_runledger() -> None:
    tree = ast.parse(VERIFIER_FILE.read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "relative import"
            roots.add((node.module or "").split(".")[0])
    allowed = set(sys.stdlib_module_names) | {"cryptography", "__future__"}
    assert roots <= allowed, roots - allowed


def test_copied_verifier_runs_alone(fx: Fixture, tmp_path: Path) -> None:
    copy = tmp_path / "verifier.py"
    shutil.copy(VERIFIER_FILE, copy)
    proof = fx.write("incl.json", fx.inclusion_doc())
    args = ["--checkpoint", fx.dir / "new.checkpoint", "--public-key", fx.public_key_path]
    rc, out = run("inclusion", "--proof", proof, *args, cwd=tmp_path, script=copy)
    assert rc == 0 and out.startswith("OK: "), out
    bad = fx.inclusion_doc()
    bad["leaf_index"] += 1
    rc, out = run("inclusion", "--proof", fx.write("bad.json", bad), *args, cwd=tmp_path, script=copy)
    assert rc == 1 and out.startswith("FAIL: "), out


def test_help_exits_zero() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "runledger.ledger.verifier", "--help"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0 and "inclusion" in proc.stdout
