"""The reference run as an event stream anyone can generate: ``ledger simulate reference-535b``.

A producer like the trainer (trainer → bus → ingest): it emits, through any ``EventSink``, the events
the real trainer (``runledger.trainer.telemetry`` and ``loop``) and the GitHub webhook receiver would
have produced for the run of ../shared/reference/marin-535b.md, with the same event types, sources,
payload fields and scalar names. Its story, which an analyst can check against the published facts:

* shape: 48 layers, 384 experts, top-8, hidden 6144, 4,096 context, 792 ranks (11 GB200 NVL72
  racks), 11,264 sequences = 46,137,344 tokens per step, 390,000 steps (~18T tokens), ~3 months;
* per step, 32 scalars (loss falling as a data-scaling power law with noise and rare spikes, a WSD
  learning-rate schedule, grad norm, tokens/s and MFU ~22.71%, 22.87% after the switch) and per layer
  the router's drop rate, drops split by sender/receiver, load-balancing loss, z-loss and entropy;
* token-drop rate: 2.67% mean under pooled-wave (capacity factor 1.15, 3 waves) with per-layer
  variation and an early transient, 0.018% from the dispatcher switch at step 81,716 on;
* expert counts (48 × 384, skewed, summing to tokens·k − dropped) every ``expert_counts_every``
  steps, 792 per-rank stats every ``rank_stats_every`` steps (two flaky hosts run slow);
* ~19 crashes (NCCL timeouts, Xid/ECC errors, OOMs, preemptions, non-finite losses; rank and host,
  clustered on two flaky hosts), each followed by a resume from the last checkpoint (~500 steps
  back; two back after a non-finite loss): the new attempt re-emits the superseded steps;
* live config changes, each caused by a merged PR (``cause.kind="commit"``), the dispatcher switch
  (``moe.dispatcher`` pooled_wave → ragged_all_to_all) at step 81,716 among them;
* a GitHub stream of the run's repository over the same months (issues, PRs with reviews and
  synchronize pushes, squash merges pushed to main, crash reports, relaunch comments on the run's
  status issue), made by ``runledger.ingest.github_events.webhook_events`` as the receiver makes it;
  every attempt runs the commit at the head of main when it launched.

The package, top to bottom: ``facts`` (the published figures, ``SimOptions``), ``story`` (the plan:
attempts, crashes, config changes), ``github_story`` (the repository's deliveries), ``values``
(every reported number, a chunk of steps at a time) and ``emission`` (``simulate``: the envelopes).

A shorter run (``steps`` < 390,000) keeps the story: every position is the reference step scaled
by ``steps / 390,000`` and the run still spans the same three months. Everything is a function of
``seed``: ids, times and values; two runs with the same options write identical bytes.
"""

from runledger.workflows.simulate.emission import SimStats, simulate
from runledger.workflows.simulate.facts import (
    DROP_RATE_POOLED,
    DROP_RATE_RAGGED,
    FLAKY_RANKS,
    LAYERS,
    MFU_POOLED_PERCENT,
    MFU_RAGGED_PERCENT,
    RANKS,
    REFERENCE_CRASHES,
    REFERENCE_STEPS,
    RUN_ID,
    SCALAR_NAMES,
    SCENARIOS,
    SWITCH_STEP,
    SimOptions,
    at,
    host_of,
)
from runledger.workflows.simulate.story import plan
from runledger.workflows.simulate.timeline import Plan

__all__ = [
    "DROP_RATE_POOLED",
    "DROP_RATE_RAGGED",
    "FLAKY_RANKS",
    "LAYERS",
    "MFU_POOLED_PERCENT",
    "MFU_RAGGED_PERCENT",
    "RANKS",
    "REFERENCE_CRASHES",
    "REFERENCE_STEPS",
    "RUN_ID",
    "SCALAR_NAMES",
    "SCENARIOS",
    "SWITCH_STEP",
    "Plan",
    "SimOptions",
    "SimStats",
    "at",
    "host_of",
    "plan",
    "simulate",
]
