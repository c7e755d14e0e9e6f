"""Data: the shipped public-domain corpus through a byte-level tokenizer, or synthetic tokens.

The corpus is Isaac Newton's *Opticks* (4th edition, 1730; public domain), the Project Gutenberg
transcription as the Go distribution ships it for its compression tests
(``src/testdata/Isaac.Newton-Opticks.txt``), without Gutenberg's header and licence boilerplate.

Batches are a pure function of (seed, step, micro-batch, data-parallel rank): random windows of
``seq_length + 1`` bytes. A resumed run therefore sees exactly the batches it would have seen had it
never stopped, with no loader state in the checkpoint.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

from runledger.trainer.config import ConfigError, TrainConfig

DATA_DIR = Path(__file__).parent / "data"
CORPORA = {"opticks": DATA_DIR / "opticks.txt"}


def corpus_path(name: str) -> Path:
    path = CORPORA.get(name, Path(name))
    if not path.is_file():
        raise ConfigError(f"data.corpus {name!r}: no such shipped corpus or file")
    return path


def encode(text: str) -> list[int]:
    """Byte-level tokenizer: UTF-8 bytes are the tokens (vocabulary 256)."""
    return list(text.encode("utf-8"))


def decode(tokens: list[int]) -> str:
    return bytes(tokens).decode("utf-8", errors="replace")


@lru_cache(maxsize=4)
def load_corpus(name: str) -> torch.Tensor:
    """The corpus as a uint8 tensor of byte tokens (cached per process)."""
    return torch.frombuffer(bytearray(corpus_path(name).read_bytes()), dtype=torch.uint8)


class Batches:
    """Deterministic (tokens, labels) micro-batches for one data-parallel rank."""

    def __init__(self, cfg: TrainConfig, *, dp_rank: int, device: torch.device) -> None:
        self.seq = cfg.model.seq_length
        self.batch = cfg.data.micro_batch_size
        self.micro_batches = cfg.data.micro_batches
        self.seed = cfg.run.seed
        self.dp_rank = dp_rank
        self.device = device
        self.synthetic = cfg.data.source == "synthetic"
        self.vocab = cfg.model.vocab_size
        self.data = None if self.synthetic else load_corpus(cfg.data.corpus)
        if self.data is not None and len(self.data) <= self.seq + 1:
            raise ConfigError("the corpus is shorter than one sequence")
        self._window = torch.arange(self.seq + 1)

    def _generator(self, step: int, micro: int) -> torch.Generator:
        # Distinct, reproducible stream per (seed, step, micro-batch, rank).
        key = ((self.seed * 1_000_003 + step) * 1009 + micro) * 4099 + self.dp_rank
        return torch.Generator().manual_seed(key & 0x7FFF_FFFF_FFFF_FFFF)

    def get(self, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        gen = self._generator(step, micro)
        if self.data is None:
            rows = torch.randint(0, self.vocab, (self.batch, self.seq + 1), generator=gen)
        else:
            starts = torch.randint(0, len(self.data) - self.seq - 1, (self.batch, 1), generator=gen)
            rows = self.data[starts + self._window].long()
        rows = rows.to(self.device, non_blocking=True)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    @property
    def tokens_per_step(self) -> int:
        """Tokens one rank consumes per optimizer step."""
        return self.batch * self.seq * self.micro_batches
