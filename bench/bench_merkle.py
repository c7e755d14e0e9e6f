"""Benchmark the Merkle core: append throughput, proof generation, proof size and verification time.

Run from the repository root::

    .venv/bin/python -m bench.bench_merkle                 # 10 million leaves (~1-2 min, ~2 GB RAM)
    .venv/bin/python -m bench.bench_merkle --leaves 100000 # quick run

Figures printed (all in the same run, over the same leaf hashes):

* leaves/s for CompactRange.append and MerkleTree.append, against two references: recomputing the
  root from scratch over all leaves once at the end (root_from_leaf_hashes), and the hashlib ceiling
  (one 65-byte SHA-256 per leaf, the amortised node-hashing work of any append-only tree);
* what from-scratch recomputation would cost if the root were rebuilt after every ingest commit;
* inclusion and consistency proofs at the full size: generation time from a plain list of leaf
  hashes (O(n)) and from MerkleTree (O(log n)), proof size in hashes/bytes/JSON, and verification time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import resource
import sys
import time
from collections.abc import Callable
from typing import TypeVar

from runledger.ledger import verifier
from runledger.ledger.log_checkpoint import parse_and_verify_checkpoint, sign_checkpoint
from runledger.ledger.merkle import (
    CompactRange,
    MerkleTree,
    consistency_proof,
    inclusion_proof,
    leaf_hash,
    root_from_leaf_hashes,
    verify_consistency,
    verify_inclusion,
)
from runledger.schemas.note import generate_keypair

T = TypeVar("T")


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def per_call(fn: Callable[[], object], repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def rate(n: int, seconds: float) -> str:
    return f"{n / seconds:>12,.0f} leaves/s  ({seconds:7.2f} s)"


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--leaves", type=int, default=10_000_000, help="number of leaves (default 10M)")
    parser.add_argument("--commit-every", type=int, default=10_000, help="events per ingest commit (model)")
    args = parser.parse_args(argv)
    n: int = args.leaves
    if n < 2:
        parser.error("--leaves must be at least 2")

    print(f"Python {sys.version.split()[0]}, {n:,} leaves")

    leaves, t = timed(lambda: [leaf_hash(i.to_bytes(8, "big")) for i in range(n)])
    print(f"leaf hashing (SHA-256(0x00‖8 bytes))      {rate(n, t)}")

    print("\n-- append throughput (leaf hashes precomputed) --")
    a, b = leaves[0], leaves[1]
    sha = hashlib.sha256
    _, t_ceiling = timed(lambda: [sha(b"\x01" + a + b).digest() for _ in range(n)])
    print(f"hashlib ceiling (1 node hash per leaf)     {rate(n, t_ceiling)}")

    def run_compact() -> CompactRange:
        cr = CompactRange()
        append = cr.append
        for lh in leaves:
            append(lh)
        return cr

    cr, t_compact = timed(run_compact)
    print(f"CompactRange.append                        {rate(n, t_compact)}")

    scratch_root, t_scratch = timed(lambda: root_from_leaf_hashes(leaves))
    print(f"baseline: root from scratch, once at end   {rate(n, t_scratch)}")
    assert scratch_root == cr.root()

    def run_tree_append() -> MerkleTree:
        tree = MerkleTree()
        append = tree.append
        for lh in leaves:
            append(lh)
        return tree

    appended, t_tree_append = timed(run_tree_append)
    print(f"MerkleTree.append (keeps all levels)       {rate(n, t_tree_append)}")
    assert appended.root() == scratch_root
    del appended

    tree, t_build = timed(lambda: MerkleTree.from_leaf_hashes(leaves))
    print(f"MerkleTree.from_leaf_hashes (bulk)         {rate(n, t_build)}")
    assert tree.root() == scratch_root

    commits = n // args.commit_every
    # Re-rooting from scratch after commit k hashes k*B leaves: B * commits * (commits + 1) / 2 in total.
    rehashed = args.commit_every * commits * (commits + 1) // 2
    est = rehashed / (n / t_scratch)
    print(
        f"baseline if re-rooted after every commit of {args.commit_every:,} events: "
        f"{rehashed:,} leaf-hashes re-hashed, est. {est:,.0f} s "
        f"(CompactRange: {t_compact:.1f} s + {commits:,} root() calls)"
    )
    blob = cr.to_bytes()
    _, t_root = timed(cr.root)
    print(
        f"CompactRange state: {len(cr.hashes)} hashes, {len(blob)} bytes serialised, "
        f"root() {t_root * 1e6:.1f} µs"
    )

    print(f"\n-- proofs at tree size {n:,} --")
    index = n // 3 + 7
    old = n // 2 + 12345 if n > 30_000 else n // 2 + 1
    root, old_root = tree.root(), tree.root(old)

    incl_pure, t_incl_pure = timed(lambda: inclusion_proof(leaves, index, n))
    incl, t_incl_tree = timed(lambda: tree.inclusion_proof(index))
    assert incl == incl_pure
    cons_pure, t_cons_pure = timed(lambda: consistency_proof(leaves, old, n))
    cons, t_cons_tree = timed(lambda: tree.consistency_proof(old))
    assert cons == cons_pure

    incl_doc = verifier.inclusion_proof_document(
        stream="metrics",
        event_id="evt",
        leaf_index=index,
        tree_size=n,
        leaf_hash=leaves[index],
        audit_path=incl,
        root_hash=root,
    )
    cons_doc = verifier.consistency_proof_document(
        stream="metrics", first=old, second=n, consistency=cons, first_root=old_root, second_root=root
    )
    reps = 2000
    t_vi = per_call(lambda: verify_inclusion(leaves[index], index, n, incl, root), reps)
    t_vc = per_call(lambda: verify_consistency(old, n, old_root, root, cons), reps)
    t_vi_sa = per_call(lambda: verifier.verify_inclusion(leaves[index], index, n, incl, root), reps)
    t_vc_sa = per_call(lambda: verifier.verify_consistency(old, n, old_root, root, cons), reps)

    def row(kind: str, proof: list[bytes], doc: dict[str, object], gen_pure: float, gen_tree: float) -> None:
        print(
            f"{kind:<24} {len(proof):>3} hashes = {32 * len(proof):>4} bytes raw, "
            f"{len(json.dumps(doc)):>5} bytes JSON; generate: list {gen_pure:6.2f} s, "
            f"MerkleTree {gen_tree * 1e6:7.1f} µs"
        )

    row(f"inclusion (leaf {index:,})", incl, incl_doc, t_incl_pure, t_incl_tree)
    row(f"consistency ({old:,}->)", cons, cons_doc, t_cons_pure, t_cons_tree)
    print(
        f"verify inclusion:   {t_vi * 1e6:6.1f} µs (runledger.ledger.merkle)  {t_vi_sa * 1e6:6.1f} µs (runledger.ledger.verifier)"
    )
    print(
        f"verify consistency: {t_vc * 1e6:6.1f} µs (runledger.ledger.merkle)  {t_vc_sa * 1e6:6.1f} µs (runledger.ledger.verifier)"
    )

    skey, vkey = generate_keypair("bench.example/log")
    t_sign = per_call(lambda: sign_checkpoint("bench.example/log", n, root, skey), 200)
    note = sign_checkpoint("bench.example/log", n, root, skey)
    t_open = per_call(lambda: parse_and_verify_checkpoint(note, vkey), 200)
    print(f"checkpoint: sign {t_sign * 1e6:.0f} µs, verify {t_open * 1e6:.0f} µs, {len(note.encode())} bytes")
    print(f"\npeak RSS {peak_rss_mib():,.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
