"""Anomaly detectors: deterministic functions of the log, recorded as ``ledger.anomaly`` events (issue 44).

Each detector sees the admitted events of a run's stream in stream order and says what it finds:
a loss spike against a robust window (median and MAD of the last ``window_steps`` losses of the
same run and attempt), a non-finite value, a router layer whose token-drop rate jumps or whose
routing entropy collapses, a straggler rank (its step time far above the median of the ranks seen
at that step) and a throughput drop (``tokens_per_second`` against its window).

Rules are frozen dataclasses: a name, a version and parameters. ``RULE_SETS`` numbers the rule
sets; ``RULE_SET_IN_FORCE`` is the one this code judges with. Changing a parameter or a behaviour
makes a new rule version (and a new set), and every finding records the rule, its version and its
parameters. Set 2 reports a lasting condition (a router's collapse, a straggler rank, a throughput
drop) once per episode: at its first tripped value, and again only after a value judged fine.
``DetectorState`` holds the windows: one bounded deque per (stream, attempt, metric), dropped when
the attempt ends (``run.finished``/``run.crashed``), the open episodes, and which set judged from
which commit on. It is JSON-serializable, so the commit record carries it and a restart or another
host goes on exactly, and ``verify`` judges each commit with the set that judged it.

Non-finite values cannot travel in JSON: the trainer and the client record a NaN loss as
``runledger.step.skipped`` (reason ``nonfinite_<metric>``, value ``"nan"``) or as a
``runledger.run.crashed`` of kind ``nonfinite_loss``; a free-form scalar the client could not send
arrives as ``null`` in ``scalars``. The detector reads all three (and a float that is not finite,
from a producer in the same process). A named field (``loss``) that is null is not a NaN: it may
simply not have been reported at that step.

Recording (``AnomalyRound``, hooked into ``runledger.ledger.store``) and re-deriving
(``derive``, used by ``runledger.ledger.integrity``) go through the same functions.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import math
import statistics
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

import msgspec

from runledger.schemas import catalogue as c
from runledger.schemas import payloads as p
from runledger.schemas.codec import Envelope, Event, decode_event, encode_event, make_event

ANOMALY_INGEST = "ledger:anomalies"  # ingest source (and event source) of anomaly events
NONFINITE_TEXT = frozenset({"nan", "inf", "-inf", "+inf"})
MAD_TO_SIGMA = 1.4826  # the MAD of a normal sample times this is its standard deviation

# The event types a detector reads (verify re-derives from these alone).
WATCHED_TYPES = (
    c.STEP_METRICS,
    c.MOE_ROUTER_STATS,
    c.RANK_STATS,
    c.STEP_SKIPPED,
    c.RUN_CRASHED,
    c.RUN_FINISHED,
)


# ------------------------------------------------------------------------------------------ rules
@dataclass(frozen=True)
class Rule:
    """A detector's name, version and parameters (the dataclass fields after these two)."""

    name: str
    version: int
    # The first version that reports a lasting condition once per episode (None: every version
    # reports each tripped value; a loss spike or a non-finite value is news each time).
    episodic_since: ClassVar[int | None] = None

    def params(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items() if k not in ("name", "version")}

    @property
    def per_episode(self) -> bool:
        return self.episodic_since is not None and self.version >= self.episodic_since


@dataclass(frozen=True)
class LossSpike(Rule):
    name: str = "loss-spike"
    version: int = 1
    window_steps: int = 50
    min_steps: int = 20
    k: float = 6.0  # robust z-score (value - median) / (1.4826 MAD) above which a loss is a spike
    min_scale_fraction: float = 0.01  # the scale's floor, as a fraction of |median| (a flat window)


@dataclass(frozen=True)
class NonFinite(Rule):
    name: str = "non-finite"
    version: int = 1


@dataclass(frozen=True)
class RouterCollapse(Rule):
    name: str = "router-collapse"
    version: int = 2
    episodic_since: ClassVar[int | None] = 2
    window_steps: int = 20
    min_steps: int = 10
    drop_jump: float = 0.1  # token-drop rate above the window's median by this much (absolute)…
    k: float = 3.5  # …and by more than k robust standard deviations (a router still settling is noisy)
    entropy_ratio: float = 0.5  # routing entropy below this fraction of the window's median


@dataclass(frozen=True)
class Straggler(Rule):
    name: str = "straggler"
    version: int = 2
    episodic_since: ClassVar[int | None] = 2
    min_ranks: int = 4  # ranks seen at the step (this one included) before one is judged
    ratio: float = 2.0  # step time above this multiple of the other ranks' median


@dataclass(frozen=True)
class ThroughputDrop(Rule):
    name: str = "throughput-drop"
    version: int = 2
    episodic_since: ClassVar[int | None] = 2
    window_steps: int = 50
    min_steps: int = 20
    ratio: float = 0.5  # tokens per second below this fraction of the window's median


RULES_V1: tuple[Rule, ...] = (
    LossSpike(),
    NonFinite(),
    RouterCollapse(version=1),
    Straggler(version=1),
    ThroughputDrop(version=1),
)
# Set 1's rules, with the lasting conditions reported once per episode (their v2).
RULES_V2: tuple[Rule, ...] = (LossSpike(), NonFinite(), RouterCollapse(), Straggler(), ThroughputDrop())
RULE_SETS: dict[int, tuple[Rule, ...]] = {1: RULES_V1, 2: RULES_V2}
RULE_SET_IN_FORCE = 2
RULES_IN_FORCE = RULE_SETS[RULE_SET_IN_FORCE]


def rule_set_number(rules: tuple[Rule, ...]) -> int:
    """The number of the set ``rules`` is; rules of no set (an operator's own) claim the set in
    force, which ``verify`` then judges them by."""
    return next((n for n, known in RULE_SETS.items() if known == rules), RULE_SET_IN_FORCE)


@dataclass(frozen=True)
class Finding:
    """What one rule found in one event (before it is an event of its own)."""

    rule: Rule
    metric: str
    value: float | None = None
    baseline: float | None = None
    score: float | None = None

    def payload(self, cause_id: str) -> p.LedgerAnomaly:
        return p.LedgerAnomaly(
            rule=self.rule.name,
            rule_version=self.rule.version,
            params=self.rule.params(),
            metric=self.metric,
            value=self.value,
            baseline=self.baseline,
            score=self.score,
            event_id=cause_id,
        )


# ------------------------------------------------------------------------------------------ state
WindowKey = tuple[str, int, str]  # (stream, attempt, metric)


@dataclass
class RankStep:
    """The step times of the ranks seen at one step: by rank, and in order (a median in O(1))."""

    step: int
    times: dict[int, float] = field(default_factory=dict)
    ordered: list[float] = field(default_factory=list)

    def median_without(self, rank: int) -> float | None:
        """The median of every rank's time but ``rank``'s (taken out: a repeat replaces it)."""
        old = self.times.pop(rank, None)
        if old is not None:
            del self.ordered[bisect.bisect_left(self.ordered, old)]
        n = len(self.ordered)
        if n == 0:
            return None
        middle = n // 2
        return self.ordered[middle] if n % 2 else (self.ordered[middle - 1] + self.ordered[middle]) / 2

    def put(self, rank: int, seconds: float) -> None:
        self.times[rank] = seconds
        bisect.insort(self.ordered, seconds)

    @classmethod
    def of(cls, step: int, times: dict[int, float]) -> RankStep:
        return cls(step, dict(times), sorted(times.values()))


@dataclass
class DetectorState:
    """The detectors' memory: bounded windows per (stream, attempt, metric) and, per (stream,
    attempt), the step times of the ranks seen at the latest step."""

    windows: dict[WindowKey, deque[float]] = field(default_factory=dict)
    ranks: dict[tuple[str, int], RankStep] = field(default_factory=dict)
    since: int = 0  # the first commit whose events the detectors judged (a ledger older than them: later)
    commit: int = -1  # as of this commit (-1: an empty ledger)
    # (stream, attempt, metric) of each lasting condition reported and not yet over (a per-episode rule)
    episodes: set[WindowKey] = field(default_factory=set)
    # (first commit, rule set number): which set judged from which commit on (empty: set 1 since ``since``)
    rule_sets: list[tuple[int, int]] = field(default_factory=list)
    # (stream, attempt) -> layer -> its two windows in ``windows`` (drop rate, entropy): a router
    # event names every layer every step, and finding a window by its key was most of the detectors' time.
    layers: dict[tuple[str, int], dict[int, tuple[deque[float], deque[float]]]] = field(
        default_factory=dict, repr=False, compare=False
    )

    def window(self, key: WindowKey, size: int) -> deque[float]:
        found = self.windows.get(key)
        if found is None:
            found = self.windows[key] = deque(maxlen=size)
        return found

    def end_attempt(self, stream: str, attempt: int) -> None:
        """An attempt ended: its windows are never read again."""
        for key in [k for k in self.windows if k[0] == stream and k[1] == attempt]:
            del self.windows[key]
        self.ranks.pop((stream, attempt), None)
        self.layers.pop((stream, attempt), None)
        self.episodes -= {k for k in self.episodes if k[0] == stream and k[1] == attempt}

    def news(self, rule: Rule, key: WindowKey, tripped: bool) -> bool:
        """Whether a judged value is reported: a tripped one, unless ``rule`` reports per episode and
        this condition's episode is open already. A value judged fine closes the episode."""
        if not rule.per_episode:
            return tripped
        if not tripped:
            self.episodes.discard(key)
            return False
        if key in self.episodes:
            return False
        self.episodes.add(key)
        return True

    def rule_set_history(self) -> list[tuple[int, int]]:
        """(first commit, rule set number) of each set that judged, oldest first."""
        return self.rule_sets or [(self.since, 1)]

    def judge_with(self, number: int, commit: int) -> None:
        """The set ``number`` judges from ``commit`` on (nothing changes if it judges already)."""
        history = self.rule_set_history()
        if history[-1][1] == number:
            return
        if history[-1][0] >= commit:  # the set before never judged a commit: replaced
            history = history[:-1]
        self.rule_sets = [*history, (commit, number)]

    def layer_windows(
        self, stream: str, attempt: int, layer: int, size: int
    ) -> tuple[deque[float], deque[float]]:
        """A router layer's drop-rate and entropy windows (kept in ``windows`` under their metric names)."""
        by_layer = self.layers.setdefault((stream, attempt), {})
        found = by_layer.get(layer)
        if found is None:
            drop_metric, entropy_metric = _layer_metrics(layer)
            found = by_layer[layer] = (
                self.window((stream, attempt, drop_metric), size),
                self.window((stream, attempt, entropy_metric), size),
            )
        return found

    def copy(self) -> DetectorState:
        return DetectorState(
            {k: deque(v, maxlen=v.maxlen) for k, v in self.windows.items()},
            {k: RankStep.of(seen.step, seen.times) for k, seen in self.ranks.items()},
            self.since,
            self.commit,
            set(self.episodes),
            list(self.rule_sets),
        )

    def to_json(self) -> dict[str, Any]:
        """What the commit record keeps (in a fixed order, so equal states write equal records)."""
        saved: dict[str, Any] = {
            "since": self.since,
            "windows": [[s, a, m, w.maxlen, list(w)] for (s, a, m), w in sorted(self.windows.items()) if w],
            "ranks": [
                [s, a, seen.step, sorted(seen.times.items())] for (s, a), seen in sorted(self.ranks.items())
            ],
        }
        if self.episodes:
            saved["episodes"] = [list(key) for key in sorted(self.episodes)]
        if self.rule_sets:
            saved["rule_sets"] = [list(entry) for entry in self.rule_sets]
        return saved

    @classmethod
    def from_json(cls, obj: dict[str, Any], commit: int = -1) -> DetectorState:
        state = cls(since=int(obj.get("since", 0)), commit=commit)
        for stream, attempt, metric, size, values in obj.get("windows", []):
            state.windows[(str(stream), int(attempt), str(metric))] = deque(
                map(float, values), maxlen=int(size)
            )
        for stream, attempt, step, times in obj.get("ranks", []):
            state.ranks[(str(stream), int(attempt))] = RankStep.of(
                int(step), {int(r): float(t) for r, t in times}
            )
        state.episodes = {(str(s), int(a), str(m)) for s, a, m in obj.get("episodes", [])}
        state.rule_sets = [(int(first), int(number)) for first, number in obj.get("rule_sets", [])]
        return state


# -------------------------------------------------------------------------------------- detectors
def detect(rules: Iterable[Rule], state: DetectorState, env: Envelope) -> list[Finding]:
    """Every finding of ``rules`` in one admitted event, moving ``state`` on."""
    if env.type not in WATCHED_TYPES or env.run_id is None:
        return []
    found: list[Finding] = []
    for rule in _rules_for(tuple(rules), env.type):
        found.extend(_detect_one(rule, state, env))
    if env.type in (c.RUN_FINISHED, c.RUN_CRASHED):
        state.end_attempt(env.stream, env.attempt or 1)
    return found


# The event types each kind of rule reads (the others it would only look at and pass by).
_TYPES_READ: dict[type[Rule], frozenset[str]] = {
    NonFinite: frozenset({c.STEP_SKIPPED, c.RUN_CRASHED, c.STEP_METRICS}),
    LossSpike: frozenset({c.STEP_METRICS}),
    ThroughputDrop: frozenset({c.STEP_METRICS}),
    RouterCollapse: frozenset({c.MOE_ROUTER_STATS}),
    Straggler: frozenset({c.RANK_STATS}),
}


@functools.lru_cache(maxsize=64)
def _rules_for(rules: tuple[Rule, ...], event_type: str) -> tuple[Rule, ...]:
    """The rules of ``rules`` that read ``event_type`` (a rule of a kind not listed reads every type)."""
    return tuple(r for r in rules if event_type in _TYPES_READ.get(type(r), frozenset({event_type})))


def _detect_one(rule: Rule, state: DetectorState, env: Envelope) -> list[Finding]:
    data: Any = env.data
    attempt = env.attempt or 1
    if isinstance(rule, NonFinite):
        return non_finite(rule, data)
    if isinstance(rule, LossSpike) and isinstance(data, p.StepMetrics):
        window = state.window((env.stream, attempt, "loss"), rule.window_steps)
        return loss_spike(rule, window, data.loss)
    if isinstance(rule, ThroughputDrop) and isinstance(data, p.StepMetrics):
        return throughput_drop(rule, state, (env.stream, attempt), data.tokens_per_second)
    if isinstance(rule, RouterCollapse) and isinstance(data, p.MoeRouterStats):
        return router_collapse(rule, state, env.stream, attempt, data)
    if isinstance(rule, Straggler) and isinstance(data, p.RankStats) and env.step is not None:
        return straggler(rule, state, (env.stream, attempt), env.step, data)
    return []


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def _mad(values: Iterable[float], median: float) -> float:
    return statistics.median(abs(v - median) for v in values)


def loss_spike(rule: LossSpike, window: deque[float], loss: float | None) -> list[Finding]:
    """A loss far above its window's median, in robust standard deviations (one-sided: a spike)."""
    if not _finite(loss):
        return []
    assert loss is not None
    found = []
    if len(window) >= rule.min_steps:
        median = statistics.median(window)
        scale = max(MAD_TO_SIGMA * _mad(window, median), rule.min_scale_fraction * abs(median), 1e-12)
        score = (loss - median) / scale
        if score > rule.k:
            found.append(Finding(rule, "loss", loss, median, score))
    window.append(loss)  # the spike too: the median and MAD are robust to it
    return found


def throughput_drop(
    rule: ThroughputDrop, state: DetectorState, key: tuple[str, int], rate: float | None
) -> list[Finding]:
    """Tokens per second below ``ratio`` of its window's median (score: value / median)."""
    if not _finite(rate):
        return []
    assert rate is not None
    metric = "tokens_per_second"
    window = state.window((*key, metric), rule.window_steps)
    found = []
    if len(window) >= rule.min_steps:
        median = statistics.median(window) if rate < rule.ratio * max(window) else None  # (else fine)
        tripped = median is not None and median > 0 and rate < rule.ratio * median
        if (tripped or state.episodes) and state.news(rule, (*key, metric), tripped):
            assert median is not None
            found.append(Finding(rule, metric, rate, median, rate / median))
    window.append(rate)
    return found


@functools.lru_cache(maxsize=4096)
def _layer_metrics(layer: int) -> tuple[str, str]:
    """A layer's two metric names, made once (a router event names every layer, every step)."""
    return f"layer.{layer}.token_drop_rate", f"layer.{layer}.routing_entropy"


def router_collapse(
    rule: RouterCollapse, state: DetectorState, stream: str, attempt: int, stats: p.MoeRouterStats
) -> list[Finding]:
    """Per layer: a token-drop rate jump (score: value - median; above ``drop_jump`` and ``k`` robust
    standard deviations of the window, so the noise of a router still settling is not one) or an
    entropy collapse (value / median)."""
    found = []
    size, enough, drop_jump, ratio = rule.window_steps, rule.min_steps, rule.drop_jump, rule.entropy_ratio
    by_layer = state.layers.get((stream, attempt), {})
    isfinite = math.isfinite
    # (Runs for every layer of every router event: the common case, a value judged fine with no
    # episode open, touches no median, no metric name and no episode.)
    for layer in stats.layers:
        number = layer.layer
        window, entropy_window = by_layer.get(number) or state.layer_windows(stream, attempt, number, size)
        rate = layer.token_drop_rate
        # (A jump needs rate > drop_jump, the median being >= 0: most layers never compute it.)
        if len(window) >= enough:
            median = jump = 0.0
            if rate > drop_jump:
                median = statistics.median(window)
                jump = rate - median
            tripped = jump > drop_jump and jump > rule.k * MAD_TO_SIGMA * _mad(window, median)
            if tripped or state.episodes:
                metric = _layer_metrics(number)[0]
                if state.news(rule, (stream, attempt, metric), tripped):
                    found.append(Finding(rule, metric, rate, median, jump))
        window.append(rate)
        entropy = layer.routing_entropy
        if entropy is None or not isfinite(entropy):
            continue
        # (A collapse needs entropy below ratio × the window's largest: most never compute the median.)
        if len(entropy_window) >= enough:
            median = 0.0
            if entropy < ratio * max(entropy_window):
                median = statistics.median(entropy_window)
            tripped = median > 0 and entropy < ratio * median
            if tripped or state.episodes:
                metric = _layer_metrics(number)[1]
                if state.news(rule, (stream, attempt, metric), tripped):
                    found.append(Finding(rule, metric, entropy, median, entropy / median))
        entropy_window.append(entropy)
    return found


def straggler(
    rule: Straggler, state: DetectorState, key: tuple[str, int], step: int, stats: p.RankStats
) -> list[Finding]:
    """This rank's step time against the median of the other ranks seen at the same step (score:
    the ratio). Only the latest step is kept: its ranks' times, at most one per rank."""
    if not _finite(stats.step_time_s):
        return []
    assert stats.step_time_s is not None
    seen = state.ranks.get(key)
    if seen is None or seen.step != step:
        seen = state.ranks[key] = RankStep(step)
    median = seen.median_without(stats.rank)  # the others', before this rank's time joins them
    count = len(seen.ordered) + 1
    seen.put(stats.rank, stats.step_time_s)
    if median is None or count < rule.min_ranks:
        return []  # not judged: an open episode stays open
    tripped = median > 0 and stats.step_time_s > rule.ratio * median
    if not (tripped or state.episodes):
        return []
    metric = f"rank.{stats.rank}.step_time_s"
    if not state.news(rule, (*key, metric), tripped):
        return []
    return [Finding(rule, metric, stats.step_time_s, median, stats.step_time_s / median)]


def non_finite(rule: NonFinite, data: Any) -> list[Finding]:
    """NaN or infinity, as the log can carry it (the module docstring says where)."""
    if isinstance(data, p.StepSkipped):
        reason = data.reason
        if reason.startswith("nonfinite_") or (data.value or "").lower() in NONFINITE_TEXT:
            return [Finding(rule, reason.removeprefix("nonfinite_") or "loss")]
    elif isinstance(data, p.RunCrashed) and data.kind == "nonfinite_loss":
        return [Finding(rule, "loss")]
    elif isinstance(data, p.StepMetrics):
        return [Finding(rule, name) for name in _nonfinite_fields(data)]
    return []


def _nonfinite_fields(data: p.StepMetrics) -> list[str]:
    """The named fields holding a float that is not finite, and the scalars that are null or not finite."""
    names = [
        name
        for name in ("loss", "grad_norm", "lr", "tokens_per_second", "mfu", "step_time_s")
        if isinstance(v := getattr(data, name), float) and not math.isfinite(v)
    ]
    names += sorted(f"scalars.{k}" for k, v in data.scalars.items() if v is None or not math.isfinite(v))
    return names


# ------------------------------------------------------------------------------------- the events
def anomaly_event(finding: Finding, cause: Envelope) -> Envelope:
    """The finding as an event: on the cause's stream, run, attempt and step, at the cause's time,
    with an id and seq derived from the cause, so whoever meets the same cause writes the same bytes."""
    digest = hashlib.sha256(
        "\x1f".join((cause.source, cause.id, finding.rule.name, finding.metric)).encode()
    ).hexdigest()
    return make_event(
        finding.payload(cause.id),
        source=ANOMALY_INGEST,
        stream=cause.stream,
        seq=cause.seq,
        run_id=cause.run_id,
        attempt=cause.attempt,
        step=cause.step,
        subject=cause.source,
        id=f"anomaly-{finding.rule.name}-{digest[:32]}",
        time=cause.time,
    )


def derive(
    rules: Iterable[Rule], state: DetectorState, events: Iterable[Envelope]
) -> Iterator[tuple[Envelope, list[bytes]]]:
    """Each event with the anomaly events it causes (encoded), in order, moving ``state`` on."""
    rules = tuple(rules)
    for env in events:
        yield env, [encode_event(anomaly_event(f, env)) for f in detect(rules, state, env)]


# ------------------------------------------------------------------------------------- reading
# A run's anomaly events in log order (``ledger history``, the report): one parameter, the run's stream.
ANOMALIES_OF_RUN_SQL = (
    f"SELECT canonical FROM events WHERE stream = ? AND type = '{c.LEDGER_ANOMALY}' ORDER BY stream_seq"
)


def anomaly_text(data: p.LedgerAnomaly) -> str:
    """One finding as a line: ``loss-spike v1: loss 9 vs 2.05 (score 339)``."""
    seen = "" if data.value is None else f" {data.value:.4g}"
    against = "" if data.baseline is None else f" vs {data.baseline:.4g}"
    score = "" if data.score is None else f" (score {data.score:.3g})"
    return f"{data.rule} v{data.rule_version}: {data.metric}{seen}{against}{score}"


# -------------------------------------------------------------------------------------- the round
class AnomalyRound:
    """One commit's detectors: see each admitted event, hand back the anomaly records it caused.
    Works on a copy of the ledger's state, kept only if the commit succeeds (``keep``)."""

    def __init__(self, rules: tuple[Rule, ...], state: DetectorState, positions: dict[str, int]) -> None:
        self.rules = rules
        self.state = state
        self.positions = positions  # the commit's own (live) positions: anomalies take the next one
        self._pending: list[bytes] = []

    def see(self, event: Event) -> None:
        env = event.envelope
        if env.source == ANOMALY_INGEST or not self.rules:
            return
        self._pending.extend(encode_event(anomaly_event(f, env)) for f in detect(self.rules, self.state, env))

    def records(self) -> Iterator[tuple[str, int, bytes]]:
        """The anomaly events seen so far, as (ingest source, position, bytes), each at the next
        position of ``ANOMALY_INGEST``, which the commit moves on as it consumes each one."""
        while self._pending:
            yield ANOMALY_INGEST, self.positions.get(ANOMALY_INGEST, 0), self._pending.pop(0)

    def keep(self, ledger: AnomalyLedger, commit: int) -> None:
        """The commit succeeded: its state is the ledger's."""
        self.state.commit = commit
        ledger.anomaly_state = self.state


class AnomalyLedger(Protocol):
    """What the detectors read (and keep) of a ledger (``runledger.ledger.store.Ledger``)."""

    anomaly_rules: tuple[Rule, ...]
    anomaly_state: DetectorState | None  # the state as of a commit, kept here between commits

    @property
    def last_commit(self) -> int: ...

    def commit_paths(self) -> list[Path]: ...

    def events_reader(self) -> AbstractContextManager[Any]: ...


def anomaly_round(ledger: AnomalyLedger, positions: dict[str, int]) -> AnomalyRound:
    """The detectors of the commit ``ledger`` is about to make (under its writer lock)."""
    state = ledger.anomaly_state
    if state is None or state.commit != ledger.last_commit:
        state = ledger.anomaly_state = load_state(ledger)
    judged = state.copy()
    judged.judge_with(rule_set_number(ledger.anomaly_rules), ledger.last_commit + 1)
    return AnomalyRound(ledger.anomaly_rules, judged, positions)


def load_state(ledger: AnomalyLedger) -> DetectorState:
    """The state as of the ledger's last commit, from that commit's record; a ledger whose records
    predate the detectors has its windows rebuilt from its events (``scan_state``), and is judged
    from its next commit on."""
    paths = ledger.commit_paths()
    if not paths:
        return DetectorState()
    record = msgspec.json.decode(paths[-1].read_bytes())
    saved = record.get("anomalies")
    if saved is None:
        return scan_state(ledger, ledger.anomaly_rules, record["commit"])
    try:
        return DetectorState.from_json(saved, record["commit"])
    except (ValueError, TypeError, KeyError) as exc:  # (each field is read with int() and float())
        from runledger.ledger.records import LedgerError

        raise LedgerError(
            f"{paths[-1]}: its detector state is damaged ({type(exc).__name__}: {exc}), so no commit can "
            "judge anomalies; delete the file and open the ledger again: it is copied again from the lake"
        ) from None


def scan_state(ledger: AnomalyLedger, rules: tuple[Rule, ...], commit: int) -> DetectorState:
    """The windows as of ``commit`` (the last), from the events table in stream order, with nothing
    recorded: the detectors start judging at the next commit."""
    state = DetectorState(since=commit + 1, commit=commit)
    marks = ", ".join("?" for _ in WATCHED_TYPES)
    with ledger.events_reader() as con:
        cursor = con.execute(
            f"SELECT canonical FROM events WHERE type IN ({marks}) ORDER BY stream, stream_seq",
            list(WATCHED_TYPES),
        )
        while rows := cursor.fetchmany(SCAN_BATCH_ROWS):
            for (text,) in rows:
                decoded = decode_event(text.encode())
                if isinstance(decoded, Event):  # a redacted event's payload is gone: not seen
                    detect(rules, state, decoded.envelope)
    return state


SCAN_BATCH_ROWS = 2_000


def admitted_anomaly(event: Event, ingest_source: str) -> bool:
    """An anomaly event the ledger itself made (from its own ingest source), so admission lets it in."""
    env = event.envelope
    return ingest_source == ANOMALY_INGEST and env.source == ANOMALY_INGEST and env.type == c.LEDGER_ANOMALY
