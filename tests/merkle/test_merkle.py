"""Tests for runledger.ledger.merkle: known answers, corrupted proofs, properties, compact ranges."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runledger.ledger.merkle import (
    EMPTY_ROOT,
    CompactRange,
    MerkleTree,
    ProofError,
    consistency_proof,
    consistency_proof_size,
    inclusion_proof,
    inclusion_proof_size,
    leaf_hash,
    node_hash,
    root_from_leaf_hashes,
    verify_consistency,
    verify_inclusion,
)


def h(hex_text: str) -> bytes:
    return bytes.fromhex(hex_text)


# --------------------------------------------------------------------------------------------------
# Known-answer vectors, copied from github.com/transparency-dev/merkle:
#   testonly/constants.go  (LeafInputs, NodeHashes, RootHashes, CompactTrees, EmptyRootHash)
#   proof/verify_test.go   (inclusionProofs, consistencyProofs, sha256SomeHash)

LEAF_INPUTS = [
    h(""),
    h("00"),
    h("10"),
    h("2021"),
    h("3031"),
    h("40414243"),
    h("5051525354555657"),
    h("606162636465666768696a6b6c6d6e6f"),
]

NODE_HASHES = [
    [
        h("6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d"),
        h("96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7"),
        h("0298d122906dcfc10892cb53a73992fc5b9f493ea4c9badb27b791b4127a7fe7"),
        h("07506a85fd9dd2f120eb694f86011e5bb4662e5c415a62917033d4a9624487e7"),
        h("bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b"),
        h("4271a26be0d8a84f0bd54c8c302e7cb3a3b5d1fa6780a40bcce2873477dab658"),
        h("b08693ec2e721597130641e8211e7eedccb4c26413963eee6c1e2ed16ffb1a5f"),
        h("46f6ffadd3d06a09ff3c5860d2755c8b9819db7df44251788c7d8e3180de8eb1"),
    ],
    [
        h("fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125"),
        h("5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e"),
        h("0ebc5d3437fbe2db158b9f126a1d118e308181031d0a949f8dededebc558ef6a"),
        h("ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0"),
    ],
    [
        h("d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7"),
        h("6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4"),
    ],
    [
        h("5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328"),
    ],
]

EMPTY_ROOT_HEX = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"

# Indexed by tree size, 0..8.
ROOT_HASHES = [
    h(EMPTY_ROOT_HEX),
    h("6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d"),
    h("fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125"),
    h("aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77"),
    h("d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7"),
    h("4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4"),
    h("76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef"),
    h("ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c"),
    h("5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328"),
]

_NH = NODE_HASHES
# CompactTrees(): frontier hashes for every size 0..8.
COMPACT_TREES: list[list[bytes]] = [
    [],
    [_NH[0][0]],
    [_NH[1][0]],
    [_NH[1][0], _NH[0][2]],
    [_NH[2][0]],
    [_NH[2][0], _NH[0][4]],
    [_NH[2][0], _NH[1][2]],
    [_NH[2][0], _NH[1][2], _NH[0][6]],
    [_NH[3][0]],
]

SOME_HASH = h("abacaba000000000000000000000000000000000000000000060061e00123456")

# (1-based leaf, tree size, proof) as in Go's inclusionProofs (its {0,0} and {1,1} entries are the
# empty-proof edge cases, tested separately).
INCLUSION_VECTORS: list[tuple[int, int, list[bytes]]] = [
    (
        1,
        8,
        [
            h("96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7"),
            h("5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e"),
            h("6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4"),
        ],
    ),
    (
        6,
        8,
        [
            h("bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b"),
            h("ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0"),
            h("d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7"),
        ],
    ),
    (3, 3, [h("fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125")]),
    (
        2,
        5,
        [
            h("6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d"),
            h("5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e"),
            h("bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b"),
        ],
    ),
]

# (size1, size2, proof) as in Go's consistencyProofs.
CONSISTENCY_VECTORS: list[tuple[int, int, list[bytes]]] = [
    (1, 1, []),
    (
        1,
        8,
        [
            h("96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7"),
            h("5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e"),
            h("6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4"),
        ],
    ),
    (
        6,
        8,
        [
            h("0ebc5d3437fbe2db158b9f126a1d118e308181031d0a949f8dededebc558ef6a"),
            h("ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0"),
            h("d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7"),
        ],
    ),
    (
        2,
        5,
        [
            h("5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e"),
            h("bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b"),
        ],
    ),
    (
        6,
        7,
        [
            h("0ebc5d3437fbe2db158b9f126a1d118e308181031d0a949f8dededebc558ef6a"),
            h("b08693ec2e721597130641e8211e7eedccb4c26413963eee6c1e2ed16ffb1a5f"),
            h("d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7"),
        ],
    ),
]

LEAF_HASHES = [leaf_hash(x) for x in LEAF_INPUTS]


# --------------------------------------------------------------------------------------------------
# Naive reference: RFC 6962 §2.1 recursions written literally, with list slicing.


def ref_mth(d: Sequence[bytes]) -> bytes:
    n = len(d)
    if n == 0:
        return hashlib.sha256(b"").digest()
    if n == 1:
        return d[0]
    k = 1
    while k * 2 < n:
        k *= 2
    return node_hash(ref_mth(d[:k]), ref_mth(d[k:]))


def ref_path(m: int, d: Sequence[bytes]) -> list[bytes]:
    n = len(d)
    if n == 1:
        return []
    k = 1
    while k * 2 < n:
        k *= 2
    if m < k:
        return [*ref_path(m, d[:k]), ref_mth(d[k:])]
    return [*ref_path(m - k, d[k:]), ref_mth(d[:k])]


def ref_subproof(m: int, d: Sequence[bytes], b: bool) -> list[bytes]:
    n = len(d)
    if m == n:
        return [] if b else [ref_mth(d)]
    k = 1
    while k * 2 < n:
        k *= 2
    if m <= k:
        return [*ref_subproof(m, d[:k], b), ref_mth(d[k:])]
    return [*ref_subproof(m - k, d[k:], False), ref_mth(d[:k])]


# --------------------------------------------------------------------------------------------------
# Known answers


def test_empty_root() -> None:
    assert EMPTY_ROOT.hex() == EMPTY_ROOT_HEX
    assert root_from_leaf_hashes([]) == EMPTY_ROOT
    assert CompactRange().root() == EMPTY_ROOT
    assert MerkleTree().root() == EMPTY_ROOT


def test_leaf_and_node_hashes() -> None:
    assert NODE_HASHES[0] == LEAF_HASHES
    for level in range(1, len(NODE_HASHES)):
        below = NODE_HASHES[level - 1]
        assert [node_hash(below[2 * i], below[2 * i + 1]) for i in range(len(below) // 2)] == NODE_HASHES[
            level
        ]


@pytest.mark.parametrize("size", range(len(ROOT_HASHES)))
def test_root_hashes(size: int) -> None:
    assert root_from_leaf_hashes(LEAF_HASHES[:size]) == ROOT_HASHES[size]
    assert MerkleTree.from_leaf_hashes(LEAF_HASHES).root(size) == ROOT_HASHES[size]


@pytest.mark.parametrize("size", range(len(COMPACT_TREES)))
def test_compact_trees(size: int) -> None:
    cr = CompactRange()
    cr.extend(LEAF_HASHES[:size])
    assert list(cr.hashes) == COMPACT_TREES[size]
    assert cr.root() == ROOT_HASHES[size]
    assert CompactRange.from_leaf_hashes(LEAF_HASHES[:size]) == cr
    assert MerkleTree.from_leaf_hashes(LEAF_HASHES).compact_range(size) == cr


@pytest.mark.parametrize(("leaf", "size", "proof"), INCLUSION_VECTORS)
def test_inclusion_vectors(leaf: int, size: int, proof: list[bytes]) -> None:
    index = leaf - 1
    assert inclusion_proof(LEAF_HASHES, index, size) == proof
    assert MerkleTree.from_leaf_hashes(LEAF_HASHES).inclusion_proof(index, size) == proof
    verify_inclusion(LEAF_HASHES[index], index, size, proof, ROOT_HASHES[size])


@pytest.mark.parametrize(("size1", "size2", "proof"), CONSISTENCY_VECTORS)
def test_consistency_vectors(size1: int, size2: int, proof: list[bytes]) -> None:
    assert consistency_proof(LEAF_HASHES, size1, size2) == proof
    assert MerkleTree.from_leaf_hashes(LEAF_HASHES).consistency_proof(size1, size2) == proof
    verify_consistency(size1, size2, ROOT_HASHES[size1], ROOT_HASHES[size2], proof)


def test_all_small_proofs_match_reference() -> None:
    tree = MerkleTree.from_leaf_hashes(LEAF_HASHES)
    for size in range(1, 9):
        for index in range(size):
            proof = inclusion_proof(LEAF_HASHES, index, size)
            assert proof == ref_path(index, LEAF_HASHES[:size]) == tree.inclusion_proof(index, size)
            assert len(proof) == inclusion_proof_size(index, size)
            verify_inclusion(LEAF_HASHES[index], index, size, proof, ROOT_HASHES[size])
        for old in range(1, size + 1):
            proof = consistency_proof(LEAF_HASHES, old, size)
            assert proof == ref_subproof(old, LEAF_HASHES[:size], True)
            assert len(proof) == consistency_proof_size(old, size)
            verify_consistency(old, size, ROOT_HASHES[old], ROOT_HASHES[size], proof)


# --------------------------------------------------------------------------------------------------
# Edge cases (Go's TestVerifyInclusionSingleEntry / TestVerifyInclusion / TestVerifyConsistency)


def test_single_entry_inclusion() -> None:
    lh = leaf_hash(b"data")
    verify_inclusion(lh, 0, 1, [], lh)  # root of a one-leaf tree is the leaf hash
    for leaf, root in [(lh, b""), (b"", lh), (b"", b"")]:
        with pytest.raises(ProofError):
            verify_inclusion(leaf, 0, 1, [], root)


@pytest.mark.parametrize(("index", "size"), [(0, 0), (1, 0), (2, 1), (1, 1), (-1, 4)])
def test_inclusion_index_out_of_range(index: int, size: int) -> None:
    with pytest.raises(ProofError):
        verify_inclusion(SOME_HASH, index, size, [], EMPTY_ROOT)
    with pytest.raises(ProofError):
        inclusion_proof(LEAF_HASHES, index, size)


def test_trivial_consistency() -> None:
    r1, r2 = ROOT_HASHES[1], ROOT_HASHES[2]
    verify_consistency(0, 0, EMPTY_ROOT, EMPTY_ROOT, [])
    verify_consistency(0, 5, EMPTY_ROOT, ROOT_HASHES[5], [])
    verify_consistency(1, 1, r1, r1, [])
    bad: list[tuple[int, int, bytes, bytes, list[bytes]]] = [
        (1, 1, r1, r2, []),  # same size, different roots: a fork
        (0, 0, EMPTY_ROOT, r2, []),
        (0, 1, r1, r1, []),  # size 0 must have the empty root
        (1, 0, r1, r2, []),  # trees do not shrink
        (2, 1, r2, r1, []),
        (1, 2, r1, r2, []),  # empty proof
        (0, 0, EMPTY_ROOT, EMPTY_ROOT, [EMPTY_ROOT]),  # proofs must be empty here
        (0, 1, EMPTY_ROOT, r1, [EMPTY_ROOT]),
        (1, 1, r1, r1, [EMPTY_ROOT]),
        (-1, 1, r1, r1, []),
    ]
    for args in bad:
        with pytest.raises(ProofError):
            verify_consistency(*args)


def test_proof_generation_rejects_bad_sizes() -> None:
    with pytest.raises(ProofError):
        inclusion_proof(LEAF_HASHES, 0, 9)  # more than available
    with pytest.raises(ProofError):
        consistency_proof(LEAF_HASHES, 5, 4)
    with pytest.raises(ProofError):
        consistency_proof(LEAF_HASHES, 1, 9)
    with pytest.raises(ProofError):
        MerkleTree.from_leaf_hashes(LEAF_HASHES).root(9)
    assert consistency_proof(LEAF_HASHES, 0, 8) == []
    assert consistency_proof(LEAF_HASHES, 8, 8) == []


def test_non_int_sizes_rejected() -> None:
    with pytest.raises(ProofError):
        verify_inclusion(LEAF_HASHES[0], 0, True, [], ROOT_HASHES[1])  # type: ignore[arg-type]
    with pytest.raises(ProofError):
        verify_consistency(1.0, 1, ROOT_HASHES[1], ROOT_HASHES[1], [])  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------
# Every corrupted proof is rejected


def flip_bit(b: bytes, bit: int) -> bytes:
    out = bytearray(b)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


def corrupted_inclusion(
    leaf: bytes, index: int, size: int, proof: list[bytes], root: bytes
) -> list[tuple[str, tuple[bytes, int, int, list[bytes], bytes]]]:
    probes: list[tuple[str, tuple[bytes, int, int, list[bytes], bytes]]] = [
        ("index - 1", (leaf, index - 1, size, proof, root)),
        ("index + 1", (leaf, index + 1, size, proof, root)),
        ("index ^ 2", (leaf, index ^ 2, size, proof, root)),
        ("size * 2", (leaf, index, size * 2, proof, root)),
        ("size // 2", (leaf, index, size // 2, proof, root)),
        ("wrong leaf", (leaf_hash(b"WrongLeaf"), index, size, proof, root)),
        ("short leaf", (b"WrongLeaf", index, size, proof, root)),
        ("empty root", (leaf, index, size, proof, EMPTY_ROOT)),
        ("random root", (leaf, index, size, proof, SOME_HASH)),
        ("trailing garbage", (leaf, index, size, [*proof, b""], root)),
        ("trailing root", (leaf, index, size, [*proof, root], root)),
        ("preceding garbage", (leaf, index, size, [b"", *proof], root)),
        ("preceding root", (leaf, index, size, [root, *proof], root)),
        ("leaf as root", (root, index, size, proof, leaf)),
    ]
    for i in range(len(proof)):
        probes.append((f"removed proof[{i}]", (leaf, index, size, proof[:i] + proof[i + 1 :], root)))
        probes.append(
            (f"inserted before proof[{i}]", (leaf, index, size, [*proof[:i], SOME_HASH, *proof[i:]], root))
        )
        for bit in (0, 3, 100, 255):
            wrong = [*proof]
            wrong[i] = flip_bit(proof[i], bit)
            probes.append((f"proof[{i}] bit {bit}", (leaf, index, size, wrong, root)))
    for bit in (0, 255):
        probes.append((f"leaf bit {bit}", (flip_bit(leaf, bit), index, size, proof, root)))
        probes.append((f"root bit {bit}", (leaf, index, size, proof, flip_bit(root, bit))))
    return probes


def corrupted_consistency(
    size1: int, size2: int, root1: bytes, root2: bytes, proof: list[bytes]
) -> list[tuple[str, tuple[int, int, bytes, bytes, list[bytes]]]]:
    probes: list[tuple[str, tuple[int, int, bytes, bytes, list[bytes]]]] = [
        ("size1 - 1", (size1 - 1, size2, root1, root2, proof)),
        ("size1 + 1", (size1 + 1, size2, root1, root2, proof)),
        ("size1 ^ 2", (size1 ^ 2, size2, root1, root2, proof)),
        ("size2 * 2", (size1, size2 * 2, root1, root2, proof)),
        ("size2 // 2", (size1, size2 // 2, root1, root2, proof)),
        ("wrong root1", (size1, size2, SOME_HASH, root2, proof)),
        ("wrong root2", (size1, size2, root1, SOME_HASH, proof)),
        ("short root1", (size1, size2, b"WrongRoot", root2, proof)),
        ("swapped roots", (size1, size2, root2, root1, proof)),
        ("empty proof", (size1, size2, root1, root2, [])),
        ("trailing garbage", (size1, size2, root1, root2, [*proof, b""])),
        ("trailing root1", (size1, size2, root1, root2, [*proof, root1])),
        ("trailing root2", (size1, size2, root1, root2, [*proof, root2])),
        ("preceding garbage", (size1, size2, root1, root2, [b"", *proof])),
        ("preceding root1", (size1, size2, root1, root2, [root1, *proof])),
        ("preceding root2", (size1, size2, root1, root2, [root2, *proof])),
        ("preceding proof[0]", (size1, size2, root1, root2, [proof[0], *proof])),
    ]
    for i in range(len(proof)):
        probes.append((f"removed proof[{i}]", (size1, size2, root1, root2, proof[:i] + proof[i + 1 :])))
        probes.append(
            (f"inserted before proof[{i}]", (size1, size2, root1, root2, [*proof[:i], SOME_HASH, *proof[i:]]))
        )
        for bit in (0, 4, 100, 255):
            wrong = [*proof]
            wrong[i] = flip_bit(proof[i], bit)
            probes.append((f"proof[{i}] bit {bit}", (size1, size2, root1, root2, wrong)))
    for bit in (0, 255):
        probes.append((f"root1 bit {bit}", (size1, size2, flip_bit(root1, bit), root2, proof)))
        probes.append((f"root2 bit {bit}", (size1, size2, root1, flip_bit(root2, bit), proof)))
    return probes


def accepted(fn: Callable[..., None], args: tuple[object, ...]) -> bool:
    try:
        fn(*args)
    except ProofError:
        return False
    return True


@pytest.mark.parametrize(("leaf", "size", "proof"), INCLUSION_VECTORS)
def test_corrupted_inclusion_vectors_rejected(leaf: int, size: int, proof: list[bytes]) -> None:
    index = leaf - 1
    probes = corrupted_inclusion(LEAF_HASHES[index], index, size, proof, ROOT_HASHES[size])
    wrongly = [d for d, args in probes if accepted(verify_inclusion, args)]
    assert wrongly == []


@pytest.mark.parametrize(("size1", "size2", "proof"), [v for v in CONSISTENCY_VECTORS if v[2]])
def test_corrupted_consistency_vectors_rejected(size1: int, size2: int, proof: list[bytes]) -> None:
    probes = corrupted_consistency(size1, size2, ROOT_HASHES[size1], ROOT_HASHES[size2], proof)
    wrongly = [d for d, args in probes if accepted(verify_consistency, args)]
    assert wrongly == []


def test_every_bit_of_every_hash_matters() -> None:
    # Exhaustive single-bit flips for one inclusion and one consistency proof.
    index, size = 5, 7
    proof = inclusion_proof(LEAF_HASHES, index, size)
    for i in range(len(proof)):
        for bit in range(256):
            wrong = [*proof]
            wrong[i] = flip_bit(proof[i], bit)
            assert not accepted(verify_inclusion, (LEAF_HASHES[index], index, size, wrong, ROOT_HASHES[size]))
    cproof = consistency_proof(LEAF_HASHES, 3, 7)
    for i in range(len(cproof)):
        for bit in range(256):
            wrong = [*cproof]
            wrong[i] = flip_bit(cproof[i], bit)
            assert not accepted(verify_consistency, (3, 7, ROOT_HASHES[3], ROOT_HASHES[7], wrong))


# --------------------------------------------------------------------------------------------------
# Property tests over random trees

# Distinct leaves: with duplicates a proof for one copy is legitimately a proof for the other.
_leaf_data = st.lists(st.binary(max_size=12), min_size=1, max_size=200, unique=True)


@settings(max_examples=150, deadline=None)
@given(data=_leaf_data, choice=st.data())
def test_property_inclusion_proofs_verify(data: list[bytes], choice: st.DataObject) -> None:
    hashes = [leaf_hash(d) for d in data]
    size = choice.draw(st.integers(1, len(hashes)), label="size")
    index = choice.draw(st.integers(0, size - 1), label="index")
    root = root_from_leaf_hashes(hashes[:size])
    assert root == ref_mth(hashes[:size])
    proof = inclusion_proof(hashes, index, size)
    assert proof == ref_path(index, hashes[:size])
    verify_inclusion(hashes[index], index, size, proof, root)
    # Neighbouring leaves and any single flipped bit must not verify.
    for other in (index - 1, index + 1):
        assert not accepted(verify_inclusion, (hashes[index], other, size, proof, root))
    if proof:
        i = choice.draw(st.integers(0, len(proof) - 1), label="i")
        bit = choice.draw(st.integers(0, 255), label="bit")
        wrong = [*proof]
        wrong[i] = flip_bit(proof[i], bit)
        assert not accepted(verify_inclusion, (hashes[index], index, size, wrong, root))


@settings(max_examples=150, deadline=None)
@given(data=_leaf_data, choice=st.data())
def test_property_consistency_proofs_verify(data: list[bytes], choice: st.DataObject) -> None:
    hashes = [leaf_hash(d) for d in data]
    new = choice.draw(st.integers(0, len(hashes)), label="new")
    old = choice.draw(st.integers(0, new), label="old")
    old_root, new_root = root_from_leaf_hashes(hashes[:old]), root_from_leaf_hashes(hashes[:new])
    proof = consistency_proof(hashes, old, new)
    if 0 < old < new:
        assert proof == ref_subproof(old, hashes[:new], True)
    verify_consistency(old, new, old_root, new_root, proof)
    if 0 < old < new:
        assert not accepted(verify_consistency, (old, new, new_root, old_root, proof))
        i = choice.draw(st.integers(0, len(proof) - 1), label="i")
        bit = choice.draw(st.integers(0, 255), label="bit")
        wrong = [*proof]
        wrong[i] = flip_bit(proof[i], bit)
        assert not accepted(verify_consistency, (old, new, old_root, new_root, wrong))
        # A tree that differs in any one of the old leaves is not consistent with the new root.
        j = choice.draw(st.integers(0, old - 1), label="j")
        forked = [*hashes[:old]]
        forked[j] = leaf_hash(b"forked" + data[j])
        assert not accepted(verify_consistency, (old, new, root_from_leaf_hashes(forked), new_root, proof))


@settings(max_examples=100, deadline=None)
@given(data=st.lists(st.binary(max_size=8), max_size=300))
def test_property_compact_range_matches_scratch_root(data: list[bytes]) -> None:
    hashes = [leaf_hash(d) for d in data]
    cr = CompactRange()
    tree = MerkleTree()
    assert cr.root() == EMPTY_ROOT
    for n, lh in enumerate(hashes, start=1):
        cr.append(lh)
        tree.append(lh)
        assert cr.size == n
        assert len(cr.hashes) == n.bit_count()
        assert cr.root() == root_from_leaf_hashes(hashes[:n]) == tree.root()
    assert CompactRange.from_bytes(cr.to_bytes()) == cr
    assert CompactRange.from_json(cr.to_json()) == cr
    assert CompactRange.from_leaf_hashes(hashes) == cr == tree.compact_range()
    assert tree.compact_range() == MerkleTree.from_leaf_hashes(hashes).compact_range()


@settings(max_examples=100, deadline=None)
@given(data=st.lists(st.binary(max_size=8), max_size=100), split=st.integers(0, 100))
def test_property_compact_range_resumes_after_serialisation(data: list[bytes], split: int) -> None:
    # The ledger persists the frontier after a commit and resumes appending in a later process.
    hashes = [leaf_hash(d) for d in data]
    split = min(split, len(hashes))
    first = CompactRange()
    first.extend(hashes[:split])
    resumed = CompactRange.from_bytes(first.to_bytes())
    resumed.extend(hashes[split:])
    resumed_json = CompactRange.from_json(first.to_json())
    resumed_json.extend(hashes[split:])
    assert resumed.root() == resumed_json.root() == root_from_leaf_hashes(hashes)


@settings(max_examples=60, deadline=None)
@given(data=st.lists(st.binary(max_size=8), min_size=1, max_size=120), choice=st.data())
def test_property_merkle_tree_matches_pure_functions(data: list[bytes], choice: st.DataObject) -> None:
    hashes = [leaf_hash(d) for d in data]
    built = MerkleTree.from_leaf_hashes(hashes)
    appended = MerkleTree()
    appended.extend(hashes)
    size = choice.draw(st.integers(1, len(hashes)))
    index = choice.draw(st.integers(0, size - 1))
    old = choice.draw(st.integers(0, size))
    for tree in (built, appended):
        assert tree.root(size) == root_from_leaf_hashes(hashes[:size])
        assert tree.inclusion_proof(index, size) == inclusion_proof(hashes, index, size)
        assert tree.consistency_proof(old, size) == consistency_proof(hashes, old, size)
        assert tree.leaf_hash(index) == hashes[index]


# --------------------------------------------------------------------------------------------------
# Compact range serialisation errors


def test_compact_range_rejects_bad_state() -> None:
    with pytest.raises(ValueError):
        CompactRange(3, [SOME_HASH])  # size 3 needs two hashes
    with pytest.raises(ValueError):
        CompactRange(1, [b"short"])
    with pytest.raises(ValueError):
        MerkleTree.from_leaf_hashes([SOME_HASH[:31], SOME_HASH + b"x"])
    with pytest.raises(ProofError):
        root_from_leaf_hashes([SOME_HASH, SOME_HASH[:31]])
    good = CompactRange.from_leaf_hashes(LEAF_HASHES[:7]).to_bytes()
    for bad in (good[:-1], good + b"\x00", b"XXXX" + good[4:], good[:5]):
        with pytest.raises(ValueError):
            CompactRange.from_bytes(bad)
    with pytest.raises(ValueError):
        CompactRange.from_json('{"size": 2, "hashes": []}')
    doc = CompactRange.from_leaf_hashes(LEAF_HASHES[:7]).to_json().replace('"size":7', '"size":7.0')
    with pytest.raises(ValueError):
        CompactRange.from_json(doc)


def test_compact_range_root_field_checked() -> None:
    cr = CompactRange.from_leaf_hashes(LEAF_HASHES[:5])
    other = CompactRange.from_leaf_hashes(LEAF_HASHES[:3])
    doc = json.loads(cr.to_json())
    doc["root"] = json.loads(other.to_json())["root"]
    with pytest.raises(ValueError, match="root"):
        CompactRange.from_json(json.dumps(doc))
    assert len(cr.to_bytes()) == 5 + 8 + 2 * 32
