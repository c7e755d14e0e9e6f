"""Shared pieces of the trainer tests: a tiny MoE config, spool readers, gap checks."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import msgspec

from runledger.ingest.spool import SpoolReader
from runledger.schemas import Envelope, Event, decode_event
from runledger.trainer.config import TINY_CPU, TrainConfig, load_config, write_config

# The repository: where subprocesses run `python -m runledger.cli.train_cmd`.
ROOT = Path(__file__).resolve().parents[2]


TINY = [*TINY_CPU, "schedule.warmup_steps=5", "telemetry.peak_tflops=0.16"]


def tiny_config(tmp_path: Path, *extra: str, run_id: str = "tiny") -> TrainConfig:
    return load_config(None, [*TINY, f"run.run_id={run_id}", f"checkpoint.dir={tmp_path / 'ckpt'}", *extra])


def tiny_config_file(tmp_path: Path, *extra: str, run_id: str = "tiny") -> Path:
    path = tmp_path / "train.toml"
    write_config(path, tiny_config(tmp_path, *extra, run_id=run_id))
    return path


def _valid(raw: bytes) -> Event:
    event = decode_event(raw)
    assert isinstance(event, Event), event
    return event


def read_spool(directory: Path) -> list[Envelope]:
    out = []
    for record in SpoolReader(directory).read():
        assert record.corrupt is None, record.corrupt
        out.append(_valid(record.payload).envelope)
    return out


def assert_gap_free(events: list[Envelope]) -> dict[str, list[int]]:
    """Every source's seq is 0, 1, 2, … in spool order; returns the seqs per source."""
    by_source: dict[str, list[int]] = defaultdict(list)
    for e in events:
        by_source[e.source].append(e.seq)
    for source, seqs in by_source.items():
        assert seqs == list(range(len(seqs))), f"{source}: {seqs}"
    return by_source


def data(e: Envelope) -> dict:
    out: dict = msgspec.to_builtins(e.data)
    return out
