"""The W&B bridge: one line in an existing W&B script and its run also lands in the ledger.

    import runledger.wandb
    runledger.wandb.tee()          # before wandb.init; nothing else in the script changes
    run = wandb.init(project=..., config=...)
    ...

``tee`` wraps W&B's public entry points (``wandb.init``; ``wandb.Run.log``, ``define_metric`` and
``finish``, so ``wandb.log``/``wandb.define_metric``/``wandb.finish`` too; ``wandb.sdk.wandb_config.Config.update``/``[k] = v``/``.k = v``/
``setdefaults``; ``wandb.sdk.wandb_summary.SummaryDict.update``, behind ``run.summary[k] = v``).
Each call runs W&B's own code first, then tells a ``runledger`` run (``runledger.init``) the same:

  ``wandb.init``          ``run.started`` (config, W&B ids in ``external``), ledger run id = the W&B
                          run id; a W&B resume of a run the ledger knows is a new attempt
                          (``run.resumed`` from the step before W&B's ``starting_step``)
  ``wandb.log``           one ``step.metrics`` per W&B history row: rows are assembled as W&B does
                          (``commit=False`` and same-step calls merge; a step below the current one
                          is dropped, as W&B drops it); nested dicts flattened with ``.`` as W&B
                          names them; every value under the name it was logged with, the typed
                          fields (loss, lr, grad_norm…) filled from it (``runledger.schemas.wandb_rows``, as
                          the importers do); numbers and bools (0/1) kept, NaN/inf as null,
                          strings/media skipped
  ``define_metric``       the row's ledger step is its step metric's value (the Hugging Face
                          Trainer's ``train/global_step``), else W&B's ``_step``; consecutive rows
                          at one ledger step (a train row and its eval row) are one event
  ``config`` changes      ``config.changed`` (RFC 6902 patch of the top-level keys, cause "api";
                          every key but W&B's own ``_wandb``)
  ``run.summary`` updates ``run.summary`` (every explicitly set key so far)
  ``wandb.finish``        the pending row, then ``run.finished`` (exit code 0: completed, else failed)

**Every way out.** The row being assembled and the row held for its eval row reach the ledger run
before it ends, whichever way it ends: ``wandb.finish``, interpreter exit without it (the Hugging
Face Trainer and Lightning's ``WandbLogger`` never call it; the ``runledger`` client's atexit hook
finishes the run), SIGTERM, Ctrl-C and an uncaught exception (the client's crash capture), or
``untee``. The bridge flushes inside the ledger run's own ``finish`` and ``crash``, so the order of
W&B's, the client's and anyone's exit hooks does not matter, and ``run.finished``'s ``final_step``
is the last row's step.

The bridge never breaks the W&B script: a failure on the ledger side is logged (once per kind) and
counted in ``Tee.errors``. ``untee()`` puts every wrapped function back and ends the ledger side of
runs still open (status "stopped").
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The bridge uses the wandb the user's environment already has: runledger does not install it.
try:
    import wandb
    from wandb.sdk import wandb_config, wandb_summary
except ModuleNotFoundError as exc:
    if (exc.name or "").split(".")[0] != "wandb":
        raise
    raise ModuleNotFoundError(
        "runledger.wandb bridges a W&B run: install wandb (pip install wandb); runledger does not",
        name="wandb",
    ) from None

from runledger import attempts as attempts_lib
from runledger import client, host_values
from runledger.schemas.wandb_rows import StepAxis, step_metrics_of_row

log = logging.getLogger("runledger.wandb")


@dataclass
class _TeedRun:
    """One W&B run and its ledger run: the W&B row being assembled, as W&B assembles it."""

    ledger: client.Run
    step: int  # W&B's current step: where a log without ``step=`` goes
    row: dict[str, float | int | None] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    dropped_rows: int = 0  # logs W&B refused (a step below its current one)
    axis: StepAxis = field(default_factory=StepAxis)  # the run's define_metric step metrics
    pending: dict[str, float | int | None] = field(default_factory=dict)  # committed, not yet sent
    pending_step: int | None = None  # the ledger step of ``pending``

    def on_log(self, data: Mapping[str, Any], step: int | None, commit: bool | None) -> None:
        if step is not None:
            if step < self.step:
                self.dropped_rows += 1  # W&B warns and drops it: so do we
                return
            if step > self.step:
                self.commit()
                self.step = step
        values, skipped = host_values.scalars(host_values.flatten(data, sep="."))
        for name in skipped:
            self.ledger.note_skipped(name)
        self.row.update(values)
        if (step is None and commit is None) or commit:
            self.commit()
            self.step += 1

    def commit(self) -> None:
        """W&B committed the row: it joins the pending ledger row when both land at one ledger step
        (an eval row logged at the train row's ``train/global_step``), else the pending one is sent."""
        if not self.row:
            return
        ledger_step = self.axis.step_of(self.row, self.step)
        if ledger_step != self.pending_step:
            self.send()
        self.pending.update(self.row)
        self.pending_step = ledger_step
        self.row = {}
        if not self.axis.defined:
            self.send()  # no step metric: W&B's _step, one row a step, nothing to wait for

    def send(self) -> None:
        if self.pending and self.pending_step is not None:
            _log_row(self.ledger, dict(self.pending), self.pending_step)
        self.pending, self.pending_step = {}, None

    def on_define_metric(self, name: Any, step_metric: Any, overwrite: Any) -> None:
        if step_metric is not None and not isinstance(step_metric, str):
            step_metric = getattr(step_metric, "name", None)  # a wandb Metric object
        self.axis.define(
            str(name), None if step_metric is None else str(step_metric), overwrite=bool(overwrite)
        )

    def on_config(self, config: Any) -> None:
        self.ledger.config.update(_user_config(config), cause="wandb config update")

    def on_summary(self, values: Mapping[str, Any]) -> None:
        kept = {str(k): v for k, v in values.items() if not str(k).startswith("_")}
        if not kept or not self.ledger.is_main or self.ledger.ended:
            return
        numbers, _ = host_values.scalars(kept)  # NumPy/torch scalars as numbers, NaN as null
        self.summary.update(client.json_tree({k: v for k, v in kept.items() if k not in numbers}))
        self.summary.update(numbers)
        snapshot = dict(self.summary)
        self.ledger.log_summary(snapshot)

    def flush(self) -> None:
        """The row being assembled and the pending one, to the ledger run (while it is still open)."""
        self.commit()
        self.send()

    def finish(self, exit_code: int | None) -> None:
        self.flush()
        self.ledger.finish("completed" if not exit_code else "failed")

    def flush_before_every_end(self, guard: Callable[[str, Callable[[], None]], None]) -> None:
        """Make the ledger run flush this W&B run's rows before it ends, however it ends (a failure
        goes to ``guard``: logged and counted, never in the way of the end itself).

        Every end of a ``runledger`` run goes through its ``finish`` or ``crash``: ``wandb.finish``
        here, the client's atexit hook (interpreter exit without ``wandb.finish``), its excepthook
        (an uncaught exception) and its SIGTERM/SIGINT handler. Wrapping those two on this one run
        puts the rows in first whatever order the exit hooks run in (atexit is LIFO, and W&B's, the
        client's and the script's are registered in an order the bridge does not choose)."""
        for name in ("finish", "crash"):
            setattr(self.ledger, name, self._flushing(getattr(self.ledger, name), guard))

    def _flushing(
        self, end: Callable[..., None], guard: Callable[[str, Callable[[], None]], None]
    ) -> Callable[..., None]:
        @functools.wraps(end)
        def flushed_then_ended(*args: Any, **kwargs: Any) -> None:
            if not self.ledger.ended:
                guard("the last W&B row", self.flush)  # the rows first, while the run is open
            end(*args, **kwargs)

        return flushed_then_ended


def _user_config(config: Any) -> dict[str, Any]:
    """The run's config as the script set it: every key (``_name_or_path`` too) but W&B's ``_wandb``."""
    as_dict = getattr(config, "_as_dict", None)  # W&B's Config hides ``_`` keys from items()
    items = as_dict().items() if callable(as_dict) else config.items()
    return {k: v for k, v in items if not str(k).startswith("_wandb")}


def _log_row(ledger: client.Run, values: dict[str, float | int | None], step: int) -> None:
    """One row as ``step.metrics`` at ``step``, its names as logged (``runledger.schemas.wandb_rows``); the
    run's step counter moves as ``Run.log``'s does (its finish reports the last step)."""
    # An empty log moves the run's step counter (its last step, for finish, crash and summary) and
    # sends nothing; the row itself goes to the emitter, since Run.log would rename its keys.
    ledger.log({}, step=step)
    if values and ledger.is_main and not ledger.ended:
        ledger.emitter.submit(lambda: step_metrics_of_row(values), step=step)


class Tee:
    """The active bridge (``tee()`` returns it): its runs, and the failures it swallowed."""

    def __init__(self, init_kwargs: Mapping[str, Any]) -> None:
        self.init_kwargs = dict(init_kwargs)
        self.runs: dict[int, _TeedRun] = {}  # id(wandb run) → its ledger side
        self.by_config: dict[int, _TeedRun] = {}  # id(run.config) → …
        self.by_summary: dict[int, _TeedRun] = {}  # id(run.summary) → …
        self.errors = 0
        self._said: set[str] = set()
        self._originals: list[tuple[Any, str, Any]] = []

    # -- the ledger side, guarded: the W&B script must never fail because of it

    def guard(self, what: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:
            self.errors += 1
            if what not in self._said:
                self._said.add(what)
                log.warning("runledger.wandb: %s not recorded in the ledger: %s", what, exc)

    def attach(self, run: Any) -> None:
        if run is None or id(run) in self.runs:
            return  # wandb.init returned a run we already follow
        wandb_id = str(run.id)
        ledger_id = str(self.init_kwargs.pop("run_id", None) or wandb_id)
        starting = int(getattr(run, "starting_step", 0) or 0)
        kwargs = dict(self.init_kwargs)
        state = kwargs.get("state_dir") or attempts_lib.default_state_dir()
        if attempts_lib.attempts(Path(state), ledger_id):  # W&B resumed a known run
            kwargs["resume_from_step"] = max(0, starting - 1)
        else:  # wandb.init(fork_from=…) or resume_from= another run: this run id goes on from it
            kwargs.update(_branch_point(run, ledger_id))
        external = {"wandb_run_id": wandb_id}
        for key, value in (
            ("wandb_project", run.project),
            ("wandb_entity", run.entity),
            ("wandb_url", run.url),
        ):
            if value:
                external[key] = str(value)
        config = _user_config(run.config)
        ledger = client.init(ledger_id, config=config, name=run.name or None, external=external, **kwargs)
        teed = _TeedRun(ledger=ledger, step=starting)
        teed.flush_before_every_end(self.guard)
        self.runs[id(run)] = teed
        self.by_config[id(run.config)] = teed
        self.by_summary[id(run.summary)] = teed

    def forget(self, run: Any) -> _TeedRun | None:
        teed = self.runs.pop(id(run), None)
        if teed is not None:
            self.by_config = {k: v for k, v in self.by_config.items() if v is not teed}
            self.by_summary = {k: v for k, v in self.by_summary.items() if v is not teed}
        return teed

    # -- patching

    def _wrap(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        self._originals.append((owner, name, original))
        setattr(owner, name, make(original))

    def install(self) -> None:
        self._wrap(wandb, "init", self._init_wrapper)
        self._wrap(wandb.Run, "log", self._log_wrapper)
        self._wrap(wandb.Run, "finish", self._finish_wrapper)
        self._wrap(wandb.Run, "define_metric", self._define_metric_wrapper)
        for name in ("update", "__setitem__", "__setattr__", "setdefaults"):
            self._wrap(wandb_config.Config, name, self._config_wrapper)
        self._wrap(wandb_summary.SummaryDict, "update", self._summary_wrapper)

    def restore(self) -> None:
        for owner, name, original in reversed(self._originals):
            setattr(owner, name, original)
        self._originals.clear()

    # Each wrapper calls W&B first (its errors are the script's, unchanged), then the ledger, and
    # looks the bridge up at call time: a method bound before ``untee`` then records nothing.

    def _init_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def init(*args: Any, **kwargs: Any) -> Any:
            run = original(*args, **kwargs)
            if _ACTIVE is self:
                self.guard("wandb.init", lambda: self.attach(run))
            return run

        return init

    def _log_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def log_(run: Any, data: Any, step: int | None = None, commit: bool | None = None, **kw: Any) -> Any:
            result = original(run, data, step, commit, **kw)
            teed = self.runs.get(id(run)) if _ACTIVE is self else None
            if teed is not None:
                self.guard("wandb.log", lambda: teed.on_log(data, step, commit))
            return result

        return log_

    def _define_metric_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def define_metric(run: Any, name: str, step_metric: Any = None, *args: Any, **kw: Any) -> Any:
            result = original(run, name, step_metric, *args, **kw)
            teed = self.runs.get(id(run)) if _ACTIVE is self else None
            if teed is not None:
                overwrite = kw.get("overwrite", args[3] if len(args) > 3 else None)
                self.guard("wandb.define_metric", lambda: teed.on_define_metric(name, step_metric, overwrite))
            return result

        return define_metric

    def _finish_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def finish(run: Any, exit_code: int | None = None, *args: Any, **kw: Any) -> Any:
            teed = self.forget(run) if _ACTIVE is self else None
            if teed is not None:
                self.guard("wandb.finish", lambda: teed.finish(exit_code))
            return original(run, exit_code, *args, **kw)

        return finish

    def _config_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def change(config: Any, *args: Any, **kw: Any) -> Any:
            result = original(config, *args, **kw)
            teed = self.by_config.get(id(config)) if _ACTIVE is self else None
            if teed is not None:
                self.guard("wandb config change", lambda: teed.on_config(config))
            return result

        return change

    def _summary_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def update(summary: Any, d: Mapping[str, Any], *args: Any, **kw: Any) -> Any:
            result = original(summary, d, *args, **kw)
            teed = self.by_summary.get(id(summary)) if _ACTIVE is self else None
            if teed is not None and isinstance(d, Mapping):
                self.guard("wandb summary update", lambda: teed.on_summary(d))
            return result

        return update


_ACTIVE: Tee | None = None


def tee(**init_kwargs: Any) -> Tee:
    """Start recording every W&B run of this process in the ledger. Call it before ``wandb.init``.

    ``init_kwargs`` go to ``runledger.init`` for each run (``spool=``, ``kafka_bootstrap=``,
    ``state_dir=``, ``repository=``, ``run_id=`` for the first run instead of the W&B id, …)."""
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError("runledger.wandb.tee() is active already (untee() first)")
    bridge = Tee(init_kwargs)
    bridge.install()
    _ACTIVE = bridge
    return bridge


def untee() -> None:
    """Put W&B back as it was; W&B runs still open stop being recorded (their ledger side ends as
    "stopped"). Safe to call when not teed."""
    global _ACTIVE
    bridge, _ACTIVE = _ACTIVE, None
    if bridge is None:
        return
    bridge.restore()
    for teed in list(bridge.runs.values()):
        with contextlib.suppress(Exception):
            teed.flush()
            teed.ledger.finish("stopped")
    bridge.runs.clear()
    bridge.by_config.clear()
    bridge.by_summary.clear()


def _branch_point(run: Any, run_id: str) -> dict[str, Any]:
    """``parent_run``/``fork_step`` for ``runledger.init`` from the run's ``fork_from`` (or a
    ``resume_from`` naming another run): W&B's ``RunMoment`` (run id, ``_step`` value). None of them
    where the moment names this run (a rewind: a resume) or is not a whole step."""
    settings = getattr(run, "settings", None)
    moment = getattr(settings, "fork_from", None) or getattr(settings, "resume_from", None)
    parent, value = getattr(moment, "run", None), getattr(moment, "value", None)
    if not isinstance(parent, str) or parent == run_id:
        return {}
    try:
        client.check_run_id(parent)
    except ValueError:  # not a run id the ledger can hold: the run is recorded without its lineage
        return {}
    step = None
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        step = int(value) if value >= 0 and value == int(value) else None
    return {"parent_run": parent, "fork_step": step}
