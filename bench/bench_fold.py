"""The fold, history and verify at the reference run's size (issue 11), each beside its baseline.

Builds ledgers shaped like the reference run (../shared/reference/marin-535b.md) at 10%, 30% and 100%
of its 390,000 steps: per step 32 scalars and 48 layers × 5 router stats, expert counts every 100
steps, 792 rank-stat events every 1,000 steps, a checkpoint every 500 steps, 19 crashes (scaled)
each resumed from the last checkpoint, config changes caused by merged PRs (the dispatcher switch at
step 81,716 among them) and a GitHub stream of issues and PRs. Then, per size:

* ``state --step`` (mid-run, late, last), ``diff``, ``blame`` and the ``history`` summary through the
  Reader, beside the old code path: ledger/query.py as it was at BASELINE_COMMIT (every state event
  of the run read from ``events`` and decoded, per call), after checking both give the same answers;
* ``verify_ledger`` in a child process: its wall time and peak RSS (``os.wait4``'s rusage of that
  child), beside the old verify (ledger/integrity.py at BASELINE_COMMIT) up to ``--old-verify-max``.

Ledgers are built once under ``--work`` (default /tmp/runledger-bench-fold) and reused.

    python -m bench.bench_fold [--fractions 0.1,0.3,1.0] [--work DIR]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import jsonpatch

from bench.measure import run_measured
from runledger.ingest.bus import SpoolSink
from runledger.ingest.spool_ingester import ingest_spool
from runledger.ledger.history import history_counts, summarise_history
from runledger.ledger.query import Reader
from runledger.ledger.store import Ledger
from runledger.schemas import config_hash, make_event
from runledger.schemas import payloads as p
from runledger.schemas.durable import write_durably
from runledger.schemas.github import GitHubIssue, GitHubPullRequest

REFERENCE_STEPS = 390_000
REFERENCE_CRASHES = 19
LAYERS, EXPERTS, TOP_K, RANKS = 48, 384, 8, 792
SWITCH_STEP = 81_716  # pooled-wave dispatcher → ragged all-to-all
STEP_S = 20.0  # ~3 months over 390k steps
CHECKPOINT_EVERY = 500
RUN_ID, REPO = "marin-535b", "marin-community/marin"
T0 = datetime(2025, 3, 1, tzinfo=UTC)


def _config() -> dict[str, Any]:
    return {
        "model": {"layers": LAYERS, "experts": EXPERTS, "top_k": TOP_K, "hidden": 7168},
        "optim": {"lr": 3e-4, "warmup_steps": 2000, "weight_decay": 0.1},
        "moe": {"capacity_factor": 1.25, "dispatcher": "pooled-wave", "aux_loss_coeff": 0.01},
        "data": {"seq_len": 4096, "global_batch_tokens": 46_137_344},
    } | {f"knob_{i:02d}": i for i in range(40)}


def _sha(n: int) -> str:
    return f"{n * 2654435761 % (1 << 160):040x}"


class _Emitter:
    def __init__(self, sink: SpoolSink) -> None:
        self.sink = sink
        self.seq: dict[str, int] = {}

    def __call__(self, payload: Any, *, stream: str, at: datetime, **env: Any) -> None:
        seq = self.seq.get(stream, 0)
        self.seq[stream] = seq + 1
        self.sink.emit(make_event(payload, source=f"bench/{stream}", stream=stream, seq=seq, time=at, **env))


def emit_reference(sink: SpoolSink, steps: int) -> int:
    """Emit a reference-shaped run of ``steps`` steps and its GitHub stream; returns the events emitted."""
    emit = _Emitter(sink)
    crashes = max(2, round(REFERENCE_CRASHES * steps / REFERENCE_STEPS))
    crash_steps = {steps * (i + 1) // (crashes + 1) + 137 for i in range(crashes)}
    changes = sorted(
        {s for s in (steps // 7, SWITCH_STEP * steps // REFERENCE_STEPS, steps // 2, steps * 5 // 6)}
    )
    config = _config()
    now = T0
    attempt, step, last_ckpt, events = 1, 0, 0, 0
    pr = 100

    def run_event(payload: Any, at_step: int | None) -> None:
        nonlocal events
        emit(payload, stream=RUN_ID, at=now, run_id=RUN_ID, attempt=attempt, step=at_step)
        events += 1

    def github(payload: Any) -> None:
        nonlocal events
        emit(payload, stream=REPO, at=now)
        events += 1

    run_event(
        p.RunStarted(
            config=config,
            config_hash=config_hash(config),
            git_commit=_sha(1),
            repository=REPO,
            host="node-000",
            world_size=RANKS,
        ),
        0,
    )
    done_changes: set[int] = set()
    while step < steps:
        step += 1
        now += timedelta(seconds=STEP_S)
        if step in changes and step not in done_changes:
            done_changes.add(step)
            pr += 1
            new = _changed(config, step == changes[1])
            github(
                GitHubPullRequest(
                    action="closed",
                    repo=REPO,
                    number=pr,
                    title=f"tune the run at step {step}",
                    state="closed",
                    author="dlwh",
                    actor="dlwh",
                    merged=True,
                    merge_commit_sha=_sha(pr),
                    head_sha=_sha(pr + 10_000),
                )
            )
            run_event(
                p.ConfigChanged(
                    patch=[p.PatchOp(**op) for op in jsonpatch.make_patch(config, new).patch],
                    previous_hash=config_hash(config),
                    config_hash=config_hash(new),
                    cause=p.ChangeCause(kind="commit", commit=_sha(pr), actor="dlwh"),
                ),
                step,
            )
            config = new
        drop = 0.0267 if step < SWITCH_STEP * steps // REFERENCE_STEPS else 0.00018
        run_event(
            p.StepMetrics(
                loss=2.0 + 8.0 / (1 + step / 1000) + (step % 97) * 1e-4,
                grad_norm=0.3 + (step % 13) * 0.01,
                lr=config["optim"]["lr"],
                tokens=46_137_344,
                total_tokens=46_137_344 * step,
                tokens_per_second=2.3e6 + step % 1000,
                mfu=38.0 + (step % 17) * 0.1,
                step_time_s=STEP_S,
                scalars={f"s{i:02d}": step * 1e-4 + i for i in range(24)},
            ),
            step,
        )
        with_counts = step % 100 == 0
        run_event(
            p.MoeRouterStats(
                layers=[
                    p.MoeLayerStats(
                        layer=layer,
                        tokens=11_264,
                        top_k=TOP_K,
                        dropped=int(11_264 * TOP_K * drop),
                        token_drop_rate=drop,
                        aux_loss=0.01 + layer * 1e-5,
                        routing_entropy=5.9 - layer * 1e-3,
                        expert_counts=[(11_264 * TOP_K // EXPERTS) + (e + step) % 7 for e in range(EXPERTS)]
                        if with_counts
                        else [],
                    )
                    for layer in range(LAYERS)
                ]
            ),
            step,
        )
        if step % 1000 == 0:
            for rank in range(RANKS):
                run_event(
                    p.RankStats(rank=rank, host=f"node-{rank // 8:03d}", step_time_s=STEP_S + rank % 5), step
                )
        if step % CHECKPOINT_EVERY == 0:
            run_event(p.CheckpointSaved(path=f"gs://marin/ckpt/step-{step}", bytes=1 << 40), step)
            last_ckpt = step
        if step % 2000 == 0:
            pr += 1
            github(
                GitHubIssue(
                    action="opened", repo=REPO, number=pr, title=f"loss spike near {step}", author="a"
                )
            )
        if step in crash_steps:
            crash_steps.discard(step)
            host = f"node-{(step * 31) % 99:03d}"
            run_event(
                p.RunCrashed(
                    kind="exception", exc_type="NcclError", message="timeout", rank=step % RANKS, host=host
                ),
                step,
            )
            now += timedelta(minutes=40)
            attempt += 1
            step = last_ckpt
            run_event(
                p.RunResumed(
                    config=config,
                    config_hash=config_hash(config),
                    git_commit=_sha(pr if pr > 100 else 1),
                    repository=REPO,
                    host="node-000",
                    world_size=RANKS,
                    from_checkpoint_step=step,
                    previous_attempt=attempt - 1,
                ),
                step,
            )
    run_event(p.RunFinished(status="completed", final_step=steps), steps)
    return events


def _changed(config: dict[str, Any], switch: bool) -> dict[str, Any]:
    new = {k: (dict(v) if isinstance(v, dict) else v) for k, v in config.items()}
    if switch:
        new["moe"]["dispatcher"] = "ragged-all-to-all"
    else:
        new["optim"]["lr"] = config["optim"]["lr"] * 0.8
    return new


def build(work: Path, steps: int, *, emit_only: bool = False) -> Path:
    """The ledger of a ``steps``-step reference run under ``work`` (emitted and built once, then reused)."""
    ledger_dir, spool, spooled, done = work / "ledger", work / "spool", work / "SPOOLED", work / "BUILT"
    if done.exists():
        return ledger_dir
    if not spooled.exists():
        shutil.rmtree(spool, ignore_errors=True)
        sink = SpoolSink(spool)
        t = time.perf_counter()
        n = emit_reference(sink, steps)
        sink.close()
        write_durably(spooled, f"{n} events, emit {time.perf_counter() - t:.1f} s")
    if emit_only:
        return ledger_dir
    shutil.rmtree(ledger_dir, ignore_errors=True)
    t = time.perf_counter()
    ingest_spool(Ledger.create(ledger_dir), spool, batch_size=5000)
    write_durably(done, f"{spooled.read_text()}, ingest {time.perf_counter() - t:.1f} s\n")
    return ledger_dir


# ----------------------------------------------------------------------------- the old code path

# The commit before issue 11's changes: its query.py and integrity.py are the baseline, loaded as they
# were (every state event read from ``events`` per call; verify holding every event row in memory).
BASELINE_COMMIT = "8fe1e73"


def baseline_module(name: str, path: str) -> ModuleType:
    """``path`` (e.g. ledger/query.py) as it was at BASELINE_COMMIT, importable as ``name``."""
    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(
        ["git", "-C", str(root), "show", f"{BASELINE_COMMIT}:{path}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    module = ModuleType(name)
    module.__file__ = f"<{BASELINE_COMMIT}:{path}>"
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


def timed(fn: Callable[[], Any], repeat: int = 5, budget_s: float = 20.0) -> float:
    """Median of up to ``repeat`` runs (fewer once ``budget_s`` is spent: the old path takes seconds)."""
    samples: list[float] = []
    while len(samples) < repeat and sum(samples) < budget_s:
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


_VERIFY = """
import sys, time
{load}
t = time.perf_counter()
report = verify_ledger(sys.argv[1])
print(report.ok, len(report.problems), report.events, round(time.perf_counter() - t, 1))
"""


def verify_in_child(ledger_dir: Path, *, baseline: bool) -> tuple[float, float, str]:
    """``verify_ledger`` in a child process: (wall seconds, the child's peak RSS in MB, its output)."""
    if baseline:
        load = (
            "from bench.bench_fold import baseline_module\n"
            "verify_ledger = baseline_module('old_integrity', 'ledger/integrity.py').verify_ledger"
        )
    else:
        load = "from runledger.ledger.integrity import verify_ledger"
    root = Path(__file__).resolve().parent.parent
    child = run_measured([sys.executable, "-c", _VERIFY.format(load=load), str(ledger_dir)], cwd=root)
    lines = child.stdout.strip().splitlines()
    return child.seconds, child.peak_rss_mb, lines[-1] if lines else ""


def _history_rows(items: Sequence[Any]) -> list[tuple[Any, ...]]:
    return [(i.time, i.step, i.attempt, i.kind, i.text) for i in items]


def measure(fraction: float, ledger_dir: Path, old_verify_max: float, verify: bool) -> None:
    old = baseline_module("old_query", "ledger/query.py").Reader(ledger_dir)
    new = Reader(ledger_dir)
    n = new.sql("SELECT count(*) FROM events").rows[0][0]
    last = new.last_step(RUN_ID) or 0
    mid, late = last // 2 + 1, last - 3
    key = "moe.dispatcher"
    # Identical answers first.
    for step in (mid, late):
        assert new.state(RUN_ID, step=step).to_dict() == old.state(RUN_ID, step=step).to_dict()
    assert _history_rows(new.history(RUN_ID)) == _history_rows(old.history(RUN_ID))
    d_new, d_old = new.diff(RUN_ID, mid - 5000, mid), old.diff(RUN_ID, mid - 5000, mid)
    assert d_new["config_patch"] == d_old["config_patch"]
    assert _history_rows(d_new["events"]) == _history_rows(d_old["events"])
    assert new.blame(RUN_ID, key, mid) == old.blame(RUN_ID, key, mid)
    history = new.history(RUN_ID)
    queries: list[tuple[str, Callable[[], Any], Callable[[], Any]]] = [
        (f"state --step {mid:,}", lambda: old.state(RUN_ID, step=mid), lambda: new.state(RUN_ID, step=mid)),
        (
            f"state --step {late:,}",
            lambda: old.state(RUN_ID, step=late),
            lambda: new.state(RUN_ID, step=late),
        ),
        ("state (last step)", lambda: old.state(RUN_ID), lambda: new.state(RUN_ID)),
        (
            "diff (5,000 steps)",
            lambda: old.diff(RUN_ID, mid - 5000, mid),
            lambda: new.diff(RUN_ID, mid - 5000, mid),
        ),
        (f"blame {key}", lambda: old.blame(RUN_ID, key, mid), lambda: new.blame(RUN_ID, key, mid)),
        (
            "history summary",
            lambda: old.history(RUN_ID),
            lambda: summarise_history(new.history(RUN_ID)),
        ),
    ]
    size = f"{fraction:>5.0%} {n:>10,}"
    for label, before, after in queries:
        print(
            f"{size} | {label:<26} {timed(before) * 1e3:>9.1f} ms {timed(after) * 1e3:>9.1f} ms", flush=True
        )
    shown = summarise_history(history)
    print(f"{size} | history lines: {len(history):,} events → {len(shown)} lines ({history_counts(history)})")
    if not verify:
        return
    for baseline in (True, False) if fraction <= old_verify_max else (False,):
        wall, rss_mb, out = verify_in_child(ledger_dir, baseline=baseline)
        label = "verify (old)" if baseline else "verify"
        print(
            f"{size} | {label:<26} {wall:>9.1f} s  peak RSS {rss_mb:>7.0f} MB   [ok, problems, events, s: {out}]",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fractions", default="0.1,0.3,1.0")
    parser.add_argument("--work", type=Path, default=Path("/tmp/runledger-bench-fold"))
    parser.add_argument("--build-only", action="store_true")
    parser.add_argument("--emit-only", action="store_true")
    parser.add_argument("--no-verify", action="store_true")
    parser.add_argument(
        "--old-verify-max",
        type=float,
        default=0.1,
        help="run the old verify only up to this fraction (its RSS grows)",
    )
    args = parser.parse_args()
    print(f"{'size':>5} {'events':>10} | {'query':<26} {'before':>12} {'after':>12}")
    for fraction in (float(f) for f in args.fractions.split(",")):
        steps = round(REFERENCE_STEPS * fraction)
        ledger_dir = build(args.work / f"steps-{steps}", steps, emit_only=args.emit_only)
        if args.emit_only:
            print((ledger_dir.parent / "SPOOLED").read_text().strip())
        elif args.build_only:
            print((ledger_dir.parent / "BUILT").read_text().strip())
        else:
            measure(fraction, ledger_dir, args.old_verify_max, not args.no_verify)


if __name__ == "__main__":
    main()
