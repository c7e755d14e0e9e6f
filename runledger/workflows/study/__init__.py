"""The token-drop study: reproduce the reference run's 4K-context drop test on small experts.

One call (``run_study``) does, in order, all into one ledger in the study's work folder:

1. **Pre-registration.** Predictions for every (policy, capacity factor) from a balanced-router
   Monte Carlo with the study's exact shapes, plus stated claims, are written as annotation events on
   the study's own stream, ingested, and a log checkpoint is signed. Every training run's id embeds
   the SHA-256 of that signed checkpoint, so each training event (all of them carry the run id,
   signed by the producer key) provably came after it.
2. **Runs.** Small Megatron-Core MoE GPTs train through ``runledger.trainer.loop.train`` (normal
   recorded runs): a dropless run (the ragged control) and a run trained with Megatron's capacity
   dropping on. On each, hooks on the routers keep every micro-batch's top-k selection before
   dropping, and every layer's drop rate per step is counted for Megatron's per-micro-batch capacity
   at each capacity factor of the sweep, for pooled-wave accounting (stated shards and waves) and
   for dropless (0). The capacity-trained run cross-checks the accounting: the trainer's own measured
   drop must equal the counterfactual at that factor, layer by layer and step by step.
3. **Results.** Per policy × cf (× shards) mean / p50 / max drop over layers and steps, as events
   (annotations on the study stream and each run's, a run summary per run), a scored comparison with
   the predictions and with the reference run's published figures, a second signed checkpoint, the
   figure and ``results.json``.

Router losses as in the reference run where Megatron has them: the switch load-balancing loss is
logged but not trained on (coefficient 0); balance comes from a per-expert bias updated outside the
gradient (Megatron's ``moe_router_enable_expert_bias``, updated after every step with the rule of
``moe_utils.get_updated_expert_bias``); the z-loss is logged (and trained with a small coefficient).

The modules: ``options`` (options, the reference figures), ``policies`` (accounting rules, counts
through ``runledger.trainer.drop_accounting``, statistics), ``collect`` (router hooks, per-step counts, expert
bias), ``predictions`` (predictions, claims, scoring), ``output`` (``StudyResult``, ``results.json``,
figure), ``pipeline`` (``run_study`` and its steps). The public names are importable from here.
"""

from __future__ import annotations

from runledger.workflows.study.collect import DropCollector
from runledger.workflows.study.options import (
    REFERENCE_POOLED_WAVE_CF,
    REFERENCE_POOLED_WAVE_RATE,
    REFERENCE_RAGGED_RATE,
    REFERENCE_WAVES,
    StudyError,
    StudyOptions,
)
from runledger.workflows.study.output import StudyResult, plot_study, write_results_json
from runledger.workflows.study.pipeline import (
    AUTHOR,
    STUDY_CONFIG,
    TAG,
    Say,
    StudyEvents,
    prepare_workdir,
    run_study,
    train_config,
)
from runledger.workflows.study.policies import (
    Policy,
    Summary,
    count_drops,
    pooled_wave_policy,
    study_policies,
    summarise,
)
from runledger.workflows.study.predictions import (
    Prediction,
    Score,
    balanced_rates,
    claims,
    make_predictions,
    score,
)

__all__ = [
    "AUTHOR",
    "REFERENCE_POOLED_WAVE_CF",
    "REFERENCE_POOLED_WAVE_RATE",
    "REFERENCE_RAGGED_RATE",
    "REFERENCE_WAVES",
    "STUDY_CONFIG",
    "TAG",
    "DropCollector",
    "Policy",
    "Prediction",
    "Say",
    "Score",
    "StudyError",
    "StudyEvents",
    "StudyOptions",
    "StudyResult",
    "Summary",
    "balanced_rates",
    "claims",
    "count_drops",
    "make_predictions",
    "plot_study",
    "pooled_wave_policy",
    "prepare_workdir",
    "run_study",
    "score",
    "study_policies",
    "summarise",
    "train_config",
    "write_results_json",
]
