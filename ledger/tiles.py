"""C2SP tlog-tiles: the static layout a log is published in, as pure functions (no I/O).

A tiled log of ``size`` leaves is served as

* ``tile/<L>/<N>[.p/<W>]``: hash tiles. A level-0 tile holds up to 256 consecutive leaf hashes
  (32 bytes each, concatenated); a level-L tile holds the roots of 256 consecutive *full* tiles of
  level L-1 (so a hash at level L is the root of a perfect subtree of 256**L leaves). A tile that is
  not full is a partial tile, named with ``.p/<W>`` (W = 1..255 hashes); it is never hashed upward.
* ``tile/entries/<N>[.p/<W>]``: entry bundles, the same grouping of the entries themselves, each
  entry as a big-endian uint16 length then its bytes (so an entry is at most 65,535 bytes).

``<N>`` is written in 3-digit groups, each but the last prefixed ``x`` (1234067 → ``x001/x234/067``).
Hashing is RFC 6962, ``runledger.ledger.merkle``'s. Readers and writers here take a ``TileReader`` (a function
from (level, index, width) to the tile's bytes) so the same code serves a folder, an HTTP server or
tiles staged in memory.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from runledger.ledger.merkle import (
    HASH_SIZE,
    ProofError,
    _consistency_path,
    _inclusion_path,
    _range_root,
    leaf_hash,
    root_from_leaf_hashes,
)

__all__ = [
    "MAX_ENTRY_BYTES",
    "TILE_HEIGHT",
    "TILE_WIDTH",
    "BundleReader",
    "Tile",
    "TileError",
    "TileReader",
    "check_bundle",
    "check_tile_tree",
    "consistency_proof_from_tiles",
    "decode_bundle",
    "encode_bundle",
    "entries_path",
    "format_index",
    "grow_tiles",
    "inclusion_proof_from_tiles",
    "parse_tile_path",
    "root_from_tiles",
    "root_of_prefix",
    "split_hashes",
    "tile_path",
    "tile_width",
    "walk_entries",
    "walk_new_entries",
]

TILE_HEIGHT = 8  # a tile spans 8 tree levels
TILE_WIDTH = 1 << TILE_HEIGHT  # 256 hashes (or entries) in a full tile
MAX_ENTRY_BYTES = 0xFFFF  # the uint16 length prefix of a bundle entry

# (level, index, width) -> the tile's bytes: width * 32 bytes (width 256 for a full tile)
TileReader = Callable[[int, int, int], bytes]


class TileError(ValueError):
    """A tile, bundle or path is malformed, or does not match the tree it claims to be part of."""


@dataclass(frozen=True)
class Tile:
    """One hash tile to publish: where it goes and what it holds."""

    level: int
    index: int
    width: int
    data: bytes

    @property
    def path(self) -> str:
        return tile_path(self.level, self.index, self.width)


# --------------------------------------------------------------------------------------------------
# Paths


def format_index(n: int) -> str:
    """``<N>`` in tile paths: 3-digit groups, each but the last prefixed with ``x``."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise TileError(f"tile index must be a non-negative integer, got {n!r}")
    groups = [f"{n % 1000:03d}"]
    n //= 1000
    while n:
        groups.append(f"x{n % 1000:03d}")
        n //= 1000
    return "/".join(reversed(groups))


def _suffix(width: int) -> str:
    if not 1 <= width <= TILE_WIDTH:
        raise TileError(f"tile width {width} is not in 1..{TILE_WIDTH}")
    return "" if width == TILE_WIDTH else f".p/{width}"


def tile_path(level: int, index: int, width: int = TILE_WIDTH) -> str:
    """``tile/<L>/<N>[.p/<W>]`` for the hash tile at ``level`` and ``index`` holding ``width`` hashes."""
    if not isinstance(level, int) or not 0 <= level <= 63:
        raise TileError(f"tile level {level!r} is not in 0..63")
    return f"tile/{level}/{format_index(index)}{_suffix(width)}"


def entries_path(index: int, width: int = TILE_WIDTH) -> str:
    """``tile/entries/<N>[.p/<W>]`` for the entry bundle ``index`` holding ``width`` entries."""
    return f"tile/entries/{format_index(index)}{_suffix(width)}"


_PATH = re.compile(r"tile/(entries|[0-9]|[1-5][0-9]|6[0-3])/((?:x[0-9]{3}/)*[0-9]{3})(?:\.p/([0-9]{1,3}))?")


def parse_tile_path(path: str) -> tuple[int | None, int, int]:
    """(level, index, width) of a tile path; level None for an entry bundle. Strict: one path per tile."""
    match = _PATH.fullmatch(path)
    if match is None:
        raise TileError(f"not a tile path: {path!r}")
    kind, digits, width_text = match.groups()
    index = int(digits.replace("x", "").replace("/", ""))
    width = TILE_WIDTH if width_text is None else int(width_text)
    level = None if kind == "entries" else int(kind)
    rebuilt = entries_path(index, width) if level is None else tile_path(level, index, width)
    if rebuilt != path:  # leading zeros in a group prefix, .p/256, .p/007 ...
        raise TileError(f"not a canonical tile path: {path!r}")
    return level, index, width


def tile_width(level: int, index: int, tree_size: int) -> int:
    """How many hashes tile (level, index) holds in a tree of ``tree_size`` leaves (0: none yet)."""
    hashes_at_level = tree_size >> (TILE_HEIGHT * level)
    return max(0, min(TILE_WIDTH, hashes_at_level - index * TILE_WIDTH))


# --------------------------------------------------------------------------------------------------
# Entry bundles


def encode_bundle(entries: Iterable[bytes]) -> bytes:
    """Entries as a bundle: each a big-endian uint16 length, then its bytes."""
    out = bytearray()
    for i, entry in enumerate(entries):
        if len(entry) > MAX_ENTRY_BYTES:
            raise TileError(
                f"entry {i} has {len(entry)} bytes; a bundle entry holds at most {MAX_ENTRY_BYTES}"
            )
        out += len(entry).to_bytes(2, "big") + entry
    return bytes(out)


def decode_bundle(data: bytes, width: int | None = None) -> list[bytes]:
    """The entries of a bundle; TileError if it is cut short or (``width`` given) has another count."""
    entries: list[bytes] = []
    pos = 0
    while pos < len(data):
        if pos + 2 > len(data):
            raise TileError(f"entry bundle ends inside a length prefix at byte {pos}")
        length = int.from_bytes(data[pos : pos + 2], "big")
        if pos + 2 + length > len(data):
            raise TileError(f"entry {len(entries)} claims {length} bytes, past the end of the bundle")
        entries.append(bytes(data[pos + 2 : pos + 2 + length]))
        pos += 2 + length
    if width is not None and len(entries) != width:
        raise TileError(f"entry bundle holds {len(entries)} entries, want {width}")
    return entries


# --------------------------------------------------------------------------------------------------
# Hash tiles


def split_hashes(data: bytes, width: int) -> list[bytes]:
    """A tile's hashes; TileError unless it holds exactly ``width`` of them."""
    if len(data) != width * HASH_SIZE:
        raise TileError(f"tile has {len(data)} bytes, want {width * HASH_SIZE} ({width} hashes)")
    return [bytes(data[i : i + HASH_SIZE]) for i in range(0, len(data), HASH_SIZE)]


def grow_tiles(old_size: int, new_leaf_hashes: Sequence[bytes], read_tile: TileReader) -> list[Tile]:
    """The hash tiles that change when a tree of ``old_size`` leaves grows by ``new_leaf_hashes``:
    every tile the new leaves fill or extend, at every level, the new partial tiles included.

    ``read_tile`` supplies the old tree's partial tiles (the only old tiles a growth touches).
    Only tiles that become full are hashed into the level above; a partial tile never is.
    """
    tiles: list[Tile] = []
    level, old_count, added = 0, old_size, list(new_leaf_hashes)
    while added:
        first_tile = old_count // TILE_WIDTH
        kept = old_count % TILE_WIDTH
        hashes = split_hashes(read_tile(level, first_tile, kept), kept) if kept else []
        hashes += added
        completed: list[bytes] = []  # roots of tiles this growth made full: the level above's new hashes
        for start in range(0, len(hashes), TILE_WIDTH):
            chunk = hashes[start : start + TILE_WIDTH]
            tiles.append(Tile(level, first_tile + start // TILE_WIDTH, len(chunk), b"".join(chunk)))
            if len(chunk) == TILE_WIDTH:
                completed.append(root_from_leaf_hashes(chunk))
        level, old_count, added = level + 1, old_count // TILE_WIDTH, completed
    return tiles


def _node_from_tiles(read_tile: TileReader, tree_size: int) -> Callable[[int, int], bytes]:
    """(level, index) -> hash of the perfect subtree over leaves [index << level, (index+1) << level),
    read from the tiles of a tree of ``tree_size`` leaves (each tile fetched once)."""
    cache: dict[tuple[int, int], list[bytes]] = {}

    def hashes_of(tile_level: int, index: int) -> list[bytes]:
        key = (tile_level, index)
        if key not in cache:
            width = tile_width(tile_level, index, tree_size)
            if width == 0:
                raise ProofError(f"tile {tile_level}/{index} is beyond a tree of {tree_size} leaves")
            cache[key] = split_hashes(read_tile(tile_level, index, width), width)
        return cache[key]

    def node(level: int, index: int) -> bytes:
        tile_level, height = divmod(level, TILE_HEIGHT)
        first = index << height  # the subtree's first hash at tile level `tile_level`
        tile = hashes_of(tile_level, first // TILE_WIDTH)
        lo = first % TILE_WIDTH
        chunk = tile[lo : lo + (1 << height)]
        if len(chunk) != 1 << height:
            raise ProofError(f"subtree {level}/{index} is not complete in a tree of {tree_size} leaves")
        return root_from_leaf_hashes(chunk)

    return node


def root_from_tiles(read_tile: TileReader, tree_size: int) -> bytes:
    """The RFC 6962 root of the tree of ``tree_size`` leaves, from its tiles."""
    return _range_root(_node_from_tiles(read_tile, tree_size), 0, tree_size)


def root_of_prefix(read_tile: TileReader, tree_size: int, prefix_size: int) -> bytes:
    """The root of the first ``prefix_size`` leaves, from the tiles of a tree of ``tree_size``."""
    if not 0 <= prefix_size <= tree_size:
        raise ProofError(f"prefix {prefix_size} is not within a tree of {tree_size} leaves")
    return _range_root(_node_from_tiles(read_tile, tree_size), 0, prefix_size)


def inclusion_proof_from_tiles(read_tile: TileReader, index: int, tree_size: int) -> list[bytes]:
    """RFC 6962 audit path of leaf ``index`` in the tree of ``tree_size`` leaves, from its tiles."""
    if not 0 <= index < tree_size:
        raise ProofError(f"leaf index {index} is not below tree size {tree_size}")
    return _inclusion_path(_node_from_tiles(read_tile, tree_size), index, tree_size)


def consistency_proof_from_tiles(read_tile: TileReader, old_size: int, new_size: int) -> list[bytes]:
    """RFC 6962 consistency proof from ``old_size`` to ``new_size``, from the new tree's tiles."""
    if not 0 <= old_size <= new_size:
        raise ProofError(f"need 0 <= old size <= new size, got {old_size} and {new_size}")
    if old_size in (0, new_size):
        return []
    return _consistency_path(_node_from_tiles(read_tile, new_size), old_size, new_size)


def check_bundle(bundle: bytes, index: int, width: int, read_tile: TileReader, tree_size: int) -> list[bytes]:
    """The entries of bundle ``index``, checked against the level-0 tile of the same index (whose
    hashes the caller has tied to a signed root): TileError on any difference."""
    entries = decode_bundle(bundle, width)
    hashes = split_hashes(read_tile(0, index, width), width)
    for i, (entry, want) in enumerate(zip(entries, hashes, strict=True)):
        if leaf_hash(entry) != want:
            raise TileError(f"entry {index * TILE_WIDTH + i} does not match its leaf hash in tile 0/{index}")
    if tile_width(0, index, tree_size) != width:
        raise TileError(f"bundle {index} has {width} entries, the tree of {tree_size} gives it another")
    return entries


BundleReader = Callable[[int, int], bytes]  # (index, width) -> the entry bundle's bytes


def check_tile_tree(read_tile: TileReader, tree_size: int, root: bytes) -> None:
    """Check every hash tile of a tree of ``tree_size`` leaves against its signed ``root``: the root
    from the partial tiles, then each tile's hashes against the full tiles one level down. After it,
    every level-0 tile is tied to ``root``. ProofError/TileError on the first difference."""
    if root_from_tiles(read_tile, tree_size) != root:
        raise ProofError(f"the tiles of a tree of {tree_size} leaves do not give its signed root")
    level = 1
    while tree_size >> (TILE_HEIGHT * level):
        for index in range(-(-(tree_size >> (TILE_HEIGHT * level)) // TILE_WIDTH)):
            width = tile_width(level, index, tree_size)
            for i, want in enumerate(split_hashes(read_tile(level, index, width), width)):
                child = index * TILE_WIDTH + i
                if (
                    root_from_leaf_hashes(split_hashes(read_tile(level - 1, child, TILE_WIDTH), TILE_WIDTH))
                    != want
                ):
                    raise ProofError(
                        f"tile {level - 1}/{child} does not hash to its entry in tile {level}/{index}"
                    )
        level += 1


def walk_entries(
    read_tile: TileReader, read_bundle: BundleReader, tree_size: int, root: bytes
) -> Iterable[bytes]:
    """Every entry of the log, in order, each checked against the signed ``root`` (one tile and one
    bundle in memory at a time)."""
    check_tile_tree(read_tile, tree_size, root)
    for index in range(-(-tree_size // TILE_WIDTH)):
        width = tile_width(0, index, tree_size)
        yield from check_bundle(read_bundle(index, width), index, width, read_tile, tree_size)


def walk_new_entries(
    read_tile: TileReader, read_bundle: BundleReader, old_size: int, tree_size: int, root: bytes
) -> Iterable[tuple[int, bytes]]:
    """(index, entry) for the entries [old_size, tree_size), each checked against the signed ``root``,
    reading only the tiles that changed since ``old_size``. The caller has checked (or checks) that
    the first ``old_size`` leaves of these tiles give the old tree's root (``root_of_prefix``): the
    hashes of old leaves are then tied to what was verified before."""
    if not 0 <= old_size <= tree_size:
        raise ProofError(f"need 0 <= old size <= tree size, got {old_size} and {tree_size}")
    if root_from_tiles(read_tile, tree_size) != root:
        raise ProofError(f"the tiles of a tree of {tree_size} leaves do not give its signed root")
    level = 1
    while tree_size >> (TILE_HEIGHT * level):
        first_new_child = (old_size >> (TILE_HEIGHT * (level - 1))) // TILE_WIDTH
        for index in range(
            first_new_child // TILE_WIDTH, -(-(tree_size >> (TILE_HEIGHT * level)) // TILE_WIDTH)
        ):
            width = tile_width(level, index, tree_size)
            for i, want in enumerate(split_hashes(read_tile(level, index, width), width)):
                child = index * TILE_WIDTH + i
                if child < first_new_child:
                    continue  # a full tile of the old tree: tied to the old root already
                got = root_from_leaf_hashes(split_hashes(read_tile(level - 1, child, TILE_WIDTH), TILE_WIDTH))
                if got != want:
                    raise ProofError(
                        f"tile {level - 1}/{child} does not hash to its entry in tile {level}/{index}"
                    )
        level += 1
    for index in range(old_size // TILE_WIDTH, -(-tree_size // TILE_WIDTH)):
        width = tile_width(0, index, tree_size)
        for i, entry in enumerate(
            check_bundle(read_bundle(index, width), index, width, read_tile, tree_size)
        ):
            if index * TILE_WIDTH + i >= old_size:
                yield index * TILE_WIDTH + i, entry
