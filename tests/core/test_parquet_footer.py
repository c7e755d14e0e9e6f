"""runledger.ledger.parquet_footer: a Parquet file without its trailing lineage columns, by its footer.

Files written by DuckDB itself (as DuckLake's merge writes them: lineage columns last, a list column,
several row groups) and by pyarrow; every engine here must read the rewritten file as the source
less those columns, and every damaged or unexpected footer must be refused with ``FooterError``
(the caller then re-encodes), never another exception and never a file.
"""

from __future__ import annotations

import random
import struct
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from runledger.ledger.parquet_footer import (
    MAX_DEPTH,
    STRUCT,
    FooterError,
    copy_without_trailing_columns,
    decode_struct,
    encode_struct,
    read_footer,
    without_trailing_columns,
)
from runledger.ledger.publish import LAKE_INTERNAL, _without_lake_columns

ROWS = 5_000


def _duckdb_file(path: Path, select: str, row_group_size: int = 1_000) -> Path:
    con = duckdb.connect()
    con.execute(
        f"COPY ({select} FROM range({ROWS}) t(i)) TO '{path}' "
        f"(FORMAT parquet, ROW_GROUP_SIZE {row_group_size}, COMPRESSION zstd)"
    )
    con.close()
    return path


MERGED = (
    "SELECT i AS step, 'run-' || (i % 7) AS run_id, [i, i + 1] AS counts, i / 3.0 AS loss, "
    "{'a': i, 'b': 'x' || i} AS nested, i * 2 AS _ducklake_internal_row_id, "
    "i // 100 AS _ducklake_internal_snapshot_id"
)


def _rows(path: Path) -> list[dict[str, object]]:
    return duckdb.sql(f"SELECT * FROM read_parquet('{path}') ORDER BY step").arrow().read_all().to_pylist()


def test_a_merged_file_is_read_by_every_engine_as_the_source_without_its_lineage(tmp_path: Path) -> None:
    source = _duckdb_file(tmp_path / "merged.parquet", MERGED)
    target = tmp_path / "published.parquet"
    assert copy_without_trailing_columns(source, target, LAKE_INTERNAL)
    want = pq.read_table(source).drop(["_ducklake_internal_row_id", "_ducklake_internal_snapshot_id"])
    got = pq.read_table(target)
    assert got.equals(want)
    groups = pq.ParquetFile(source).metadata.num_row_groups
    assert groups > 1 and pq.ParquetFile(target).metadata.num_row_groups == groups
    assert _rows(target) == want.to_pylist()
    assert duckdb.sql(f"SELECT sum(step), sum(counts[2]) FROM '{target}'").fetchone() == (
        sum(range(ROWS)),
        sum(range(1, ROWS + 1)),
    )
    # the body is the source's, byte for byte: only the footer was written again
    start, _ = read_footer(source)
    assert target.read_bytes()[:start] == source.read_bytes()[:start]
    assert not list(tmp_path.glob("*.tmp"))


def test_footers_are_written_back_as_their_own_bytes(tmp_path: Path) -> None:
    """Thrift's compact protocol decoded and encoded again is the footer it was, for the writers the
    ledger meets: DuckDB (the lake's merge) and pyarrow (the ledger's own files)."""
    files = [_duckdb_file(tmp_path / "duck.parquet", MERGED)]
    table = pa.table({"a": list(range(100)), "b": [[1.5, float("nan")]] * 100, "c": ["é"] * 100})
    pq.write_table(table, tmp_path / "arrow.parquet", row_group_size=30, write_statistics=True)
    files.append(tmp_path / "arrow.parquet")
    for path in files:
        _, footer = read_footer(path)
        meta, end = decode_struct(footer)
        assert end == len(footer) and encode_struct(meta) == footer, path


def test_a_file_without_lineage_columns_is_left_as_it_is(tmp_path: Path) -> None:
    source = _duckdb_file(tmp_path / "plain.parquet", "SELECT i AS step, 'x' AS run_id")
    assert not copy_without_trailing_columns(source, tmp_path / "out.parquet", LAKE_INTERNAL)
    assert not (tmp_path / "out.parquet").exists()


@pytest.mark.parametrize(
    ("select", "why"),
    [
        ("SELECT i AS _ducklake_internal_row_id, i AS step", "before a table column"),
        ("SELECT i AS step, {'x': i} AS _ducklake_internal_row_id", "nested lineage column"),
    ],
)
def test_lineage_columns_it_cannot_hide_are_refused(tmp_path: Path, select: str, why: str) -> None:
    source = _duckdb_file(tmp_path / "odd.parquet", select)
    with pytest.raises(FooterError, match=why):
        copy_without_trailing_columns(source, tmp_path / "out.parquet", LAKE_INTERNAL)
    assert not (tmp_path / "out.parquet").exists()


def test_a_pyarrow_file_is_refused_here_and_re_encoded_by_publish(tmp_path: Path) -> None:
    """pyarrow keeps an Arrow schema beside the Parquet one, which would still name the column: the
    footer is refused, and publish's copy is re-encoded without the column instead."""
    table = pa.table({"step": [1, 2, 3], "_ducklake_internal_row_id": [7, 8, 9]})
    pq.write_table(table, tmp_path / "arrow.parquet")
    with pytest.raises(FooterError, match="Arrow schema"):
        copy_without_trailing_columns(tmp_path / "arrow.parquet", tmp_path / "out.parquet", LAKE_INTERNAL)
    copy = _without_lake_columns(tmp_path / "arrow.parquet", tmp_path / "copy" / "arrow.parquet")
    assert pq.read_table(copy).to_pylist() == [{"step": 1}, {"step": 2}, {"step": 3}]


def test_publish_hides_a_duckdb_files_lineage_by_its_footer(tmp_path: Path) -> None:
    source = _duckdb_file(tmp_path / "merged.parquet", MERGED)
    copy = _without_lake_columns(source, tmp_path / "copy" / "merged.parquet")
    assert copy != source and source.exists()
    assert copy.stat().st_size > source.stat().st_size - 4096  # the body copied, not re-encoded
    assert LAKE_INTERNAL not in " ".join(pq.read_schema(copy).names)
    assert _without_lake_columns(source, copy) == copy  # made once


def test_every_truncated_or_damaged_footer_is_refused_or_rewritten(tmp_path: Path) -> None:
    """Every cut of the footer and 2,000 flipped bytes: FooterError or a footer (never another
    exception); a footer that still decodes is written back with the same columns hidden."""
    source = _duckdb_file(tmp_path / "merged.parquet", MERGED)
    _, footer = read_footer(source)
    for cut in range(len(footer)):
        with pytest.raises(FooterError):
            without_trailing_columns(footer[:cut], LAKE_INTERNAL)
    rng = random.Random(44)
    outcomes = {"refused": 0, "rewritten": 0}
    for _ in range(2_000):
        damaged = bytearray(footer)
        damaged[rng.randrange(len(damaged))] ^= 1 << rng.randrange(8)
        try:
            rewritten = without_trailing_columns(bytes(damaged), LAKE_INTERNAL)
        except FooterError:
            outcomes["refused"] += 1
            continue
        outcomes["rewritten"] += 1
        if rewritten is not None:
            decode_struct(rewritten)  # what it writes is a footer again
    assert outcomes["refused"] and outcomes["rewritten"], outcomes


def test_hostile_footers_are_refused_without_recursion_or_allocation(tmp_path: Path) -> None:
    deep = bytes([0x1C] * (MAX_DEPTH + 10)) + bytes(MAX_DEPTH + 10)  # field 1: a struct, nested
    with pytest.raises(FooterError, match="nests deeper"):
        decode_struct(deep)
    huge_list = bytes([0x19, 0xFC]) + b"\xff\xff\xff\xff\x0f"  # field 1: a list of 2^32 structs
    with pytest.raises(FooterError, match="longer than the footer"):
        decode_struct(huge_list)
    huge_string = bytes([0x18]) + b"\xff\xff\xff\xff\x0f"
    with pytest.raises(FooterError, match="runs past"):
        decode_struct(huge_string)
    assert decode_struct(bytes([0x15, 0x04, 0x00])) == ([[1, 5, 2]], 3)  # i32 field 1 = 2 (zigzag)
    assert encode_struct([[1, STRUCT, []], [20, 5, -1]]) == bytes([0x1C, 0x00, 0x05, 0x28, 0x01, 0x00])


def test_a_file_that_is_not_parquet_is_refused(tmp_path: Path) -> None:
    for name, body in [
        ("empty", b""),
        ("text", b"not parquet at all"),
        ("long", b"PAR1" + b"\x00" * 64 + struct.pack("<I", 10**6) + b"PAR1"),
    ]:
        path = tmp_path / name
        path.write_bytes(body)
        with pytest.raises(FooterError):
            copy_without_trailing_columns(path, tmp_path / "out", LAKE_INTERNAL)
        assert not (tmp_path / "out").exists()
