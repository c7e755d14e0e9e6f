"""`ledger monitor URL`: follow a published tile log and refuse any checkpoint that rewrites history.

Each check fetches ``<URL>/checkpoint``, verifies its signature with the log's key, and compares it
with the last checkpoint this monitor accepted (kept in a small JSON state file):

* a smaller size is a **rollback**; the same size with another root, or a bigger tree whose tiles do
  not give back the old root, is a **fork** (two histories signed by one key);
* a bigger tree is accepted only when its tiles give its signed root, the first ``old size`` leaves
  give the old root, and the RFC 6962 consistency proof built from those tiles verifies.

With witness keys and a quorum, that many valid cosignatures are required. With ``entries``, each
look also walks the entries new since the last accepted checkpoint and hashes the data files of
the signed manifest not verified before: a remote verifier of what is new only.

The log is read over HTTP from its base URL, or through any ``LogFiles`` (``files=``: e.g.
``ledger.remote``'s reader of an S3 bucket).

Only an accepted checkpoint is written to the state file, so a refused one is refused again; a look
that finds nothing new leaves the file as it was (no rewrite, no fsync).
"""

from __future__ import annotations

import base64
import hashlib
import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ledger.log_checkpoint import parse_and_verify_checkpoint
from ledger.merkle import ProofError, verify_consistency
from ledger.tiles import (
    TileError,
    TileReader,
    consistency_proof_from_tiles,
    entries_path,
    root_from_tiles,
    root_of_prefix,
    tile_path,
    walk_new_entries,
)
from ledger.witness import parse_cosignature_key, verify_cosignatures
from schemas.durable import write_durably
from schemas.note import CheckpointError, open_note

__all__ = ["LogFiles", "MonitorError", "MonitorReport", "check_log"]

_MAX_FETCH_BYTES = 1 << 20  # a checkpoint or a tile is far smaller
_TIMEOUT_S = 10


class MonitorError(ValueError):
    """The log showed a fork, a rollback or a bad signature (``kind`` says which), or was unreachable."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


@dataclass(frozen=True)
class MonitorReport:
    origin: str
    old_size: int | None  # None: the first checkpoint this monitor saw
    size: int
    entries: int = 0  # entries walked and checked (with ``entries``)
    files: int = 0  # data files fetched and checked against the signed manifest


def _no_scheme(url: str) -> MonitorError:
    """A path given where a URL is wanted (urllib raises ValueError: not a traceback for the user)."""
    return MonitorError(
        "unreachable", f"{url}: not a URL: give http://, https://, file:///path or s3://bucket/prefix"
    )


def _fetch(url: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=_TIMEOUT_S) as response:
            data: bytes = response.read(_MAX_FETCH_BYTES + 1)
    except (urllib.error.URLError, OSError) as exc:
        raise MonitorError("unreachable", f"{url}: {exc}") from exc
    except ValueError:
        raise _no_scheme(url) from None
    if len(data) > _MAX_FETCH_BYTES:
        raise MonitorError("malformed", f"{url} is larger than {_MAX_FETCH_BYTES} bytes")
    return data


class LogFiles(Protocol):
    """A published log's files by path relative to its root (failures are MonitorError)."""

    name: str

    def read(self, rel: str) -> bytes: ...

    def sha256(self, rel: str) -> str: ...


class _HttpFiles:
    """The log served under a base URL."""

    def __init__(self, base: str) -> None:
        self.name = base

    def read(self, rel: str) -> bytes:
        return _fetch(self.name + rel)

    def sha256(self, rel: str) -> str:
        return _sha256_url(self.name + rel)


def _tile_reader(files: LogFiles) -> TileReader:
    def read(level: int, index: int, width: int) -> bytes:
        return files.read(tile_path(level, index, width))

    return read


def _check_growth(files: LogFiles, old: dict[str, object], size: int, root: bytes) -> None:
    read = _tile_reader(files)
    old_size = int(str(old["size"]))
    old_root = base64.b64decode(str(old["root"]))
    try:
        if root_from_tiles(read, size) != root:
            raise MonitorError("bad-tiles", f"the tiles of size {size} do not give the signed root")
        if root_of_prefix(read, size, old_size) != old_root:
            raise MonitorError(
                "fork", f"the tree of size {size} does not extend the one of size {old_size} seen before"
            )
        verify_consistency(old_size, size, old_root, root, consistency_proof_from_tiles(read, old_size, size))
    except (ProofError, TileError) as exc:
        raise MonitorError("fork", f"no valid consistency proof from {old_size} to {size}: {exc}") from exc


def check_quorum(text: bytes, witnesses: Sequence[str], quorum: int) -> None:
    keys = [parse_cosignature_key(w) for w in witnesses]
    good = verify_cosignatures(text.decode(), keys)
    if len(good) < quorum:
        raise MonitorError(
            "quorum", f"{len(good)} valid cosignatures of the {quorum} required ({', '.join(good) or 'none'})"
        )


def check_log(
    url: str,
    log_key: str,
    state_path: Path,
    *,
    witnesses: Sequence[str] = (),
    quorum: int = 0,
    entries: bool = False,
    files: LogFiles | None = None,
) -> MonitorReport:
    """One look at the log at ``url``: raises MonitorError on a fork, rollback, bad signature, or
    fewer than ``quorum`` valid cosignatures by ``witnesses``. With ``entries``, also walks every
    entry new since the last accepted checkpoint and checks the new data files against the signed
    manifest (only what is new: bounded by the growth, not the log). ``files``: read the log
    through it instead of over HTTP from ``url``."""
    base = url if url.endswith("/") else url + "/"
    files = files or _HttpFiles(base)
    saved = state_path.read_bytes() if state_path.exists() else None
    old = json.loads(saved) if saved is not None else None
    text = files.read("checkpoint")
    try:
        checkpoint = parse_and_verify_checkpoint(text, log_key, old["origin"] if old else None)
    except CheckpointError as exc:
        raise MonitorError("bad-signature", f"{base}checkpoint: {exc}") from exc
    if quorum:
        check_quorum(text, witnesses, quorum)
    size, root = checkpoint.size, checkpoint.root
    if old is not None:
        old_size, old_root = old["size"], base64.b64decode(old["root"])
        if size < old_size:
            raise MonitorError("rollback", f"the log shrank from {old_size} to {size} entries")
        if size == old_size and root != old_root:
            raise MonitorError("fork", f"two different roots signed for size {size}")
        if size > old_size:
            _check_growth(files, old, size, root)
    verified = dict(old.get("files", {})) if old else {}
    counted = (0, 0)
    if entries and (old is None or size > old["size"]):  # the same checkpoint: nothing new to walk
        counted = _check_new_entries(
            files, checkpoint.origin, log_key, old["size"] if old else 0, size, root, verified
        )
    state = {"url": base, "origin": checkpoint.origin, "size": size, "root": base64.b64encode(root).decode()}
    _save(state_path, saved, json.dumps(state | {"checkpoint": text.decode(), "files": verified}).encode())
    return MonitorReport(checkpoint.origin, None if old is None else old["size"], size, *counted)


def _save(state_path: Path, saved: bytes | None, state: bytes) -> None:
    """Write the state file only when it changes: a monitor polling a quiet log every few seconds
    would otherwise rewrite and fsync the same bytes each time."""
    if state == saved:
        return
    state_path.parent.mkdir(parents=True, exist_ok=True)
    write_durably(state_path, state)


def _check_new_entries(
    files: LogFiles,
    origin: str,
    log_key: str,
    old_size: int,
    size: int,
    root: bytes,
    verified: dict[str, str],
) -> tuple[int, int]:
    """Walk the entries [old_size, size) against the signed root, then the manifest the last
    snapshot entry names and each data file in it not verified before. Returns (entries, files)."""
    read = _tile_reader(files)

    def read_bundle(index: int, width: int) -> bytes:
        return files.read(entries_path(index, width))

    manifest_digest = None
    count = 0
    try:
        for _, entry in walk_new_entries(read, read_bundle, old_size, size, root):
            doc = json.loads(entry)
            if doc.get("t") == "snapshot":
                manifest_digest = doc["manifest_sha256"]
            count += 1
    except (ProofError, TileError, ValueError) as exc:
        raise MonitorError(
            "bad-entries", f"an entry of {files.name} does not match the signed tree: {exc}"
        ) from exc
    if manifest_digest is None:
        return count, 0
    return count, _check_data(files, origin, log_key, manifest_digest, verified)


def _check_data(files: LogFiles, origin: str, log_key: str, digest: str, verified: dict[str, str]) -> int:
    manifest = files.read("manifest.json")
    if hashlib.sha256(manifest).hexdigest() != digest:
        raise MonitorError(
            "bad-manifest", "manifest.json is not the manifest the log's last snapshot entry names"
        )
    try:
        signed = open_note(files.read("manifest.sig"), log_key).split("\n")
    except CheckpointError as exc:
        raise MonitorError("bad-signature", f"manifest.sig: {exc}") from exc
    if signed[0] != f"{origin}/manifest" or base64.b64decode(signed[2]).hex() != digest:
        raise MonitorError("bad-manifest", "manifest.sig does not sign this manifest")
    checked = 0
    for item in json.loads(manifest)["files"]:
        if verified.get(item["path"]) == item["sha256"]:
            continue  # verified on an earlier look: files never change once named
        if files.sha256(item["path"]) != item["sha256"]:
            raise MonitorError(
                "bad-data", f"{item['path']} does not match its SHA-256 in the signed manifest"
            )
        verified[item["path"]] = item["sha256"]
        checked += 1
    return checked


def _sha256_url(url: str) -> str:
    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=_TIMEOUT_S) as response:
            for block in iter(lambda: response.read(1 << 20), b""):
                digest.update(block)
    except (urllib.error.URLError, OSError) as exc:
        raise MonitorError("unreachable", f"{url}: {exc}") from exc
    except ValueError:
        raise _no_scheme(url) from None
    return digest.hexdigest()
