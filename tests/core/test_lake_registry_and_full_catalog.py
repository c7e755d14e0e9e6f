"""On a ledger that is a lake: the producer registry is read back from the lake (``ledger init``,
``producers export``, ``kafka replay --registry``), and a full disk under its SQLite catalog, as DuckDB
words it, is told as a full disk."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest

from runledger.ledger import registry
from runledger.ledger.store import Ledger
from runledger.schemas.durable import disk_full
from runledger.schemas.note import generate_keypair
from runledger.schemas.payloads import PolicyChanged, ProducerScope


def test_the_registry_of_a_lake_is_read_back_in_log_order(tmp_path: Path) -> None:
    ledger = Ledger.create(tmp_path / "l")
    assert ledger.lake is not None  # a new ledger is a lake
    assert registry.registry_entries(ledger) == []
    _, public = generate_keypair("trainer")
    key_id = registry.register_producer(ledger, "trainer", public, ProducerScope(sources=["trainer/"]))
    registry.append_registry_event(ledger, PolicyChanged(unsigned_sources=["people/"]))
    entries = registry.registry_entries(ledger)
    assert [entry.position for entry in entries] == [0, 1]
    assert key_id in entries[0].raw.decode() and "people/" in entries[1].raw.decode()
    # Exported and read back (a folder, or the file written from it): the same entries.
    saved = tmp_path / "registry.jsonl"
    assert registry.write_registry_file(entries, saved) == 2
    assert registry.read_registry(saved) == entries
    assert registry.read_registry(tmp_path / "l") == entries


@pytest.mark.parametrize(
    ("words", "full"),
    [
        ("IO Error: database or disk is full", True),  # SQLITE_FULL from the lake's SQLite catalog
        ("IO Error: No space left on device", True),
        ("IO Error: Disk quota exceeded", True),
        ("IO Error: Could not open file", False),
    ],
)
def test_a_full_disk_under_duckdb_is_told_by_its_words(words: str, full: bool) -> None:
    error = duckdb.IOException(words)
    try:
        raise RuntimeError("commit failed") from error
    except RuntimeError as outer:
        assert (disk_full(outer) is error) is full
