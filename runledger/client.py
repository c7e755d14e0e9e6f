"""``runledger.init``: any training loop's events, in a few lines (see docs/client.md).

    run = runledger.init(config={"lr": 3e-4}, repository="org/repo")
    with run:
        for step in range(steps):
            ...
            run.log({"loss": loss, "lr": lr}, step=step)
            run.log_router(step, counts=counts, drop=drop, aux_loss=aux, top_k=8)

What it finds by itself: git commit/branch/dirty of the script's checkout, host, cluster and job id
(``runledger.provenance``), rank and world size from torchrun / JAX / SLURM / MPI variables,
the bus from the environment (``open_rank_sink``: the spool, or Kafka with
``RUNLEDGER_KAFKA_BOOTSTRAP``; signed with ``RUNLEDGER_PRODUCER_KEY``), and the attempt number
(``runledger.attempts``). Events are the trainer's own (``runledger.schemas.payloads``), built by the
same functions (``runledger.schemas.step_payloads``) and emitted by the same background emitter
(``runledger.emitter``), with source ``trainer/<run_id>/a<attempt>/rank<rank>``.

Ranks: run-level events (launch, step metrics, router stats, config changes, checkpoints, finish)
come from rank 0; on other ranks those calls return False and send nothing. Every rank may send its
own rank stats (``log_rank``), annotations and its own crash.

Bounds on the calling thread: ``log``/``log_router``/``log_rank`` never wait while the bus takes
events (a full queue drops the event, counts it in ``dropped`` and later says so with
``producer.dropped``); while the bus is down (it refused an event: a full disk, Kafka away) they
queue while there is room, then wait for room at most ``outage_wait_s`` in all per outage, then drop
and count at once until the bus is back (see docs/client.md, "When the bus is down"); lifecycle
events (launch, config change, checkpoint, finish, crash) wait for queue room at most
``critical_timeout_s``; ``finish`` and crash capture drain and sync the queue, waiting at most about
3 × ``flush_timeout_s`` even when the bus hangs (a bus still down then: what is left is dropped and
counted); ``init`` on ranks other than 0 waits at most ``attempt_wait_s`` for rank 0's attempt.
"""

from __future__ import annotations

import atexit
import contextlib
import getpass
import hashlib
import logging
import math
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, Literal

import msgspec

from runledger import attempts as attempts_lib
from runledger import host_values, provenance
from runledger import signals as signals_lib
from runledger.crashes import CrashKind, NonFinite, cause_of, crashed
from runledger.emitter import Emitter, open_rank_sink, rank_spool
from runledger.ingest.bus import EventSink
from runledger.schemas import config_hash
from runledger.schemas.envelope import RunId
from runledger.schemas.launch import launch_event, launch_fields
from runledger.schemas.payloads import (
    Annotation,
    ChangeCause,
    CheckpointSaved,
    ConfigChanged,
    PatchOp,
    RankStats,
    RunFinished,
    RunSummary,
    StepSkipped,
)
from runledger.schemas.step_payloads import layer_stats_from_arrays, metrics_from_values

log = logging.getLogger("runledger.client")

FinishStatus = Literal["completed", "stopped", "failed"]
_RUN_ID = msgspec.json.Decoder(RunId)


class RunExistsError(ValueError):
    """``init`` of a run id that was launched before, without ``resume_from_step``."""


class NonFiniteError(NonFinite):
    """``check_finite`` found NaN/inf under ``policy="stop"`` (the crash is recorded already)."""

    def __init__(self, name: str, step: int, value: str) -> None:
        super().__init__(f"non-finite {name} ({value}) at step {step}")
        self.step = step
        self.value = value


# --- where this process is ----------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """This process's rank in the job, from the launcher's environment variables."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Placement:
        e = os.environ if env is None else env
        # (rank, world size, local rank) variables, most specific launcher first.
        for rank_key, size_key, local_key in (
            ("RANK", "WORLD_SIZE", "LOCAL_RANK"),  # torchrun, accelerate, deepspeed
            ("JAX_PROCESS_ID", "JAX_NUM_PROCESSES", "JAX_LOCAL_PROCESS_ID"),  # jax.distributed
            ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
            ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
            ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
        ):
            if e.get(rank_key, "").strip():
                try:
                    rank = int(e[rank_key])
                    size = int(e.get(size_key) or rank + 1)
                    local = int(e.get(local_key) or 0)
                except ValueError as exc:
                    raise ValueError(f"{rank_key}/{size_key}/{local_key} are not integers: {exc}") from None
                return cls(rank, size, local).checked()
        return cls()

    def checked(self) -> Placement:
        if not (0 <= self.rank < self.world_size) or self.local_rank < 0:
            raise ValueError(f"rank {self.rank} is not within world size {self.world_size}")
        return self

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _code_root() -> Path:
    """The checkout whose commit a run records: the script's directory, else the working directory."""
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    return Path(main).resolve().parent if main else Path.cwd()


def _plain(obj: Any) -> Any:
    """What msgspec cannot encode: NumPy (and other array) values as lists/numbers, the rest as text."""
    tolist = getattr(obj, "tolist", None)
    return tolist() if callable(tolist) else str(obj)


def json_tree(value: Any) -> dict[str, Any]:
    """A config as plain JSON data (arrays as lists, other objects it cannot encode as their ``str``)."""
    tree = msgspec.to_builtins(value, str_keys=True, enc_hook=_plain)
    if not isinstance(tree, dict):
        raise ValueError(f"config must be a mapping, not {type(value).__name__}")
    return tree


# --- the config, as the run sees it ------------------------------------------------------------


class RunConfig(Mapping[str, Any]):
    """The run's current config. ``update``/``[key] = value`` record a ``config.changed`` event
    (an RFC 6902 patch and its cause); reading is plain mapping access."""

    def __init__(self, run: Run, tree: dict[str, Any]) -> None:
        self._run = run
        self._tree = tree

    def __getitem__(self, key: str) -> Any:
        return self._tree[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tree)

    def __len__(self) -> int:
        return len(self._tree)

    def as_dict(self) -> dict[str, Any]:
        return msgspec.json.decode(msgspec.json.encode(self._tree))  # a deep copy

    def update(
        self, values: Mapping[str, Any], *, cause: str | ChangeCause | None = None, step: int | None = None
    ) -> bool:
        """Merge ``values`` into the top level; records the change (if any). True if one was recorded."""
        import jsonpatch

        new = self._tree | json_tree(dict(values))
        patch: list[dict[str, Any]] = jsonpatch.make_patch(self._tree, new).patch
        if not patch:
            return False
        self._run.config_changed(patch, cause=cause, step=step)
        return True

    def __setitem__(self, key: str, value: Any) -> None:
        self.update({key: value})


# --- the run -----------------------------------------------------------------------------------


class Run:
    """A run handle (``runledger.init`` makes one). See the module docs for what each call sends."""

    def __init__(
        self,
        *,
        run_id: str,
        attempt: int,
        previous_attempts: int,
        placement: Placement,
        emitter: Emitter,
        sink: EventSink,
        owns_sink: bool,
        config: dict[str, Any],
        start_step: int,
        flush_timeout_s: float,
        host: str,
    ) -> None:
        self.run_id = run_id
        self.attempt = attempt
        self.previous_attempts = previous_attempts
        self.placement = placement
        self.emitter = emitter
        self.sink = sink
        self._owns_sink = owns_sink
        self.config = RunConfig(self, config)
        self.flush_timeout_s = flush_timeout_s
        self.host = host
        self.skipped: dict[str, int] = {}  # names of logged values that were not numbers → count
        self._next_step = start_step  # what ``log`` without ``step=`` uses (W&B-like)
        self._last_step: int | None = None
        self._started = time.perf_counter()
        self._ended = False
        self._end_lock = threading.RLock()  # re-entrant: a signal may land inside finish()
        self._hooks: _Hooks | None = None

    # -- identity

    @property
    def rank(self) -> int:
        return self.placement.rank

    @property
    def world_size(self) -> int:
        return self.placement.world_size

    @property
    def is_main(self) -> bool:
        return self.placement.is_main

    @property
    def source(self) -> str:
        return self.emitter.source

    @property
    def ended(self) -> bool:
        return self._ended

    @property
    def last_step(self) -> int | None:
        """The highest step logged so far (None before the first)."""
        return self._last_step

    @property
    def dropped(self) -> int:
        """Events that did not reach the bus: dropped on a full queue, while the bus was down, or
        still queued when ``finish`` found it down. Each used its ``seq`` and is reported by a
        ``producer.dropped`` event once the bus takes events again; a bus still down at the end
        leaves that report in the spool's ``pending/`` folder for the next ``ledger ingest spool``."""
        return self.emitter.dropped

    @property
    def undelivered(self) -> int:
        """Events the bus took but that are not on Kafka yet: they wait in the Kafka sink's outage
        spool (its close warning names the ``ledger kafka drain-spool`` command that sends them). 0 on
        the spool bus, where the spool is the bus. A script may exit 3 when this is not 0, as the CLI does."""
        if "runledger.ingest.kafka_sink" not in sys.modules:  # no Kafka sink was ever made: nothing to ask
            return 0
        from runledger.ingest.kafka_sink import KafkaSink

        return self.sink.undelivered().events if isinstance(self.sink, KafkaSink) else 0

    # -- steps

    def _take_step(self, step: int | None) -> int:
        if step is None:
            step = self._next_step
        elif isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, not {step!r}")
        self._next_step = max(self._next_step, step + 1)
        self._last_step = step if self._last_step is None else max(self._last_step, step)
        return step

    def log(self, values: Mapping[str, Any], step: int | None = None) -> bool:
        """One step's values (W&B-like): known names to ``StepMetrics``' typed fields, the rest named
        scalars. Python/NumPy numbers and torch scalars (one device-to-host copy per call); strings,
        media and arrays are skipped and counted in ``skipped``. Nested dicts are flattened with
        ``/``. True if the event was queued (rank 0 only): it then reaches the bus, or, if the bus
        is down until ``finish``, is counted in ``dropped``. False: not sent, or dropped and counted
        (queue full, or the bus down and the wait for room spent)."""
        if not isinstance(values, Mapping):
            raise TypeError(f"log() takes a mapping of name → value, not {type(values).__name__}")
        flat = host_values.flatten(values)  # refused (too deep) before the step counter moves
        step = self._take_step(step)
        if not self.is_main or self._ended:
            return False
        host, skipped = host_values.scalars(flat)
        for name in skipped:
            self.note_skipped(name)
        if not host:
            return False
        return self.emitter.submit(lambda: metrics_from_values(host), step=step)

    def note_skipped(self, name: str) -> None:
        """Count a logged value that is not a number (``skipped``; warned once per name); nothing is sent."""
        if name not in self.skipped:
            log.warning("runledger: %r is not a number; not recorded (said once per name)", name)
        self.skipped[name] = self.skipped.get(name, 0) + 1

    def log_summary(self, values: Mapping[str, Any]) -> bool:
        """The run's summary so far (W&B's ``run.summary``: final values by name) as ``run.summary``
        at the last logged step; rank 0 only. True if the event was queued."""
        if not self.is_main or self._ended:
            return False
        return self.emitter.submit(RunSummary(values=dict(values)), step=self._last_step)

    def log_router(
        self,
        step: int | None = None,
        *,
        counts: Any = None,
        drop: Any = None,
        aux_loss: Any = None,
        z_loss: Any = None,
        entropy: Any = None,
        tokens: Any = None,
        dropped: Any = None,
        max_load: Any = None,
        top_k: int = 1,
    ) -> bool:
        """Per-layer router statistics as ``moe.router_stats``: each argument one value per layer
        (``counts``: layers × experts tokens kept per expert; ``drop``: token-drop rate in [0, 1];
        ``tokens``: tokens routed; ``dropped``: dropped (token, expert) assignments; ``max_load``:
        the busiest expert's tokens over the mean per expert, as the caller measures it). NumPy arrays,
        lists or torch tensors (one device-to-host copy per call). What is not given is derived
        where the others determine it (tokens from counts and drop, drops from tokens and counts)."""
        if not self.is_main or self._ended:
            self._take_step(step)
            return False
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k must be an int ≥ 1, not {top_k!r}")
        given = {
            "counts": counts,
            "drop": drop,
            "aux_loss": aux_loss,
            "z_loss": z_loss,
            "entropy": entropy,
            "tokens": tokens,
            "dropped": dropped,
            "max_load": max_load,
        }
        a = host_values.arrays(given)
        if not a:
            raise ValueError("log_router() needs at least one per-layer array")
        layers = _check_router_shapes(a)
        stats = _router_columns(a, layers, top_k)
        step = self._take_step(step)  # only once the arrays were accepted
        return self.emitter.submit(lambda: _router_payload(stats, a, top_k), step=step)

    def log_rank(
        self, values: Mapping[str, Any] | None = None, *, step: int | None = None, step_time_s: Any = None
    ) -> bool:
        """This rank's own view of a step (``rank.stats``): any rank, e.g. its step time and memory."""
        if self._ended:
            return False
        step = self._last_step if step is None else step
        host, skipped = host_values.scalars(
            host_values.flatten({**(values or {}), "_step_time_s": step_time_s})
        )
        for name in skipped:
            if name != "_step_time_s":
                self.note_skipped(name)
        seconds = host.pop("_step_time_s", None)
        payload = RankStats(
            rank=self.rank,
            host=self.host,
            step_time_s=None if seconds is None else float(seconds),
            values={k: None if v is None else float(v) for k, v in host.items()},
        )
        return self.emitter.submit(payload, step=step)

    # -- lifecycle events

    def config_changed(
        self,
        patch: Iterable[Mapping[str, Any] | PatchOp],
        *,
        cause: str | ChangeCause | None = None,
        step: int | None = None,
    ) -> None:
        """Apply an RFC 6902 patch to the run's config and record it (``config.changed``) with its
        cause; ``step``: the first step that runs with it (default: the next step ``log`` gets).
        A patch that does not apply raises ValueError and changes nothing."""
        from runledger.schemas.config_patch import apply_config_patch

        ops = [msgspec.convert(msgspec.to_builtins(op), PatchOp) for op in patch]
        if not ops:
            return
        old = self.config._tree
        new = json_tree(apply_config_patch(old, ops))
        if isinstance(cause, ChangeCause):
            why = cause
        else:
            why = ChangeCause(kind="api", detail=cause or "runledger client config update")
        self.config._tree = new
        if self.is_main and not self._ended:
            payload = ConfigChanged(
                patch=ops, previous_hash=config_hash(old), config_hash=config_hash(new), cause=why
            )
            self.emitter.submit(payload, step=self._next_step if step is None else step, critical=True)

    def checkpoint(
        self,
        step: int,
        path: str | os.PathLike[str],
        *,
        bytes: int | None = None,
        duration_s: float | None = None,
        reason: Literal["interval", "signal", "final", "manual"] = "interval",
    ) -> bool:
        """A checkpoint of ``step``'s state was written at ``path`` (rank 0 records it)."""
        if not self.is_main or self._ended:
            return False
        payload = CheckpointSaved(path=str(path), bytes=bytes, duration_s=duration_s, reason=reason)
        return self.emitter.submit(payload, step=self._take_step_as_is(step), critical=True)

    def _take_step_as_is(self, step: int) -> int:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, not {step!r}")
        return step

    def annotate(
        self, text: str, *, step: int | None = None, author: str | None = None, tags: Iterable[str] = ()
    ) -> bool:
        """A note on the run (``annotation``), at ``step`` (default: the last step logged)."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError("an annotation needs some text")
        if self._ended:
            return False
        who = author or _user()
        payload = Annotation(author=who, text=text, tags=[str(t) for t in tags])
        at = self._last_step if step is None else self._take_step_as_is(step)
        return self.emitter.submit(payload, step=at, critical=True)

    def check_finite(
        self,
        value: Any,
        *,
        step: int | None = None,
        name: str = "loss",
        policy: Literal["stop", "skip"] = "stop",
    ) -> bool:
        """True if ``value`` is finite. Otherwise, ``policy="skip"``: record ``step.skipped`` and
        return False (skip the update); ``"stop"``: record the crash (durably) and raise
        ``NonFiniteError``."""
        host, _ = host_values.scalars({name: value})
        number = host.get(name)
        if number is not None:
            return True
        raw = _nonfinite_text(value)
        at = self._last_step if step is None else step
        if policy == "skip":
            if self.is_main and not self._ended:
                self.emitter.submit(
                    StepSkipped(reason=f"nonfinite_{name}", value=raw), step=at, critical=True
                )
            return False
        error = NonFiniteError(name, at if at is not None else 0, raw)
        self.crash(error, kind="nonfinite_loss")
        raise error

    def crash(
        self,
        exc: BaseException | None = None,
        *,
        kind: CrashKind = "exception",
        signum: int | None = None,
        message: str | None = None,
    ) -> None:
        """Record this rank's crash and make it durable (drain, ``sink.sync``); the run is over."""
        with self._end_lock:
            if self._ended:
                return
            self._ended = True  # first: a signal handler entering here now finds the run over
            payload = crashed(
                kind,
                exc,
                signum=signum,
                message=message,
                rank=self.rank,
                host=self.host,
                last_step=self._last_step,
            )
            self.emitter.submit(payload, step=self._last_step, critical=True)
            self._close()

    def finish(
        self,
        status: FinishStatus = "completed",
        *,
        final_step: int | None = None,
        total_tokens: int | None = None,
    ) -> None:
        """The run ended (rank 0 records ``run.finished``); drains and syncs the queue. Idempotent."""
        if status not in ("completed", "stopped", "failed"):
            raise ValueError(f"status must be completed, stopped or failed, not {status!r}")
        with self._end_lock:
            if self._ended:
                return
            self._ended = True
            if self.is_main:
                payload = RunFinished(
                    status=status,
                    final_step=self._last_step if final_step is None else final_step,
                    total_tokens=total_tokens,
                    duration_s=time.perf_counter() - self._started,
                )
                self.emitter.submit(payload, step=payload.final_step, critical=True)
            self._close()

    def _close(self) -> None:
        """Drain, sync and stop the emitter (bounded), close our sink, take our hooks off."""
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None
        drained = self.emitter.close(timeout=self.flush_timeout_s)
        if not drained:
            log.error("runledger: the bus did not take every event within %.0fs", self.flush_timeout_s)
        if self._owns_sink and drained:  # a stuck emitter thread may still be inside the sink
            try:
                self.sink.close()
            except Exception as exc:
                if not self.emitter.bus_down:  # a bus that is down has been reported in one line
                    log.error("runledger: closing the sink failed: %s: %s", type(exc).__name__, exc)

    # -- context manager

    def __enter__(self) -> Run:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.finish("completed")
        elif isinstance(exc, SystemExit):
            self.finish("completed" if exc.code in (None, 0) else "failed")
        else:
            crash_kind, signum = cause_of(exc)
            self.crash(exc, kind=crash_kind, signum=signum)


def _nonfinite_text(value: Any) -> str:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return "nan"
    if math.isnan(number):
        return "nan"
    return "inf" if number > 0 else "-inf"


def _user() -> str:
    try:
        return getpass.getuser() or "unknown"
    except Exception:
        return "unknown"


# --- router arrays -----------------------------------------------------------------------------


def _check_router_shapes(a: dict[str, Any]) -> int:
    """The number of layers; ValueError (one line) on inconsistent or out-of-range arrays."""
    counts = a.get("counts")
    if counts is not None and counts.ndim != 2:
        raise ValueError(f"counts must be layers × experts (2-D), got shape {counts.shape}")
    layers = counts.shape[0] if counts is not None else None
    for name, array in a.items():
        if name == "counts":
            continue
        if array.ndim != 1:
            raise ValueError(f"{name} must have one value per layer (1-D), got shape {array.shape}")
        if layers is None:
            layers = array.shape[0]
        elif array.shape[0] != layers:
            raise ValueError(f"{name} has {array.shape[0]} layers, the others {layers}")
    for name in ("counts", "tokens", "dropped"):
        if name in a and not (np_finite(a[name]) and (a[name] >= 0).all()):
            raise ValueError(f"{name} must be finite and non-negative")
    if "drop" in a and not (np_finite(a["drop"]) and ((a["drop"] >= 0) & (a["drop"] <= 1)).all()):
        raise ValueError("drop (token-drop rate) must be within [0, 1]")
    if "max_load" in a and (a["max_load"] < 0).any():  # (NaN is no comparison: it travels as null)
        raise ValueError("max_load must be non-negative")
    return int(layers or 0)


def np_finite(array: Any) -> bool:
    import numpy as np

    return bool(np.isfinite(array).all())


def _router_columns(a: dict[str, Any], layers: int, top_k: int) -> dict[str, Any]:
    """tokens, dropped and drop rate per layer, each from what was given or derived from the rest."""
    import numpy as np

    counts, drop = a.get("counts"), a.get("drop")
    kept = counts.sum(axis=1) if counts is not None else None
    if "tokens" in a:
        tokens = np.rint(a["tokens"])
    elif kept is not None:
        assignments = kept if drop is None else np.where(drop < 1, kept / np.maximum(1e-300, 1 - drop), kept)
        tokens = np.rint(assignments / top_k)
    else:
        tokens = np.zeros(layers)
    if "dropped" in a:
        dropped = np.rint(a["dropped"])
    elif kept is not None:
        dropped = np.maximum(0, tokens * top_k - np.rint(kept))
    elif drop is not None:
        dropped = np.rint(drop * tokens * top_k)
    else:
        dropped = np.zeros(layers)
    rate = drop if drop is not None else np.minimum(1.0, dropped / np.maximum(1, tokens * top_k))
    return {"tokens": tokens, "dropped": dropped, "drop_rate": rate}


def _router_payload(stats: dict[str, Any], a: dict[str, Any], top_k: int) -> Any:
    import numpy as np

    from runledger.schemas.payloads import MoeRouterStats

    counts = a.get("counts")
    layers = layer_stats_from_arrays(
        top_k=top_k,
        tokens=stats["tokens"],
        dropped=stats["dropped"],
        drop_rate=stats["drop_rate"],
        counts=np.rint(counts) if counts is not None else None,
        aux_loss=a.get("aux_loss"),
        z_loss=a.get("z_loss"),
        entropy=a.get("entropy"),
        max_load=a.get("max_load"),
    )
    return MoeRouterStats(layers=layers)


# --- crash capture -----------------------------------------------------------------------------


class _Hooks:
    """The process hooks a run installs: an uncaught exception (``sys.excepthook``), SIGTERM/SIGINT
    (recorded, then the previous handler's behaviour: KeyboardInterrupt, or the default death), and
    interpreter exit without ``finish`` (recorded as completed). Removed when the run ends."""

    def __init__(self, run: Run, *, signals: bool, exceptions: bool) -> None:
        self.run = run
        self.pid = os.getpid()  # a forked child (a data-loader worker) inherits the hooks, not the run
        self.previous_hook: Callable[..., Any] | None = None
        if exceptions:
            self.previous_hook = sys.excepthook
            sys.excepthook = self._excepthook
        # An ignored signal (nohup, a background job's SIGINT) stays ignored: it would not end the
        # process, so it is not a crash either.
        self.signals = signals_lib.Handlers(
            self._on_signal, signums=signals_lib.STOP_SIGNALS if signals else (), keep_ignored=True
        )
        atexit.register(self._at_exit)

    def _excepthook(self, kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if os.getpid() == self.pid:  # a forked child has the hook but not the run
            with contextlib.suppress(Exception):
                crash_kind, signum = cause_of(exc)
                self.run.crash(exc, kind=crash_kind, signum=signum)
        (self.previous_hook or sys.__excepthook__)(kind, exc, tb)  # Python's own report still follows

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        previous = self.signals.previous_of(signum)
        if os.getpid() == self.pid:  # a forked child (a data-loader worker) only behaves as before
            name = signal.Signals(signum).name
            self.run.crash(
                kind="signal", signum=signum, message=f"{name} received at step {self.run.last_step}"
            )
        # Now what would have happened without us (in the run's process remove() has put the
        # previous handlers back already).
        signals_lib.act_as(previous, signum, frame)

    def _at_exit(self) -> None:
        if not self.run.ended and os.getpid() == self.pid:
            self.run.finish("completed")

    def remove(self) -> None:
        if sys.excepthook == self._excepthook:
            sys.excepthook = self.previous_hook or sys.__excepthook__
        self.signals.remove()
        atexit.unregister(self._at_exit)


# --- init --------------------------------------------------------------------------------------


def _new_run_id(placement: Placement, launch_key: str | None) -> str:
    if placement.world_size > 1:
        if launch_key is None:
            raise ValueError(
                "a multi-rank run needs a run_id every rank agrees on: pass run_id=, or launch_id= "
                "(or set RUNLEDGER_LAUNCH_ID)"
            )
        return "run-" + hashlib.sha256(launch_key.encode()).hexdigest()[:12]
    return f"run-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:6]}"


def check_run_id(run_id: str) -> str:
    """``run_id`` if the ledger can hold it as a run id, else a ValueError saying what one is."""
    try:
        return _RUN_ID.decode(msgspec.json.encode(run_id))
    except msgspec.ValidationError:
        raise ValueError(
            f"run_id {run_id!r} is not valid: letters, digits, '.', '_', '-', at most 128, "
            "starting with a letter or digit"
        ) from None


def init(
    run_id: str | None = None,
    *,
    config: Mapping[str, Any] | None = None,
    repository: str | None = None,
    name: str | None = None,
    resume_from_step: int | None = None,
    checkpoint_path: str | os.PathLike[str] | None = None,
    parent_run: str | None = None,
    fork_step: int | None = None,
    external: Mapping[str, str] | None = None,
    parallelism: Mapping[str, int] | None = None,
    spool: str | os.PathLike[str] | None = None,
    kafka_bootstrap: str | None = None,
    sink: EventSink | None = None,
    state_dir: str | os.PathLike[str] | None = None,
    launch_id: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    source_prefix: str = "trainer",
    queue_size: int = 4096,
    critical_timeout_s: float = 10.0,
    flush_timeout_s: float = 10.0,
    outage_wait_s: float = 1.0,
    attempt_wait_s: float = 60.0,
    handle_signals: bool = True,
    capture_exceptions: bool = True,
) -> Run:
    """Start (or, with ``resume_from_step``, resume as a new attempt) a run; see docs/client.md.

    ``run_id``: generated when None (multi-rank: from the launch, so every rank gets the same).
    A run id that was launched before needs ``resume_from_step`` (the step of the state it resumes
    from); a relaunch is always a new attempt. ``sink``: your own ``EventSink`` (left open);
    otherwise ``spool``/``kafka_bootstrap``/the environment pick one per rank (closed by ``finish``).
    ``state_dir`` (``RUNLEDGER_STATE``, default ``.runledger/runs``): where attempts are numbered;
    every rank must see it. ``rank``/``world_size``/``local_rank`` override the environment's.
    ``outage_wait_s``: while the bus is down, how long ``log`` calls may wait for queue room in all
    (per outage) before they drop and count (docs/client.md, "When the bus is down").
    ``parent_run``/``fork_step``: a relaunch under a new run id (a fork, or a resume the lab gives a
    new id) goes on from run ``parent_run`` at ``fork_step``: ``ledger history``, ``state``, ``blame``,
    the report and the page follow the lineage (docs/client.md, "A run under a new id").
    """
    _check_lineage(run_id, parent_run, fork_step, resume_from_step)
    if resume_from_step is not None and (
        isinstance(resume_from_step, bool) or not isinstance(resume_from_step, int) or resume_from_step < 0
    ):
        raise ValueError(f"resume_from_step must be a non-negative int, not {resume_from_step!r}")
    found = Placement.from_env()
    placement = Placement(
        found.rank if rank is None else rank,
        found.world_size if world_size is None else world_size,
        found.local_rank if local_rank is None else local_rank,
    ).checked()
    launch_key = f"explicit:{launch_id}" if launch_id else attempts_lib.launch_key_from_env()
    run_id = check_run_id(run_id if run_id is not None else _new_run_id(placement, launch_key))
    tree = json_tree(dict(config or {}))
    state = Path(state_dir) if state_dir is not None else attempts_lib.default_state_dir()
    host = provenance.host()
    attempt, previous = _agree_attempt(
        state, run_id, placement, launch_key, resume_from_step, tree, host, attempt_wait_s
    )
    owns_sink = sink is None
    if sink is None:
        sink = open_rank_sink(spool, placement.rank, kafka_bootstrap)
    emitter = Emitter(
        sink,
        source=f"{source_prefix}/{run_id}/a{attempt}/rank{placement.rank}",
        stream=run_id,
        run_id=run_id,
        attempt=attempt,
        queue_size=queue_size,
        critical_timeout_s=critical_timeout_s,
        outage_wait_s=outage_wait_s,
        # Our own sink's spool folder (Kafka's outage spool with Kafka): where a drop report the
        # bus still refuses at exit waits for the next ``ledger ingest spool`` of that spool.
        pending_dir=rank_spool(spool, placement.rank) if owns_sink else None,
    )
    start_step = 0 if resume_from_step is None else resume_from_step + 1
    run = Run(
        run_id=run_id,
        attempt=attempt,
        previous_attempts=previous,
        placement=placement,
        emitter=emitter,
        sink=sink,
        owns_sink=owns_sink,
        config=tree,
        start_step=start_step,
        flush_timeout_s=flush_timeout_s,
        host=host,
    )
    if placement.is_main:
        fields = launch_fields(
            config=tree,
            config_hash=config_hash(tree),
            provenance=provenance.of_this_process(_code_root(), host_name=host),
            repository=repository,
            world_size=placement.world_size,
            parallelism=parallelism,
            external=external,
        )
        payload, at_step = launch_event(
            fields,
            attempt=attempt,
            name=name,
            resumed_from_step=resume_from_step,
            checkpoint_path=str(checkpoint_path) if checkpoint_path is not None else None,
            parent_run=parent_run,
            fork_step=fork_step,
        )
        emitter.submit(payload, step=at_step, critical=True)
    run._hooks = _Hooks(run, signals=handle_signals, exceptions=capture_exceptions)
    return run


def _check_lineage(
    run_id: str | None, parent_run: str | None, fork_step: int | None, resume_from_step: int | None
) -> None:
    """``init``'s lineage arguments, checked before anything is started (a ValueError, one line)."""
    if fork_step is not None and (
        isinstance(fork_step, bool) or not isinstance(fork_step, int) or fork_step < 0
    ):
        raise ValueError(f"fork_step must be a non-negative int, not {fork_step!r}")
    if parent_run is None:
        if fork_step is not None:
            raise ValueError("fork_step needs parent_run: the run the new run id goes on from")
        return
    check_run_id(parent_run)
    if parent_run == run_id:
        raise ValueError(
            f"parent_run {parent_run!r} is this run: a relaunch of one run id is resume_from_step"
        )
    if resume_from_step is not None:
        raise ValueError("parent_run is for a new run id; a resume of this run id is resume_from_step")


def _agree_attempt(
    state: Path,
    run_id: str,
    placement: Placement,
    launch_key: str | None,
    resume_from_step: int | None,
    tree: dict[str, Any],
    host: str,
    wait_s: float,
) -> tuple[int, int]:
    """(attempt, attempts before it): rank 0 registers the launch; the others wait for its number."""
    if not placement.is_main:
        if launch_key is None:
            raise ValueError(
                "ranks other than 0 learn the attempt from the launch: pass launch_id= "
                "(or set RUNLEDGER_LAUNCH_ID); torchrun and SLURM set one already"
            )
        attempt = attempts_lib.wait_for(
            state, run_id, launch_key, since=time.time() - wait_s, timeout_s=wait_s
        )
        return attempt, attempt - 1
    before = attempts_lib.attempts(state, run_id)
    if resume_from_step is None and before:
        raise RunExistsError(
            f"run {run_id!r} was launched before ({len(before)} attempt(s) in {state}); "
            "pass resume_from_step= to resume it as a new attempt, or choose another run_id"
        )
    if resume_from_step is not None and not before:
        raise RunExistsError(f"nothing to resume: run {run_id!r} has no attempts in {state}")
    record = {
        "launch_key": launch_key,
        "host": host,
        "pid": os.getpid(),
        "from_step": resume_from_step or 0,
        "config_hash": config_hash(tree),
    }
    attempt, before_n = attempts_lib.register(state, run_id, record)
    if resume_from_step is None and before_n:
        # Two processes launched this run id at once: both found no attempt above, and the other
        # registered first. It is the run; this one refuses, as it would have a moment later.
        raise RunExistsError(
            f"run {run_id!r} was launched at the same moment by another process (registered in "
            f"{state}); pass resume_from_step= to resume it as a new attempt, or choose another run_id"
        )
    return attempt, before_n
