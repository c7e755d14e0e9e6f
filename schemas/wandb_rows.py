"""One W&B history row → one ``StepMetrics``, and the ledger step of a row: shared by the live bridge
(``runledger.wandb.tee``) and the importers (``runledger.ingest.wandb_import``, ``runledger.ingest.wandb_online``), so a
run bridged live and the same run imported later say the same thing.

**Names.** Every value is kept under the name it was logged with (``train/loss`` stays
``train/loss``, a named scalar), and the typed fields are filled from the first name that means them
(``loss``, else ``train/loss``, ``lm loss``…: ``runledger.schemas.step_payloads.ALIASES``), so reports and
``loss``-based answers work for every stack. A name that *is* a typed field (``loss``) is recorded
once, as the field. Nothing is invented: a step that logged no token count has no ``tokens``.

**Steps.** W&B's own row counter (``_step``) counts every committed row, eval rows too. A script can
name its own step with ``define_metric("*", step_metric="train/global_step")`` (the Hugging Face
Trainer does): a row whose keys have a step metric is recorded at that metric's value in the row (or
its last value, as W&B's ``step_sync`` inserts it). Rows without one follow ``_step``.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from runledger.schemas.payloads import StepMetrics
from runledger.schemas.step_payloads import ALIASES, COUNT_FIELDS, STEP_FIELDS

TYPED_FIELDS = (*STEP_FIELDS, *COUNT_FIELDS)
# Each typed field's names, the field's own first: the first one a row holds fills the field.
_SPELLINGS: dict[str, tuple[str, ...]] = {
    name: (name, *(alias for alias, target in ALIASES.items() if target == name)) for name in TYPED_FIELDS
}


def _finite(value: float | int | None) -> float | None:
    if value is None or isinstance(value, bool):
        return None if value is None else float(value)
    number = float(value)
    return number if math.isfinite(number) else None


def _count(value: float | int | None) -> int | None:
    """A whole non-negative number as an int (an int as it is: counts above 2**53 stay exact)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value if value >= 0 else None
    if isinstance(value, float) and math.isfinite(value) and value >= 0 and value.is_integer():
        return int(value)
    return None


def step_metrics_of_row(values: Mapping[str, float | int | None]) -> StepMetrics:
    """One W&B row's numbers (NaN/inf already None or still floats) as ``StepMetrics``."""
    fields: dict[str, Any] = {}
    for name, spellings in _SPELLINGS.items():
        key = next((k for k in spellings if k in values), None)
        if key is None:
            continue
        if name in COUNT_FIELDS:
            count = _count(values[key])
            if count is not None:
                fields[name] = count
            elif key == name:
                continue  # a count that is not one stays a named scalar (below), never lost
        else:
            fields[name] = _finite(values[key])
    scalars = {
        key: _finite(value) for key, value in values.items() if key not in TYPED_FIELDS or key not in fields
    }
    return StepMetrics(**fields, scalars=scalars)


def is_step_value(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return math.isfinite(value) and value >= 0 and float(value).is_integer()


@dataclass
class StepAxis:
    """W&B's ``define_metric`` step metrics of one run, and the last value of each step metric."""

    exact: dict[str, str | None] = field(default_factory=dict)  # metric name → its step metric
    globs: dict[str, str | None] = field(default_factory=dict)  # glob (``*``, ``train/*``) → …
    last: dict[str, int] = field(default_factory=dict)  # step metric → its last logged value

    @property
    def defined(self) -> bool:
        """Whether any metric has a step metric (else every row is at W&B's ``_step``)."""
        return any(s is not None for s in (*self.exact.values(), *self.globs.values()))

    def define(self, name: str, step_metric: str | None, *, overwrite: bool = False) -> None:
        """One ``define_metric`` call (or its ``metric`` record): later ones merge over earlier ones
        unless ``overwrite``, as in W&B."""
        table = self.globs if "*" in name else self.exact
        if step_metric is not None or overwrite or name not in table:
            table[name] = step_metric

    def step_metric_of(self, name: str) -> str | None:
        if name in self.exact:
            return self.exact[name]
        for glob, step_metric in self.globs.items():
            if fnmatch.fnmatchcase(name, glob):
                return step_metric
        return None

    def step_of(self, row: Mapping[str, Any], wandb_step: int) -> int:
        """The ledger step of a committed row: its step metric's value, else W&B's ``_step``."""
        step_metrics = {s for s in (*self.exact.values(), *self.globs.values()) if s is not None}
        if not step_metrics:
            return wandb_step
        for key in step_metrics & row.keys():
            if is_step_value(row[key]):
                self.last[key] = int(row[key])  # remembered: W&B's step_sync inserts it in later rows
        for key in row:
            if key.startswith("_"):
                continue
            step_metric = self.step_metric_of(key)
            if step_metric is None or step_metric == key:
                continue
            if step_metric in self.last:
                return self.last[step_metric]
        return wandb_step
