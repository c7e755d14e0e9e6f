"""The per-step payloads (``StepMetrics``, ``MoeRouterStats``) and the crash record, built from host
values: one builder for runledger's own trainer (``runledger.trainer.telemetry``, ``runledger.trainer.loop``) and
the client library (``runledger.init``), so both describe a step and a crash with the same fields.

Names: ``STEP_FIELDS`` and ``COUNT_FIELDS`` are ``StepMetrics``' typed fields; any other name is a
named scalar (``StepMetrics.scalars``). ``ALIASES`` maps the names other stacks log the same
quantities under (Megatron-LM's ``lm loss``, Hugging Face's ``train/learning_rate``, the W&B keys
runledger's own mirror writes, ``router/aux_loss`` …) to runledger's. Non-finite values travel as
null: JSON has no NaN/Inf.

No torch here: host numbers and NumPy arrays only.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from runledger.schemas.payloads import MoeLayerStats, MoeRouterStats, StepMetrics

STEP_FIELDS = ("loss", "grad_norm", "lr", "tokens_per_second", "mfu", "step_time_s")
COUNT_FIELDS = ("tokens", "total_tokens")
# The trainer's step scalars: router stats averaged over the layers (max_load where every layer has it)
LAYER_MEANS = ("token_drop_rate", "aux_loss", "z_loss", "routing_entropy", "max_load")

# Another name → runledger's name. Only exact names: a key is renamed only when nothing else in the
# same row already carries runledger's name (then both are kept, the alias as a named scalar).
ALIASES: dict[str, str] = {
    # Megatron-LM's W&B/TensorBoard keys
    "lm loss": "loss",
    "learning-rate": "lr",
    "grad-norm": "grad_norm",
    "iteration-time": "step_time_s",
    # common trainer loops, Hugging Face Trainer
    "train/loss": "loss",
    "train_loss": "loss",
    "learning_rate": "lr",
    "train/learning_rate": "lr",
    "train/lr": "lr",
    "train/grad_norm": "grad_norm",
    "gradient_norm": "grad_norm",
    # runledger's own W&B mirror (``runledger.trainer.mirror.step_values``): layer means, counters
    "router/token_drop_rate": "token_drop_rate",
    "router/aux_loss": "aux_loss",
    "router/z_loss": "z_loss",
    "router/entropy": "routing_entropy",
    "router/load_imbalance": "max_load",  # the mirror's name: max ÷ mean tokens per expert
    "router/max_load": "max_load",
    "trainer/events_dropped": "events_dropped",
    "trainer/skipped_steps": "skipped_steps",
}


def finite(x: float | None) -> float | None:
    """JSON has no NaN/Inf: they travel as null."""
    return x if x is not None and math.isfinite(x) else None


def ledger_names(keys: list[str]) -> dict[str, str]:
    """Each key's name in the ledger (``ALIASES`` applied where it does not collide)."""
    taken = set(keys)
    out: dict[str, str] = {}
    for key in keys:
        name = ALIASES.get(key)
        if name is not None and name not in taken:
            taken.add(name)
            out[key] = name
        else:
            out[key] = key
    return out


_TYPED_NAMES = frozenset((*STEP_FIELDS, *COUNT_FIELDS))


@functools.lru_cache(maxsize=256)
def _ledger_names_of(keys: tuple[str, ...]) -> dict[str, str]:
    """``ledger_names`` of one step's keys, kept: a loop logs the same keys step after step (68 of
    them with the 48 per-layer max loads: ~30% of building the step's payload). Callers only read it."""
    return ledger_names(list(keys))


def metrics_from_values(values: Mapping[str, float | int | None]) -> StepMetrics:
    """One step's host numbers as ``StepMetrics``: known names to the typed fields, the rest scalars.

    A count field (``tokens``, ``total_tokens``) that is not a non-negative whole number is kept as
    a named scalar instead, so no value is lost to validation."""
    names = _ledger_names_of(tuple(values))
    fields: dict[str, Any] = {}
    scalars: dict[str, float | None] = {}
    for key, value in values.items():
        name = names[key]
        if type(value) is float and name not in _TYPED_NAMES:  # the usual named scalar, first
            scalars[name] = value if math.isfinite(value) else None
            continue
        number = None if value is None else float(value)
        if name in STEP_FIELDS:
            fields[name] = finite(number)
        elif name in COUNT_FIELDS and isinstance(value, int) and value >= 0:
            fields[name] = value  # an int as it is: a float would round counts above 2**53
        elif name in COUNT_FIELDS and number is not None and number >= 0 and number.is_integer():
            fields[name] = int(number)
        else:
            scalars[name] = finite(number)
    return StepMetrics(**fields, scalars=scalars)


@dataclass
class StepReport:
    """One step as the loop saw it (host floats): what progress callbacks and events are built from."""

    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens: int
    total_tokens: int
    step_time_s: float
    tokens_per_second: float
    mfu: float
    layers: list[MoeLayerStats] = field(default_factory=list)
    scalars: dict[str, float | None] = field(default_factory=dict)

    @property
    def token_drop_rate(self) -> float | None:
        if not self.layers:
            return None
        return sum(layer.token_drop_rate for layer in self.layers) / len(self.layers)


def report_fields(report: StepReport) -> dict[str, float | int | None]:
    """The step's typed quantities by their ledger names (W&B's mirror logs them under the same)."""
    return {
        "loss": report.loss,
        "grad_norm": report.grad_norm,
        "lr": report.lr,
        "tokens": report.tokens,
        "total_tokens": report.total_tokens,
        "tokens_per_second": report.tokens_per_second,
        "mfu": report.mfu,
        "step_time_s": report.step_time_s,
    }


def step_metrics(report: StepReport) -> StepMetrics:
    """The trainer's step: its fields, its own scalars and the router's layer means."""
    scalars = dict(report.scalars)
    if report.layers:
        n = len(report.layers)
        scalars["token_drop_rate"] = report.token_drop_rate
        for name in ("aux_loss", "z_loss", "routing_entropy"):
            values = [getattr(layer, name) for layer in report.layers]
            scalars[name] = None if None in values else sum(values) / n
        # max_load only where every layer measured it: steps without it keep their scalars as before
        loads = [layer.max_load for layer in report.layers if isinstance(layer.max_load, float)]
        if len(loads) == n:
            scalars["max_load"] = sum(loads) / n
    return metrics_from_values(report_fields(report) | scalars)


def max_load_of_counts(counts: np.ndarray) -> np.ndarray:
    """Per layer (``counts``: layers × experts tokens per expert): the busiest expert's tokens over
    the mean tokens per expert (1.0 balanced, experts ÷ top_k the worst); NaN (null) for a layer
    that routed no token."""
    counts_f = np.asarray(counts, dtype=np.float64)
    mean_tokens = counts_f.sum(axis=1) / max(1, counts_f.shape[1])
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(mean_tokens > 0, counts_f.max(axis=1, initial=0.0) / mean_tokens, np.nan)


def router_stats(report: StepReport) -> MoeRouterStats:
    return MoeRouterStats(layers=report.layers)


def layer_stats_from_arrays(
    *,
    top_k: int,
    tokens: np.ndarray,
    dropped: np.ndarray,
    drop_rate: np.ndarray,
    counts: np.ndarray | None = None,
    aux_loss: np.ndarray | None = None,
    z_loss: np.ndarray | None = None,
    entropy: np.ndarray | None = None,
    max_load: np.ndarray | None = None,
) -> list[MoeLayerStats]:
    """Per-layer stats from per-layer arrays (``counts``: layers × experts). Whole-array conversions
    (``tolist``), then one struct per layer: no Python work per expert. ``max_load`` None: the
    layers carry none (left out of the event, not null)."""
    n = len(tokens)
    tokens_l = np.asarray(tokens, dtype=np.int64).tolist()
    dropped_l = np.asarray(dropped, dtype=np.int64).tolist()
    rate_l = np.asarray(drop_rate, dtype=np.float64).tolist()
    counts_l = np.asarray(counts, dtype=np.int64).tolist() if counts is not None else [[]] * n

    def column(a: np.ndarray | None) -> list[float | None]:
        if a is None:
            return [None] * n
        values = np.asarray(a, dtype=np.float64)
        if np.isfinite(values).all():  # the usual case: one check for the array, not one per value
            return values.tolist()
        return [finite(x) for x in values.tolist()]

    aux_l, z_l, ent_l = column(aux_loss), column(z_loss), column(entropy)
    layers = [
        MoeLayerStats(
            layer=i,
            tokens=tokens_l[i],
            top_k=top_k,
            dropped=dropped_l[i],
            token_drop_rate=rate_l[i],
            expert_counts=counts_l[i],
            aux_loss=aux_l[i],
            z_loss=z_l[i],
            routing_entropy=ent_l[i],
        )
        for i in range(n)
    ]
    # Set after construction: a keyword per layer would need a dict per layer to leave it out
    if max_load is not None:
        for layer, load in zip(layers, column(max_load), strict=True):
            layer.max_load = load
    return layers
