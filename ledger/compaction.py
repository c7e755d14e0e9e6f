"""Which part files to merge, and how: the ledger's compaction, apart from its commit protocol.

Every commit writes one small file per touched partition, so a ledger that ingests for months has
thousands per partition, and each query opens them all. ``Ledger.commit`` therefore merges a
partition's newest files after a commit whenever ``tail_to_merge`` says so (a log-structured merge:
files are grouped in size levels a factor ``fanout`` apart, and ``fanout`` files of one level become
one of the next). A partition then holds at most about ``fanout`` files per level, and each byte is
rewritten once per level (a handful of times over the ledger's life). ``ledger compact`` merges
whole partitions.

Merged files keep commit order, except ``metrics``: sorted by metric name, with small row groups, so
that one metric's series reads only its own row groups (by their min/max statistics) instead of
every metric's rows; the encodings keep the file as small as the commit-ordered one.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

COMPACT_FANOUT = 8
LEVEL_FLOOR_BYTES = 1 << 20  # files up to this size are all level 0
MERGE_ROW_GROUP_BYTES = 16 << 20  # Arrow bytes per merged row group: what a reader (verify) holds at once

# Tables whose merged files are sorted, and by what. Rows of one metric lie together, in step order.
SORTED_TABLES: dict[str, tuple[str, ...]] = {"metrics": ("name", "attempt", "step", "stream", "stream_seq")}
SORTED_ROW_GROUP_ROWS = 128 * 1024
_SORT_CHUNK_ROWS = 512 * 1024  # rows sorted in memory at once (~30 MB of metric rows)
_SORTED_WRITE_OPTIONS = {
    # Sorted by name, a step's time and seq no longer repeat row after row: deltas encode them in a
    # few bits, and a metric's floats split into byte streams compress ~30% better.
    "use_dictionary": ["name", "stream", "attempt"],
    "column_encoding": {
        "step": "DELTA_BINARY_PACKED",
        "time": "DELTA_BINARY_PACKED",
        "stream_seq": "DELTA_BINARY_PACKED",
        "value": "BYTE_STREAM_SPLIT",
    },
}


def level(size_bytes: int, *, fanout: int = COMPACT_FANOUT, floor_bytes: int = LEVEL_FLOOR_BYTES) -> int:
    """A file's size level: 0 up to ``floor_bytes``, then one more per factor ``fanout``."""
    if size_bytes <= floor_bytes:
        return 0
    return int(math.log(size_bytes / floor_bytes, fanout)) + 1


def tail_to_merge(
    sizes_bytes: Sequence[int], *, fanout: int = COMPACT_FANOUT, floor_bytes: int = LEVEL_FLOOR_BYTES
) -> int:
    """How many of a partition's newest files to merge into one (0: leave it).

    ``sizes_bytes`` in commit order, oldest first. A level with ``fanout`` files merges, together
    with the newer (smaller) files after them; the lowest such level goes first. Only a tail is ever
    merged, so the merged file (named by a newer commit) still sorts after every file older than
    its rows, and a big old file is never rewritten to absorb a few small ones."""
    levels = [level(s, fanout=fanout, floor_bytes=floor_bytes) for s in sizes_bytes]
    for lowest in sorted(set(levels)):
        run = at_level = 0
        for lv in reversed(levels):
            if lv > lowest:
                break
            run += 1
            at_level += lv == lowest
        if at_level >= fanout:
            return run
    return 0


def merge_parts(parts: Sequence[Path], table: str, schema: pa.Schema, tmp: Path) -> None:
    """``parts`` merged into one file at ``tmp``, fsynced. Memory stays bounded whatever their size."""
    keys = SORTED_TABLES.get(table)
    if keys is None:
        _copy_in_order(parts, schema, tmp)
    else:
        _merge_sorted(parts, schema, tmp, keys)
    with open(tmp, "rb+") as handle:
        os.fsync(handle.fileno())


def _copy_in_order(parts: Sequence[Path], schema: pa.Schema, tmp: Path) -> None:
    """Copied row group by row group, in commit order (each stream's rows stay in ``stream_seq``
    order). Memory is about one output row group: a reference-size run's events (GBs of canonical
    JSON) never sit in memory at once. (A dataset scan over a big file reads many row groups ahead:
    over 1 GB of Arrow memory on a reference-size events partition.)"""
    pending: list[pa.Table] = []
    pending_bytes = 0
    with pq.ParquetWriter(tmp, schema, compression="zstd") as writer:
        for part in parts:
            f = pq.ParquetFile(part)
            for group in range(f.metadata.num_row_groups):
                # Under the table's schema (as queries read it): an older file's missing column is null.
                rows = conform(f.read_row_group(group), schema)
                pending.append(rows)
                pending_bytes += rows.nbytes
                if pending_bytes >= MERGE_ROW_GROUP_BYTES:
                    writer.write_table(pa.concat_tables(pending))
                    pending, pending_bytes = [], 0
        if pending:
            writer.write_table(pa.concat_tables(pending))
    pa.default_memory_pool().release_unused()


def _merge_sorted(parts: Sequence[Path], schema: pa.Schema, tmp: Path, keys: Sequence[str]) -> None:
    """Sorted by ``keys`` (the first a string column), a chunk of first-key values at a time: each
    chunk reads only the row groups whose statistics may hold its values, so memory is one chunk."""
    first = keys[0]
    files = [pq.ParquetFile(part) for part in parts]
    counts: Counter[str | None] = Counter()
    for f in files:
        for group in range(f.metadata.num_row_groups):
            column = f.read_row_group(group, columns=[first]).column(first)
            for entry in pc.value_counts(column).to_pylist():
                if entry["values"] is not None:
                    counts[entry["values"]] += entry["counts"]
            counts[None] += column.null_count
    order = [(k, "ascending") for k in keys]
    with pq.ParquetWriter(tmp, schema, compression="zstd", **_SORTED_WRITE_OPTIONS) as writer:
        for chunk in _chunks(counts):
            pieces = [
                _rows_in(f, group, first, chunk, schema) for f in files for group in _groups(f, first, chunk)
            ]
            pieces = [p for p in pieces if p.num_rows]
            if pieces:
                merged = pa.concat_tables(pieces).sort_by(order)
                writer.write_table(merged, row_group_size=SORTED_ROW_GROUP_ROWS)
                del merged, pieces
    pa.default_memory_pool().release_unused()


def _chunks(counts: Counter[str | None]) -> list[list[str | None]]:
    """Consecutive first-key values (nulls last, alone) in groups of about ``_SORT_CHUNK_ROWS`` rows."""
    chunks: list[list[str | None]] = []
    current: list[str | None] = []
    rows = 0
    for value in sorted(k for k in counts if k is not None):
        if current and rows + counts[value] > _SORT_CHUNK_ROWS:
            chunks.append(current)
            current, rows = [], 0
        current.append(value)
        rows += counts[value]
    if current:
        chunks.append(current)
    if counts.get(None):
        chunks.append([None])
    return chunks


def _groups(f: pq.ParquetFile, column: str, chunk: list[str | None]) -> list[int]:
    """The row groups of ``f`` whose statistics do not rule out every value of ``chunk``."""
    index = f.schema_arrow.get_field_index(column)
    wanted = [v for v in chunk if v is not None]
    out = []
    for group in range(f.metadata.num_row_groups):
        stats = f.metadata.row_group(group).column(index).statistics if index >= 0 else None
        unknown = chunk == [None] or stats is None or not stats.has_min_max or not wanted
        if unknown or stats is None or not (stats.max < wanted[0] or stats.min > wanted[-1]):
            out.append(group)
    return out


def _rows_in(
    f: pq.ParquetFile, group: int, column: str, chunk: list[str | None], schema: pa.Schema
) -> pa.Table:
    table = f.read_row_group(group)
    values = table.column(column)
    wanted = pa.array(chunk, pa.string())
    mask = pc.is_null(values) if chunk == [None] else pc.is_in(values, value_set=wanted)
    return conform(table.filter(mask), schema)


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """``table`` under ``schema``: a column an older file lacks is null, as queries read it."""
    columns = [
        table.column(field.name).cast(field.type)
        if field.name in table.column_names
        else pa.nulls(table.num_rows, field.type)
        for field in schema
    ]
    return pa.Table.from_arrays(columns, schema=schema)
