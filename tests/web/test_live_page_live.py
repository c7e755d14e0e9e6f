"""The run's page keeps its heatmap, attempts timeline and superseded steps live (issue 28): an open
page in a real headless Chromium, a real uvicorn server, a real ledger committed to while it is open.

After the page loads (run live-r: attempts 1 and 2, the second resumed from step 35), more steps are
committed: attempt 2 runs to step 70 and crashes, attempt 3 resumes from 65 and runs to 75, each
attempt's router stats with its own drop rates. Without a reload the page must show attempt 3 in the
timeline, attempt 2's steps after 65 greyed (its own dashed series, as `ledger report` draws them),
its crash row superseded, and new heatmap buckets holding attempt 3's rates, not attempt 2's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from runledger.ledger.query import Reader
from runledger.ledger.report import build_report
from runledger.ledger.store import Ledger, SourceRecord
from runledger.schemas import config_hash
from runledger.schemas import payloads as p
from tests.support.factory import RunBuilder
from tests.web.test_live_page import HOSTILE, _chromium, _open, _story, _until, serving

LAYERS = 3


@pytest.fixture(scope="module")
def browser() -> Any:
    driver = _chromium()
    try:
        yield driver
    finally:
        driver.quit()


def _router(run: RunBuilder, step: int, rate: float) -> None:
    layers = [
        p.MoeLayerStats(layer=k, tokens=100, top_k=2, dropped=k, token_drop_rate=rate * k)
        for k in range(LAYERS)
    ]
    run._emit(p.MoeRouterStats(layers=layers), step)


def _more(ledger: Path, run: RunBuilder) -> None:
    """Attempt 2 to step 70 (rate 0.05/layer), a crash, attempt 3 from 65 to 75 (rate 0.09/layer)."""
    for step in range(61, 71):
        run.step(step, loss=3.0)
        _router(run, step, 0.05)
    run._emit(p.RunCrashed(kind="exception", exc_type="RuntimeError", message="boom", last_step=70), 70)
    run.attempt += 1  # a resume whose host and job are hostile texts (they reach the attempts table)
    resumed = p.RunResumed(
        config=run.config,
        config_hash=config_hash(run.config),
        host=HOSTILE,
        job_id=HOSTILE,
        git_commit="c" * 40,
        from_checkpoint_step=65,
        previous_attempt=2,
    )
    run._emit(resumed, 65)
    for step in range(66, 76):
        run.step(step, loss=2.0)
        _router(run, step, 0.09)
    Ledger.open(ledger).commit([SourceRecord("spool:t", i, raw) for i, raw in enumerate(run.events)])


def _series(driver: Any, chart: str) -> dict[str, list[float]]:
    """Each line series of ``chart``: its name → the steps of its points."""
    return driver.execute_script(
        "var name = arguments[0];"
        "var c = window.__report.charts.filter(function (c) { return c.name === name; })[0];"
        "var out = {}; c.chart.getOption().series.forEach(function (s) {"
        "  if (s.type === 'line') out[s.name] = (s.data || []).map(function (d) { return Array.isArray(d) ? d[0] : d.value[0]; }); });"
        "return out;",
        chart,
    )


def _option(driver: Any, chart: str, path: str) -> Any:
    return driver.execute_script(
        "var name = arguments[0];"
        "var c = window.__report.charts.filter(function (c) { return c.name === name; })[0];"
        "return c.chart.getOption()" + path + ";",
        chart,
    )


def test_heatmap_attempts_and_superseded_steps_follow_the_stream(tmp_path: Path, browser: Any) -> None:
    ledger = tmp_path / "ledger"
    run = _story(ledger)
    driver = browser
    with serving(ledger) as url:
        try:
            _open(driver, url + "/runs/live-r")
            built_columns = len(_option(driver, "drop-heatmap:live-r", ".xAxis[0].data"))
            built_loss = _series(driver, "curve:loss")
            assert len(_option(driver, "attempts", ".series[0].data")) == 2
            _until(lambda: driver.execute_script("return window.__live.connected"), "the stream connected")
            _more(ledger, run)
            head = Ledger.open(ledger).stream_heads()["live-r"].size
            _until(lambda: driver.execute_script("return window.__live.last") == head - 1, "every new leaf")
            _until(
                lambda: len(_option(driver, "attempts", ".series[0].data")) == 3, "attempt 3 in the timeline"
            )
            live = driver.execute_script("return window.__live")
            assert live["gaps"] == 0 and live["duplicates"] == 0 and live["superseded"] == [[3, 65]]

            # The timeline: attempt 2 ran to 70 but its steps after 65 are superseded; attempt 3 runs 65..75.
            rows = _until(
                lambda: (r := _option(driver, "attempts", ".series[0].data")) and r[2][2] == 75 and r,
                "attempt 3 reached step 75",
            )
            assert rows[1][1:4] == [35, 70, 65] and rows[1][5] == 1  # start, end, live up to; crashed
            assert rows[2][1:4] == [65, 75, 75] and rows[2][5] == 0
            labels = _option(driver, "attempts", ".yAxis[0].data")
            assert labels == ["live-r #1", "live-r #2", "live-r #3"]

            # The curves: attempt 2's points after 65 moved to its dashed superseded series, as the report has them.
            loss = _until(
                lambda: (s := _series(driver, "curve:loss")).get("live-r · attempt 3 · loss") and s,
                "attempt 3 drawn",
            )
            assert max(loss["live-r · attempt 2 · loss"]) <= 65
            # The report's own series are all still there, untouched (a new series never replaces one).
            assert (
                set(built_loss) <= set(loss)
                and loss["live-r · attempt 1 · loss"] == built_loss["live-r · attempt 1 · loss"]
            )
            live_grey = [x for x in loss["live-r · attempt 2 (superseded) · loss"] if x > 60]
            report = build_report(Reader(ledger), ["live-r"])["runs"][0]
            exact = next(
                seg["x"] for seg in report["series"]["loss"] if seg["attempt"] == 2 and seg["superseded"]
            )
            assert live_grey == [x for x in exact if x > 60] == list(range(66, 71))
            assert loss["live-r · attempt 3 · loss"] == list(range(66, 76))
            grey_style = driver.execute_script(
                "var c = window.__report.charts.filter(function (c) { return c.name === 'curve:loss'; })[0];"
                "return c.chart.getOption().series.filter(function (s) {"
                " return s.name === 'live-r · attempt 2 (superseded) · loss'; })[0].lineStyle.type"
            )
            assert grey_style == "dashed"
            assert max(_series(driver, "mean-drop")["live-r · mean drop rate"]) == 75

            # The events table: attempt 2's crash at step 70 is superseded, attempt 3's launch is not.
            classes = driver.execute_script(
                "return Array.prototype.map.call(document.querySelectorAll('#events tbody tr'),"
                " function (tr) { return [tr.children[1].textContent, tr.children[2].textContent,"
                " tr.children[3].textContent, tr.className]; })"
            )
            crash = [c for c in classes if c[:3] == ["70", "2", "crash"]]
            assert crash and crash[0][3] == "superseded", classes
            assert all(c[3] != "superseded" for c in classes if c[1] == "3")

            # The heatmap: new buckets for steps 61..75, attempt 3's rates where it replaced attempt 2.
            labels = _option(driver, "drop-heatmap:live-r", ".xAxis[0].data")
            assert len(labels) > built_columns and labels[-1] == 75
            cells = _option(driver, "drop-heatmap:live-r", ".series[0].data")
            by_step: dict[int, dict[int, float]] = {labels[c[0]]: {} for c in cells if c[0] >= built_columns}
            for column, layer, value in cells:
                if column >= built_columns:
                    by_step[labels[column]][layer] = value
            assert sorted(by_step) == list(range(61, 76))
            assert by_step[63][2] == pytest.approx(0.10)  # attempt 2 (0.05 × layer 2), not superseded
            assert by_step[68][2] == pytest.approx(0.18)  # attempt 3 (0.09 × layer 2): attempt 2's left out
            assert driver.execute_script("return window.__live.heatSteps") == 15
            # The live attempts row: the hostile host and job shown whole, as text.
            row = driver.execute_script(
                "var rows = document.querySelectorAll('[data-chart=\"attempts\"] + table tbody tr[data-live]');"
                "return Array.prototype.map.call(rows, function (tr) { return tr.textContent; });"
            )
            assert len(row) == 1 and row[0].count(HOSTILE) == 2, row
            assert driver.execute_script(
                "return window.__pwned === undefined && !document.querySelector('img')"
            )
            severe = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
            assert not severe, severe
        finally:
            driver.get("about:blank")
