"""The stand-alone verifier checks producer signatures of leaves (``--producer-key``), run as a real
subprocess on events a real ``Sealer`` signed."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import pytest

from runledger.ledger import verifier
from runledger.ledger.log_checkpoint import sign_checkpoint
from runledger.ledger.merkle import MerkleTree, leaf_hash
from runledger.schemas import Event, decode_event, encode_event, make_event
from runledger.schemas.note import write_keypair
from runledger.schemas.payloads import StepMetrics
from runledger.schemas.signing import Sealer

REPO_ROOT = Path(__file__).resolve().parents[2]
ORIGIN = "runledger.example/run-9"


def canonical(raw: bytes) -> bytes:
    event = decode_event(raw)
    assert isinstance(event, Event), event
    return event.canonical


def altered_signature(leaf: bytes) -> bytes:
    """The same event with one bit of its signature flipped (still well-formed base64)."""
    value = json.loads(leaf)
    signature = bytearray(base64.b64decode(value["signature"]))
    signature[5] ^= 0x01
    value["signature"] = base64.b64encode(bytes(signature)).decode()
    return canonical(json.dumps(value).encode())


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict:
    d = tmp_path_factory.mktemp("signed")
    log_key, log_pub = write_keypair(d / "log", ORIGIN)
    producer_key, producer_pub = write_keypair(d / "producer", "trainer")
    sealer = Sealer(producer_key.read_text())
    leaves = []
    for i in range(4):
        envelope = make_event(
            StepMetrics(loss=1.0 / (i + 1)),
            source="trainer/r/a1/rank0",
            stream="r",
            run_id="r",
            step=i,
            seq=i,
        )
        leaves.append(canonical(encode_event(sealer.seal(envelope))))
    leaves.append(altered_signature(leaves[3]))  # what a ledger without a registry would have kept
    tree = MerkleTree.from_leaf_hashes([leaf_hash(leaf) for leaf in leaves])
    size = len(leaves)
    checkpoint = d / "cp.txt"
    checkpoint.write_text(sign_checkpoint(ORIGIN, size, tree.root(size), log_key.read_text()))
    return {
        "dir": d,
        "leaves": leaves,
        "tree": tree,
        "checkpoint": checkpoint,
        "log_pub": log_pub,
        "producer_pub": producer_pub,
        "other_pub": write_keypair(d / "other", "trainer")[1],
    }


def run_inclusion(world: dict, index: int, *extra: str | Path) -> tuple[int, str]:
    tree, leaves = world["tree"], world["leaves"]
    size = len(leaves)
    doc = verifier.inclusion_proof_document(
        stream="r",
        event_id=json.loads(leaves[index])["id"],
        leaf_index=index,
        tree_size=size,
        leaf_hash=tree.leaf_hash(index),
        audit_path=tree.inclusion_proof(index, size),
        root_hash=tree.root(size),
        leaf=leaves[index],
    )
    proof = world["dir"] / f"proof-{index}.json"
    proof.write_text(json.dumps(doc))
    args = ["--proof", proof, "--checkpoint", world["checkpoint"], "--public-key", world["log_pub"], *extra]
    proc = subprocess.run(
        [sys.executable, "-m", "runledger.ledger.verifier", "inclusion", *map(str, args)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return proc.returncode, proc.stdout.strip()


def test_verifier_checks_the_producer_signature_of_a_leaf(world: dict) -> None:
    rc, out = run_inclusion(world, 1, "--producer-key", world["producer_pub"])
    assert rc == 0 and out.startswith("OK: ") and "signed by producer trainer+" in out, out


def test_verifier_rejects_an_altered_producer_signature(world: dict) -> None:
    # The leaf is in the log (inclusion alone is OK), but its producer signature does not verify.
    rc, out = run_inclusion(world, 4)
    assert rc == 0, out
    rc, out = run_inclusion(world, 4, "--producer-key", world["producer_pub"])
    assert (rc, out) == (
        1,
        "FAIL: producer signature of " + json.loads(world["leaves"][4])["key_id"] + " does not verify",
    )
    with pytest.raises(verifier.VerificationError, match="does not verify"):
        verifier.verify_producer_signature(world["leaves"][4], world["producer_pub"].read_text())


def test_verifier_rejects_another_producers_key_and_ambiguous_leaves(world: dict) -> None:
    rc, out = run_inclusion(world, 0, "--producer-key", world["other_pub"])
    assert rc == 1 and out.startswith("FAIL: event is signed by trainer+"), out
    leaf = json.loads(world["leaves"][0])
    # A copy of the signature member inside the payload makes the signing bytes ambiguous.
    leaf["data"]["scalars"] = {"x": None}
    leaf["data"]["signature"] = leaf["signature"]
    nested = canonical(json.dumps(leaf).encode())
    with pytest.raises(verifier.VerificationError, match="ambiguous"):
        verifier.verify_producer_signature(nested, world["producer_pub"].read_text())
    unsigned = canonical(encode_event(make_event(StepMetrics(), source="s", stream="r", run_id="r", seq=0)))
    with pytest.raises(verifier.VerificationError, match="unsigned"):
        verifier.verify_producer_signature(unsigned, world["producer_pub"].read_text())
