"""RFC 6962 / RFC 9162 Merkle tree: hashing, proofs, verification, compact ranges.

Pure functions over SHA-256 hashes; no I/O. The layout follows transparency-dev/merkle:

* ``leaf_hash``/``node_hash`` are the RFC 6962 hashes with 0x00/0x01 domain separation, so a leaf can
  never be confused with an interior node (second-preimage protection).
* ``inclusion_proof``/``consistency_proof`` produce RFC 6962 PATH/PROOF lists from a sequence of leaf
  hashes in O(n) hashing (each leaf is hashed into at most one sibling subtree), which is fine for
  one-off proofs; ``MerkleTree`` keeps every complete subtree hash in contiguous byte arrays so that
  repeated proofs cost O(log n).
* ``verify_inclusion``/``verify_consistency`` are the RFC 9162 §2.1.3.2 / §2.1.4.2 algorithms verbatim
  (bit-twiddling over ``fn``/``sn``), preceded by explicit size checks for clearer errors.
* ``CompactRange`` is the frontier of perfect subtrees of a growing tree: append is amortised O(1)
  hashing, root is O(log n), and it serialises to a few hundred bytes so a store can persist it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import struct
from collections.abc import Callable, Iterable, Sequence

__all__ = [
    "EMPTY_ROOT",
    "HASH_SIZE",
    "CompactRange",
    "MerkleTree",
    "ProofError",
    "consistency_proof",
    "consistency_proof_size",
    "inclusion_proof",
    "inclusion_proof_size",
    "leaf_hash",
    "node_hash",
    "root_from_leaf_hashes",
    "verify_consistency",
    "verify_inclusion",
]

HASH_SIZE = 32
_sha256 = hashlib.sha256
EMPTY_ROOT: bytes = _sha256(b"").digest()

# Perfect subtrees up to 2**_CHUNK_LEVEL leaves are hashed level by level with list comprehensions,
# which keeps the per-hash Python overhead low without materialising big intermediate lists.
_CHUNK_LEVEL = 12

# A (level, index) -> hash lookup of the perfect, aligned subtree covering leaves
# [index << level, (index + 1) << level).
NodeFn = Callable[[int, int], bytes]


class ProofError(ValueError):
    """A Merkle proof (or its inputs) failed verification."""


def leaf_hash(data: bytes) -> bytes:
    """RFC 6962 leaf hash: SHA-256(0x00 ‖ data)."""
    return _sha256(b"\x00" + data).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    """RFC 6962 interior node hash: SHA-256(0x01 ‖ left ‖ right)."""
    return _sha256(b"\x01" + left + right).digest()


# --------------------------------------------------------------------------------------------------
# Tree geometry helpers


def _check_size(name: str, value: object) -> int:
    # bool is an int subclass; a JSON `true` must not pass as tree size 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ProofError(f"{name} must be an integer, got {type(value).__name__}")
    if value < 0 or value >= 1 << 64:
        raise ProofError(f"{name} {value} is out of range [0, 2^64)")
    return value


def _check_hash(name: str, value: object) -> bytes:
    if not isinstance(value, bytes | bytearray | memoryview):
        raise ProofError(f"{name} must be bytes, got {type(value).__name__}")
    value = bytes(value)
    if len(value) != HASH_SIZE:
        raise ProofError(f"{name} has {len(value)} bytes, want {HASH_SIZE}")
    return value


def _split(n: int) -> int:
    """Largest power of two strictly less than n (n >= 2): the RFC 6962 MTH split point."""
    return 1 << ((n - 1).bit_length() - 1)


def _decomp_incl_proof(index: int, size: int) -> tuple[int, int]:
    # Inner part: levels below the point where the paths to `index` and `size - 1` diverge;
    # border part: left siblings on the right border above it (transparency-dev/merkle).
    inner = (index ^ (size - 1)).bit_length()
    border = (index >> inner).bit_count()
    return inner, border


def inclusion_proof_size(index: int, size: int) -> int:
    """Number of hashes in the inclusion proof of leaf ``index`` in a tree of ``size`` leaves."""
    if not 0 <= index < size:
        raise ProofError(f"leaf index {index} is not below tree size {size}")
    inner, border = _decomp_incl_proof(index, size)
    return inner + border


def consistency_proof_size(old_size: int, new_size: int) -> int:
    """Number of hashes in the consistency proof between two tree sizes."""
    if not 0 <= old_size <= new_size:
        raise ProofError(f"need 0 <= old size <= new size, got {old_size} and {new_size}")
    if old_size in (0, new_size):
        return 0
    inner, border = _decomp_incl_proof(old_size - 1, new_size)
    shift = (old_size & -old_size).bit_length() - 1
    # A power-of-two old tree is itself a node on the path, so its root is not repeated in the proof.
    seed = 0 if old_size == 1 << shift else 1
    return seed + inner - shift + border


# --------------------------------------------------------------------------------------------------
# Subtree roots


def _perfect_root_from_leaves(leaf_hashes: Sequence[bytes], lo: int, level: int) -> bytes:
    """Root of the perfect subtree over leaf_hashes[lo : lo + 2**level]."""
    if level > _CHUNK_LEVEL:
        half = level - 1
        return node_hash(
            _perfect_root_from_leaves(leaf_hashes, lo, half),
            _perfect_root_from_leaves(leaf_hashes, lo + (1 << half), half),
        )
    nodes = list(leaf_hashes[lo : lo + (1 << level)])
    if any(len(n) != HASH_SIZE for n in nodes):
        raise ProofError(f"leaf hashes must be {HASH_SIZE} bytes (bad one in [{lo}, {lo + len(nodes)}))")
    while len(nodes) > 1:
        nodes = [_sha256(b"\x01" + a + b).digest() for a, b in zip(nodes[0::2], nodes[1::2], strict=True)]
    return bytes(nodes[0])


def _leaf_node_fn(leaf_hashes: Sequence[bytes]) -> NodeFn:
    return lambda level, index: _perfect_root_from_leaves(leaf_hashes, index << level, level)


def _range_root(node: NodeFn, lo: int, hi: int) -> bytes:
    """MTH of leaves [lo, hi), where lo is a multiple of the largest power of two <= hi - lo.

    Every range in the RFC 6962 recursion has that alignment, so the range is the perfect subtrees
    given by the binary digits of hi - lo, largest first, folded from the right (which is exactly
    MTH's split at the largest power of two below n).
    """
    n = hi - lo
    if n == 0:
        return EMPTY_ROOT
    parts: list[bytes] = []
    pos = lo
    for level in range(n.bit_length() - 1, -1, -1):
        if n >> level & 1:
            parts.append(node(level, pos >> level))
            pos += 1 << level
    root = parts[-1]
    for h in reversed(parts[:-1]):
        root = node_hash(h, root)
    return root


def _inclusion_path(node: NodeFn, index: int, size: int) -> list[bytes]:
    # Iterative RFC 6962 PATH(m, D[n]): collect siblings top-down, then reverse to leaf-to-root order.
    proof: list[bytes] = []
    lo, hi = 0, size
    while hi - lo > 1:
        k = _split(hi - lo)
        if index < lo + k:
            proof.append(_range_root(node, lo + k, hi))
            hi = lo + k
        else:
            proof.append(_range_root(node, lo, lo + k))
            lo += k
    proof.reverse()
    return proof


def _consistency_path(node: NodeFn, old_size: int, new_size: int) -> list[bytes]:
    # Iterative RFC 6962 SUBPROOF(m, D[n], b); `complete` is b (m is the whole original tree so far).
    proof: list[bytes] = []
    lo, hi, m, complete = 0, new_size, old_size, True
    while True:
        if m == hi - lo:
            if not complete:
                proof.append(_range_root(node, lo, hi))
            break
        k = _split(hi - lo)
        if m <= k:
            proof.append(_range_root(node, lo + k, hi))
            hi = lo + k
        else:
            proof.append(_range_root(node, lo, lo + k))
            lo += k
            m -= k
            complete = False
    proof.reverse()
    return proof


def root_from_leaf_hashes(hashes: Sequence[bytes]) -> bytes:
    """RFC 6962 Merkle Tree Hash over the given leaf hashes (EMPTY_ROOT for none)."""
    return _range_root(_leaf_node_fn(hashes), 0, len(hashes))


def _check_tree_size(size: int, available: int) -> int:
    size = _check_size("tree size", size)
    if size > available:
        raise ProofError(f"tree size {size} exceeds the {available} leaf hashes available")
    return size


def inclusion_proof(leaf_hashes: Sequence[bytes], index: int, size: int) -> list[bytes]:
    """RFC 6962 PATH: audit path for leaf ``index`` in the tree over ``leaf_hashes[:size]``.

    O(size) hashing; use ``MerkleTree`` when many proofs are needed over the same leaves.
    """
    size = _check_tree_size(size, len(leaf_hashes))
    index = _check_size("leaf index", index)
    if index >= size:
        raise ProofError(f"leaf index {index} is not below tree size {size}")
    return _inclusion_path(_leaf_node_fn(leaf_hashes), index, size)


def consistency_proof(leaf_hashes: Sequence[bytes], old_size: int, new_size: int) -> list[bytes]:
    """RFC 6962 PROOF: consistency proof from ``old_size`` to ``new_size`` over ``leaf_hashes``.

    Empty when ``old_size`` is 0 or equals ``new_size`` (nothing to prove). O(new_size) hashing.
    """
    new_size = _check_tree_size(new_size, len(leaf_hashes))
    old_size = _check_size("old size", old_size)
    if old_size > new_size:
        raise ProofError(f"old size {old_size} exceeds new size {new_size}")
    if old_size in (0, new_size):
        return []
    return _consistency_path(_leaf_node_fn(leaf_hashes), old_size, new_size)


# --------------------------------------------------------------------------------------------------
# Verification (RFC 9162 §2.1.3.2 and §2.1.4.2)


def _roots_equal(calculated: bytes, expected: bytes) -> bool:
    return hmac.compare_digest(calculated, expected)


def verify_inclusion(leaf_hash: bytes, index: int, size: int, proof: Sequence[bytes], root: bytes) -> None:
    """Check that ``leaf_hash`` is leaf ``index`` of the tree of ``size`` leaves with root ``root``.

    Raises ProofError on any mismatch or malformed input.
    """
    leaf_hash = _check_hash("leaf hash", leaf_hash)
    root = _check_hash("root hash", root)
    index = _check_size("leaf index", index)
    size = _check_size("tree size", size)
    if index >= size:
        raise ProofError(f"leaf index {index} is not below tree size {size}")
    path = [_check_hash(f"proof[{i}]", p) for i, p in enumerate(proof)]
    want = inclusion_proof_size(index, size)
    if len(path) != want:
        raise ProofError(f"inclusion proof has {len(path)} hashes, want {want} for leaf {index} of {size}")

    fn, sn = index, size - 1
    r = leaf_hash
    for p in path:
        if sn == 0:
            raise ProofError("inclusion proof is longer than the path to the root")
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            # On the right border a node without a right sibling is promoted unchanged.
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            r = node_hash(r, p)
        fn >>= 1
        sn >>= 1
    if sn != 0:
        raise ProofError("inclusion proof is shorter than the path to the root")
    if not _roots_equal(r, root):
        raise ProofError(
            f"inclusion proof for leaf {index} of {size} gives root {r.hex()}, expected {root.hex()}"
        )


def verify_consistency(
    old_size: int, new_size: int, old_root: bytes, new_root: bytes, proof: Sequence[bytes]
) -> None:
    """Check that the tree (old_size, old_root) is a prefix of the tree (new_size, new_root).

    Conventions for the trivial cases: equal sizes need an empty proof and equal roots; an old size
    of 0 needs an empty proof and old_root == EMPTY_ROOT (every tree extends the empty tree).
    Raises ProofError on any mismatch or malformed input.
    """
    old_size = _check_size("old size", old_size)
    new_size = _check_size("new size", new_size)
    old_root = _check_hash("old root", old_root)
    new_root = _check_hash("new root", new_root)
    path = [_check_hash(f"proof[{i}]", p) for i, p in enumerate(proof)]
    if old_size > new_size:
        raise ProofError(f"old size {old_size} exceeds new size {new_size}: trees only grow")
    if old_size == new_size:
        if path:
            raise ProofError("sizes are equal but the consistency proof is not empty")
        if not _roots_equal(old_root, new_root):
            raise ProofError(f"two different roots for the same tree size {old_size}")
        return
    if old_size == 0:
        if path:
            raise ProofError("a consistency proof from the empty tree must be empty")
        if not _roots_equal(old_root, EMPTY_ROOT):
            raise ProofError("old size is 0 but old root is not the empty-tree hash")
        return
    want = consistency_proof_size(old_size, new_size)
    if len(path) != want:
        raise ProofError(
            f"consistency proof has {len(path)} hashes, want {want} for {old_size} -> {new_size}"
        )

    # RFC 9162 §2.1.4.2, step by step.
    if old_size & (old_size - 1) == 0:
        path.insert(0, old_root)
    fn, sn = old_size - 1, new_size - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            raise ProofError("consistency proof is longer than the path to the root")
        if fn & 1 or fn == sn:
            fr = node_hash(c, fr)
            sr = node_hash(c, sr)
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            sr = node_hash(sr, c)
        fn >>= 1
        sn >>= 1
    if sn != 0:
        raise ProofError("consistency proof is shorter than the path to the root")
    if not _roots_equal(fr, old_root):
        raise ProofError(f"consistency proof gives old root {fr.hex()}, expected {old_root.hex()}")
    if not _roots_equal(sr, new_root):
        raise ProofError(f"consistency proof gives new root {sr.hex()}, expected {new_root.hex()}")


# --------------------------------------------------------------------------------------------------
# Compact range: the right frontier of a growing tree

_COMPACT_MAGIC = b"RLCR\x01"  # format tag + version, so a stored blob is never misread


class CompactRange:
    """Frontier of a tree over leaves [0, size): one perfect-subtree hash per set bit of ``size``.

    ``hashes[0]`` is the leftmost (largest) subtree. Appending merges equal-sized subtrees like a
    binary counter, so n appends cost n leaf merges in total (amortised O(1)); ``root`` folds the
    O(log n) frontier hashes from the right.
    """

    __slots__ = ("_hashes", "_size")

    def __init__(self, size: int = 0, hashes: Iterable[bytes] = ()) -> None:
        size = _check_size("compact range size", size)
        frontier = [_check_hash(f"frontier[{i}]", h) for i, h in enumerate(hashes)]
        if len(frontier) != size.bit_count():
            raise ValueError(
                f"a compact range of size {size} has {size.bit_count()} hashes, got {len(frontier)}"
            )
        self._size = size
        self._hashes = frontier

    @classmethod
    def from_leaf_hashes(cls, leaf_hashes: Sequence[bytes]) -> CompactRange:
        """Build the frontier directly (hashes every leaf once, no per-append bookkeeping)."""
        n = len(leaf_hashes)
        node = _leaf_node_fn(leaf_hashes)
        frontier: list[bytes] = []
        pos = 0
        for level in range(n.bit_length() - 1, -1, -1):
            if n >> level & 1:
                frontier.append(node(level, pos >> level))
                pos += 1 << level
        return cls(n, frontier)

    @property
    def size(self) -> int:
        return self._size

    @property
    def hashes(self) -> tuple[bytes, ...]:
        return tuple(self._hashes)

    def append(self, leaf_hash: bytes) -> None:
        h = _check_hash("leaf hash", leaf_hash)
        frontier = self._hashes
        s = self._size
        while s & 1:
            h = node_hash(frontier.pop(), h)
            s >>= 1
        frontier.append(h)
        self._size += 1

    def extend(self, leaf_hashes: Iterable[bytes]) -> None:
        for h in leaf_hashes:
            self.append(h)

    def root(self) -> bytes:
        if not self._hashes:
            return EMPTY_ROOT
        r = self._hashes[-1]
        for h in reversed(self._hashes[:-1]):
            r = node_hash(h, r)
        return r

    def copy(self) -> CompactRange:
        return CompactRange(self._size, self._hashes)

    def to_bytes(self) -> bytes:
        """Magic ‖ 8-byte big-endian size ‖ frontier hashes (at most 64 * 32 bytes)."""
        return _COMPACT_MAGIC + struct.pack(">Q", self._size) + b"".join(self._hashes)

    @classmethod
    def from_bytes(cls, data: bytes) -> CompactRange:
        data = bytes(data)
        head = len(_COMPACT_MAGIC) + 8
        if len(data) < head or not data.startswith(_COMPACT_MAGIC):
            raise ValueError("not a serialised compact range (bad magic or truncated)")
        (size,) = struct.unpack(">Q", data[len(_COMPACT_MAGIC) : head])
        body = data[head:]
        if len(body) != size.bit_count() * HASH_SIZE:
            raise ValueError(
                f"compact range of size {size} needs {size.bit_count()} hashes, got {len(body)} bytes"
            )
        return cls(size, [body[i : i + HASH_SIZE] for i in range(0, len(body), HASH_SIZE)])

    def to_json(self) -> str:
        """``{"size": n, "hashes": [base64...]}`` with the root included for human inspection."""
        return json.dumps(
            {
                "size": self._size,
                "hashes": [base64.b64encode(h).decode() for h in self._hashes],
                "root": base64.b64encode(self.root()).decode(),
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> CompactRange:
        doc = json.loads(text)
        if not isinstance(doc, dict) or "size" not in doc or not isinstance(doc.get("hashes"), list):
            raise ValueError("compact range JSON needs 'size' and 'hashes'")
        hashes = []
        for h in doc["hashes"]:
            if not isinstance(h, str):
                raise ValueError("compact range hashes must be base64 strings")
            hashes.append(base64.b64decode(h, validate=True))
        cr = cls(doc["size"], hashes)
        # The stored root is redundant; if present it must agree, which catches a corrupted file early.
        if "root" in doc and base64.b64decode(doc["root"], validate=True) != cr.root():
            raise ValueError("compact range JSON root does not match its hashes")
        return cr

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CompactRange):
            return NotImplemented
        return self._size == other._size and self._hashes == other._hashes

    def __hash__(self) -> int:
        return hash((self._size, tuple(self._hashes)))

    def __repr__(self) -> str:
        return f"CompactRange(size={self._size}, root={self.root().hex()[:16]}…)"


# --------------------------------------------------------------------------------------------------
# In-memory tree with every complete subtree hash, for repeated O(log n) proofs


class MerkleTree:
    """All complete-subtree hashes of a tree, one contiguous ``bytearray`` per level.

    Level 0 holds the leaf hashes; level L holds the ``size >> L`` complete nodes of 2**L leaves.
    Memory is about 2 * 32 bytes per leaf (640 MB at 10M leaves), versus ~75 bytes per leaf for a
    list of ``bytes``. Roots and proofs for any size up to ``size`` cost O(log n) lookups and at most
    O(log^2 n) hashing; appends are amortised O(1).
    """

    __slots__ = ("_levels", "_size")

    def __init__(self) -> None:
        self._levels: list[bytearray] = [bytearray()]
        self._size = 0

    @classmethod
    def from_leaf_hashes(cls, leaf_hashes: Iterable[bytes]) -> MerkleTree:
        tree = cls()
        hashes = leaf_hashes if isinstance(leaf_hashes, Sequence) else list(leaf_hashes)
        # Checked per item: a 31- and a 33-byte hash would otherwise join into two "valid" ones.
        if any(len(h) != HASH_SIZE for h in hashes):
            raise ValueError("leaf hashes must all be 32 bytes")
        level = bytearray(b"".join(hashes))
        tree._size = len(level) // HASH_SIZE
        tree._levels = [level]
        while len(level) >= 2 * HASH_SIZE:
            end = len(level) - len(level) % (2 * HASH_SIZE)
            level = bytearray(
                b"".join(
                    [_sha256(b"\x01" + level[i : i + 2 * HASH_SIZE]).digest() for i in range(0, end, 64)]
                )
            )
            tree._levels.append(level)
        return tree

    @property
    def size(self) -> int:
        return self._size

    def append(self, leaf_hash: bytes) -> None:
        h = _check_hash("leaf hash", leaf_hash)
        levels = self._levels
        levels[0] += h
        s, lvl = self._size, 0
        while s & 1:
            pair = levels[lvl][-2 * HASH_SIZE :]
            h = node_hash(bytes(pair[:HASH_SIZE]), bytes(pair[HASH_SIZE:]))
            lvl += 1
            if lvl == len(levels):
                levels.append(bytearray())
            levels[lvl] += h
            s >>= 1
        self._size += 1

    def extend(self, leaf_hashes: Iterable[bytes]) -> None:
        for h in leaf_hashes:
            self.append(h)

    def _node(self, level: int, index: int) -> bytes:
        off = index * HASH_SIZE
        return bytes(self._levels[level][off : off + HASH_SIZE])

    def leaf_hash(self, index: int) -> bytes:
        if not 0 <= index < self._size:
            raise IndexError(f"leaf index {index} out of range for size {self._size}")
        return self._node(0, index)

    def _size_arg(self, size: int | None) -> int:
        return self._size if size is None else _check_tree_size(size, self._size)

    def root(self, size: int | None = None) -> bytes:
        return _range_root(self._node, 0, self._size_arg(size))

    def inclusion_proof(self, index: int, size: int | None = None) -> list[bytes]:
        size = self._size_arg(size)
        index = _check_size("leaf index", index)
        if index >= size:
            raise ProofError(f"leaf index {index} is not below tree size {size}")
        return _inclusion_path(self._node, index, size)

    def consistency_proof(self, old_size: int, new_size: int | None = None) -> list[bytes]:
        new_size = self._size_arg(new_size)
        old_size = _check_size("old size", old_size)
        if old_size > new_size:
            raise ProofError(f"old size {old_size} exceeds new size {new_size}")
        if old_size in (0, new_size):
            return []
        return _consistency_path(self._node, old_size, new_size)

    def compact_range(self, size: int | None = None) -> CompactRange:
        """The frontier at ``size`` (e.g. to check a persisted CompactRange against the leaves)."""
        size = self._size_arg(size)
        frontier: list[bytes] = []
        pos = 0
        for level in range(size.bit_length() - 1, -1, -1):
            if size >> level & 1:
                frontier.append(self._node(level, pos >> level))
                pos += 1 << level
        return CompactRange(size, frontier)
