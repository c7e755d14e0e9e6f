"""A Parquet file without some of its trailing columns, by rewriting its footer alone.

A file DuckLake's merge wrote keeps each row's lineage in a last column of its own
(``_ducklake_internal_snapshot_id``, …) that a raw reader would take for the table's. Publishing
such a file used to re-encode every column (a read and a zstd write: 1.8-2.4x the CPU of publishing
an unmerged lake). A Parquet reader finds every column chunk through the footer's offsets, so a
footer that no longer names the trailing columns hides them: the body's bytes are copied as they are
(the dropped chunks stay in it, unreferenced), and only the footer is written again.

The footer is Thrift's compact protocol (``FileMetaData``, parquet.thrift). ``decode_struct`` reads it
into a generic tree that ``encode_struct`` writes back byte for byte; ``without_trailing_columns``
edits the tree. Any footer this does not understand exactly (nested or non-trailing lineage columns,
an ``ARROW:schema`` key, encryption, column chunks in other files, a sort on a dropped column, a
re-encoding that is not the original's bytes) is refused with ``FooterError``, and the caller
re-encodes the file instead.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

MAGIC = b"PAR1"
TAIL_BYTES = 8  # the footer's length (4 bytes, little-endian) and the magic
MAX_FOOTER_BYTES = 64 * 1024 * 1024  # a footer larger than this is not one the lake wrote
MAX_DEPTH = 64  # Thrift nesting a FileMetaData never reaches
COPY_CHUNK_BYTES = 1024 * 1024

# Thrift compact protocol types (the low nibble of a field header or a list header).
STOP, TRUE, FALSE, BYTE, I16, I32, I64, DOUBLE, BINARY, LIST, SET, MAP, STRUCT = range(13)

# FileMetaData, SchemaElement, RowGroup, ColumnChunk and ColumnMetaData field ids (parquet.thrift).
FMD_SCHEMA, FMD_ROW_GROUPS, FMD_KEY_VALUES, FMD_COLUMN_ORDERS = 2, 4, 5, 7
FMD_ENCRYPTION = (8, 9)
SE_NAME, SE_NUM_CHILDREN = 4, 5
RG_COLUMNS, RG_TOTAL_BYTE_SIZE, RG_SORTING_COLUMNS, RG_TOTAL_COMPRESSED_SIZE = 1, 2, 4, 6
CC_FILE_PATH, CC_META_DATA = 1, 3
CMD_PATH_IN_SCHEMA, CMD_UNCOMPRESSED, CMD_COMPRESSED = 3, 6, 7
SC_COLUMN_IDX = 1

Field = list[Any]  # [field id, compact type, value]


class FooterError(ValueError):
    """A footer this module does not rewrite (the caller re-encodes the file instead)."""


# ------------------------------------------------------------------------------------------ decode
def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise FooterError("a varint runs past the footer")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _zigzag(n: int) -> int:
    return (n >> 1) ^ -(n & 1)


def _value(buf: bytes, pos: int, kind: int, depth: int) -> tuple[Any, int]:
    if depth > MAX_DEPTH:
        raise FooterError("the footer nests deeper than a Parquet footer does")
    if kind in (TRUE, FALSE):  # a boolean inside a list: one byte of its own
        if pos >= len(buf):
            raise FooterError("a boolean runs past the footer")
        return buf[pos], pos + 1
    if kind == BYTE:
        if pos >= len(buf):
            raise FooterError("a byte runs past the footer")
        return buf[pos], pos + 1
    if kind in (I16, I32, I64):
        raw, pos = _varint(buf, pos)
        return _zigzag(raw), pos
    if kind == DOUBLE:
        if pos + 8 > len(buf):
            raise FooterError("a double runs past the footer")
        return buf[pos : pos + 8], pos + 8  # (its bytes: written back as they were)
    if kind == BINARY:
        size, pos = _varint(buf, pos)
        if pos + size > len(buf):
            raise FooterError("a string runs past the footer")
        return buf[pos : pos + size], pos + size
    if kind in (LIST, SET):
        if pos >= len(buf):
            raise FooterError("a list runs past the footer")
        head = buf[pos]
        pos += 1
        size, element = head >> 4, head & 0x0F
        if size == 15:
            size, pos = _varint(buf, pos)
        if size > len(buf) - pos:
            raise FooterError("a list is longer than the footer")
        items = []
        for _ in range(size):
            item, pos = _value(buf, pos, element, depth + 1)
            items.append(item)
        return (element, items), pos
    if kind == MAP:
        size, pos = _varint(buf, pos)
        if size == 0:
            return (0, 0, []), pos
        if pos >= len(buf) or size > len(buf) - pos:
            raise FooterError("a map runs past the footer")
        key_kind, value_kind = buf[pos] >> 4, buf[pos] & 0x0F
        pos += 1
        pairs = []
        for _ in range(size):
            key, pos = _value(buf, pos, key_kind, depth + 1)
            value, pos = _value(buf, pos, value_kind, depth + 1)
            pairs.append((key, value))
        return (key_kind, value_kind, pairs), pos
    if kind == STRUCT:
        return decode_struct(buf, pos, depth + 1)
    raise FooterError(f"unknown Thrift compact type {kind}")


def decode_struct(buf: bytes, pos: int = 0, depth: int = 0) -> tuple[list[Field], int]:
    """One Thrift compact struct at ``pos``: its fields as ``[id, type, value]`` (a boolean field's
    value is its type, TRUE or FALSE), and the position after its stop byte."""
    fields: list[Field] = []
    last = 0
    while True:
        if pos >= len(buf):
            raise FooterError("a struct runs past the footer")
        head = buf[pos]
        pos += 1
        kind = head & 0x0F
        if kind == STOP:
            return fields, pos
        if head >> 4:
            field_id = last + (head >> 4)
        else:
            raw, pos = _varint(buf, pos)
            field_id = _zigzag(raw)
        if kind in (TRUE, FALSE):
            fields.append([field_id, kind, kind == TRUE])
        else:
            value, pos = _value(buf, pos, kind, depth)
            fields.append([field_id, kind, value])
        last = field_id


# ------------------------------------------------------------------------------------------ encode
def _put_varint(out: bytearray, n: int) -> None:
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


def _put_zigzag(out: bytearray, n: int) -> None:
    _put_varint(out, (n << 1) ^ (n >> 63) if n < 0 else n << 1)


def _put_value(out: bytearray, kind: int, value: Any) -> None:
    if kind in (TRUE, FALSE, BYTE):
        out.append(value)
    elif kind in (I16, I32, I64):
        _put_zigzag(out, value)
    elif kind == DOUBLE:
        out += value
    elif kind == BINARY:
        _put_varint(out, len(value))
        out += value
    elif kind in (LIST, SET):
        element, items = value
        if len(items) < 15:
            out.append(len(items) << 4 | element)
        else:
            out.append(0xF0 | element)
            _put_varint(out, len(items))
        for item in items:
            _put_value(out, element, item)
    elif kind == MAP:
        key_kind, value_kind, pairs = value
        _put_varint(out, len(pairs))
        if pairs:
            out.append(key_kind << 4 | value_kind)
        for key, item in pairs:
            _put_value(out, key_kind, key)
            _put_value(out, value_kind, item)
    elif kind == STRUCT:
        out += encode_struct(value)
    else:
        raise FooterError(f"unknown Thrift compact type {kind}")


def encode_struct(fields: list[Field]) -> bytes:
    """``decode_struct``'s fields as Thrift compact bytes (the short field header where the id grows
    by 1-15, as Thrift's own writers do)."""
    out = bytearray()
    last = 0
    for field_id, kind, value in fields:
        delta = field_id - last
        if 0 < delta <= 15:
            out.append(delta << 4 | kind)
        else:
            out.append(kind)
            _put_zigzag(out, field_id)
        if kind not in (TRUE, FALSE):
            _put_value(out, kind, value)
        last = field_id
    out.append(STOP)
    return bytes(out)


# ------------------------------------------------------------------------------------------- edit
def _get(fields: list[Field], field_id: int) -> Any:
    return next((value for fid, _kind, value in fields if fid == field_id), None)


def _set(fields: list[Field], field_id: int, value: Any) -> None:
    for entry in fields:
        if entry[0] == field_id:
            entry[2] = value


def _name(element: list[Field]) -> str:
    raw = _get(element, SE_NAME)
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else ""


def _top_level(schema: list[list[Field]]) -> list[tuple[str, int, int]]:
    """The schema's top-level columns in order: (name, schema elements, leaves) of each."""
    columns: list[tuple[str, int, int]] = []
    pos = 1
    for _ in range(_get(schema[0], SE_NUM_CHILDREN) or 0):
        first, pending, leaves = pos, 1, 0
        while pending:  # the column's subtree, depth first: each group names its children
            if pos >= len(schema):
                raise FooterError("a schema with fewer elements than its groups name")
            children = _get(schema[pos], SE_NUM_CHILDREN) or 0
            pending += children - 1
            leaves += not children
            pos += 1
        columns.append((_name(schema[first]), pos - first, leaves))
    if pos != len(schema):
        raise FooterError("a schema with more elements than its groups name")
    return columns


def _trailing_columns(schema: list[list[Field]], prefix: str) -> tuple[int, int]:
    """How many of the schema's last top-level columns are named ``prefix…`` (each a plain column:
    one element, one leaf), and the schema's leaves; refused when one is nested or not at the end."""
    columns = _top_level(schema)
    drop = 0
    while drop < len(columns) and columns[len(columns) - 1 - drop][0].startswith(prefix):
        drop += 1
    if any(name.startswith(prefix) for name, _, _ in columns[: len(columns) - drop]):
        raise FooterError("a lineage column before a table column")
    if any((elements, leaves) != (1, 1) for _, elements, leaves in columns[len(columns) - drop :]):
        raise FooterError("a nested lineage column")
    return drop, sum(leaves for _, _, leaves in columns)


def without_trailing_columns(footer: bytes, prefix: str) -> bytes | None:
    """The footer with its trailing top-level columns named ``prefix…`` no longer named (schema,
    every row group's column chunks and sizes, the column orders); None when it names none."""
    meta, end = decode_struct(footer)
    if end != len(footer) or encode_struct(meta) != footer:
        raise FooterError("the footer is not written back as its own bytes")
    try:
        return _edited(meta, prefix)
    except (TypeError, IndexError, AttributeError, ValueError) as exc:  # (FooterError is a ValueError)
        if isinstance(exc, FooterError):
            raise
        raise FooterError(f"a footer of a shape Parquet's writers do not write ({exc})") from None


def _edited(meta: list[Field], prefix: str) -> bytes | None:
    element, schema = _get(meta, FMD_SCHEMA) or (STRUCT, [])
    if not schema:
        raise FooterError("a footer with no schema")
    drop, leaves = _trailing_columns(schema, prefix)
    if not drop:
        return None
    if any(_get(meta, fid) is not None for fid in FMD_ENCRYPTION):
        raise FooterError("an encrypted footer")
    if any(key == b"ARROW:schema" for key in _key_values(meta)):
        raise FooterError("an Arrow schema beside the Parquet one")
    names = [[_name(e).encode()] for e in schema[len(schema) - drop :]]
    _set(schema[0], SE_NUM_CHILDREN, _get(schema[0], SE_NUM_CHILDREN) - drop)
    _set(meta, FMD_SCHEMA, (element, schema[: len(schema) - drop]))
    for group in (_get(meta, FMD_ROW_GROUPS) or (STRUCT, []))[1]:
        _drop_chunks(group, leaves, drop, names)
    orders = _get(meta, FMD_COLUMN_ORDERS)
    if orders is not None:
        if len(orders[1]) != leaves:
            raise FooterError("column orders that do not match the columns")
        _set(meta, FMD_COLUMN_ORDERS, (orders[0], orders[1][: leaves - drop]))
    return encode_struct(meta)


def _key_values(meta: list[Field]) -> list[bytes]:
    pairs = _get(meta, FMD_KEY_VALUES)
    return [_get(pair, 1) for pair in pairs[1]] if pairs else []


def _drop_chunks(group: list[Field], leaves: int, drop: int, names: list[list[bytes]]) -> None:
    """A row group without its last ``drop`` column chunks (which must be the columns ``names``)."""
    element, chunks = _get(group, RG_COLUMNS)
    if len(chunks) != leaves:
        raise FooterError("a row group whose column chunks do not match the schema")
    if any(_get(chunk, CC_FILE_PATH) is not None for chunk in chunks):
        raise FooterError("a column chunk in another file")
    gone = chunks[leaves - drop :]
    metas = [_get(chunk, CC_META_DATA) for chunk in gone]
    if any(m is None or _get(m, CMD_PATH_IN_SCHEMA)[1] != name for m, name in zip(metas, names, strict=True)):
        raise FooterError("a dropped column chunk is not the dropped column")
    sorting = _get(group, RG_SORTING_COLUMNS)
    if sorting and any(_get(s, SC_COLUMN_IDX) >= leaves - drop for s in sorting[1]):
        raise FooterError("a row group sorted by a dropped column")
    _set(group, RG_COLUMNS, (element, chunks[: leaves - drop]))
    total = _get(group, RG_TOTAL_BYTE_SIZE)
    _set(group, RG_TOTAL_BYTE_SIZE, total - sum(_get(m, CMD_UNCOMPRESSED) for m in metas))
    compressed = _get(group, RG_TOTAL_COMPRESSED_SIZE)
    if compressed is not None:
        _set(group, RG_TOTAL_COMPRESSED_SIZE, compressed - sum(_get(m, CMD_COMPRESSED) for m in metas))


# ------------------------------------------------------------------------------------------- files
def read_footer(path: Path) -> tuple[int, bytes]:
    """Where ``path``'s footer starts, and its bytes (checked: the magic at both ends, a length
    that fits)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(4)
        if size < 12 or head != MAGIC:
            raise FooterError(f"{path} is not a Parquet file")
        f.seek(size - TAIL_BYTES)
        tail = f.read(TAIL_BYTES)
        (length,) = struct.unpack("<I", tail[:4])
        if tail[4:] != MAGIC or length > min(size - 12, MAX_FOOTER_BYTES):
            raise FooterError(f"{path} has no Parquet footer")
        start = size - TAIL_BYTES - length
        f.seek(start)
        return start, f.read(length)


def copy_without_trailing_columns(path: Path, target: Path, prefix: str) -> bool:
    """``path`` written to ``target`` without its trailing columns named ``prefix…`` (its body copied,
    its footer rewritten; ``target`` replaced atomically); False, writing nothing, when it has none.
    ``FooterError`` when its footer is not one to rewrite."""
    start, footer = read_footer(path)
    rewritten = without_trailing_columns(footer, prefix)
    if rewritten is None:
        return False
    tmp = target.with_name(target.name + ".tmp")
    with path.open("rb") as source, tmp.open("wb") as out:
        _copy_bytes(source, out, start)
        out.write(rewritten)
        out.write(struct.pack("<I", len(rewritten)) + MAGIC)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, target)
    return True


def _copy_bytes(source: Any, out: Any, count: int) -> None:
    left = count
    while left:
        chunk = source.read(min(left, COPY_CHUNK_BYTES))
        if not chunk:
            raise FooterError("the file ended before its footer")
        out.write(chunk)
        left -= len(chunk)
