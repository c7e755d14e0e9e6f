"""Shared pieces of the trainer tests: a tiny MoE config, spool readers, a sink that keeps events."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import msgspec
import pytest

from ingest.spool import SpoolReader
from schemas import Envelope, Event, decode_event, encode_event
from trainer.config import TINY_CPU, TrainConfig, load_config, write_config

HERE = Path(__file__).parent
ROOT = HERE.parents[1]  # the repository: where subprocesses run `python -m cli.train_cmd`


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Megatron-Core warns about the absent Transformer Engine / Apex and its own deprecations on
    # every model build: expected on CPU, noise in these tests' reports.
    for item in items:
        if HERE in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.filterwarnings("ignore:.*:UserWarning:megatron"))
            item.add_marker(pytest.mark.filterwarnings("ignore:.*:DeprecationWarning:megatron"))
            item.add_marker(pytest.mark.filterwarnings("ignore:.*:DeprecationWarning:torch"))


TINY = [*TINY_CPU, "schedule.warmup_steps=5", "telemetry.peak_tflops=0.16"]


def tiny_config(tmp_path: Path, *extra: str, run_id: str = "tiny") -> TrainConfig:
    return load_config(None, [*TINY, f"run.run_id={run_id}", f"checkpoint.dir={tmp_path / 'ckpt'}", *extra])


def tiny_config_file(tmp_path: Path, *extra: str, run_id: str = "tiny") -> Path:
    path = tmp_path / "train.toml"
    write_config(path, tiny_config(tmp_path, *extra, run_id=run_id))
    return path


class ListSink:
    """An in-memory sink that round-trips every event through the wire encoding."""

    def __init__(self) -> None:
        self.raw: list[bytes] = []
        self.syncs = 0

    def emit(self, envelope: Envelope) -> None:
        self.raw.append(encode_event(envelope))

    def sync(self) -> None:
        self.syncs += 1

    def close(self) -> None:
        pass

    @property
    def events(self) -> list[Envelope]:
        return [_valid(raw).envelope for raw in self.raw]

    def of(self, type_suffix: str) -> list[Envelope]:
        return [e for e in self.events if e.type.endswith(type_suffix)]


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


@pytest.fixture
def sink() -> ListSink:
    return ListSink()
