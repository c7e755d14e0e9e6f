"""The demo (``ledger demo``): the main job, end to end on CPU, as a library function.

A tiny Megatron-Core MoE trains on the shipped corpus; mid-run its config file is edited (the
capacity factor), a crash is injected, the run resumes from its last checkpoint; every event goes
through the embedded spool into a fresh ledger, which is signed, verified and asked a few questions.
``run_demo`` returns all of it as a ``DemoResult``; while it runs it tells a ``DemoObserver`` (the
CLI's prints the progress bar and the attempts' endings). It prints nothing itself.

The work folder: the demo only ever removes what it creates itself (``DEMO_OUTPUTS``). It makes the
folder, or takes an empty one, and marks it with ``MARKER``; a rerun reuses a marked folder. A
non-empty folder it did not make is refused unless ``force``; the current folder, any folder above
it, $HOME and / are always refused (``prepare_workdir``, ``DemoError``).

SIGINT or SIGTERM (``runledger.signals``: the command's policy, or one ``run_demo`` installs for its
call), in every phase, ends the demo with ``DemoResult.stop`` set, never by raising: during the
start-up (the trainer's imports) before anything is recorded (no ledger is made); during training the
trainer stops at the next step boundary and records the stop, and the demo folds what was spooled
into the ledger and does not resume; during the fold, the signing, the verification, the questions or
the report, the ledger holds the whole run. Writing files (the set-up, the fold, the signatures)
defers a signal to the end of that write; a second signal there stops at once (commits are atomic,
so the ledger stays consistent).
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from runledger import signals
from runledger.crashes import SignalStop
from runledger.signals import Interrupted

if TYPE_CHECKING:
    from runledger.ingest.bus import SpoolSink
    from runledger.ingest.spool_ingester import IngestStats
    from runledger.ledger.history import HistoryItem
    from runledger.ledger.integrity import Report
    from runledger.ledger.query import Reader, Result
    from runledger.trainer.loop import TrainResult
    from runledger.trainer.telemetry import StepReport

DEMO_DIR = Path(".runledger/demo")
MARKER = ".runledger-demo"  # written into every work folder the demo made or took over
# All the demo writes there: the ledger holds its log key (``ledger/.keys``), ``keys`` the trainer's.
DEMO_OUTPUTS = ("checkpoints", "spool", "ledger", "keys", "config.toml", "report.html")
PRODUCER = "demo-trainer"  # the trainer's producer key, registered in the ledger


class DemoError(Exception):
    """A work folder the demo refuses (nothing was removed or written): one line for the user."""


# --- the work folder ---------------------------------------------------------------------------


def _protected(target: Path) -> str | None:
    """Why ``target`` (resolved) must never be a work folder, or None."""
    if target == Path(target.anchor):
        return "it is the root folder"
    try:
        if target == Path.home().resolve():
            return "it is your home folder"
    except RuntimeError:  # no home folder can be determined
        pass
    cwd = Path.cwd().resolve()
    if target == cwd:
        return "it is the current folder"
    if target in cwd.parents:
        return "it holds the current folder"
    return None


def prepare_workdir(workdir: Path, *, force: bool = False) -> None:
    """Make ``workdir`` ready for a demo, removing only the demo's own outputs; refuse anything else
    (``DemoError``)."""
    target = workdir.expanduser().resolve()
    why = _protected(target)
    if why is not None:
        raise DemoError(
            f"refusing --workdir {workdir}: {why}; the demo needs a folder of its own, "
            f"e.g. --workdir {DEMO_DIR}"
        )
    if target.exists() or target.is_symlink():
        if not target.is_dir():
            raise DemoError(f"refusing --workdir {workdir}: it is not a folder")
        ours = (target / MARKER).is_file()
        if not ours and not force and any(target.iterdir()):
            raise DemoError(
                f"refusing --workdir {workdir}: it is not empty and was not made by `ledger demo`; "
                "give a new or empty folder, or --force to use it (removes only "
                + ", ".join(DEMO_OUTPUTS)
                + " there)"
            )
        for name in DEMO_OUTPUTS:
            path = target / name
            if path.is_symlink() or path.is_file():
                path.unlink()
            elif path.is_dir():
                shutil.rmtree(path)
    target.mkdir(parents=True, exist_ok=True)
    (target / MARKER).write_text(
        "This folder was made by `ledger demo`; a rerun replaces its outputs: "
        + ", ".join(DEMO_OUTPUTS)
        + ".\n"
    )


# --- what the demo reports and returns ---------------------------------------------------------


class DemoObserver:
    """What ``run_demo`` tells while it runs, in this order; every method does nothing here."""

    def started(self, run_id: str, steps: int) -> None:
        """The run's config is written, nothing trained yet."""

    @contextlib.contextmanager
    def training(self, steps: int) -> Iterator[None]:
        """Around both attempts (a progress display lives here)."""
        yield

    def step(self, report: StepReport) -> None:
        """A step is done (its update applied)."""

    def resuming(self) -> None:
        """Attempt 1 crashed as planned; attempt 2 resumes from its last checkpoint."""

    def attempt_ended(self, result: TrainResult, *, resumed: bool) -> None:
        """An attempt returned (``resumed``: the second one)."""

    def folded(self, stats: IngestStats, ledger_dir: Path) -> None:
        """The spool is in the ledger; signing, verifying and the questions follow unless stopped."""


@dataclass(frozen=True)
class DemoStop:
    """A signal stopped the demo: which (None: unknown), where (``step 12 of attempt 1``, ``the
    report``) and whether during training (the run was not resumed, nor its ledger signed)."""

    signum: int | None
    where: str
    training: bool = True


@dataclass
class DemoResult:
    """What a demo did. A ``stop`` ends it where it came: before training nothing is recorded
    (``ingested`` None: no ledger); during training it ends after the fold (no signature,
    verification, answers or report); later, what was done by then is here."""

    run_id: str
    workdir: Path
    ledger_dir: Path
    attempts: list[TrainResult] = field(default_factory=list)
    ingested: IngestStats | None = None
    stop: DemoStop | None = None
    verify: Report | None = None
    public_key: Path | None = None  # the log key the checkpoints are signed with
    history: list[HistoryItem] = field(default_factory=list)
    answers: list[tuple[str, Result]] = field(default_factory=list)  # (question, its SQL's answer)
    report: Path | None = None
    elapsed_s: float = 0.0


# --- the steps ---------------------------------------------------------------------------------


def _write_config(workdir: Path, run_id: str, *, steps: int, crash_at: int) -> Path:
    from runledger.trainer.config import load_config, write_config

    cfg = load_config(
        None,
        [
            f"run.run_id={run_id}",
            f"run.steps={steps}",
            "run.device=cpu",
            "moe.capacity_factor=1.0",
            f"checkpoint.dir={workdir / 'checkpoints'}",
            f"checkpoint.interval={max(5, min(50, crash_at // 3 // 5 * 5))}",
            f"debug.crash_at_step={crash_at}",
            "telemetry.peak_tflops=0.2",
        ],
    )
    config_path = workdir / "config.toml"
    write_config(config_path, cfg)
    return config_path


def _signal_stop(result: TrainResult, attempt: str) -> DemoStop | None:
    """How ``result`` was stopped by a signal, if it was: the trainer's recorded stop, or one that
    came after its last step boundary or after it returned (``attempt``: which, in words)."""
    if result.status == "signal":
        return DemoStop(
            result.crash.signal if result.crash else None, f"step {result.final_step} of {attempt}"
        )
    signum = signals.take()
    return DemoStop(signum, f"step {result.final_step} of {attempt}") if signum is not None else None


def _train(
    config_path: Path,
    sink: SpoolSink,
    *,
    steps: int,
    change_at: int,
    observer: DemoObserver,
) -> tuple[list[TrainResult], DemoStop | None]:
    """Attempt 1 (its config file edited after ``change_at``, crashing as configured), then attempt 2
    resumed from the last checkpoint, unless a signal stopped the run."""
    with signals.interruptible():  # torch, slow to import; nothing is recorded yet
        from runledger.trainer.loop import train

    attempts: list[TrainResult] = []
    stop: DemoStop | None = None
    edited = False

    def on_step(report: StepReport) -> None:
        nonlocal edited
        observer.step(report)
        if report.step >= change_at and not edited:
            # A person edits the watched config file: picked up at the next step boundary.
            text = config_path.read_text().replace("capacity_factor = 1.0", "capacity_factor = 1.25")
            config_path.write_text(text)
            edited = True

    try:
        # The trainer takes a signal over at its set-up; between the attempts it is acted on here,
        # before a resume.
        with observer.training(steps):
            first = train(config_path, sink, progress=on_step)
            attempts.append(first)
            observer.attempt_ended(first, resumed=False)
            stop = _signal_stop(first, "attempt 1")
            if stop is None:
                observer.resuming()
                second = train(config_path, sink, resume_from="latest", progress=on_step)
                attempts.append(second)
                observer.attempt_ended(second, resumed=True)
                stop = _signal_stop(second, f"attempt {second.attempt}")
    except (SignalStop, Interrupted) as exc:  # a second signal while the first was being honoured
        signals.take()
        stop = DemoStop(exc.signum, f"the start or end of attempt {len(attempts) + 1}")
    return attempts, stop


def _fold(workdir: Path, producer_pub: Path, run_id: str) -> IngestStats:
    """A fresh ledger that admits the trainer's key for this run only, and the whole spool folded into
    it (deferred, as all of the demo: a second signal stops it between whole commits)."""
    from runledger.ingest.spool_ingester import ingest_spool
    from runledger.ledger.registry import register_producer
    from runledger.ledger.store import Ledger
    from runledger.schemas.payloads import run_scope

    ledger = Ledger.create(workdir / "ledger")
    # Scoped to its run (sources trainer/<run>, stream <run>): the key cannot write another run.
    register_producer(ledger, PRODUCER, producer_pub.read_text(), run_scope(run_id))
    return ingest_spool(ledger, workdir / "spool")


def _sign(ledger_dir: Path) -> Path:
    """Every stream's checkpoint signed with a fresh log key, kept with the ledger and recorded as its
    log key; its public key."""
    from runledger.ledger.log_key import default_keys, record_log_key
    from runledger.ledger.store import Ledger
    from runledger.ledger.stream_checkpoints import sign_checkpoints
    from runledger.schemas.note import write_keypair

    # The log key lives with the ledger (``<ledger>/.keys``), where a plain `ledger checkpoint`,
    # `publish` or `verify` looks, and the lake records it so no other key can sign for this ledger.
    private, public = write_keypair(default_keys(ledger_dir), "demo")
    with Ledger.open(ledger_dir) as ledger:
        record_log_key(ledger, public.read_text().strip())
    sign_checkpoints(ledger_dir, private.read_text().strip())
    return public


def demo_questions(run_id: str, *, change_at: int, crash_at: int) -> list[tuple[str, str]]:
    """The demo's questions to its ledger: (title, SQL)."""
    return [
        (
            "loss by attempt (superseded steps kept, not overwritten)",
            "SELECT attempt, count(*) AS steps, sum(superseded::INT) AS superseded, round(min(value), 3) AS min_loss, "
            "round(max(value), 3) AS max_loss FROM metrics_all WHERE name = 'loss' GROUP BY attempt ORDER BY attempt",
        ),
        (
            "token-drop rate before and after the capacity-factor change",
            f"SELECT CASE WHEN step < {change_at + 1} THEN 'capacity 1.0' ELSE 'capacity 1.25' END AS phase, "
            "round(avg(token_drop_rate) * 100, 3) AS drop_pct, count(DISTINCT step) AS steps "
            "FROM moe_layer_stats GROUP BY phase ORDER BY phase",
        ),
        (
            "config live at the crash step, from SQL",
            f"SELECT attempt, step, json_extract(config, '$.moe.capacity_factor') AS capacity_factor, "
            f"left(config_hash, 12) AS hash FROM config_at('{run_id}', {crash_at})",
        ),
    ]


def _ask(reader: Reader, result: DemoResult, *, change_at: int, crash_at: int) -> None:
    """The run's history and the answers to ``demo_questions``, into ``result``."""
    result.history = reader.history(result.run_id)
    questions = demo_questions(result.run_id, change_at=change_at, crash_at=crash_at)
    result.answers = [(title, reader.sql(sql)) for title, sql in questions]


# --- the demo ----------------------------------------------------------------------------------


def run_demo(
    workdir: Path,
    *,
    steps: int,
    crash_at: int,
    change_at: int,
    observer: DemoObserver | None = None,
) -> DemoResult:
    """The demo in ``workdir`` (made ready by ``prepare_workdir``). A signal stop does not raise: the
    result's ``stop`` says which and where, and the ledger holds what was recorded up to it."""
    # The command's signal policy (or one for this call): every signal is recorded until acted on,
    # and waits for the next safe point, but in the windows that write nothing (``interruptible``).
    with signals.listening(), signals.deferred():
        observer = observer or DemoObserver()
        started = time.perf_counter()
        workdir.mkdir(parents=True, exist_ok=True)
        result = DemoResult(f"demo-{time.strftime('%Y%m%d-%H%M%S')}", workdir, workdir / "ledger")
        _record(result, steps=steps, crash_at=crash_at, change_at=change_at, observer=observer)
        if result.attempts or result.stop is None:  # else nothing was recorded: no ledger to make
            result.ingested = _fold(workdir, workdir / "keys" / f"{PRODUCER}.pub", result.run_id)
            observer.folded(result.ingested, result.ledger_dir)
            signum = signals.take()
            if result.stop is None and signum is not None:
                result.stop = DemoStop(signum, "the fold", training=False)
        if result.stop is None:
            _conclude(result, change_at=change_at, crash_at=crash_at)
            signum = signals.take()  # after the report: everything the demo makes is whole
            if result.stop is None and signum is not None:
                result.stop = DemoStop(signum, "the end", training=False)
        result.elapsed_s = time.perf_counter() - started
        return result


def _record(result: DemoResult, *, steps: int, crash_at: int, change_at: int, observer: DemoObserver) -> None:
    """The set-up (config, keys, spool), then both attempts into the spool; ``result.stop`` on a signal."""
    workdir = result.workdir
    sink: SpoolSink | None = None
    try:
        sink, config_path = _set_up(workdir, result.run_id, steps=steps, crash_at=crash_at)
        signals.check()
        observer.started(result.run_id, steps)
        result.attempts, result.stop = _train(
            config_path, sink, steps=steps, change_at=change_at, observer=observer
        )
    except Interrupted as exc:  # before the trainer recorded anything (its imports are slow)
        signals.take()
        result.stop = DemoStop(exc.signum, "the start-up")
    finally:
        if sink is not None:
            sink.close()


def _set_up(workdir: Path, run_id: str, *, steps: int, crash_at: int) -> tuple[SpoolSink, Path]:
    """The run's config file, the trainer's producer key and the spool it writes to."""
    from runledger.ingest.bus import SpoolSink
    from runledger.schemas.note import write_keypair
    from runledger.schemas.signing import Sealer

    config_path = _write_config(workdir, run_id, steps=steps, crash_at=crash_at)
    # The trainer signs (and chains) its events with its own producer key; the ledger registers it.
    producer_key, _ = write_keypair(workdir / "keys", PRODUCER)
    return SpoolSink(workdir / "spool", sealer=Sealer(producer_key.read_text())), config_path


def _conclude(result: DemoResult, *, change_at: int, crash_at: int) -> None:
    """Sign (deferred: whole files), then verify, ask and report, where a signal stops at once (the
    ledger holds the whole run by then)."""
    ledger_dir, phase = result.ledger_dir, "the signing"
    try:
        result.public_key = _sign(ledger_dir)
        with signals.interruptible():
            from runledger.ledger.integrity import verify_ledger
            from runledger.ledger.query import Reader
            from runledger.ledger.report import write_report

            phase = "the verification"
            result.verify = verify_ledger(ledger_dir, result.public_key.read_text().strip())
            phase = "the questions"
            _ask(Reader(ledger_dir), result, change_at=change_at, crash_at=crash_at)
            phase = "the report"  # written whole (runledger.schemas.durable), or not at all
            result.report, _ = write_report(
                ledger_dir, [result.run_id], result.workdir / "report.html", public_key_path=result.public_key
            )
    except (Interrupted, Exception) as exc:  # (or DuckDB's error for the raise it caught in a query)
        signum = signals.taken_for(exc)
        if signum is None:
            raise
        result.stop = DemoStop(signum, phase, training=False)
