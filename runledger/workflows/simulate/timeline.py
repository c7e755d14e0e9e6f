"""The story's data: the crashes, config changes and attempts the plan lays out, the plan itself and
the layers' profile. Data only; ``story`` builds it, ``github_story`` and ``values`` fill it in and
read it, ``emission`` turns it into events. Below all of them, so none of them imports another for
its types.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from runledger.schemas import Envelope
from runledger.schemas import payloads as p
from runledger.workflows.simulate.facts import SimOptions

CrashKind = Literal["exception", "nonfinite_loss", "signal", "oom"]  # as run.crashed names them


@dataclass
class Crash:
    step: int  # the last step the attempt completed
    kind: CrashKind
    rank: int
    host: str
    exc_type: str | None
    message: str
    signal: int | None
    exit_code: int
    resume_from: int  # the checkpoint the next attempt resumes from
    cause: str  # what failed: nccl, xid, ecc, oom, signal, nonfinite


@dataclass
class Change:
    step: int
    ops: list[p.PatchOp]
    title: str
    pr: int = 0  # filled in when the GitHub story is laid out
    sha: str = ""
    author: str = ""


@dataclass
class Segment:
    """One attempt: from its checkpoint to its crash (or the end), with each step's duration."""

    attempt: int
    start_step: int
    end_step: int
    crash: Crash | None
    mfu: np.ndarray  # per step start_step+1 .. end_step, percent
    step_time_s: np.ndarray
    launch_time_s: float = 0.0  # seconds since START
    wall_s: np.ndarray = field(default_factory=lambda: np.zeros(0))  # each step's end, since START
    git_commit: str = ""
    job_id: str = ""


@dataclass
class Plan:
    options: SimOptions
    scale: float
    switch_step: int
    checkpoint_every: int
    warmup_steps: int
    decay_start_step: int
    changes: list[Change]
    segments: list[Segment]
    github: list[tuple[float, list[Envelope]]] = field(default_factory=list)  # (seconds, events)
    initial_config: dict[str, Any] = field(default_factory=dict)
    profile: Profile | None = None

    @property
    def crashes(self) -> list[Crash]:
        return [s.crash for s in self.segments if s.crash is not None]


@dataclass
class Profile:
    """Per-layer character of the run, fixed for a seed: which layers drop more, their z-loss…"""

    drop: np.ndarray  # mean 1: the layer's share of pooled-wave drops
    drop_ragged: np.ndarray
    sender_share: np.ndarray
    z_base: np.ndarray
    entropy_fall: np.ndarray
    load_hot: np.ndarray  # (layers, experts): persistent expert popularity, drifting over the run
    load_late: np.ndarray
    drop_norm: float  # mean of the early transient over the pooled-wave steps
