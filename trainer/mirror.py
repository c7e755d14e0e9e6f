"""An optional mirror of the run to an experiment tracker (Weights & Biases), seen from the trainer.

The trainer knows a mirror only through the ``Mirror`` protocol below, so it never imports wandb;
``runledger.ingest.wandb_mirror.WandbMirror`` satisfies it. The ledger stays the record: the mirror is a copy for
people who read W&B, and a mirror that cannot start never stops training.

What the loop does with one (rank 0 only):

  launch        ``start(run_id, resolved config, name=run.name)`` before the run-started/resumed
                event, whose ``external`` then holds ``mirror.external`` (wandb_run_id, …). A start
                that raises is logged; the attempt trains without the mirror and ``external`` holds
                ``wandb_error``: the exception in one line, secrets redacted.
  each logged   ``log(step, step_values(report))`` at the cadence of the step-metrics event
  step          (``telemetry.log_interval``)
  live change   ``config_update(resolved new config)`` once an allowed change is applied
  attempt end   ``summary(end_summary(result))`` and ``finish(exit_code)``, in a ``finally``: a crash
                or a signal still finishes the W&B run (with its non-zero exit code)

``log`` and ``config_update`` are called as they are: an implementation decides whether its failures
matter (``WandbMirror`` logs and counts them; with ``strict=True`` it raises, and the attempt then
crashes like on any exception). ``summary`` and ``finish`` failures are only logged: the attempt's
outcome is already recorded by then.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from runledger.schemas.step_payloads import report_fields
from runledger.trainer.telemetry import StepReport

log = logging.getLogger(__name__)

ERROR_KEY = "wandb_error"
_MAX_ERROR = 300
# Long opaque tokens (API keys are 40 hex characters; other keys are longer still) and key=value pairs.
_TOKEN_RE = re.compile(r"\b[0-9a-fA-F]{32,}\b|\b[A-Za-z0-9_-]{48,}\b")
_ASSIGN_RE = re.compile(r"(?i)\b(api[_-]?key|token|secret|password)(\s*[=:]\s*)(\S+)")
_SECRET_ENV_RE = re.compile(r"(?i)(KEY|TOKEN|SECRET|PASSWORD)")


@runtime_checkable
class Mirror(Protocol):
    """What the trainer needs from a mirror (``runledger.ingest.wandb_mirror.WandbMirror`` is one)."""

    def start(
        self,
        run_id: str,
        config: Mapping[str, Any],
        *,
        name: str | None = None,
        fork: tuple[str, int] | None = None,
    ) -> tuple[str, str | None]:
        """Start, or for a later attempt resume, the mirrored run; (its id, its URL or None).
        ``fork``: (parent run id, step) when the run goes on from another run's checkpoint."""
        ...

    @property
    def external(self) -> dict[str, str]:
        """Ids and places of the mirrored run, for ``RunStarted.external`` / ``RunResumed.external``."""
        ...

    def log(self, step: int, values: Mapping[str, Any]) -> None: ...

    def config_update(self, values: Mapping[str, Any]) -> None: ...

    def summary(self, values: Mapping[str, Any]) -> None: ...

    def finish(self, exit_code: int = 0) -> None: ...


def one_line_error(exc: BaseException) -> str:
    """``Type: message`` on one line, at most 300 characters, with anything secret-looking redacted."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    for name, value in os.environ.items():
        if len(value) >= 8 and _SECRET_ENV_RE.search(name) and value in text:
            text = text.replace(value, "***")
    text = _ASSIGN_RE.sub(r"\1\2***", text)
    text = _TOKEN_RE.sub("***", text)
    return text if len(text) <= _MAX_ERROR else text[: _MAX_ERROR - 1] + "…"


def start(
    mirror: Mirror,
    run_id: str,
    config: Mapping[str, Any],
    name: str | None,
    fork: tuple[str, int] | None = None,
) -> tuple[Mirror | None, dict[str, str]]:
    """Start the mirror: (the mirror, its ``external``), or (None, ``{"wandb_error": …}``) if it failed."""
    try:
        mirror.start(run_id, config, name=name, fork=fork)
        external = {str(k): str(v) for k, v in mirror.external.items()}
    except Exception as exc:
        message = one_line_error(exc)
        log.warning("the W&B mirror did not start; training goes on without it: %s", message)
        with _quiet():
            mirror.finish(exit_code=1)  # whatever it may have half-started
        return None, {ERROR_KEY: message}
    return mirror, external


def step_values(report: StepReport) -> dict[str, float | int]:
    """One logged step as W&B keys: the step metrics, router stats averaged over layers
    (``router/…``) and per layer (``router/layer{i}/…``), and the trainer's own counters."""
    values: dict[str, float | int] = report_fields(report)  # type: ignore[assignment]
    per_layer: dict[str, list[float]] = {}
    for layer in report.layers:
        counts = layer.expert_counts
        mean = sum(counts) / len(counts) if counts else 0.0
        row: dict[str, float | None] = {
            "token_drop_rate": layer.token_drop_rate,
            "dropped": float(layer.dropped),
            "aux_loss": layer.aux_loss,
            "z_loss": layer.z_loss,
            "entropy": layer.routing_entropy,
            # max ÷ mean tokens per expert: 1.0 is perfectly balanced, num_experts / top_k the worst
            "load_imbalance": max(counts) / mean if mean > 0 else None,
        }
        for key, value in row.items():
            if value is not None:
                values[f"router/layer{layer.layer}/{key}"] = value
                per_layer.setdefault(key, []).append(value)
    for key, series in per_layer.items():
        if len(series) == len(report.layers):  # an average only over every layer
            values[f"router/{key}"] = sum(series) / len(series)
    for key, value in report.scalars.items():
        if value is not None:
            values[f"trainer/{key}"] = value
    return values


def end_summary(
    *, status: str, final_step: int, total_tokens: int, attempt: int, exit_code: int, **extra: Any
) -> dict[str, Any]:
    """What the mirrored run's summary gets at the end of an attempt."""
    out = {
        "status": status,
        "final_step": final_step,
        "total_tokens": total_tokens,
        "attempt": attempt,
        "exit_code": exit_code,
    }
    out.update({k: v for k, v in extra.items() if v is not None})
    return out


def finish(mirror: Mirror, summary: Mapping[str, Any], exit_code: int) -> None:
    """Summary, then finish; failures are logged, never raised (the attempt is over and recorded)."""
    with _quiet("summary"):
        mirror.summary(summary)
    with _quiet("finish"):
        mirror.finish(exit_code=exit_code)


class _quiet:
    """Log and swallow an Exception (not a BaseException: a second Ctrl-C still gets through)."""

    def __init__(self, what: str | None = None) -> None:
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        if exc is None or not isinstance(exc, Exception):
            return False
        if self.what is not None:
            log.warning("W&B mirror %s failed: %s", self.what, one_line_error(exc))
        return True
