"""The ledger's signed stream checkpoints on disk: where each stream's lives (``checkpoint_path``:
``_checkpoints/<stream>.txt``, every one signed kept beside it under its size), the origin line that
names the ledger and the stream (``origin_of``), and signing every stream's head (``sign_checkpoints``).

Apart from ``runledger.ledger.integrity`` (which checks them) so that signing, the report and the
page do not import verification's Parquet readers (pyarrow and NumPy: ~0.2 s a process).
"""

from __future__ import annotations

from pathlib import Path

from runledger.ledger.log_checkpoint import sign_checkpoint
from runledger.ledger.store import Ledger
from runledger.schemas.durable import write_durably
from runledger.schemas.note import parse_private_key

CHECKPOINTS = "_checkpoints"


def origin_of(ledger: Ledger, stream: str) -> str:
    return f"runledger/{ledger.ledger_id}/{stream}"


def checkpoint_path(root: Path, stream: str) -> Path:
    return root / CHECKPOINTS / (stream.replace("/", "~") + ".txt")


def sign_checkpoints(root: str | Path | Ledger, private_key: str) -> list[Path]:
    """Sign each stream's current (size, root); write the latest and keep every one signed. ``root``:
    the ledger's folder, or the ledger open already (a command that found its key in it)."""
    if isinstance(root, Ledger):
        ledger = root
        heads = sorted(ledger.stream_heads().items())
    else:
        with Ledger.open(root) as ledger:
            heads = sorted(ledger.stream_heads().items())
    signer = parse_private_key(private_key)
    written = []
    for stream, head in heads:
        text = sign_checkpoint(origin_of(ledger, stream), head.size, head.tree.root(), signer)
        latest = checkpoint_path(ledger.root, stream)
        history = latest.with_suffix("") / f"{head.size:012d}.txt"
        history.parent.mkdir(parents=True, exist_ok=True)
        write_durably(history, text)
        write_durably(latest, text)
        written.append(latest)
    return written
