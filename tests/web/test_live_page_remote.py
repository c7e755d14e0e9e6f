"""`ledger serve page --remote URL --log-key VKEY`: the same pages over a published copy
(`ledger publish`), served by a real http.server on 127.0.0.1; the live page (uvicorn) polls its
checkpoint, and only a checkpoint that verifies reaches the open pages. Every wait is bounded."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ledger.live_page import create_published_app
from tests.merkle.test_publish import Site
from tests.merkle.test_remote import Served, _flipped, _serving
from tests.web.test_live_page import WAIT_S, _chromium, _free_port, _open, _page_live_data, _until, read_sse


@contextlib.contextmanager
def serving_published(url: str, key: str, cache: Path, **options: Any) -> Iterator[str]:
    """The live page over the copy at ``url`` in this process (uvicorn in a thread); its base URL."""
    server = uvicorn.Server(
        uvicorn.Config(
            create_published_app(url, key, cache, poll_s=0.1, **options),
            host="127.0.0.1",
            port=_free_port(),
            log_level="warning",
            timeout_graceful_shutdown=1,
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    _until(lambda: server.started, "the server started")
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture()
def site(tmp_path: Path) -> Iterator[tuple[Site, Served]]:
    """A ledger with run-a (a start and 30 steps: leaves 0..30) published and served over HTTP."""
    site = Site(tmp_path)
    site.add(30)
    site.publish()
    with _serving(site.dest) as served:
        yield site, served


def _listen(url: str, out: list[dict[str, Any]], **options: Any) -> threading.Thread:
    def run() -> None:
        out.extend(read_sse(url, **options))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_pages_over_a_published_copy_follow_each_verified_publish(
    site: tuple[Site, Served], tmp_path: Path
) -> None:
    pub, copy = site
    with serving_published(copy.url, pub.vkey, tmp_path / "cache") as url:
        index = httpx.get(url + "/", timeout=WAIT_S)
        assert index.status_code == 200 and "/runs/run-a" in index.text, index.text
        assert "as of the verified published checkpoint runledger/pub-test at " in index.text
        page = httpx.get(url + "/runs/run-a", timeout=WAIT_S)
        assert page.status_code == 200, page.text
        live = _page_live_data(page.text)
        size = pub.checkpoint()[0]
        assert live["after"] == 30 and live["state"]["step"] == 30
        record = live["record"]
        assert record["signed_size"] == size and record["cosignatures"] == 0, record
        assert record["checkpoint"].startswith("signed published checkpoint runledger/pub-test at "), record
        # The open page's stream; then more ingest and a publish: the new leaves arrive, in order.
        got: list[dict[str, Any]] = []
        listener = _listen(url + "/runs/run-a/events", got, ids=5, params={"after": live["after"]})
        # (connected before or after the publish: either way it starts at the leaf after `after`)
        pub.add(5)
        pub.publish()
        listener.join(timeout=WAIT_S)
        assert [m["id"] for m in got if "id" in m] == [31, 32, 33, 34, 35], got
        steps = [m["data"]["step"] for m in got if "id" in m]
        assert steps == list(range(steps[0], steps[0] + 5)) and steps[0] > 30, steps
        assert all(m["event"] == "step" for m in got if "id" in m)
        # A reconnect resumes after its Last-Event-ID, with no duplicate and no gap.
        again = read_sse(url + "/runs/run-a/events", ids=2, headers={"Last-Event-ID": "33"})
        assert [m["id"] for m in again if "id" in m] == [34, 35]
        # The record now answers from the new published checkpoint.
        newer = [m["data"] for m in again if m["event"] == "record"]
        assert newer and newer[-1]["signed_size"] == pub.checkpoint()[0] > size, newer
        state = [m["data"] for m in again if m["event"] == "state"]
        assert state and state[-1]["step"] == steps[-1]


def _listen_until_refused(url: str, told: list[tuple[str, Any]]) -> threading.Thread:
    """An open page's stream, its messages appended as they come, until a `ledger` one says not ok."""

    def run() -> None:
        event = ""
        with httpx.stream("GET", url + "/runs/run-a/events", timeout=WAIT_S) as resp:
            for line in resp.iter_lines():
                event = line[7:] if line.startswith("event: ") else event
                if line.startswith("data: "):
                    told.append((event, json.loads(line[6:])))
                    if event == "ledger" and not told[-1][1]["ok"]:
                        return

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _replace(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".swap")
    tmp.write_bytes(data)
    os.replace(tmp, path)


@pytest.mark.parametrize("what", ["signature", "rollback"])
def test_a_checkpoint_that_fails_verification_is_shown_and_stops_updates(
    site: tuple[Site, Served], tmp_path: Path, what: str
) -> None:
    pub, copy = site
    checkpoint = pub.dest / "checkpoint"
    older = checkpoint.read_bytes()
    with serving_published(copy.url, pub.vkey, tmp_path / "cache") as url:
        assert httpx.get(url + "/runs/run-a", timeout=WAIT_S).status_code == 200
        pub.add(3)
        pub.publish()
        _until(
            lambda: httpx.get(url + "/healthz", timeout=WAIT_S).json()["commit"] == pub.checkpoint()[0],
            "seen",
        )
        told: list[tuple[str, Any]] = []
        listener = _listen_until_refused(url, told)
        _until(lambda: any(event == "record" for event, _ in told), "the open page's stream")
        told_before = len(told)
        # Each change replaces the file whole, as a publisher does (written in place, the page's
        # poller could read it half-written: "malformed", not the failure under test; 1 CI run in ~10).
        good = checkpoint.read_bytes()
        if what == "signature":
            at = len(good) - 10  # a byte of the signature
            _replace(checkpoint, good[:at] + bytes([good[at] ^ 0x01]) + good[at + 1 :])
        else:
            _replace(checkpoint, older)  # validly signed, but smaller than the one seen: a rollback
        listener.join(timeout=WAIT_S)
        assert not listener.is_alive()
        said = [data for event, data in told[told_before:] if event == "ledger"]
        reason = {"signature": "not verified: bad-signature", "rollback": "not verified: rollback"}[what]
        assert said and said[-1]["ok"] is False and said[-1]["message"].startswith(reason), told
        page = httpx.get(url + "/runs/run-a", timeout=WAIT_S)
        assert page.status_code == 503 and reason in page.text, page.text
        # Updates stop for good: the good checkpoint back, and more published, are not even fetched.
        copy.reset()
        _replace(checkpoint, good)
        pub.add(2)
        pub.publish()
        time.sleep(5 * 0.1)  # five polls' time (a negative check: nothing may happen)
        assert "/checkpoint" not in copy.requests, copy.requests
        health = httpx.get(url + "/healthz", timeout=WAIT_S)
        assert health.status_code == 503 and health.json()["lost"].startswith(reason)
        assert httpx.get(url + "/", timeout=WAIT_S).status_code == 503


def test_an_unreachable_copy_is_only_unavailable_and_the_page_resumes_when_it_is_back(
    site: tuple[Site, Served], tmp_path: Path
) -> None:
    pub, copy = site
    hidden = tmp_path / "moved-away"
    with serving_published(copy.url, pub.vkey, tmp_path / "cache") as url:
        told: list[tuple[str, Any]] = []
        listener = _listen_until_refused(url, told)
        _until(lambda: any(event == "record" for event, _ in told), "the open page's stream")
        pub.dest.rename(hidden)  # the server answers 404 for everything: unreachable, not refused
        listener.join(timeout=WAIT_S)
        said = [data for event, data in told if event == "ledger"]
        assert said and not said[-1]["ok"] and "unreachable" in said[-1]["message"], told
        assert "not verified" not in said[-1]["message"]
        assert httpx.get(url + "/runs/run-a", timeout=WAIT_S).status_code == 503
        hidden.rename(pub.dest)
        pub.add(2)
        pub.publish()
        _until(lambda: httpx.get(url + "/healthz", timeout=WAIT_S).json()["ok"], "the copy is back")
        got = read_sse(url + "/runs/run-a/events", ids=2, params={"after": 30})
        assert [m["id"] for m in got if "id" in m] == [31, 32]


def test_a_tampered_manifest_is_refused_before_any_page(site: tuple[Site, Served], tmp_path: Path) -> None:
    pub, copy = site
    _flipped(pub.dest / "manifest.json", 20)
    with serving_published(copy.url, pub.vkey, tmp_path / "cache") as url:
        for path in ("/", "/runs/run-a"):
            page = httpx.get(url + path, timeout=WAIT_S)
            assert page.status_code == 503 and "not verified: bad-manifest" in page.text, page.text
        stream = httpx.get(url + "/runs/run-a/events", timeout=WAIT_S)
        assert stream.status_code == 503 and "not verified: bad-manifest" in stream.text, stream.text


def test_the_page_in_a_browser_shows_its_published_checkpoint_then_not_verified(
    site: tuple[Site, Served], tmp_path: Path
) -> None:
    pub, copy = site
    driver = _chromium()
    try:
        with serving_published(copy.url, pub.vkey, tmp_path / "cache") as url:
            _open(driver, url + "/runs/run-a")
            record = driver.find_element("id", "record-now").text
            assert "signed published checkpoint runledger/pub-test" in record, record
            assert "witness cosignatures no cosignatures" in record, record
            status = driver.find_element("id", "live-status")
            _until(lambda: status.get_attribute("class") == "live", "the page is live")
            good = (pub.dest / "checkpoint").read_bytes()
            at = len(good) - 10  # a byte of the signature, the file replaced whole (see _replace)
            _replace(pub.dest / "checkpoint", good[:at] + bytes([good[at] ^ 0x01]) + good[at + 1 :])
            _until(lambda: "not verified: bad-signature" in status.text, "the page says not verified")
            assert status.get_attribute("class") == "stale"
            assert "stale" in driver.execute_script("return document.body.className")
            driver.get("about:blank")  # the page's stream closed before the server stops
    finally:
        driver.quit()


def test_cli_serve_page_remote_needs_a_log_key_and_a_url() -> None:
    runner = CliRunner()
    no_key = runner.invoke(app, ["serve", "page", "--remote", "http://127.0.0.1:9/"])
    assert no_key.exit_code == 2 and "--log-key" in no_key.output, no_key.output
    bad_url = runner.invoke(app, ["serve", "page", "--remote", "ftp://x/", "--log-key", "k"])
    assert bad_url.exit_code == 2 and "http://" in bad_url.output, bad_url.output
