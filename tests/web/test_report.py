"""`ledger report` and `ledger plot`: the data reduction against a direct computation, and the page as a
person sees it, in a real headless Chromium opened from disk with the network off."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from collections import defaultdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ledger.query import Reader
from runledger.ledger.report import (
    HEATMAP_BUCKETS,
    StepRange,
    build_report,
    record_status,
    reduce_series,
    render_html,
    router_view,
    run_markers,
)
from runledger.ledger.store import Ledger, SourceRecord
from runledger.ledger.stream_checkpoints import sign_checkpoints
from runledger.schemas import encode_event, make_event
from runledger.schemas import payloads as p
from runledger.schemas.github import GitHubPullRequest, GitHubPush
from runledger.schemas.note import write_keypair
from tests.support.browser import chromium
from tests.support.factory import T0, RunBuilder

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / ".artifacts"  # gitignored: screenshots kept for review
HOSTILE_NOTE = "</script><script>window.__pwned = 1</script> <!-- & ünïcode"
LAYERS, EXPERTS = 3, 4


# ---------------------------------------------------------------------------------------- a synthetic run
def _router(run: RunBuilder, step: int, rng: random.Random, with_counts: bool) -> dict[int, float]:
    rates = {layer: round(rng.uniform(0, 0.2), 4) for layer in range(LAYERS)}
    layers = [
        p.MoeLayerStats(
            layer=layer,
            tokens=100,
            top_k=2,
            dropped=int(200 * rate),
            token_drop_rate=rate,
            expert_counts=[rng.randint(10, 90) for _ in range(EXPERTS)] if with_counts else [],
        )
        for layer, rate in rates.items()
    ]
    run._emit(p.MoeRouterStats(layers=layers), step)
    return rates


def _story(
    tmp_path: Path,
) -> tuple[Path, RunBuilder, dict[tuple[int, int], float], dict[tuple[int, int], float]]:
    """1,000 steps with random losses; a config change, checkpoints every 7 steps, a crash at 640, a
    resume from 630 (so 631..640 of attempt 1 are superseded), a note. Returns the losses and drop
    rates by (attempt, step) / (step, layer) as emitted."""
    rng = random.Random(12)
    run = RunBuilder(run_id="run-r")
    run.start()
    losses: dict[tuple[int, int], float] = {}
    drops: dict[tuple[int, int], float] = {}
    for step in range(1, 641):
        if step == 300:
            run.change(step, "moe/capacity_factor", 1.5)
        if step % 7 == 0:
            run.checkpoint(step)
        losses[(1, step)] = rng.uniform(0.5, 5.0)
        run.step(step, loss=losses[(1, step)])
        for layer, rate in _router(run, step, rng, step % 50 == 0).items():
            drops[(step, layer)] = rate
    run.crash(640)
    run.resume(630)
    run._emit(p.Annotation(author="ana", text=HOSTILE_NOTE), 700)
    for step in range(631, 1001):
        losses[(2, step)] = rng.uniform(0.5, 5.0)
        run.step(step, loss=losses[(2, step)])
        for layer, rate in _router(run, step, rng, step % 50 == 0).items():
            drops[(step, layer)] = rate  # the canonical series: attempt 2 from step 631 on
    ledger = tmp_path / "ledger"
    Ledger.create(ledger).commit([SourceRecord("spool:t", i, raw) for i, raw in enumerate(run.events)])
    other = RunBuilder(run_id="run-s")  # a second, shorter run in the same ledger: for the overlay
    other.start()
    for step in range(1, 301):
        other.step(step, loss=rng.uniform(0.5, 5.0))
    Ledger.open(ledger).commit([SourceRecord("spool:s", i, raw) for i, raw in enumerate(other.events)])
    return ledger, run, losses, drops


@pytest.fixture(scope="module")
def story(tmp_path_factory: pytest.TempPathFactory):
    return _story(tmp_path_factory.mktemp("report"))


def _bucket(step: int, rng: StepRange, buckets: int) -> int:
    return (step - rng.lo) * buckets // rng.span


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 * max(abs(a), abs(b))  # values are written with 6 significant digits


# ---------------------------------------------------------------------------------------- reduction
@pytest.mark.parametrize(("lo", "hi", "buckets"), [(0, 1000, 37), (200, 700, 64), (0, 1000, 2000)])
def test_each_bucket_keeps_its_min_and_max_point(story, lo: int, hi: int, buckets: int) -> None:
    ledger, _run, losses, _drops = story
    rng = StepRange(lo, hi)
    segments = reduce_series(Reader(ledger), "run-r", ["loss"], rng, buckets)["loss"]
    # Directly: per (attempt, superseded) segment and bucket, the lowest and highest loss.
    expected: dict[tuple[int, bool, int], list[tuple[int, float]]] = defaultdict(list)
    for (attempt, step), loss in losses.items():
        if lo <= step <= hi:
            superseded = attempt == 1 and step > 630
            expected[(attempt, superseded, _bucket(step, rng, buckets))].append((step, loss))
    got: dict[tuple[int, bool, int], list[tuple[int, float]]] = defaultdict(list)
    ends: dict[tuple[int, bool], list[int]] = {}
    for seg in segments:
        assert seg["x"] == sorted(seg["x"]), "points in step order"
        ends[(seg["attempt"], seg["superseded"])] = [seg["x"][0], seg["x"][-1]]
        for step, value in zip(seg["x"], seg["y"], strict=True):
            got[(seg["attempt"], seg["superseded"], _bucket(step, rng, buckets))].append((step, value))
    assert got.keys() == expected.keys()
    for (attempt, superseded, bucket), points in expected.items():
        low, high = min(points, key=lambda sv: sv[1]), max(points, key=lambda sv: sv[1])
        want = {low, high}
        # Each segment also keeps its very first and last point: the curve spans exactly its steps.
        steps = sorted(
            step
            for (a, sup, _b), pts in expected.items()
            if (a, sup) == (attempt, superseded)
            for step, _ in pts
        )
        want |= {(step, loss) for step, loss in points if step in (steps[0], steps[-1])}
        assert ends[(attempt, superseded)] == [steps[0], steps[-1]]
        key = (attempt, superseded, bucket)
        assert [s for s, _ in got[key]] == sorted(s for s, _ in want), key
        assert all(_close(g, w) for (_, g), (_, w) in zip(got[key], sorted(want), strict=True)), key
    # The superseded steps 631..640 of attempt 1 are a segment of their own, not hidden.
    if lo <= 631 and hi >= 640:
        superseded = [seg for seg in segments if seg["superseded"]]
        assert [seg["attempt"] for seg in superseded] == [1]
        assert min(superseded[0]["x"]) >= 631 and max(superseded[0]["x"]) <= 640
    # Each segment counts the raw points it stands for; bounded: two per bucket, and its two ends.
    assert sum(seg["raw_points"] for seg in segments) == sum(len(v) for v in expected.values())
    assert sum(len(seg["x"]) for seg in segments) <= (2 * buckets + 2) * len(segments)


def _event_type(kind: str) -> str:
    return kind if kind.startswith("ledger.") else "runledger." + kind


def test_every_event_marker_is_kept_exactly(story) -> None:
    ledger, _run, _losses, _drops = story
    reader = Reader(ledger)
    for lo, hi in [(0, 1000), (250, 650)]:
        markers = run_markers(reader, "run-r", StepRange(lo, hi))
        expected = reader.sql(
            "SELECT type, step, attempt FROM events WHERE stream = 'run-r' AND step BETWEEN ? AND ? AND type NOT IN "
            "('runledger.step.metrics', 'runledger.moe.router_stats') ORDER BY step, stream_seq",
            [lo, hi],
        ).rows
        # A marker's kind is its event type without "runledger." (the ledger's own, ledger.anomaly, keep it).
        got = [(_event_type(m["kind"]), m["step"], m["attempt"]) for m in markers]
        assert sorted(got) == sorted(expected)
    markers = run_markers(reader, "run-r", StepRange(0, 1000))
    by_kind = defaultdict(list)
    for m in markers:
        by_kind[m["kind"]].append(m)
    assert len(by_kind["checkpoint.saved"]) == 640 // 7
    (change,) = by_kind["config.changed"]
    assert change["step"] == 300 and "moe.capacity_factor 1.0 → 1.5" in change["text"]
    (crash,) = by_kind["run.crashed"]
    assert crash["step"] == 640 and crash["superseded"] and "RuntimeError boom" in crash["text"]
    (resume,) = by_kind["run.resumed"]
    assert resume["step"] == 630 and resume["attempt"] == 2 and not resume["superseded"]


def test_pr_merges_and_pushes_are_placed_at_the_step_the_run_had_reached(tmp_path: Path) -> None:
    run = RunBuilder(run_id="run-g")
    run.start(repository="Octo/Hello")
    for step in range(1, 101):
        run.step(step)  # one event a second from T0 + 2 s: step k is logged at T0 + (k + 1) s
    github = [
        make_event(
            payload,
            source="github/webhook",
            stream="octo/hello",
            seq=i,
            id=f"gh-{i}",
            time=T0 + timedelta(seconds=seconds),
        )
        for i, (payload, seconds) in enumerate(
            [
                (
                    GitHubPullRequest(
                        action="closed",
                        repo="octo/hello",
                        number=7,
                        title="Raise capacity",
                        merged=True,
                        merge_commit_sha="c" * 40,
                        actor="ana",
                    ),
                    41.5,
                ),
                (
                    GitHubPush(
                        repo="octo/hello", ref="refs/heads/main", before="b" * 40, after="d" * 40, pusher="bo"
                    ),
                    71.2,
                ),
                (GitHubPullRequest(action="opened", repo="octo/hello", number=8, title="Not merged"), 80.0),
            ]
        )
    ]
    raws = [*run.events, *(encode_event(e) for e in github)]
    ledger = tmp_path / "ledger"
    Ledger.create(ledger).commit([SourceRecord("spool:g", i, raw) for i, raw in enumerate(raws)])
    markers = [
        m for m in run_markers(Reader(ledger), "run-g", StepRange(0, 100)) if m["kind"].startswith("github")
    ]
    assert [(m["kind"], m["step"]) for m in markers] == [("github.merge", 40), ("github.push", 70)]
    assert markers[0]["text"] == "PR #7 merged (ccccccc) by ana: Raise capacity"
    assert markers[1]["text"].startswith("push to refs/heads/main (ddddddd) by bo")


def test_router_view_against_a_direct_computation(story) -> None:
    ledger, _run, _losses, drops = story
    rng = StepRange(0, 1000)
    view = router_view(Reader(ledger), "run-r", rng, 2000, None)
    heat = min(2000, HEATMAP_BUCKETS, rng.span)
    cells: dict[tuple[int, int], list[float]] = defaultdict(list)
    for (step, layer), rate in drops.items():
        cells[(_bucket(step, rng, heat), layer)].append(rate)
    got = {(b, layer): v for b, layer, v in view["drop_cells"]}
    assert got.keys() == cells.keys()
    assert all(_close(got[k], sum(v) / len(v)) for k, v in cells.items())
    # The capacity factor as a step function: 1.0 from the start, 1.5 from the change at step 300 on
    # (the resume at 630 carries it over), to the end of the range.
    cap = view["capacity"]
    assert list(zip(cap["x"], cap["capacity_factor"], strict=True)) == [
        (0, 1.0),
        (300, 1.5),
        (630, 1.5),
        (1000, 1.5),
    ]
    assert view["layers"] == list(range(LAYERS))
    logged = [s for s in range(50, 1001, 50)]
    assert view["logged_expert_steps"] == len(logged)
    assert view["expert_step"] == 1000 and set(view["expert_steps"]) <= set(logged)
    assert all(len(rows) == LAYERS and len(rows[0]) == 1 + EXPERTS for rows in view["expert_load"].values())


def test_page_is_self_contained_and_its_data_round_trips(story, tmp_path: Path) -> None:
    ledger, _run, _losses, _drops = story
    report = build_report(Reader(ledger), ["run-r"], buckets=100)
    page = render_html(report)
    assert "Content-Security-Policy" in page and "default-src 'none'" in page
    # Outside the inlined scripts' text, no element loads anything (no src, no href).
    markup = re.sub(r"(<script[^>]*>).*?(</script>)", r"\1\2", page, flags=re.S)
    assert markup.count("<script") == 3
    assert not re.search(r"\s(src|href)\s*=", markup, re.I), "nothing is loaded from outside the file"
    # The note's "</script>" cannot end the data early: the embedded JSON reads back whole.
    data = re.search(r'<script id="report-data" type="application/json">(.*?)</script>', page, re.S).group(1)
    assert json.loads(data) == json.loads(json.dumps(report, default=str))
    assert any(m["text"].endswith(HOSTILE_NOTE) for m in json.loads(data)["runs"][0]["markers"])


def test_several_runs_are_overlaid_each_with_its_own_range_and_markers(story) -> None:
    ledger, _run, _losses, _drops = story
    report = build_report(Reader(ledger), ["run-r", "run-s"], to_step=500, buckets=50)
    runs = {r["run_id"]: r for r in report["runs"]}
    assert list(runs) == ["run-r", "run-s"]
    assert runs["run-r"]["range"] == [0, 500] and runs["run-s"]["range"] == [0, 300]
    assert [m["kind"] for m in runs["run-s"]["markers"]] == ["run.started"]
    assert max(runs["run-s"]["series"]["loss"][0]["x"]) == 300
    assert runs["run-s"]["router"]["drop_cells"] == []  # no router statistics: an empty heatmap, not an error


def test_record_status_says_whether_the_signed_checkpoints_match(story, tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    shutil.copytree(story[0], ledger)
    private, public = write_keypair(tmp_path / "keys", "test")
    _other_private, other_public = write_keypair(tmp_path / "other", "test")
    reader = Reader(ledger)
    unsigned = record_status(reader, None, None)
    assert {s["stream"]: s["checkpoint"] for s in unsigned["streams"]} == {
        "run-r": "not signed",
        "run-s": "not signed",
    }
    sign_checkpoints(ledger, private.read_text().strip())
    signed = record_status(reader, public.read_text().strip(), public)
    for stream in signed["streams"]:
        assert stream["checkpoint"] == "matches the record (signature verified)"
        assert stream["signed_size"] == stream["size"] and len(stream["root"]) == 64
    assert signed["command"] == f"ledger verify --ledger {ledger.resolve()} --public-key {public}"
    wrong_key = record_status(reader, other_public.read_text().strip(), other_public)
    assert all(s["checkpoint"].startswith("FAILS") for s in wrong_key["streams"])
    # The ledger grew after signing: the older signed size is checked against the log's leaves.
    run = RunBuilder(run_id="run-s", seq=301)
    run.step(301)
    Ledger.open(ledger).commit([SourceRecord("spool:s", 301, run.events[0])])
    grown = {
        s["stream"]: s for s in record_status(Reader(ledger), public.read_text().strip(), public)["streams"]
    }
    assert grown["run-s"]["size"] == grown["run-s"]["signed_size"] + 1
    assert grown["run-s"]["checkpoint"] == "matches the record (signature verified)"


def test_cli_report_and_plot(story, tmp_path: Path) -> None:
    ledger, _run, _losses, _drops = story
    runner = CliRunner()
    out = tmp_path / "r.html"
    result = runner.invoke(
        app, ["report", "run-r", "-o", str(out), "--ledger", str(ledger), "--from-step", "100"]
    )
    assert result.exit_code == 0, result.output
    assert out.stat().st_size > 1_000_000  # the chart library is inside
    bad = runner.invoke(
        app,
        ["report", "run-r", "-o", str(out), "--ledger", str(ledger), "--from-step", "9", "--to-step", "3"],
    )
    assert bad.exit_code == 1 and "--from-step 9 is after --to-step 3" in bad.output
    unknown = runner.invoke(app, ["report", "nope", "-o", str(out), "--ledger", str(ledger)])
    assert unknown.exit_code == 1 and "unknown run 'nope'" in unknown.output
    png, svg = tmp_path / "p.png", tmp_path / "p.svg"
    assert (
        runner.invoke(app, ["plot", "run-r", "loss", "lr", "-o", str(png), "--ledger", str(ledger)]).exit_code
        == 0
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (
        runner.invoke(app, ["plot", "run-r", "loss", "-o", str(svg), "--ledger", str(ledger)]).exit_code == 0
    )
    assert "<svg" in svg.read_text()
    missing = runner.invoke(app, ["plot", "run-r", "nope", "-o", str(png), "--ledger", str(ledger)])
    assert missing.exit_code == 1 and "has no metric nope" in missing.output


# ---------------------------------------------------------------------------------------- in a browser
def open_offline(html_file: Path, window: tuple[int, int] = (1400, 1800)) -> Any:
    """A headless Chromium with the network emulated offline, on ``html_file`` as a file:// URL."""
    args = (f"--window-size={window[0]},{window[1]}", "--hide-scrollbars", "--force-device-scale-factor=1")
    driver = chromium(args, {"browser": "ALL", "performance": "ALL"})
    driver.execute_cdp_cmd("Network.enable", {})
    driver.execute_cdp_cmd(
        "Network.emulateNetworkConditions",
        {"offline": True, "latency": 0, "downloadThroughput": -1, "uploadThroughput": -1},
    )
    driver.get(html_file.resolve().as_uri())
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, 60).until(
        lambda d: d.execute_script("return !!(window.__report && window.__report.complete)")
    )
    return driver


def screenshot(driver: Any, png: Path) -> Path:
    png.parent.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(png))
    return png


@pytest.fixture(scope="module")
def demo_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The real demo (trainer → spool → ledger, shortened), which ends by writing its report."""
    workdir = tmp_path_factory.mktemp("demo") / "demo"
    result = CliRunner().invoke(
        app, ["demo", "--workdir", str(workdir), "--steps", "40", "--crash-at", "30", "--change-at", "10"]
    )
    assert result.exit_code == 0, result.output
    report = workdir / "report.html"
    assert str(report) in result.output.replace("\n", "")
    run_id = Reader(workdir / "ledger").sql("SELECT run_id FROM runs").rows[0][0]
    return report, run_id


_COUNT_INKED = """
const c = arguments[0].querySelector('canvas');
if (!c) return 0;
const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
let n = 0;
for (let i = 0; i < d.length; i += 4) if (d[i + 3] > 0 && (d[i] < 240 || d[i + 1] < 240 || d[i + 2] < 240)) n++;
return n;
"""

_SHOW_MARKER = """
const [name, kind] = arguments;
const entry = window.__report.charts.find(c => c.name === name);
const option = entry.chart.getOption();
for (let s = 0; s < option.series.length; s++) {
  const i = (option.series[s].data || []).findIndex(d => d && d.marker && d.marker.kind === kind);
  if (option.series[s].type === 'scatter' && i >= 0) {
    entry.chart.dispatchAction({type: 'showTip', seriesIndex: s, dataIndex: i});
    return true;
  }
}
return false;
"""


def test_demo_report_in_a_browser_offline(demo_report: tuple[Path, str]) -> None:
    report, _run_id = demo_report
    driver = open_offline(report)
    try:
        charts = driver.execute_script("return window.__report.charts.map(c => c.name)")
        # 5 curves, mean drop + capacity, imbalance, attempts, and per run: drop heatmap, expert load.
        assert len(charts) == 10, charts
        boxes = driver.find_elements("css selector", "[data-chart]")
        assert len(boxes) == len(charts)
        for box in boxes:
            inked = driver.execute_script(_COUNT_INKED, box)
            assert inked > 500, f"{box.get_attribute('data-chart')} drew {inked} pixels"
        # The demo's config change, crash and resume are markers on the loss curve, with their text.
        expected = {
            "config.changed": "moe.capacity_factor 1.0 → 1.25",
            "run.crashed": "RuntimeError injected crash at step 30",
            "run.resumed": "attempt 2 resumed from checkpoint step 20",
        }
        from selenium.webdriver.support.ui import WebDriverWait

        loss = driver.find_element("css selector", '[data-chart="curve:loss"]')
        kinds = driver.execute_script(
            "return window.__report.charts.find(c => c.name === 'curve:loss').chart.getOption().series"
            ".flatMap(s => (s.data || []).filter(d => d && d.marker).map(d => d.marker.kind))"
        )
        for kind, text in expected.items():
            assert driver.execute_script(_SHOW_MARKER, "curve:loss", kind), f"no {kind} marker among {kinds}"
            WebDriverWait(driver, 10).until(lambda d, t=text: t in loss.text)
        events = driver.find_element("id", "events").text
        assert all(text in events for text in expected.values())
        assert "matches the record (signature verified)" in driver.find_element("tag name", "main").text
        assert "ledger verify --ledger" in driver.find_element("id", "verify-command").text
        screenshot(driver, ARTIFACTS / "report.png")
        # Nothing went wrong and nothing left the page.
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert errors == []
        assert driver.execute_script("return performance.getEntriesByType('resource').length") == 0
        page_url = report.resolve().as_uri()
        requested = []
        for entry in driver.get_log("performance"):
            message = json.loads(entry["message"])["message"]
            if message["method"] == "Network.requestWillBeSent":
                url = message["params"]["request"]["url"]
                if url != page_url and not url.startswith("data:"):
                    requested.append(url)
        assert requested == []
    finally:
        driver.quit()


_DRAW_ORDER = """
const r = window.__report, names = r.timings.map(t => t[0]);
const cut = names.indexOf('first screen');
const onScreen = r.charts.filter(c => c.el.getBoundingClientRect().top < window.innerHeight).map(c => c.name);
return {before: names.slice(0, cut).filter(n => r.charts.some(c => c.name === n)),
        after: names.slice(cut).filter(n => r.charts.some(c => c.name === n)), onScreen: onScreen,
        all: r.charts.map(c => c.name)};
"""

_LINES_AND_SYMBOLS = """
const option = window.__report.charts.find(c => c.name === 'curve:loss').chart.getOption();
const kinds = {symbols: [], lines: []};
option.series.forEach(s => {
  (s.data || []).forEach(d => { if (d && d.marker) kinds.symbols.push(d.marker.kind); });
  ((s.markLine || {}).data || []).forEach(d => kinds.lines.push(d.name));
});
return kinds;
"""


def test_first_screen_drawn_first_then_every_chart(demo_report: tuple[Path, str]) -> None:
    """The charts on the first screen are drawn before the page says ready, the others after it, each
    once, and routine checkpoints are symbols without a line through every chart."""
    report, _run_id = demo_report
    driver = open_offline(report)
    try:
        order = driver.execute_script(_DRAW_ORDER)
        assert order["before"] == order["onScreen"] and order["before"], order
        assert sorted(order["before"] + order["after"]) == sorted(order["all"]), order
        assert order["after"], "the demo page is longer than one screen"
        kinds = driver.execute_script(_LINES_AND_SYMBOLS)
        assert "checkpoint.saved" in kinds["symbols"] and "run.crashed" in kinds["symbols"]
        assert not any(name.startswith("checkpoint at step") for name in kinds["lines"]), kinds["lines"]
        assert any(name.startswith("crash at step") for name in kinds["lines"]), kinds["lines"]
    finally:
        driver.quit()


@pytest.mark.skipif(
    not os.environ.get("RUNLEDGER_UPDATE_SCREENSHOT"), reason="set RUNLEDGER_UPDATE_SCREENSHOT=1"
)
def test_update_readme_screenshot(demo_report: tuple[Path, str]) -> None:
    """docs/report.png, the README's picture, from the real demo report (run on purpose, not by default)."""
    driver = open_offline(demo_report[0], window=(1400, 1500))
    try:
        assert driver.execute_script(_SHOW_MARKER, "curve:loss", "config.changed")  # as if hovered
        screenshot(driver, ROOT / "docs" / "report.png")
    finally:
        driver.quit()
