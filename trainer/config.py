"""The trainer's one typed config: model, MoE, optimizer, schedule, data, checkpoints, telemetry,
parallelism, run identity and debug hooks.

Loaded from TOML (``tomllib``) with ``section.key=value`` overrides on top. Its resolved form is the
plain dict of every key (defaults included, ``None`` where unset) and its hash is
``schemas.config_hash(resolved)``: both go into the run-started event.

TOML has no null: a key that may be ``None`` (``moe.capacity_factor``) is ``None`` when left out of
the file; an override may say ``none``. Which keys may change while the run is live is data here
(``LIVE_KEYS``); every other change is refused.
"""

from __future__ import annotations

import datetime as _dt
import os
import re
import tomllib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import jsonpatch
import msgspec

from runledger.schemas import config_hash as _config_hash
from runledger.schemas.durable import write_durably

CONFIG_DIR = Path(__file__).parent / "configs"
DEMO_CONFIG = CONFIG_DIR / "demo.toml"  # the tiny CPU run the demo trains

# Overrides for the smallest model that still routes like the real one (hidden 64, 2 layers,
# 8 experts, top-2, seq 64, batch 8; about 20 ms a step on 2 CPU cores), without checkpoints:
# what the trainer's tests and benchmarks train.
TINY_CPU: tuple[str, ...] = (
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.seq_length=64",
    "moe.num_experts=8",
    "moe.top_k=2",
    "moe.ffn_hidden_size=128",
    "data.micro_batch_size=8",
    "run.device='cpu'",
    "checkpoint.interval=0",
    "checkpoint.final=false",
)


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of every section: a typo in a key is an error, not a silently ignored setting."""


class ModelConfig(_Section):
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    seq_length: int = 64
    vocab_size: int = 256  # byte-level tokenizer
    position_embedding: Literal["rope", "learned_absolute"] = "rope"
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    activation: Literal["gelu", "swiglu"] = "gelu"
    init_std: float = 0.02
    precision: Literal["fp32", "bf16"] = "fp32"  # bf16: Megatron's Float16Module + fp32 master weights
    spec: Literal["local", "transformer_engine"] = "local"  # TE needs CUDA and Transformer Engine


class MoeConfig(_Section):
    num_experts: int = 8
    top_k: int = 2
    ffn_hidden_size: int = 128
    capacity_factor: float | None = None  # None: no token dropping
    drop_policy: Literal["probs", "position"] = "probs"
    pad_to_capacity: bool = False
    aux_loss_coeff: float = 1e-2
    z_loss_coeff: float = 1e-3
    dispatcher: Literal["allgather", "alltoall"] = "allgather"  # alltoall needs CUDA streams
    # Megatron's grouped-GEMM experts (TEGroupedMLP with model.spec = "transformer_engine", else
    # GroupedMLP, which needs the grouped_gemm package) instead of SequentialMLP. CUDA only; an
    # install that cannot build them is refused at launch (cpu_compat.check_supported).
    grouped_gemm: bool = False
    score_function: Literal["softmax", "sigmoid"] = "softmax"


class OptimizerConfig(_Section):
    lr: float = 3e-3  # peak learning rate
    min_lr: float = 3e-4
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping


class ScheduleConfig(_Section):
    warmup_steps: int = 20
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    decay_steps: int | None = None  # None: decay over run.steps


class DataConfig(_Section):
    source: Literal["corpus", "synthetic"] = "corpus"
    corpus: str = "opticks"  # a shipped corpus name or a path to a text file
    micro_batch_size: int = 8  # sequences per micro-batch per data-parallel rank
    micro_batches: int = 1  # gradient accumulation


class CheckpointConfig(_Section):
    dir: str = "checkpoints/{run_id}"
    interval: int = 50  # steps; 0 disables interval checkpoints
    keep: int = 3  # newest checkpoints kept; 0 keeps all
    on_signal: bool = True  # save on SIGTERM/SIGINT before exiting
    final: bool = True  # save when the run completes


class TelemetryConfig(_Section):
    enabled: bool = True  # router stats + per-step metric events
    log_interval: int = 1  # steps between step-metrics / router-stats events
    rank_stats_interval: int = 10  # steps between each rank's rank-stats event
    peak_tflops: float = 989.0  # per device; H100/H200 SXM dense BF16. Set the CPU's for CPU runs.
    queue_size: int = 4096  # emitter queue; metric events are dropped (and counted) when it is full
    critical_timeout_s: float = 30.0  # how long a lifecycle event may wait for queue space
    config_poll_steps: int = 1  # step boundaries between looks at the config file


class ParallelConfig(_Section):
    tp: int = 1
    ep: int = 1
    dp: int | None = None  # None: world_size / tp
    backend: Literal["auto", "gloo", "nccl"] = "auto"


class RunConfig(_Section):
    run_id: str = ""  # empty: "<name>-<UTC time>"
    name: str = "moe"
    seed: int = 1234
    steps: int = 200
    nonfinite_policy: Literal["stop", "skip"] = "stop"
    repository: str | None = None  # "owner/name", joins the run to its GitHub stream
    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads: int = 0  # torch intra-op threads on CPU; 0 leaves torch's default


class DebugConfig(_Section):
    crash_at_step: int | None = None  # inject one failure at the start of this step
    crash_kind: Literal["exception", "nan", "oom", "sigkill"] = "exception"
    crash_on_attempt: int = 1  # only this attempt crashes, so a resume gets past it
    step_sleep_s: float = 0.0  # slow each step down (tests that kill a run mid-flight)


class TrainConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    moe: MoeConfig = msgspec.field(default_factory=MoeConfig)
    optimizer: OptimizerConfig = msgspec.field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = msgspec.field(default_factory=ScheduleConfig)
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = msgspec.field(default_factory=CheckpointConfig)
    telemetry: TelemetryConfig = msgspec.field(default_factory=TelemetryConfig)
    parallel: ParallelConfig = msgspec.field(default_factory=ParallelConfig)
    run: RunConfig = msgspec.field(default_factory=RunConfig)
    debug: DebugConfig = msgspec.field(default_factory=DebugConfig)


# JSON Pointers of the keys a live run accepts. Everything else changes the model, the data order or
# the run's identity, and a running process cannot honour it without a restart.
LIVE_KEYS: frozenset[str] = frozenset(
    {
        "/optimizer/lr",
        "/optimizer/min_lr",
        "/optimizer/weight_decay",
        "/optimizer/grad_clip",
        "/moe/capacity_factor",
        "/moe/drop_policy",
        "/moe/aux_loss_coeff",
        "/moe/z_loss_coeff",
        "/schedule/warmup_steps",
        "/telemetry/enabled",
        "/telemetry/log_interval",
        "/telemetry/rank_stats_interval",
        "/telemetry/peak_tflops",
        "/telemetry/config_poll_steps",
        "/checkpoint/interval",
        "/checkpoint/keep",
        "/run/nonfinite_policy",
        "/debug/crash_at_step",
        "/debug/crash_kind",
        "/debug/crash_on_attempt",
        "/debug/step_sleep_s",
    }
)


# Keys (JSON Pointer prefixes) a checkpoint pins: a resume with a different value cannot load it or
# would not continue the same run. Everything else may differ on resume (recorded in run-resumed).
CHECKPOINT_PINNED: tuple[str, ...] = (
    "/model/",
    "/moe/num_experts",
    "/moe/top_k",
    "/moe/ffn_hidden_size",
    "/moe/score_function",
    "/moe/grouped_gemm",  # GroupedMLP/TEGroupedMLP hold the expert weights under other names
    "/parallel/tp",
    "/parallel/ep",
    "/parallel/dp",
    "/run/run_id",
    "/run/seed",
    "/data/",
)


def pinned_changes(ops: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The operations of a patch that touch keys a checkpoint pins."""
    return [op for op in ops if any(str(op.get("path", "")).startswith(p) for p in CHECKPOINT_PINNED)]


class ConfigError(ValueError):
    """A config that cannot be loaded or is inconsistent."""


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"moe.capacity_factor=1.25"`` → (["moe", "capacity_factor"], 1.25). Values are TOML values;
    bare words are strings and ``none``/``null`` is None."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r} is not KEY=VALUE")
    raw = raw.strip()
    value: Any
    if raw.lower() in ("none", "null"):
        value = None
    else:
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
    return [part.strip() for part in key.split(".")], value


def _set_path(tree: dict[str, Any], path: Sequence[str], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override path {'.'.join(path)} crosses a non-table")
    node[path[-1]] = value


def from_dict(tree: dict[str, Any]) -> TrainConfig:
    try:
        return msgspec.convert(tree, TrainConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid config: {exc}") from None


# The watched file's ``[change]`` table says who made its latest edit (``author``, ``at``): it is
# about the edit, not the run, so it is never part of the config (nor of its hash).
CHANGE_TABLE = "change"


def _read_tree(path: str | Path) -> dict[str, Any]:
    try:
        return tomllib.loads(Path(path).read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def load_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> TrainConfig:
    """Read the TOML file (if any), apply ``section.key=value`` overrides, validate."""
    tree = _read_tree(path) if path is not None else {}
    tree.pop(CHANGE_TABLE, None)
    return _config_from_tree(tree, overrides)


def _config_from_tree(tree: dict[str, Any], overrides: Iterable[str]) -> TrainConfig:
    for override in overrides:
        keys, value = parse_override(override)
        _set_path(tree, keys, value)
    return validate(from_dict(tree))


def validate(cfg: TrainConfig) -> TrainConfig:
    m, moe = cfg.model, cfg.moe
    problems = []
    if m.hidden_size % m.num_attention_heads:
        problems.append("model.hidden_size must be a multiple of model.num_attention_heads")
    if not 1 <= moe.top_k <= moe.num_experts:
        problems.append("moe.top_k must be within 1..moe.num_experts")
    if moe.capacity_factor is not None and moe.capacity_factor <= 0:
        problems.append("moe.capacity_factor must be > 0 (leave it out for no dropping)")
    if moe.num_experts % cfg.parallel.ep:
        problems.append("moe.num_experts must be a multiple of parallel.ep")
    if cfg.run.steps < 1 or cfg.data.micro_batches < 1 or cfg.data.micro_batch_size < 1:
        problems.append("run.steps, data.micro_batches and data.micro_batch_size must be >= 1")
    if m.vocab_size < 256 and cfg.data.source == "corpus":
        problems.append("model.vocab_size must be >= 256 for the byte-level corpus")
    if cfg.telemetry.log_interval < 1 or cfg.telemetry.rank_stats_interval < 1:
        problems.append("telemetry intervals must be >= 1")
    if problems:
        raise ConfigError("; ".join(problems))
    return cfg


def finalize(cfg: TrainConfig, run_id: str | None = None) -> TrainConfig:
    """Fill what the file may leave open: the run id (given, or generated) and the checkpoint dir."""
    rid = cfg.run.run_id or run_id or f"{cfg.run.name}-{_dt.datetime.now(_dt.UTC):%Y%m%d-%H%M%S}"
    run = msgspec.structs.replace(cfg.run, run_id=rid)
    ckpt = msgspec.structs.replace(cfg.checkpoint, dir=cfg.checkpoint.dir.replace("{run_id}", rid))
    return msgspec.structs.replace(cfg, run=run, checkpoint=ckpt)


def resolved(cfg: TrainConfig) -> dict[str, Any]:
    """Every key with its value, as plain JSON values: what the run-started event records."""
    out: dict[str, Any] = msgspec.to_builtins(cfg)
    return out


def config_hash(cfg: TrainConfig) -> str:
    return _config_hash(resolved(cfg))


def diff(old: TrainConfig, new: TrainConfig) -> list[dict[str, Any]]:
    """The RFC 6902 patch that turns ``old`` into ``new`` (resolved forms)."""
    ops: list[dict[str, Any]] = jsonpatch.make_patch(resolved(old), resolved(new)).patch
    return ops


def split_patch(ops: Iterable[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(allowed, refused) by ``LIVE_KEYS``."""
    allowed: list[dict[str, Any]] = []
    refused: list[dict[str, Any]] = []
    for op in ops:
        (allowed if op.get("path") in LIVE_KEYS and op.get("op") in ("replace", "add") else refused).append(
            op
        )
    return allowed, refused


def apply_patch(cfg: TrainConfig, ops: Sequence[dict[str, Any]]) -> TrainConfig:
    if not ops:
        return cfg
    return validate(from_dict(jsonpatch.apply_patch(resolved(cfg), list(ops))))


class ConfigSource:
    """A config file plus overrides, reloadable: the watched source of a live run.

    The run id is pinned after the first load, so reloading a file that leaves it open yields the
    same run and the same checkpoint dir, and only real edits show up in ``diff``.
    """

    def __init__(self, path: str | Path | None, overrides: Sequence[str] = (), *, run_id: str | None = None):
        self.path = Path(path) if path is not None else None
        self.overrides = list(overrides)
        self.run_id = run_id
        self._mtime: int | None = None
        self._change: dict[str, Any] | None = None  # the file's [change] table at the last load
        self.change_author: str | None = None  # who made the edit just loaded; None: unknown

    def load(self) -> TrainConfig:
        self._mtime = self._stat()
        tree = _read_tree(self.path) if self.path is not None else {}  # read once: config and its author
        change = tree.pop(CHANGE_TABLE, None)
        cfg = finalize(_config_from_tree(tree, self.overrides), self.run_id)
        self.run_id = cfg.run.run_id
        self._note_change(change if isinstance(change, dict) else None)
        return cfg

    def _note_change(self, change: dict[str, Any] | None) -> None:
        """An edit's author is the ``[change]`` table's ``author`` only when that table changed with
        the edit: a table left as it was names the previous edit's author, who did not make this one."""
        author = change.get("author") if change is not None and change != self._change else None
        self.change_author = author if isinstance(author, str) and author.strip() else None
        self._change = change

    def _stat(self) -> int | None:
        if self.path is None:
            return None
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return st.st_mtime_ns ^ st.st_size  # size too: two writes within one mtime tick still differ

    def changed(self) -> bool:
        """True once after the file's mtime (or size) moved since the last load."""
        return self.path is not None and self._stat() != self._mtime


def write_config(path: str | Path, cfg: TrainConfig | dict[str, Any]) -> None:
    """Write a config as TOML, atomically and durably (a watcher never sees half a file)."""
    tree = resolved(cfg) if isinstance(cfg, TrainConfig) else cfg
    write_durably(path, to_toml(tree))


def to_toml(tree: dict[str, Any]) -> str:
    """A tiny TOML writer for config trees (tables of scalars; None values left out)."""
    lines: list[str] = []
    scalars = {k: v for k, v in tree.items() if not isinstance(v, dict) and v is not None}
    for key, value in scalars.items():
        lines.append(f"{key} = {_toml_value(value)}")
    for key, value in tree.items():
        if isinstance(value, dict):
            lines.append(f"\n[{key}]")
            for k, v in value.items():
                if v is not None:
                    lines.append(f"{k} = {_toml_value(v)}")
    return "\n".join(lines).lstrip("\n") + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return msgspec.json.encode(value).decode()  # JSON strings are valid TOML basic strings
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise ConfigError(f"cannot write {value!r} as TOML")


def edit_config_file(path: str | Path, changes: dict[str, Any], *, author: str | None = None) -> None:
    """Rewrite the watched config file with ``{"moe.capacity_factor": 1.5, ...}`` applied: the way a
    person (or the demo) changes a live run. ``None`` removes a key (its default is None).
    ``author``: who makes the change, written to the file's ``[change]`` table with the time, so the
    run records the change as theirs; without it the edit's author is recorded as unknown.

    The edit is made line by line so the file keeps its comments and layout; a file whose shape
    that cannot handle (inline tables, dotted keys) is rewritten whole. Atomic either way."""
    target = Path(path)
    text = target.read_text()
    tree = tomllib.loads(text)
    changes = dict(changes)
    if author is not None:
        changes[f"{CHANGE_TABLE}.author"] = author
        changes[f"{CHANGE_TABLE}.at"] = _dt.datetime.now(_dt.UTC).isoformat(timespec="microseconds")
    elif isinstance(tree.get(CHANGE_TABLE), dict) and "author" in tree[CHANGE_TABLE]:
        changes[f"{CHANGE_TABLE}.author"] = None  # a stale author must not be credited with this edit
    for dotted, value in changes.items():
        keys = dotted.split(".")
        if value is None:
            node = tree
            for part in keys[:-1]:
                node = node.setdefault(part, {})
            node.pop(keys[-1], None)
        else:
            _set_path(tree, keys, value)
    edited = _edit_lines(text, changes)
    try:
        keeps_layout = edited is not None and tomllib.loads(edited) == tree
    except tomllib.TOMLDecodeError:
        keeps_layout = False
    before = target.stat().st_mtime_ns
    if keeps_layout and edited is not None:
        write_durably(target, edited)
    else:
        write_config(target, tree)
    # Bump the mtime even when the same tick: the watcher keys on mtime and size.
    if target.stat().st_mtime_ns == before:
        os.utime(target, ns=(before + 1_000_000, before + 1_000_000))


_TABLE = re.compile(r"^\s*\[([A-Za-z0-9_.-]+)\]\s*(#.*)?$")
_KEY = re.compile(r"^(\s*)([A-Za-z0-9_-]+)(\s*=\s*)([^#]*?)(\s*#.*)?$")


def _edit_lines(text: str, changes: dict[str, Any]) -> str | None:
    """``text`` with each ``section.key`` set (or removed, for None) in place; None if a change
    is not of that two-level shape."""
    lines = text.splitlines()
    for dotted, value in changes.items():
        parts = dotted.split(".")
        if len(parts) != 2:
            return None
        section, key = parts
        table, header, found = None, None, None
        for n, line in enumerate(lines):
            if m := _TABLE.match(line):
                table = m.group(1)
                if table == section:
                    header = n
            elif table == section and (m := _KEY.match(line)) and m.group(2) == key:
                found = n
        if found is not None:
            if value is None:
                del lines[found]
            else:
                m = _KEY.match(lines[found])
                assert m is not None
                lines[found] = f"{m.group(1)}{key}{m.group(3)}{_toml_value(value)}{m.group(5) or ''}"
        elif value is not None:
            if header is None:
                lines += ["", f"[{section}]"]
                header = len(lines) - 1
            lines.insert(header + 1, f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"
