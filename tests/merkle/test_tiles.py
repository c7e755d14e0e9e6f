"""runledger.ledger.tiles: C2SP tlog-tiles paths, bundles, tile growth, proofs from tiles, every corruption."""

from __future__ import annotations

import itertools

import pytest

from runledger.ledger.merkle import (
    MerkleTree,
    ProofError,
    consistency_proof,
    inclusion_proof,
    leaf_hash,
    root_from_leaf_hashes,
)
from runledger.ledger.tiles import (
    MAX_ENTRY_BYTES,
    TILE_WIDTH,
    Tile,
    TileError,
    check_bundle,
    check_tile_tree,
    consistency_proof_from_tiles,
    decode_bundle,
    encode_bundle,
    entries_path,
    format_index,
    grow_tiles,
    inclusion_proof_from_tiles,
    parse_tile_path,
    root_from_tiles,
    root_of_prefix,
    tile_path,
    tile_width,
    walk_entries,
    walk_new_entries,
)
from tests.merkle.test_merkle import LEAF_INPUTS, ROOT_HASHES


class TileStore:
    """Tiles and bundles in a dict keyed by their C2SP paths, grown the way `ledger publish` does."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.size = 0
        self.leaves: list[bytes] = []

    def read_tile(self, level: int, index: int, width: int) -> bytes:
        try:
            return self.files[tile_path(level, index, width)]
        except KeyError:
            raise TileError(f"no tile {tile_path(level, index, width)}") from None

    def read_bundle(self, index: int, width: int) -> bytes:
        return self.files[entries_path(index, width)]

    def grow(self, entries: list[bytes]) -> list[Tile]:
        tiles = grow_tiles(self.size, [leaf_hash(e) for e in entries], self.read_tile)
        for tile in tiles:
            old = self.files.get(tile.path)
            assert old is None or old == tile.data, f"{tile.path} rewritten with other bytes"
            self.files[tile.path] = tile.data
        self.leaves += entries
        first = self.size // TILE_WIDTH
        self.size += len(entries)
        for index in range(first, -(-self.size // TILE_WIDTH)):
            width = tile_width(0, index, self.size)
            chunk = self.leaves[index * TILE_WIDTH : index * TILE_WIDTH + width]
            self.files[entries_path(index, width)] = encode_bundle(chunk)
        return tiles


def entry(i: int) -> bytes:
    return f"entry {i}".encode()


# -------------------------------------------------------------------------------- paths


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "000"),
        (5, "005"),
        (999, "999"),
        (1000, "x001/000"),
        (1234067, "x001/x234/067"),
        (10**9, "x001/x000/x000/000"),
    ],
)
def test_index_groups(n: int, text: str) -> None:
    assert format_index(n) == text


def test_paths_fixed_vectors() -> None:
    assert tile_path(0, 0) == "tile/0/000"
    assert tile_path(1, 1234067, 5) == "tile/1/x001/x234/067.p/5"
    assert tile_path(3, 2, 255) == "tile/3/002.p/255"
    assert entries_path(3, 1) == "tile/entries/003.p/1"
    assert entries_path(1234067) == "tile/entries/x001/x234/067"


def test_tile_paths_parse_back_and_only_canonically() -> None:
    for path, want in [
        ("tile/0/000", (0, 0, 256)),
        ("tile/1/x001/x234/067.p/5", (1, 1234067, 5)),
        ("tile/entries/003.p/1", (None, 3, 1)),
    ]:
        assert parse_tile_path(path) == want
    for bad in [
        "tile/0/1",
        "tile/0/x000/001",
        "tile/0/000.p/256",
        "tile/0/000.p/0",
        "tile/0/000.p/007",
        "tile/64/000",
        "tile/00/000",
        "tile/entries/000.p/",
        "tile/0/000/",
        "../tile/0/000",
    ]:
        with pytest.raises(TileError):
            parse_tile_path(bad)
    with pytest.raises(TileError):
        tile_path(0, 0, 0)
    with pytest.raises(TileError):
        format_index(-1)


def test_tile_width() -> None:
    assert [tile_width(0, i, 600) for i in range(4)] == [256, 256, 88, 0]
    assert tile_width(1, 0, 600) == 2
    assert tile_width(2, 0, 600) == 0
    assert tile_width(1, 0, 65536) == 256 and tile_width(2, 0, 65536) == 1


# -------------------------------------------------------------------------------- bundles


def test_bundle_round_trip_and_fixed_bytes() -> None:
    assert encode_bundle([b"ab", b"", b"c"]) == b"\x00\x02ab\x00\x00\x00\x01c"
    assert decode_bundle(b"\x00\x02ab\x00\x00\x00\x01c", 3) == [b"ab", b"", b"c"]
    big = b"x" * MAX_ENTRY_BYTES
    assert decode_bundle(encode_bundle([big])) == [big]
    with pytest.raises(TileError, match="at most 65535"):
        encode_bundle([big + b"x"])


@pytest.mark.parametrize(
    ("data", "width", "why"),
    [
        (b"\x00", None, "inside a length prefix"),
        (b"\x00\x05abc", None, "past the end"),
        (b"\x00\x01a", 2, "want 2"),
        (b"\x00\x01a\x00\x01b", 1, "want 1"),
    ],
)
def test_bad_bundles_are_refused(data: bytes, width: int | None, why: str) -> None:
    with pytest.raises(TileError, match=why):
        decode_bundle(data, width)


# -------------------------------------------------------------------------------- hash tiles


def test_rfc6962_roots_through_tiles_at_every_size() -> None:
    store = TileStore()
    assert root_from_tiles(store.read_tile, 0) == ROOT_HASHES[0]
    for size, data in enumerate(LEAF_INPUTS, start=1):
        store.grow([data])
        assert root_from_tiles(store.read_tile, size) == ROOT_HASHES[size]
        assert tile_path(0, 0, size) in store.files  # the partial tile of every checkpointed size
    assert store.files["tile/0/000.p/8"] == b"".join(leaf_hash(x) for x in LEAF_INPUTS)


SIZES = [1, 255, 256, 257, 511, 600, 65535, 65536, 65537, 66000]


@pytest.fixture(scope="module")
def grown() -> TileStore:
    store = TileStore()
    for size in SIZES:
        store.grow([entry(i) for i in range(store.size, size)])
    return store


def test_growth_matches_the_tree_at_every_checkpointed_size(grown: TileStore) -> None:
    hashes = [leaf_hash(e) for e in grown.leaves]
    for size in SIZES:
        want = root_from_leaf_hashes(hashes[:size])
        assert root_from_tiles(grown.read_tile, size) == want, size
        assert root_of_prefix(grown.read_tile, SIZES[-1], size) == want, size
        for level in range(3):  # every partial tile a client of this size asks for is there
            width = tile_width(level, (size >> (8 * level)) // TILE_WIDTH, size)
            if 0 < width < TILE_WIDTH:
                assert tile_path(level, (size >> (8 * level)) // TILE_WIDTH, width) in grown.files
    # Higher levels hold the roots of full tiles only: level 1 has 257 hashes (256 full + 1 partial
    # tile of level 1), level 2 one hash (the first 65,536 leaves).
    assert grown.files["tile/1/000"][:32] == root_from_leaf_hashes(hashes[:256])
    assert grown.files["tile/1/001.p/1"] == root_from_leaf_hashes(hashes[65536 : 65536 + 256])
    assert grown.files["tile/2/000.p/1"] == root_from_leaf_hashes(hashes[:65536])
    assert "tile/2/000.p/2" not in grown.files  # a partial tile is never hashed upward


def test_proofs_from_tiles_equal_proofs_from_leaves(grown: TileStore) -> None:
    tree = MerkleTree.from_leaf_hashes(leaf_hash(e) for e in grown.leaves)
    size = SIZES[-1]
    for index in [0, 1, 255, 256, 65535, 65536, 65999]:
        assert inclusion_proof_from_tiles(grown.read_tile, index, size) == tree.inclusion_proof(index, size)
    for old, new in itertools.pairwise(SIZES):
        assert consistency_proof_from_tiles(grown.read_tile, old, new) == tree.consistency_proof(old, new)
    small = [leaf_hash(x) for x in LEAF_INPUTS]  # and the module functions agree with MerkleTree
    assert inclusion_proof(small, 3, 8) == MerkleTree.from_leaf_hashes(small).inclusion_proof(3, 8)
    assert consistency_proof(small, 3, 8) == MerkleTree.from_leaf_hashes(small).consistency_proof(3, 8)
    with pytest.raises(ProofError):
        inclusion_proof_from_tiles(grown.read_tile, size, size)


def test_walk_returns_every_entry_in_order(grown: TileStore) -> None:
    root = root_from_leaf_hashes([leaf_hash(e) for e in grown.leaves])
    assert list(walk_entries(grown.read_tile, grown.read_bundle, grown.size, root)) == grown.leaves


# -------------------------------------------------------------------------------- every corruption


@pytest.fixture()
def small() -> tuple[TileStore, bytes]:
    store = TileStore()
    for size in [100, 256, 600]:
        store.grow([entry(i) for i in range(store.size, size)])
    return store, root_from_leaf_hashes([leaf_hash(e) for e in store.leaves])


def _walk(store: TileStore, root: bytes) -> list[bytes]:
    return list(walk_entries(store.read_tile, store.read_bundle, store.size, root))


def test_every_flipped_hash_byte_of_every_tile_is_caught(small: tuple[TileStore, bytes]) -> None:
    store, root = small
    tiles = ["tile/0/000", "tile/0/001", "tile/0/002.p/88", "tile/1/000.p/2"]
    missed = []
    for path in tiles:
        good = store.files[path]
        for pos in range(len(good)):
            if pos % 32:  # every hash, at its first byte
                continue
            store.files[path] = good[:pos] + bytes([good[pos] ^ 0x01]) + good[pos + 1 :]
            try:
                _walk(store, root)
                missed.append((path, pos))
            except (ProofError, TileError):
                pass
        store.files[path] = good
    assert missed == []
    assert len(_walk(store, root)) == 600


def test_every_flipped_byte_of_a_bundle_is_caught(small: tuple[TileStore, bytes]) -> None:
    store, root = small
    check_tile_tree(store.read_tile, store.size, root)
    good = store.files["tile/entries/002.p/88"]
    missed = []
    for pos in range(len(good)):
        bad = good[:pos] + bytes([good[pos] ^ 0x01]) + good[pos + 1 :]
        try:
            check_bundle(bad, 2, 88, store.read_tile, store.size)
            missed.append(pos)
        except TileError:
            pass
    assert missed == []


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b[:-1],  # cut short
        lambda b: b + b"\x00",  # a trailing byte
        lambda b: b[:-32],  # a hash missing
        lambda b: b + b"\x00" * 32,  # a hash too many
        lambda b: b[32:64] + b[:32] + b[64:],  # two hashes swapped
    ],
)
def test_reshaped_tiles_are_caught(small: tuple[TileStore, bytes], damage: object) -> None:
    store, root = small
    for path in ["tile/0/001", "tile/0/002.p/88", "tile/1/000.p/2"]:
        good = store.files[path]
        store.files[path] = damage(good)  # type: ignore[operator]
        with pytest.raises((ProofError, TileError)):
            _walk(store, root)
        store.files[path] = good


def test_reshaped_bundles_and_wrong_roots_are_caught(small: tuple[TileStore, bytes]) -> None:
    store, root = small
    entries = decode_bundle(store.files["tile/entries/001"], 256)
    for bad in [
        encode_bundle([entries[1], entries[0], *entries[2:]]),  # two entries swapped
        encode_bundle(entries[:-1]),  # one missing
        encode_bundle([*entries, b"extra"]),  # one too many
        store.files["tile/entries/001"][:-1],  # cut short
    ]:
        with pytest.raises(TileError):
            check_bundle(bad, 1, 256, store.read_tile, store.size)
    with pytest.raises(ProofError):
        _walk(store, leaf_hash(b"another root"))
    with pytest.raises((ProofError, TileError)):  # a size the tiles do not reach
        list(walk_entries(store.read_tile, store.read_bundle, 700, root))


def test_walking_only_the_new_entries(grown: TileStore, small: tuple[TileStore, bytes]) -> None:
    root = root_from_leaf_hashes([leaf_hash(e) for e in grown.leaves])
    stores = [(grown, root, old) for old in [65535, 65536, 65999, 66000]]
    stores += [(small[0], small[1], old) for old in [0, 255, 256, 300, 600]]
    for store, signed, old in stores:
        got = list(walk_new_entries(store.read_tile, store.read_bundle, old, store.size, signed))
        assert [i for i, _ in got] == list(range(old, store.size))
        assert [e for _, e in got] == store.leaves[old:]


def test_walking_new_entries_catches_a_changed_new_tile(small: tuple[TileStore, bytes]) -> None:
    store, root = small
    for path, pos in [("tile/0/001", 3), ("tile/0/002.p/88", 40), ("tile/entries/002.p/88", 9)]:
        good = store.files[path]
        store.files[path] = good[:pos] + bytes([good[pos] ^ 1]) + good[pos + 1 :]
        with pytest.raises((ProofError, TileError)):
            list(walk_new_entries(store.read_tile, store.read_bundle, 300, store.size, root))
        store.files[path] = good
