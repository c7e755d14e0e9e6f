"""The light names of a ledger's folder that a reader needs without the writer (issue 41): the error
every ledger command tells in one line, a stream's head as a commit record keeps it, and the folder
of commit records. ``runledger.ledger.store`` (the writer) re-exports them, so either import works;
``runledger.ledger.query`` imports them from here and so never loads the writer, its admission
checks or their cryptography."""

from __future__ import annotations

from typing import Any

import msgspec

from runledger.ledger.merkle import CompactRange

__all__ = ["COMMITS", "LedgerError", "StreamHead"]

COMMITS = "_commits"  # a ledger folder's commit records, one JSON file each


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
