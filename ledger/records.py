"""The light names of a ledger's folder that a reader needs without the writer (issue 41): the error
every ledger command tells in one line, a stream's head as a commit record keeps it, and the folder
of commit records with the one way to find and read them (``commit_record_path``,
``commit_record_paths``, ``newest_commit_number``, ``read_commit_record``). ``runledger.ledger.store``
(the writer) re-exports them, so either import works; ``runledger.ledger.query`` imports them from
here and so never loads the writer, its admission checks or their cryptography."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import msgspec

from runledger.ledger.merkle import CompactRange

__all__ = [
    "COMMITS",
    "LedgerError",
    "StreamHead",
    "commit_record_path",
    "commit_record_paths",
    "newest_commit_number",
    "read_commit_record",
]

COMMITS = "_commits"  # a ledger folder's commit records, one JSON file each


def commit_record_path(root: Path, number: int) -> Path:
    """Where the ledger folder ``root`` keeps commit ``number``'s record (``_commits/0000000042.json``)."""
    return root / COMMITS / f"{number:010d}.json"


def commit_record_paths(root: Path) -> list[Path]:
    """The folder's commit records, oldest first (the numbers are zero-padded: names sort as numbers)."""
    return sorted((root / COMMITS).glob("*.json"))


def newest_commit_number(root: Path) -> int | None:
    """The number of the folder's newest commit record; None where it has none (or no folder)."""
    try:
        names = os.listdir(root / COMMITS)
    except OSError:
        return None
    numbers = [int(name[:-5]) for name in names if name.endswith(".json") and name[:-5].isdigit()]
    return max(numbers) if numbers else None


def read_commit_record(root: Path, number: int) -> dict[str, Any]:
    """Commit ``number``'s record as the writer wrote it (OSError, ValueError: missing or damaged)."""
    record: dict[str, Any] = json.loads(commit_record_path(root, number).read_bytes())
    return record


class LedgerError(Exception):
    """A user-facing problem with a ledger (missing, not a ledger, locked...)."""


class StreamHead(msgspec.Struct):
    size: int
    tree: CompactRange

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "tree": self.tree.to_json()}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> StreamHead:
        return cls(size=obj["size"], tree=CompactRange.from_json(obj["tree"]))
