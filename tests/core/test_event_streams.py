"""The event streams the producers emit, compared with golden files made from the code before the refactor.

Each scenario runs a producer the way its users run it (the trainer in-process; the ``ledger demo`` and
``ledger simulate`` commands; the client library in-process and its examples as scripts) in its own
folder, captures every event as it goes onto the bus (the wire JSON, from a sink or read back from the
spool), and writes it as one canonical JSON line: every envelope attribute and every payload key, in
order, with only what legitimately differs between runs and machines masked (see ``Canon``). A
changed type, order, step, attempt, source, seq or payload value, or an added or removed key, is a
difference from ``tests/fixtures/streams/<scenario>.jsonl``, shown event by event and field by field.

The golden files are the output of commit 62ab116 (before the launch/attempt/signal, simulator and demo
refactors), except ``simulator_cli``, accepted again from the code of issue 24 (``simulate --run-id X``
now gives run X its own repository, commits and PR numbers). To make them again from that commit, in its worktree (the code must load from there:
the generator prints where each package came from and refuses a mismatch)::

    git worktree add ../baseline-62ab116 62ab116   # once, from the repository root
    B=$(realpath ../baseline-62ab116); R=$PWD
    (cd /tmp && PYTHONPATH=$B $R/.venv/bin/python $R/tests/core/test_event_streams.py --regenerate)

To accept the current code's streams as the new truth (deliberately, after reading the diff)::

    .venv/bin/python -m tests.core.test_event_streams --regenerate [--only SCENARIO ...]

``--out DIR`` writes somewhere else (e.g. twice, to check that a run is reproducible); ``--check``
compares instead of writing. The test itself runs against the baseline code the same way::

    (cd $B && PYTHONPATH=$B $R/.venv/bin/pytest --import-mode=importlib -p no:cacheprovider \\
        $R/tests/core/test_event_streams.py)

Floats: the CPU model's values (losses, gradient norms, router statistics, the examples' values) are
bit-identical run to run on one machine (two generations from 62ab116 gave byte-identical files); they
are compared within a relative 1e-4 (``FLOAT_REL_TOL``), which another machine's vector code paths stay
inside and a change of what is recorded does not. Every scenario runs torch on one intra-op thread (``torch.set_num_threads(1)``;
``OMP_NUM_THREADS=1`` for the examples), so the machine's core count does not reorder any sum. Another
CPU or math-library code path can still move the last bits (``MKL_CBWR=AVX2`` or
``ATEN_CPU_CAPABILITY=default`` does, here): a difference in float values only is reported as such, and
on such a machine the golden files are to be made again there from the baseline worktree.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import getpass
import json
import math
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "streams"
PACKAGES = (
    "runledger",
    *(f"runledger.{folder}" for folder in ("trainer", "ingest", "schemas", "ledger", "cli")),
)
MASK = "<masked>"  # a value that varies between runs; a None stays None, so its presence still counts

# Launcher, cluster and signing variables: left over in a shell or CI, they would change the streams.
CLEARED_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "JAX_PROCESS_ID",
    "JAX_NUM_PROCESSES",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_JOB_ID",
    "SLURM_CLUSTER_NAME",
    "OMPI_COMM_WORLD_RANK",
    "PMI_RANK",
    "TORCHELASTIC_RUN_ID",
    "RUNLEDGER_LAUNCH_ID",
    "RUNLEDGER_KAFKA_BOOTSTRAP",
    "RUNLEDGER_PRODUCER_KEY",
    "RUNLEDGER_CLUSTER",
    "RUNLEDGER_JOB_ID",
    "RUNLEDGER_LEDGER",
)


def code_root() -> Path:
    """The checkout whose code these scenarios run (its examples/ are the ones run as scripts)."""
    import runledger

    return Path(runledger.__file__).resolve().parents[1]


def _check_one_checkout() -> Path:
    """Every package from the same checkout: a mix (an editable install's finder winning for some) would
    make a golden file of no one commit."""
    import importlib

    root = code_root()
    for name in PACKAGES:
        where = Path(importlib.import_module(name).__file__).resolve().parents[1]
        if where != root:
            raise RuntimeError(f"{name} loads from {where}, runledger from {root}: put one checkout first")
    return root


# --- capture ---------------------------------------------------------------------------------------


class WireSink:
    """An in-memory ``EventSink``: each event as the bus would carry it (its wire JSON)."""

    def __init__(self) -> None:
        self.raw: list[bytes] = []

    def emit(self, envelope: Any) -> None:
        from runledger.schemas import encode_event

        self.raw.append(encode_event(envelope))

    def sync(self) -> None:
        pass

    def close(self) -> None:
        pass


def _read_spool(directory: Path) -> list[bytes]:
    from runledger.ingest.spool import SpoolReader

    out = []
    for record in SpoolReader(directory).read():
        assert record.corrupt is None, f"{directory}: {record.corrupt}"
        out.append(bytes(record.payload))
    return out


def _valid(raw: list[bytes]) -> list[bytes]:
    """Every event must also decode (with this checkout's catalogue) as a valid event."""
    from runledger.schemas import Event, decode_event

    for i, one in enumerate(raw):
        event = decode_event(one)
        assert isinstance(event, Event), f"event {i} does not decode: {event}"
    return raw


@contextlib.contextmanager
def _isolated(work: Path) -> Iterator[None]:
    """Run in ``work``: no launcher variables, spool and attempt state under it, one torch thread (the
    floats then do not depend on the machine's core count, and a loaded machine does not slow a step
    down to seconds with two threads fighting for a core)."""
    import torch

    saved_env = dict(os.environ)
    saved_cwd = Path.cwd()
    threads = torch.get_num_threads()
    for key in CLEARED_ENV:
        os.environ.pop(key, None)
    os.environ["RUNLEDGER_SPOOL"] = str(work / "spool")
    os.environ["RUNLEDGER_STATE"] = str(work / "state")
    os.chdir(work)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)


# --- canonical form --------------------------------------------------------------------------------

# Per payload type (the ``runledger.`` suffix): dotted paths into ``data`` whose values vary between
# runs and machines. What a launch says about the machine (host, git checkout; ``software`` keeps its
# names, not their versions) and how long things took are masked for every live producer.
LAUNCH = ("host", "git_commit", "git_dirty", "git_branch")
PROVENANCE: dict[str, tuple[str, ...]] = {
    "run.started": LAUNCH,
    "run.resumed": LAUNCH,
    "run.finished": ("duration_s",),
    "run.crashed": ("host",),
    "rank.stats": ("host",),
}
# The trainer measures more: step times and what follows from them (throughput, MFU), the seconds
# between rank stats and the emitter queue's depth at that moment, a checkpoint's write time and the
# size of its torch pickle.
TRAINER_MEASURED: dict[str, tuple[str, ...]] = {
    **PROVENANCE,
    "step.metrics": ("step_time_s", "tokens_per_second", "mfu"),
    "rank.stats": ("host", "step_time_s", "values.interval_s", "values.queue_depth"),
    "checkpoint.saved": ("bytes", "duration_s"),
}
# Launch software entries present only on some installs or processes (a CUDA build of torch, once
# torch is imported; Transformer Engine).
OPTIONAL_SOFTWARE = frozenset({"cuda", "transformer-engine"})
GENESIS = "0" * 64
HASH_KEYS = ("config_hash", "previous_hash")


class Canon:
    """Turns one scenario's wire events into stable lines.

    ``masks``: per payload type, the ``data`` paths to mask (``TRAINER_MEASURED``, ``PROVENANCE``); with
    ``live`` (a producer on this machine, now) also the envelope's id and time, the host name wherever
    it is a whole string, the software versions, and a traceback down to its last line (line numbers
    move with any edit). The simulator is not live: its every id, time and value follows from its
    seed, so its events are kept whole. ``replace``: strings that vary (the scenario's folder, a run id
    made from the clock), replaced wherever they occur in a string. ``alias_hashes``: config hashes over
    a config that holds such a string become ``<hash:N>`` (N in order of first appearance), which keeps
    which event names which config. A masked value is ``<masked>``; a None stays None, so that a field
    that starts or stops being set still counts."""

    def __init__(
        self,
        masks: dict[str, tuple[str, ...]] | None = None,
        *,
        live: bool = True,
        replace: dict[str, str] | None = None,
        alias_hashes: bool = False,
    ) -> None:
        self.masks = dict(masks or {})
        self.live = live
        self.replace = dict(replace or {})
        self.alias_hashes = alias_hashes
        self.hashes: dict[str, str] = {}
        self.host = socket.gethostname()
        try:
            self.user: str | None = getpass.getuser()
        except Exception:
            self.user = None

    def lines(self, raw: list[bytes]) -> list[str]:
        return [json.dumps(_ordered(self.event(json.loads(one))), ensure_ascii=False) for one in raw]

    def event(self, event: dict[str, Any]) -> dict[str, Any]:
        event = self._strings(event)
        kind = str(event.get("type", "")).removeprefix("runledger.")
        data = event.get("data")
        if isinstance(data, dict):
            for path in self.masks.get(kind, ()):
                _mask(data, path.split("."))
        if self.live:
            event["id"] = MASK
            event["time"] = MASK
            if isinstance(data, dict):
                if isinstance(data.get("software"), dict):
                    data["software"] = {k: MASK for k in data["software"] if k not in OPTIONAL_SOFTWARE}
                if isinstance(data.get("traceback"), str):
                    data["traceback"] = _last_line(data["traceback"])
                if kind == "annotation" and self.user and data.get("author") == self.user:
                    data["author"] = "<user>"
        # A producer key made for the run: its hash, the signatures and the chain differ every time.
        if event.get("key_id") is not None:
            event["key_id"] = re.sub(r"\+[0-9a-f]{8}$", "+<key hash>", event["key_id"])
        if event.get("signature") is not None:
            event["signature"] = MASK
        if event.get("prev") not in (None, GENESIS) and (self.live or event.get("signature") is not None):
            event["prev"] = MASK
        if self.alias_hashes and isinstance(data, dict):
            for key in HASH_KEYS:
                value = data.get(key)
                if isinstance(value, str):
                    data[key] = self.hashes.setdefault(value, f"<hash:{len(self.hashes) + 1}>")
        return event

    def _strings(self, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: self._strings(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self._strings(v) for v in value]
        if isinstance(value, str):
            if self.live and value == self.host:
                return "<host>"
            for old, new in self.replace.items():
                value = value.replace(old, new)
        return value


# The envelope's attributes in reading order (any other, e.g. a new one, follows them); the payload last.
ENVELOPE_ORDER = ("type", "stream", "run_id", "attempt", "step", "source", "seq", "schema_version", "subject")


def _ordered(event: dict[str, Any]) -> dict[str, Any]:
    first = [k for k in ENVELOPE_ORDER if k in event]
    rest = sorted(k for k in event if k not in ENVELOPE_ORDER and k != "data")
    out = {k: event[k] for k in [*first, *rest]}
    if "data" in event:
        out["data"] = _sorted(event["data"])
    return out


def _sorted(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _sorted(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_sorted(v) for v in value]
    return value


def _mask(tree: dict[str, Any], path: list[str]) -> None:
    head, *rest = path
    if head not in tree:
        return
    if rest:
        if isinstance(tree[head], dict):
            _mask(tree[head], rest)
    elif tree[head] is not None:
        tree[head] = MASK


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return "<traceback> ... " + (lines[-1] if lines else "")


# --- scenarios: the trainer ------------------------------------------------------------------------

# runledger.trainer.config.TINY_CPU with the trainer tests' warm-up, written out: the smallest MoE that still
# routes like the real one. Checkpoints go to a relative folder, so the config (and its hash) does not
# name the scenario's temp folder.
TINY = (
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.seq_length=64",
    "moe.num_experts=8",
    "moe.top_k=2",
    "moe.ffn_hidden_size=128",
    "data.micro_batch_size=8",
    "run.device='cpu'",
    "checkpoint.dir='ckpt/{run_id}'",
    "checkpoint.interval=0",
    "checkpoint.final=false",
    "schedule.warmup_steps=5",
    "telemetry.peak_tflops=0.16",
    "telemetry.rank_stats_interval=3",
)


def _tiny(run_id: str, *extra: str) -> Any:
    from runledger.trainer.config import load_config

    return load_config(None, [*TINY, f"run.run_id={run_id}", *extra])


def _tiny_file(name: str, run_id: str, *extra: str) -> Path:
    from runledger.trainer.config import write_config

    path = Path(name)  # relative: the change's cause names the file as given
    write_config(path, _tiny(run_id, *extra))
    return path


def trainer_fresh(work: Path) -> tuple[list[bytes], Canon]:
    """A fresh run that completes: launch, per-step metrics and router stats, rank stats, interval and
    final checkpoints, the finish."""
    from runledger.trainer.loop import train

    sink = WireSink()
    cfg = _tiny("fresh", "run.steps=7", "checkpoint.interval=3", "checkpoint.final=true")
    result = train(cfg, sink)
    assert (result.status, result.final_step) == ("completed", 7), result
    return sink.raw, Canon(TRAINER_MEASURED)


def trainer_live_config(work: Path) -> tuple[list[bytes], Canon]:
    """Live edits of the watched file: an accepted change (no author), a refused one (a pinned key,
    refused once), a later accepted one with an author; the run goes on at log interval 2."""
    from runledger.trainer.loop import chain, schedule_config_change, train

    sink = WireSink()
    path = _tiny_file("train.toml", "live", "run.steps=8", "schedule.decay='constant'")
    progress = chain(
        schedule_config_change(path, 3, {"optimizer.lr": 1e-3, "moe.capacity_factor": 1.0}),
        schedule_config_change(path, 5, {"model.num_layers": 3}),
        schedule_config_change(path, 6, {"telemetry.log_interval": 2}, author="alice"),
    )
    result = train(path, sink, progress=progress)
    assert (result.status, result.final_step) == ("completed", 8), result
    return sink.raw, Canon(TRAINER_MEASURED)


def trainer_crash_resume(work: Path) -> tuple[list[bytes], Canon]:
    """The demo's story: a live capacity-factor change, an injected crash, a refused fresh relaunch
    (no events), the resume from the last checkpoint as attempt 2, which completes."""
    from runledger.trainer.config import edit_config_file
    from runledger.trainer.loop import RunExistsError, train

    sink = WireSink()
    path = _tiny_file(
        "config.toml",
        "story",
        "run.steps=10",
        "moe.capacity_factor=1.0",
        "checkpoint.interval=3",
        "checkpoint.final=true",
        "debug.crash_at_step=8",
    )
    edited = False

    def on_step(report: Any) -> None:
        nonlocal edited
        if report.step >= 3 and not edited:
            edit_config_file(path, {"moe.capacity_factor": 1.25})
            edited = True

    first = train(path, sink, progress=on_step)
    assert (first.status, first.final_step) == ("crashed", 7), first
    with pytest.raises(RunExistsError):
        train(path, WireSink())
    second = train(path, sink, resume_from="latest", progress=on_step)
    assert (second.status, second.attempt, second.start_step, second.final_step) == ("completed", 2, 6, 10)
    return sink.raw, Canon(TRAINER_MEASURED)


def trainer_failures(work: Path) -> tuple[list[bytes], Canon]:
    """How else an attempt ends: a NaN loss stopping the run, a NaN step skipped, an OOM, an early stop
    (``stop_at_step``) and its resume, a SIGTERM at a step boundary (its checkpoint, its crash record)
    and the resume after it. One stream per run, one after the other."""
    import signal
    import threading

    from runledger.trainer.loop import train

    sink = WireSink()
    runs = [
        ("nan-stop", ("debug.crash_at_step=3", "debug.crash_kind='nan'"), "crashed"),
        (
            "nan-skip",
            ("debug.crash_at_step=3", "debug.crash_kind='nan'", "run.nonfinite_policy='skip'"),
            "completed",
        ),
        ("oom", ("debug.crash_at_step=2", "debug.crash_kind='oom'"), "crashed"),
    ]
    for run_id, extra, status in runs:
        result = train(_tiny(run_id, "run.steps=4", *extra), sink)
        assert result.status == status, (run_id, result)

    stopped = _tiny("stopped", "run.steps=6", "checkpoint.interval=2")
    assert train(stopped, sink, stop_at_step=3).status == "stopped"
    assert train(stopped, sink, resume_from="latest").status == "completed"

    assert threading.current_thread() is threading.main_thread()  # train installs its handler here
    sigterm = _tiny("sigterm", "run.steps=8", "checkpoint.interval=3")

    def stop_at_5(report: Any) -> None:
        if report.step == 5:
            signal.raise_signal(signal.SIGTERM)

    result = train(sigterm, sink, progress=stop_at_5)
    assert (result.status, result.exit_code, result.final_step) == ("signal", 143, 5), result
    result = train(sigterm, sink, resume_from="latest", stop_at_step=6)
    assert (result.status, result.start_step) == ("stopped", 5), result
    return sink.raw, Canon(TRAINER_MEASURED)


def demo_cli(work: Path) -> tuple[list[bytes], Canon]:
    """``ledger demo`` as a user runs it, shortened: its spool (signed, chained events) after the run."""
    from typer.testing import CliRunner

    from runledger.cli.main import app

    folder = work / "demo"
    args = ["demo", "--workdir", str(folder), "--steps", "12", "--crash-at", "8", "--change-at", "4"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    raw = _read_spool(folder / "spool")
    run_id = json.loads(raw[0])["run_id"]
    assert re.fullmatch(r"demo-\d{8}-\d{6}", run_id), run_id
    return raw, Canon(
        TRAINER_MEASURED, replace={str(folder): "<workdir>", run_id: "<run_id>"}, alias_hashes=True
    )


# --- scenarios: the client library -----------------------------------------------------------------


def _example(work: Path, name: str, *args: str) -> list[bytes]:
    root = code_root()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    env["PYTHONHASHSEED"] = "0"
    out = subprocess.run(
        [sys.executable, str(root / "examples" / name), *args],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return _read_spool(work / "spool")


def client_numpy_example(work: Path) -> tuple[list[bytes], Canon]:
    """examples/numpy_loop.py: NumPy scalars logged, a config update with its cause, an annotation."""
    return _example(work, "numpy_loop.py", "--steps", "30", "--run-id", "np-golden"), Canon(PROVENANCE)


def client_torch_example(work: Path) -> tuple[list[bytes], Canon]:
    """examples/torch_loop.py: tensors logged, router stats, rank stats, checkpoints, a live change."""
    (work / "ck").mkdir()
    raw = _example(
        work, "torch_loop.py", "--steps", "12", "--run-id", "torch-golden", "--checkpoint-dir", "ck"
    )
    return raw, Canon({**PROVENANCE, "rank.stats": ("host", "values.step_wall_ms")})


def client_direct(work: Path) -> tuple[list[bytes], Canon]:
    """``runledger.init`` itself: every kind of record; the resume as attempt 2 (``resume_from_step``),
    and an exception inside ``with run:`` recorded as the crash; a third attempt stopped on a NaN."""
    import numpy as np

    import runledger
    from runledger.schemas.payloads import ChangeCause

    sink = WireSink()
    state = work / "state"
    config = {"lr": 3e-4, "model": {"layers": 2, "experts": 4}, "tags": ["a", "b"], "note": None}
    rng = np.random.default_rng(11)

    def loss(step: int) -> float:
        return 3.0 * math.exp(-step / 17) + 0.25 * math.sin(step / 3) + 1.0

    common = {"sink": sink, "state_dir": state, "handle_signals": False}
    with runledger.init(
        "client-golden",
        config=config,
        repository="org/repo",
        name="direct",
        external={"tracker_url": "https://tracker.example/run/1"},
        parallelism={"dp": 1},
        **common,
    ) as run:
        for step in range(1, 7):
            values = {
                "loss": np.float32(loss(step)),
                "lr": run.config.as_dict()["lr"],
                "tokens": 4096,
                "total_tokens": 4096 * step,
                "eval": {"ppl": math.exp(loss(step) / 2)},
                "is_best": step % 2 == 0,
                "note": "not a number",
            }
            if step == 3:
                run.config.update({"lr": 1.5e-4, "model": {"experts": 8}}, cause="halve lr", step=3)
            run.log(values, step=step)
            counts = rng.integers(0, 50, size=(2, 4))
            run.log_router(step, counts=counts, tokens=[100, 100], aux_loss=[0.01 * step, np.nan], top_k=2)
            run.log_rank({"memory_gb": 1.5 + step / 8}, step=step, step_time_s=0.125)
            if step == 4:
                run.checkpoint(4, "ck/step4", bytes=1234, duration_s=0.5)
                assert not run.check_finite(float("nan"), step=4, policy="skip")
        run.config_changed(
            [{"op": "add", "path": "/tags/-", "value": "c"}, {"op": "remove", "path": "/note"}],
            cause=ChangeCause(kind="command", detail="ledger config set", actor="bob"),
        )
        run.annotate("looked fine", step=6, author="lena", tags=["review"])
        run.annotate("said by whoever runs this")
        run.log({"loss": 0.5})  # no step: the next one

    with (
        pytest.raises(RuntimeError, match="boom at step 6"),
        runledger.init(
            "client-golden", config=config, resume_from_step=4, checkpoint_path="ck/step4", **common
        ) as run,
    ):
        assert run.attempt == 2
        for step in range(5, 7):
            run.log({"loss": loss(step), "lr": 1.5e-4}, step=step)
        raise RuntimeError("boom at step 6")

    with (
        pytest.raises(runledger.NonFiniteError),
        runledger.init("client-golden", resume_from_step=5, **common) as run,
    ):
        run.log({"loss": loss(6)}, step=6)
        run.check_finite(float("inf"), step=7)
    return sink.raw, Canon(PROVENANCE)


# --- scenarios: the simulator ----------------------------------------------------------------------


def simulator_cli(work: Path) -> tuple[list[bytes], Canon]:
    """``ledger simulate reference-535b``, the smallest story: 200 steps with two crashes and their
    resumes, config changes, checkpoints and the repository's GitHub events."""
    from typer.testing import CliRunner

    from runledger.cli.main import app

    args = [
        "simulate",
        "reference-535b",
        "--spool",
        str(work / "sim-spool"),
        "--steps",
        "200",
        "--crashes",
        "2",
        "--metrics-every",
        "50",
        "--expert-counts-every",
        "100",
        "--rank-stats-every",
        "150",
        "--seed",
        "3",
        "--run-id",
        "sim-golden",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return _read_spool(work / "sim-spool"), Canon(live=False)


Scenario = Callable[[Path], tuple[list[bytes], Canon]]
SCENARIOS: dict[str, Scenario] = {
    "trainer_fresh": trainer_fresh,
    "trainer_live_config": trainer_live_config,
    "trainer_crash_resume": trainer_crash_resume,
    "trainer_failures": trainer_failures,
    "demo_cli": demo_cli,
    "client_numpy_example": client_numpy_example,
    "client_torch_example": client_torch_example,
    "client_direct": client_direct,
    "simulator_cli": simulator_cli,
}
SLOW: frozenset[str] = frozenset()  # the scenarios over 10 s on an idle 2-core machine


def run_scenario(name: str, work: Path) -> list[str]:
    """The canonical lines of scenario ``name``, run in the (empty) folder ``work``."""
    work.mkdir(parents=True, exist_ok=True)
    with _isolated(work), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Megatron-Core's about the absent TE/Apex, on every build
        raw, canon = SCENARIOS[name](work)
    canon.replace.setdefault(str(work), "<work>")
    canon.replace.setdefault(str(work.resolve()), "<work>")
    return canon.lines(_valid(raw))


# --- comparison ------------------------------------------------------------------------------------


def golden_path(name: str, directory: Path | None = None) -> Path:
    return (directory or GOLDEN_DIR) / f"{name}.jsonl"


def difference(
    name: str, expected: list[str], got: list[str], *, golden: Path | None = None, limit: int = 12
) -> str | None:
    """None if equal (floats within ``FLOAT_REL_TOL``); otherwise a readable account: the events added,
    removed or changed (each changed event field by field), then a unified diff of the lines."""
    if expected == got or _close_lines(expected, got):
        return None
    where = golden or golden_path(name)
    out = [f"{name}: the event stream differs from {where} ({len(expected)} → {len(got)} events)"]
    shown = 0
    opcodes = difflib.SequenceMatcher(None, expected, got, autojunk=False).get_opcodes()
    if all(
        _replaced_floats(expected[i1:i2], got[j1:j2]) for tag, i1, i2, j1, j2 in opcodes if tag != "equal"
    ):
        out.append(FLOATS_ONLY)
    for tag, i1, i2, j1, j2 in opcodes:
        if tag == "equal":
            continue
        old, new = expected[i1:i2], got[j1:j2]
        for k in range(max(len(old), len(new))):
            if shown >= limit:
                out.append("  … more differences not shown")
                return "\n".join([*out, *_unified(expected, got)])
            shown += 1
            if k < len(old) and k < len(new):
                a, b = json.loads(old[k]), json.loads(new[k])
                now = "" if _label(a) == _label(b) else f" → now #{j1 + k} {_label(b)}"
                out.append(f"  golden #{i1 + k} {_label(a)}{now}, changed:")
                out.extend(f"    {line}" for line in _field_diff(a, b))
            elif k < len(old):
                out.append(f"  golden #{i1 + k} {_label(json.loads(old[k]))}: removed")
            else:
                out.append(f"  now #{j1 + k} {_label(json.loads(new[k]))}: added")
    return "\n".join([*out, *_unified(expected, got)])


FLOATS_ONLY = (
    "  (only float values differ: no type, order, step, source, key or other value. The CPU model's floats"
    " are bit-identical run to run on one machine, not across CPUs or math-library code paths (MKL, ATen"
    " dispatch): on another machine than the golden files', regenerate them there from the baseline"
    " worktree, see this module's docstring)"
)


# The CPU model's floats move in their last bits with the CPU's vector code paths (another machine's
# MKL/ATen/NumPy dispatch) and nothing else does: a refactor that changes what is recorded changes a
# key, a type, an order or a value far beyond this.
FLOAT_REL_TOL = 1e-4
FLOAT_ABS_TOL = 1e-9


def _close_lines(expected: list[str], got: list[str]) -> bool:
    return len(expected) == len(got) and all(
        a == b or _close(json.loads(a), json.loads(b)) for a, b in zip(expected, got, strict=True)
    )


def _close(a: Any, b: Any) -> bool:
    """``a`` and ``b`` are the same but for floats within the tolerance."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=FLOAT_REL_TOL, abs_tol=FLOAT_ABS_TOL)
    return a == b and type(a) is type(b)


def _replaced_floats(old: list[str], new: list[str]) -> bool:
    """The lines ``new`` replace ``old`` one for one, differing in float values only."""
    if len(old) != len(new):
        return False
    return all(_floats_only(json.loads(a), json.loads(b)) for a, b in zip(old, new, strict=True))


def _floats_only(a: Any, b: Any) -> bool:
    """``a`` and ``b`` differ in float values only (same shape, keys, types and other values)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_floats_only(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_floats_only(x, y) for x, y in zip(a, b, strict=True))
    return (a == b and type(a) is type(b)) or (isinstance(a, float) and isinstance(b, float))


def _label(event: dict[str, Any]) -> str:
    return f"{event.get('type')} seq {event.get('seq')} step {event.get('step')} a{event.get('attempt')}"


def _field_diff(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        lines = []
        for key in [*a, *(k for k in b if k not in a)]:
            where = f"{path}.{key}" if path else key
            if key not in b:
                lines.append(f"{where}: removed (was {_short(a[key])})")
            elif key not in a:
                lines.append(f"{where}: added ({_short(b[key])})")
            else:
                lines.extend(_field_diff(a[key], b[key], where))
        return lines
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [
            line
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for line in _field_diff(x, y, f"{path}[{i}]")
        ]
    if a == b and type(a) is type(b):
        return []
    return [f"{path}: {_short(a)} → {_short(b)}"]


def _short(value: Any, width: int = 160) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= width else text[: width - 1] + "…"


def _unified(expected: list[str], got: list[str], width: int = 400, lines: int = 60) -> list[str]:
    diff = list(difflib.unified_diff(expected, got, "golden", "now", n=1, lineterm=""))
    clipped = [line if len(line) <= width else line[: width - 1] + "…" for line in diff[:lines]]
    return ["  unified diff of the canonical lines:", *(f"  {line}" for line in clipped)]


# --- the test --------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW else []) for n in SCENARIOS]
)
def test_event_stream_matches_the_golden_file(name: str, tmp_path: Path) -> None:
    golden = golden_path(name)
    assert golden.is_file(), f"no golden file {golden}: see this module's docstring"
    expected = golden.read_text().splitlines()
    root = _check_one_checkout()
    print(f"code under test: {root}")  # shown with -rP: which checkout these streams came from
    got = run_scenario(name, tmp_path)
    problem = difference(name, expected, got, golden=golden)
    if problem is not None:
        pytest.fail(f"code under test: {root}\n{problem}", pytrace=False)


def test_a_changed_event_is_reported_field_by_field() -> None:
    """The comparison itself: a payload value, an added key, a reordered event all count."""
    a = json.dumps(
        {"type": "runledger.step.metrics", "seq": 1, "step": 1, "attempt": 1, "data": {"loss": 1.0}}
    )
    b = json.dumps({"type": "runledger.run.finished", "seq": 2, "step": 1, "attempt": 1, "data": {}})
    assert difference("x", [a, b], [a, b]) is None
    changed = a.replace("1.0", "1.5").replace('"loss"', '"extra": 0, "loss"')
    report = difference("x", [a, b], [changed, b])
    assert report is not None and "data.loss: 1.0 → 1.5" in report and "data.extra: added (0)" in report
    assert difference("x", [a, b], [b, a]) is not None
    assert "removed" in (difference("x", [a, b], [a]) or "")
    assert "only float values differ" in (difference("x", [a, b], [a.replace("1.0", "1.5"), b]) or "")
    assert "only float values differ" not in report
    # The last bits of a float (another CPU's code path) are no difference; an int's are.
    assert difference("x", [a, b], [a.replace("1.0", "1.0000000001"), b]) is None
    assert difference("x", [a, b], [a.replace('"seq": 1', '"seq": 2'), b]) is not None


# --- the generator ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--regenerate", action="store_true", help="write the golden files")
    action.add_argument("--check", action="store_true", help="compare with the golden files")
    parser.add_argument("--out", type=Path, default=GOLDEN_DIR, help="golden folder (default: %(default)s)")
    parser.add_argument("--only", nargs="+", choices=sorted(SCENARIOS), help="these scenarios only")
    args = parser.parse_args(argv)
    root = _check_one_checkout()
    print(f"code under test: {root}", file=sys.stderr)
    failed = 0
    for name in args.only or list(SCENARIOS):
        with tempfile.TemporaryDirectory(prefix=f"streams-{name}-") as tmp:
            started = time.perf_counter()
            lines = run_scenario(name, Path(tmp))
            seconds = time.perf_counter() - started
        path = golden_path(name, args.out)
        if args.regenerate:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(f"{line}\n" for line in lines))
            print(f"{name}: {len(lines)} events → {path} ({seconds:.1f} s)", file=sys.stderr)
        else:
            problem = difference(name, path.read_text().splitlines(), lines, golden=path)
            failed += problem is not None
            print(problem or f"{name}: same {len(lines)} events ({seconds:.1f} s)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
