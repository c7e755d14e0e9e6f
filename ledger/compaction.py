"""How the ledger's rows are laid out in its files: the sort order of a table's rows, and a table's
rows under its current schema.

The part-file writer's own compaction (its size levels and merges) is gone with that writer: a lake
merges its files itself (``LakeTables.maintain``), keeping these orders.

``metrics`` rows are written sorted by metric name (``SORTED_TABLES``: a lake's commits and its
merges, ``runledger.ledger.lake``), so that one metric's series reads only its own row groups (by their
min/max statistics) instead of every metric's rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # issue 41: the readers import this module (its orders); pyarrow only to conform
    import pyarrow as pa

# Tables whose files are sorted, and by what. Rows of one metric lie together, in step order.
SORTED_TABLES: dict[str, tuple[str, ...]] = {"metrics": ("name", "attempt", "step", "stream", "stream_seq")}


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """``table`` under ``schema``: a column an older file lacks is null, as queries read it."""
    import pyarrow as pa

    columns = [
        table.column(field.name).cast(field.type)
        if field.name in table.column_names
        else pa.nulls(table.num_rows, field.type)
        for field in schema
    ]
    return pa.Table.from_arrays(columns, schema=schema)
