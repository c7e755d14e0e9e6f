"""Anomalies as recorded events (issue 44): the detectors are deterministic functions of the log.

* Fixed vectors per rule: a spike found at the right step with the right score, a flat or slowly
  drifting series finds nothing, NaN found, a router collapse, a straggler, a throughput drop; the
  windows stay bounded and serialize.
* Recorded at ingest through a real lake: the exact anomaly events expected, right after their
  cause, the same bytes whether the run is ingested in one commit, in two (the state carried in the
  commit record, across a reopened ledger) or rebuilt from its producer events.
* Re-derived by ``ledger verify``: a forged, a hidden (never recorded), an altered and a deleted
  anomaly event are each named.
"""

from __future__ import annotations

from collections import deque
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from runledger.ledger.anomalies import (
    ANOMALIES_OF_RUN_SQL,
    ANOMALY_INGEST,
    RULE_SET_IN_FORCE,
    RULE_SETS,
    RULES_IN_FORCE,
    RULES_V1,
    DetectorState,
    Finding,
    LossSpike,
    NonFinite,
    RouterCollapse,
    Straggler,
    ThroughputDrop,
    anomaly_event,
    anomaly_text,
    detect,
    loss_spike,
    non_finite,
    router_collapse,
    rule_set_number,
    straggler,
    throughput_drop,
)
from runledger.ledger.integrity import verify_ledger
from runledger.ledger.query import Reader
from runledger.ledger.store import Ledger, LedgerError, SourceRecord
from runledger.schemas import config_hash, decode_event, encode_event, make_event
from runledger.schemas import payloads as p
from runledger.schemas.codec import Envelope, Event

RUN = "spiky"
T0 = datetime(2026, 11, 1, tzinfo=UTC)
SPIKE = LossSpike()
ROUTER = RouterCollapse()


# ----------------------------------------------------------------------------- fixed vectors
def _alternating(steps: int) -> list[float]:
    return [2.05 if step % 2 else 2.0 for step in range(1, steps + 1)]


def test_a_loss_spike_is_found_at_its_step_with_its_robust_score() -> None:
    window: deque[float] = deque(maxlen=SPIKE.window_steps)
    found = {}
    for step, loss in enumerate([*_alternating(29), 9.0, *_alternating(10)], start=1):
        for finding in loss_spike(SPIKE, window, loss):
            found[step] = finding
    assert list(found) == [30]
    # 29 losses before it: 15 of 2.05 and 14 of 2.0, so the median is 2.05 and the MAD 0: the scale
    # is its floor, 1% of the median.
    assert found[30].baseline == 2.05
    assert found[30].score == pytest.approx((9.0 - 2.05) / (0.01 * 2.05))
    assert found[30].value == 9.0 and found[30].metric == "loss"


def test_a_spike_in_a_noisy_window_is_scored_in_robust_deviations() -> None:
    window: deque[float] = deque([2.0, 2.2, 2.4] * 10, maxlen=50)  # median 2.2, MAD 0.2
    (finding,) = loss_spike(SPIKE, window, 4.0)
    assert finding.score == pytest.approx((4.0 - 2.2) / (1.4826 * 0.2))
    assert loss_spike(SPIKE, deque([2.0, 2.2, 2.4] * 10, maxlen=50), 3.0) == []  # 2.7 deviations


@pytest.mark.parametrize(
    "series",
    [
        [2.0] * 200,  # flat
        [5.0 - 0.004 * step for step in range(500)],  # drifting down, as a loss does
        [2.0 + 0.002 * step + 0.01 * (step % 3) for step in range(500)],  # drifting up, a little noise
    ],
    ids=["flat", "drift-down", "drift-up"],
)
def test_a_flat_or_slowly_drifting_loss_finds_nothing(series: list[float]) -> None:
    window: deque[float] = deque(maxlen=SPIKE.window_steps)
    assert [f for loss in series for f in loss_spike(SPIKE, window, loss)] == []


def test_a_spike_before_the_window_fills_is_not_judged() -> None:
    window: deque[float] = deque(maxlen=SPIKE.window_steps)
    found = [f for loss in [*_alternating(SPIKE.min_steps - 1), 9.0] for f in loss_spike(SPIKE, window, loss)]
    assert found == []


def test_non_finite_values_are_found_where_the_log_carries_them() -> None:
    rule = NonFinite()
    assert [f.metric for f in non_finite(rule, p.StepSkipped(reason="nonfinite_loss", value="nan"))] == [
        "loss"
    ]
    assert [f.metric for f in non_finite(rule, p.StepSkipped(reason="nonfinite_grad_norm", value="inf"))] == [
        "grad_norm"
    ]
    assert [f.metric for f in non_finite(rule, p.RunCrashed(kind="nonfinite_loss"))] == ["loss"]
    metrics = p.StepMetrics(loss=float("nan"), scalars={"aux": None, "ok": 1.0})
    assert [f.metric for f in non_finite(rule, metrics)] == ["loss", "scalars.aux"]
    # Nothing else: a skip for another reason, another crash, a step whose loss was not reported.
    assert non_finite(rule, p.StepSkipped(reason="overflow")) == []
    assert non_finite(rule, p.RunCrashed(kind="exception")) == []
    assert non_finite(rule, p.StepMetrics(loss=None, grad_norm=1.0)) == []


def test_a_nan_loss_in_json_arrives_as_null_and_its_skip_names_it() -> None:
    """Where NaN reaches the ledger: the payload's Float cannot carry it through JSON (null), so the
    detector reads the step.skipped the trainer and client write beside it."""
    env = _env(p.StepMetrics(loss=float("nan")), 5, seq=5)
    decoded = decode_event(encode_event(env))
    assert isinstance(decoded, Event) and decoded.envelope.data.loss is None


def test_a_router_layer_whose_drops_jump_or_entropy_collapses_is_found() -> None:
    state = DetectorState()
    for _ in range(ROUTER.min_steps):
        assert router_collapse(ROUTER, state, RUN, 1, _router(0.01, 2.0)) == []
    found = router_collapse(ROUTER, state, RUN, 1, _router(0.01, 2.0, layer1_drop=0.5, layer0_entropy=0.2))
    assert [(f.metric, f.value, f.baseline) for f in found] == [
        ("layer.0.routing_entropy", 0.2, 2.0),
        ("layer.1.token_drop_rate", 0.5, 0.01),
    ]
    assert found[0].score == pytest.approx(0.1) and found[1].score == pytest.approx(0.49)
    # A drift of the drop rate within drop_jump is no collapse.
    assert router_collapse(ROUTER, state, RUN, 1, _router(0.08, 1.5)) == []


def test_a_noisy_router_still_settling_is_no_collapse_until_a_jump_stands_out_of_its_noise() -> None:
    """The demo's first steps: drop rates of 0.2-0.6 from step to step. A rise of 0.12 over the
    median is within that noise (k robust standard deviations); a rise to 0.95 is not."""
    state, noisy = DetectorState(), [0.2, 0.6, 0.35, 0.5, 0.25, 0.55, 0.3, 0.45, 0.4, 0.22, 0.58, 0.38]
    for rate in noisy:
        assert router_collapse(ROUTER, state, RUN, 1, _router(0.01, 2.0, layer1_drop=rate)) == []
    assert router_collapse(ROUTER, state, RUN, 1, _router(0.01, 2.0, layer1_drop=0.51)) == []
    [found] = router_collapse(ROUTER, state, RUN, 1, _router(0.01, 2.0, layer1_drop=0.99))
    assert (found.metric, found.value) == ("layer.1.token_drop_rate", 0.99)


def test_a_straggler_rank_is_found_against_the_other_ranks_at_its_step() -> None:
    rule, state = Straggler(), DetectorState()
    found = [
        f
        for rank, seconds in enumerate([1.0, 1.1, 0.9, 5.0, 1.0])
        for f in straggler(rule, state, (RUN, 1), 7, p.RankStats(rank=rank, host="h", step_time_s=seconds))
    ]
    assert [(f.metric, f.value, f.baseline, f.score) for f in found] == [
        ("rank.3.step_time_s", 5.0, 1.0, 5.0)
    ]
    # The next step starts afresh: three ranks are too few to judge.
    for rank in range(3):
        assert (
            straggler(rule, state, (RUN, 1), 8, p.RankStats(rank=rank, host="h", step_time_s=9.0 * rank + 1))
            == []
        )
    seen = state.ranks[(RUN, 1)]
    assert (seen.step, seen.times, seen.ordered) == (8, {0: 1.0, 1: 10.0, 2: 19.0}, [1.0, 10.0, 19.0])
    # A rank reporting the step again replaces its time (never counted twice).
    straggler(rule, state, (RUN, 1), 8, p.RankStats(rank=1, host="h", step_time_s=2.0))
    assert (seen.times, seen.ordered) == ({0: 1.0, 1: 2.0, 2: 19.0}, [1.0, 2.0, 19.0])


def test_a_throughput_drop_is_found_against_its_window() -> None:
    state = DetectorState()
    found = [
        f
        for rate in [1000.0] * 30 + [600.0, 300.0, 1000.0]
        for f in throughput_drop(ThroughputDrop(), state, (RUN, 1), rate)
    ]
    assert [(f.value, f.baseline, f.score) for f in found] == [(300.0, 1000.0, 0.3)]


# A lasting condition: 30 good values, a 15-step episode, 25 good (the windows forget it), a
# second 10-step episode.
_EPISODES = [*([False] * 30), *([True] * 15), *([False] * 25), *([True] * 10)]


def _reported_steps(version: int, judge: Any) -> list[int]:
    """The steps of ``_EPISODES`` at which ``judge(rule, state, step, tripped)`` reports."""
    state = DetectorState()
    return [step for step, tripped in enumerate(_EPISODES) if judge(version, state, step, tripped)]


def _throughput(version: int, state: DetectorState, step: int, tripped: bool) -> list[Finding]:
    return throughput_drop(ThroughputDrop(version=version), state, (RUN, 1), 100.0 if tripped else 1000.0)


def _router_drops(version: int, state: DetectorState, step: int, tripped: bool) -> list[Finding]:
    stats = _router(0.01, 2.0, layer1_drop=0.9 if tripped else 0.01)
    return router_collapse(RouterCollapse(version=version), state, RUN, 1, stats)


def _router_entropy(version: int, state: DetectorState, step: int, tripped: bool) -> list[Finding]:
    stats = _router(0.01, 2.0, layer0_entropy=0.1 if tripped else 2.0)
    return router_collapse(RouterCollapse(version=version), state, RUN, 1, stats)


def _straggling(version: int, state: DetectorState, step: int, tripped: bool) -> list[Finding]:
    rule, slow = Straggler(version=version), 9.0 if tripped else 1.0
    times = [1.0, 1.1, 0.9, 1.0, slow]  # rank 4 reports last: judged against the four others
    return [
        f
        for rank, seconds in enumerate(times)
        for f in straggler(rule, state, (RUN, 1), step, p.RankStats(rank=rank, host="h", step_time_s=seconds))
    ]


@pytest.mark.parametrize("judge", [_throughput, _router_drops, _router_entropy, _straggling])
def test_version_2_reports_a_lasting_condition_once_per_episode(judge: Any) -> None:
    """v1 reported every step of a lasting condition (a 15-step throughput drop: 15 alerts); v2
    reports its first step, and again only after a value judged fine: once per episode."""
    every = _reported_steps(1, judge)
    assert every[:2] == [30, 31] and 39 in every  # v1: step after step (the window's median moves later)
    assert _reported_steps(2, judge) == [30, 70]


def test_an_open_episode_is_kept_in_the_saved_state_and_ends_with_its_attempt() -> None:
    state = DetectorState()
    for step, tripped in enumerate(_EPISODES[:35]):
        _throughput(2, state, step, tripped)
        _straggling(2, state, step, tripped)
    assert state.episodes == {(RUN, 1, "tokens_per_second"), (RUN, 1, "rank.4.step_time_s")}
    again = DetectorState.from_json(msgspec.json.decode(msgspec.json.encode(state.to_json())))
    assert again.episodes == state.episodes
    assert [_throughput(2, s, 35, True) for s in (state, again)] == [[], []]  # still the same episode
    detect(RULES_IN_FORCE, again, _env(p.RunFinished(status="completed"), 35, seq=36))
    assert again.episodes == set()


def test_which_rule_set_judged_is_kept_and_a_switch_recorded_at_its_commit() -> None:
    state = DetectorState()
    assert state.rule_set_history() == [(0, 1)]  # a record written before the sets were numbered
    state.judge_with(2, 0)  # nothing judged by set 1: replaced
    assert state.rule_sets == [(0, 2)]
    state.judge_with(2, 5)
    assert state.rule_sets == [(0, 2)]
    old = DetectorState(since=3)
    old.judge_with(2, 7)
    assert old.rule_sets == [(3, 1), (7, 2)]
    assert DetectorState.from_json(old.to_json()).rule_sets == old.rule_sets
    assert rule_set_number(RULES_V1) == 1 and rule_set_number(RULES_IN_FORCE) == RULE_SET_IN_FORCE == 2
    assert rule_set_number((LossSpike(k=5.0),)) == RULE_SET_IN_FORCE  # an operator's own rules claim it


def test_windows_are_bounded_serializable_and_dropped_when_the_attempt_ends() -> None:
    state = DetectorState()
    for step in range(1, 501):
        detect(RULES_IN_FORCE, state, _env(_metrics(2.0), step, seq=step))
        detect(RULES_IN_FORCE, state, _env(_router(0.01, 2.0), step, seq=step))
    assert {key: len(w) for key, w in state.windows.items()} == {
        (RUN, 1, "loss"): SPIKE.window_steps,
        (RUN, 1, "tokens_per_second"): ThroughputDrop().window_steps,
        **{
            (RUN, 1, f"layer.{n}.{m}"): ROUTER.window_steps
            for n in (0, 1)
            for m in ("token_drop_rate", "routing_entropy")
        },
    }
    saved = msgspec.json.decode(msgspec.json.encode(state.to_json()))
    again = DetectorState.from_json(saved)
    assert again.to_json() == state.to_json()
    assert all(w.maxlen == state.windows[k].maxlen for k, w in again.windows.items())
    detect(RULES_IN_FORCE, state, _env(p.RunFinished(status="completed"), 500, seq=501))
    assert state.windows == {} and state.ranks == {}


def test_each_finding_records_its_rule_version_and_parameters() -> None:
    env = anomaly_event(Finding(SPIKE, "loss", 9.0, 2.0, 7.5), _env(_metrics(9.0), 30, seq=30))
    data = env.data
    assert isinstance(data, p.LedgerAnomaly)
    assert (data.rule, data.rule_version) == ("loss-spike", 1)
    assert data.params == {"window_steps": 50.0, "min_steps": 20.0, "k": 6.0, "min_scale_fraction": 0.01}
    assert (env.run_id, env.attempt, env.step, env.source, env.stream) == (RUN, 1, 30, ANOMALY_INGEST, RUN)
    assert data.event_id == f"{RUN}-30" and env.time == T0 + timedelta(seconds=30)


# --------------------------------------------------------------------------- recorded at ingest
EXPECTED = [  # (rule, metric, step, attempt) of the story's anomalies, in log order
    ("loss-spike", "loss", 30, 1),
    ("non-finite", "loss", 33, 1),
    ("throughput-drop", "tokens_per_second", 35, 1),
    ("router-collapse", "layer.0.routing_entropy", 36, 1),
    ("router-collapse", "layer.1.token_drop_rate", 36, 1),
    ("straggler", "rank.3.step_time_s", 37, 1),
    ("non-finite", "loss", 38, 1),
]


def test_anomalies_are_recorded_at_ingest_right_after_their_cause(tmp_path: Path) -> None:
    ledger = Ledger.create(tmp_path / "l")
    ledger.commit(_records(_story()))
    rows = _events(tmp_path / "l")
    anomalies = [(i, env) for i, (env, _) in enumerate(rows) if env.type == "ledger.anomaly"]
    assert [(e.data.rule, e.data.metric, e.step, e.attempt) for _, e in anomalies] == EXPECTED
    by_id = {env.id: i for i, (env, _) in enumerate(rows)}
    for i, env in anomalies:
        cause = rows[by_id[env.data.event_id]][0]
        assert by_id[env.data.event_id] < i and (cause.step, cause.run_id) == (env.step, env.run_id)
        assert all(r[0].type == "ledger.anomaly" for r in rows[by_id[env.data.event_id] + 1 : i + 1])
    spike = anomalies[0][1].data
    assert spike.score == pytest.approx((9.0 - 2.05) / (0.01 * 2.05)) and spike.baseline == 2.05
    assert verify_ledger(tmp_path / "l").ok


def test_a_ledger_judged_by_set_1_then_set_2_verifies_each_commit_by_its_own_set(tmp_path: Path) -> None:
    """An upgrade between commits: commit 0 judged by v1 rules (its throughput drop, router and
    straggler findings are v1), commit 1 by v2. The record says which set judged from when, and
    ``verify`` re-derives each commit's anomalies with that set (set 2 throughout would call commit
    0's findings altered)."""
    root, records = tmp_path / "l", _records(_story())
    old = Ledger.create(root)
    old.anomaly_rules = RULES_V1
    old.commit(records[:70])  # through the throughput drop (step 35), before the router's collapse
    old.close()
    new = Ledger.open(root)
    new.commit(records[70:])
    new.close()
    versions = [(e.data.rule, e.data.rule_version) for e, _ in _events(root) if e.type == "ledger.anomaly"]
    assert versions[:3] == [("loss-spike", 1), ("non-finite", 1), ("throughput-drop", 1)]
    assert versions[3:6] == [("router-collapse", 2), ("router-collapse", 2), ("straggler", 2)]
    newest = msgspec.json.decode(sorted((root / "_commits").glob("*.json"))[-1].read_bytes())
    assert newest["anomalies"]["rule_sets"] == [[0, 1], [1, 2]]
    report = verify_ledger(root)
    assert report.ok, [pr.line() for pr in report.problems]


def test_verify_says_once_that_a_newer_rule_set_judged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ledger written by a runledger with a rule set this one does not know: one problem saying so,
    not one per anomaly event."""
    newer = (LossSpike(version=2, k=4.0), *RULES_IN_FORCE[1:])
    monkeypatch.setitem(RULE_SETS, 3, newer)
    ledger = Ledger.create(tmp_path / "l")
    ledger.anomaly_rules = newer
    ledger.commit(_records(_story()))
    ledger.close()
    monkeypatch.undo()
    report = verify_ledger(tmp_path / "l")
    assert [(pr.kind, pr.event_id) for pr in report.problems] == [("anomaly", "rule-set-3")]
    assert "rule set 3 (from commit 0) is unknown to this runledger" in report.problems[0].detail


def test_verify_says_once_that_the_records_detector_state_is_damaged(tmp_path: Path) -> None:
    root = tmp_path / "l"
    with Ledger.create(root) as ledger:
        ledger.commit(_records(_story()))
    newest = sorted((root / "_commits").glob("*.json"))[-1]
    record = msgspec.json.decode(newest.read_bytes())
    record["anomalies"]["rule_sets"] = [["zero", 2]]
    newest.write_bytes(msgspec.json.encode(record))
    report = verify_ledger(root)
    damaged = [pr for pr in report.problems if pr.kind == "anomaly"]
    assert [pr.event_id for pr in damaged] == ["detector-state"]
    assert "detector state is damaged (ValueError" in damaged[0].detail


def test_a_writer_refuses_in_one_line_a_damaged_detector_state_and_the_lakes_copy_mends_it(
    tmp_path: Path,
) -> None:
    """The writer's next commit reads the newest record's detector state: damaged, the commit is one
    LedgerError naming the file (no bare ValueError, nothing stored); deleted, the file is copied
    again from the lake when the ledger opens, and the commit lands and verifies."""
    root = tmp_path / "l"
    records = _records(_story())
    with Ledger.create(root) as ledger:
        ledger.commit(records[:40])
    newest = sorted((root / "_commits").glob("*.json"))[-1]
    good = newest.read_bytes()
    record = msgspec.json.decode(good)
    record["anomalies"]["windows"] = [["s", "one", "loss", 5, []]]
    newest.write_bytes(msgspec.json.encode(record))
    with Ledger.open(root) as ledger, pytest.raises(LedgerError) as refused:
        ledger.commit(records[40:])
    line = str(refused.value)
    assert "\n" not in line and str(newest) in line and "detector state is damaged (ValueError" in line
    newest.unlink()
    with Ledger.open(root) as ledger:
        assert newest.read_bytes() == good
        ledger.commit(records[40:])
    report = verify_ledger(root)
    assert report.ok, [pr.line() for pr in report.problems]


def test_two_commits_across_a_reopened_ledger_equal_one_commit(tmp_path: Path) -> None:
    records = _records(_story())
    Ledger.create(tmp_path / "one").commit(records)
    for cut in (25, 31, 37):  # inside the windows, right after the spike, between straggler ranks
        root = tmp_path / f"two-{cut}"
        Ledger.create(root).commit(records[:cut])
        Ledger.create(root).commit(records[cut:])  # a new writer: the state comes from the record
        assert [raw for _, raw in _events(root)] == [raw for _, raw in _events(tmp_path / "one")]


def test_a_rebuild_from_the_producer_events_writes_the_same_anomaly_events(tmp_path: Path) -> None:
    Ledger.create(tmp_path / "live").commit(_records(_story()))
    produced = [raw for env, raw in _events(tmp_path / "live") if not env.source.startswith("ledger:")]
    rebuilt = Ledger.create(tmp_path / "rebuilt")
    for start in range(0, len(produced), 17):  # as a replay reads them: in batches of its own
        rebuilt.commit(_records([r.encode() for r in produced[start : start + 17]], first=start))
    assert _anomaly_bytes(tmp_path / "rebuilt") == _anomaly_bytes(tmp_path / "live")
    assert len(_anomaly_bytes(tmp_path / "live")) == len(EXPECTED)


# ------------------------------------------------------------------------------ re-derived by verify
def test_verify_names_a_forged_anomaly(tmp_path: Path) -> None:
    ledger = Ledger.create(tmp_path / "l")
    story = _story()
    ledger.commit(_records(story))
    cause = decode_event(story[10])
    assert isinstance(cause, Event)
    forged = anomaly_event(Finding(SPIKE, "loss", 2.0, 2.0, 0.0), cause.envelope)
    position = ledger.positions().get(ANOMALY_INGEST, 0)
    assert ledger.commit([SourceRecord(ANOMALY_INGEST, position, encode_event(forged))]).accepted == 1
    report = verify_ledger(tmp_path / "l")
    assert [(pr.kind, pr.event_id) for pr in report.problems] == [("anomaly", forged.id)]
    assert report.problems[0].detail.startswith(
        "extra: loss-spike v1 on loss at step 5, caused by event spiky-10"
    )


def test_verify_names_anomalies_hidden_by_a_writer_without_detectors(tmp_path: Path) -> None:
    ledger = Ledger.create(tmp_path / "l")
    ledger.anomaly_rules = ()  # an operator who turned the detectors off
    ledger.commit(_records(_story()))
    report = verify_ledger(tmp_path / "l")
    assert [pr.kind for pr in report.problems] == ["anomaly"] * len(EXPECTED)
    assert all(pr.detail.startswith("missing: ") for pr in report.problems)
    assert "missing: loss-spike v1 on loss at step 30" in report.problems[0].detail


def test_verify_names_an_anomaly_recorded_with_other_parameters(tmp_path: Path) -> None:
    ledger = Ledger.create(tmp_path / "l")
    ledger.anomaly_rules = (LossSpike(k=5.0), *RULES_IN_FORCE[1:])  # a parameter changed, same version
    ledger.commit(_records(_story()))
    report = verify_ledger(tmp_path / "l")
    assert [pr.kind for pr in report.problems] == ["anomaly"]
    assert report.problems[0].detail.startswith("altered: loss-spike v1 on loss at step 30")


def test_verify_names_an_anomaly_row_deleted_from_the_lake_files(tmp_path: Path) -> None:
    root = tmp_path / "l"
    Ledger.create(root).commit(_records(_story()))
    # Its row taken out of the data file, as another program would: a new file renamed over the old.
    (path,) = sorted((root / "data" / "main" / "events").rglob("*.parquet"))
    table = pq.read_table(path)
    gone = pc.and_(pc.equal(table["type"], "ledger.anomaly"), pc.equal(table["step"], 33))
    assert pc.sum(gone.cast("int8")).as_py() == 1
    forged = path.with_name("forged.tmp")
    pq.write_table(table.filter(pc.invert(gone)), forged)
    forged.replace(path)
    report = verify_ledger(root)
    # The Merkle log's leaf has no row: one problem naming the anomaly event (not a second "missing").
    (removed,) = [pr for pr in report.problems if pr.kind == "removed"]
    assert removed.event_id is not None and removed.event_id.startswith("anomaly-non-finite-")
    assert [pr for pr in report.problems if pr.kind == "anomaly"] == []


def test_verify_names_an_edited_cause_once_not_again_as_its_anomalies(tmp_path: Path) -> None:
    """The loss spike's cause edited in the data file (its bytes, as another program would): one
    "modified" problem naming it, not also "extra" for the anomaly it caused, nor "missing"/"altered"
    for those after it, whose windows no longer hold its value (the hypothesis property test found
    this: a NaN scalar's event edited, its non-finite anomaly then named "extra")."""
    root = tmp_path / "l"
    Ledger.create(root).commit(_records(_story()))
    (path,) = sorted((root / "data" / "main" / "events").rglob("*.parquet"))
    table = pq.read_table(path)
    cause = pc.and_(pc.equal(table["type"], "runledger.step.metrics"), pc.equal(table["step"], 30))
    assert pc.sum(cause.cast("int8")).as_py() == 1
    edited = pc.if_else(
        cause, pc.replace_substring(table["canonical"], '"loss":9.0', '"loss":2.0'), table["canonical"]
    )
    assert edited != table["canonical"]
    forged = path.with_name("forged.tmp")
    pq.write_table(table.set_column(table.schema.get_field_index("canonical"), "canonical", edited), forged)
    forged.replace(path)
    report = verify_ledger(root)
    lines = [pr.line() for pr in report.problems]
    cause_id = f"spiky-{_cause_index(30)}"
    assert [pr.event_id for pr in report.problems if pr.kind == "modified" and pr.event_id] == [cause_id], (
        lines
    )
    # (besides it: the data file's bytes, and the event's own metrics rows)
    assert {pr.kind for pr in report.problems} == {"modified", "table-mismatch"}, lines


def _cause_index(step: int) -> int:
    """The index in ``_story`` of the step-metrics event of ``step`` (its event id's number)."""
    for index, raw in enumerate(_story()):
        decoded = decode_event(raw)
        assert isinstance(decoded, Event)
        if decoded.envelope.type == "runledger.step.metrics" and decoded.envelope.step == step:
            return index
    raise AssertionError(step)


# ----------------------------------------------------------------------------------- the story
def _env(
    payload: Any, step: int | None, *, seq: int, attempt: int = 1, source: str = "", index: int | None = None
) -> Envelope:
    """An event of the run; ``index`` (default ``seq``): its place in the story, naming its id and time."""
    at = seq if index is None else index
    return make_event(
        payload,
        source=source or f"trainer/{RUN}/a{attempt}/rank0",
        stream=RUN,
        run_id=RUN,
        attempt=attempt,
        step=step,
        seq=seq,
        id=f"{RUN}-{at}",
        time=T0 + timedelta(seconds=at),
    )


def _metrics(loss: float, rate: float = 1000.0) -> p.StepMetrics:
    return p.StepMetrics(loss=loss, lr=1e-3, tokens=512, tokens_per_second=rate, step_time_s=0.5)


def _router(
    drop: float, entropy: float, *, layer1_drop: float | None = None, layer0_entropy: float | None = None
) -> p.MoeRouterStats:
    def layer(n: int, rate: float, h: float) -> p.MoeLayerStats:
        return p.MoeLayerStats(
            layer=n, tokens=512, top_k=2, dropped=round(rate * 1024), token_drop_rate=rate, routing_entropy=h
        )

    return p.MoeRouterStats(
        layers=[
            layer(0, drop, entropy if layer0_entropy is None else layer0_entropy),
            layer(1, drop if layer1_drop is None else layer1_drop, entropy),
        ]
    )


def _story() -> list[bytes]:
    """A run with one of each anomaly in attempt 1 (steps 30-38), then a quiet resumed attempt 2."""
    config = {"lr": 1e-3}
    launch = p.RunStarted(config=config, config_hash=config_hash(config), host="h", world_size=4)
    events = [_env(launch, 0, seq=0)]
    seqs = {f"trainer/{RUN}/a1/rank0": 1}  # each source numbers its own events

    def add(payload: Any, step: int | None, attempt: int = 1, source: str = "") -> None:
        source = source or f"trainer/{RUN}/a{attempt}/rank0"
        seq = seqs.get(source, 0)
        seqs[source] = seq + 1
        events.append(_env(payload, step, seq=seq, attempt=attempt, source=source, index=len(events)))

    for step in range(1, 38):
        if step == 33:
            add(p.StepSkipped(reason="nonfinite_loss", value="nan"), step)
            continue
        loss = 9.0 if step == 30 else (2.05 if step % 2 else 2.0)
        add(_metrics(loss, 300.0 if step == 35 else 1000.0), step)
        add(_router(0.01, 2.0, **({"layer1_drop": 0.5, "layer0_entropy": 0.2} if step == 36 else {})), step)
    for rank, seconds in enumerate([1.0, 1.0, 1.0, 5.0]):
        add(p.RankStats(rank=rank, host="h", step_time_s=seconds), 37, source=f"trainer/{RUN}/a1/rank{rank}")
    add(p.RunCrashed(kind="nonfinite_loss", last_step=37), 38)
    resume = p.RunResumed(
        config=config, config_hash=config_hash(config), host="h", from_checkpoint_step=30, previous_attempt=1
    )
    add(resume, 30, attempt=2)
    for step in range(31, 41):
        add(_metrics(2.0), step, attempt=2)
    return [encode_event(e) for e in events]


def _records(raws: list[bytes], first: int = 0) -> list[SourceRecord]:
    return [SourceRecord("spool:t", first + i, raw) for i, raw in enumerate(raws)]


def _events(root: Path) -> list[tuple[Envelope, str]]:
    reader = Reader(root)
    try:
        rows = reader.sql("SELECT canonical FROM events ORDER BY stream, stream_seq").rows
    finally:
        reader.close()
    out = []
    for (text,) in rows:
        decoded = decode_event(text.encode())
        assert isinstance(decoded, Event)
        out.append((decoded.envelope, text))
    return out


def _anomaly_bytes(root: Path) -> list[str]:
    return [raw for env, raw in _events(root) if env.type == "ledger.anomaly"]


# ---------------------------------------------------------------------------------------- shown
def test_the_demo_line_counts_the_anomalies_before_the_first_crash(tmp_path: Path) -> None:
    from runledger.cli.demo_cmd import anomalies_before_first_crash

    Ledger.create(tmp_path / "l").commit(_records(_story()))
    assert anomalies_before_first_crash(tmp_path / "l", RUN) == (
        "anomalies before the first crash (step 38): "
        "2 non-finite, 1 loss-spike, 2 router-collapse, 1 straggler, 1 throughput-drop"
    )
    quiet = [raw for raw in _story() if b'"runledger.run.crashed"' not in raw][:20]
    Ledger.create(tmp_path / "q").commit(_records(quiet))
    assert (
        anomalies_before_first_crash(tmp_path / "q", RUN)
        == "anomalies (the run did not crash): 0 non-finite, 0 loss-spike"
    )


def test_a_runs_anomalies_read_as_history_lines(tmp_path: Path) -> None:
    Ledger.create(tmp_path / "l").commit(_records(_story()))
    reader = Reader(tmp_path / "l")
    try:
        rows = reader.sql(ANOMALIES_OF_RUN_SQL, [RUN]).rows
    finally:
        reader.close()
    texts = []
    for (text,) in rows:
        decoded = decode_event(text.encode())
        assert isinstance(decoded, Event) and isinstance(decoded.envelope.data, p.LedgerAnomaly)
        texts.append(anomaly_text(decoded.envelope.data))
    assert texts == [
        "loss-spike v1: loss 9 vs 2.05 (score 339)",
        "non-finite v1: loss",
        "throughput-drop v2: tokens_per_second 300 vs 1000 (score 0.3)",
        "router-collapse v2: layer.0.routing_entropy 0.2 vs 2 (score 0.1)",
        "router-collapse v2: layer.1.token_drop_rate 0.5 vs 0.01 (score 0.49)",
        "straggler v2: rank.3.step_time_s 5 vs 1 (score 5)",
        "non-finite v1: loss",
    ]


def test_a_producer_posing_as_the_detectors_is_quarantined(tmp_path: Path) -> None:
    """An anomaly event arriving on a bus (a producer's spool record), even one the detectors would
    make byte for byte: the ledger's own events come only from its own ingest source."""
    story = _story()
    cause = decode_event(story[10])
    assert isinstance(cause, Event)
    posed = encode_event(anomaly_event(Finding(SPIKE, "loss", 2.0, 2.0, 0.0), cause.envelope))
    ledger = Ledger.create(tmp_path / "l")
    result = ledger.commit(_records([*story, posed]))
    assert [(r.position, why.code) for r, why in result.quarantined] == [(len(story), "reserved")]
    assert posed.decode() not in [raw for _, raw in _events(tmp_path / "l")]
    assert verify_ledger(tmp_path / "l").ok
