"""The live page's page cache (issue 28: a page over the full reference run opens in under 2 s):
pages are built at the server's start, a kept page is answered at once and rebuilt in the
background when old, and an old page is still exact, since its stream catches it up."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx

from runledger.ledger.live_page import PageCache
from tests.web.test_live_page import (
    WAIT_S,
    _commit_steps,
    _head,
    _page_live_data,
    _story,
    _until,
    read_sse,
    serving,
)


def test_a_kept_page_is_answered_at_once_and_rebuilt_once_in_the_background() -> None:
    cache = PageCache(max_age_s=0.0)
    started, release = threading.Event(), threading.Event()
    built: list[int] = []

    def build() -> str:
        built.append(len(built))
        if len(built) > 1:  # the rebuild: slow, as on a long run
            started.set()
            release.wait(WAIT_S)
        return f"page {len(built)}"

    assert cache.get(("r", 0), build) == "page 1"  # nothing kept: this one waits for its build
    t = time.monotonic()
    answers = [cache.get(("r", 0), build) for _ in range(20)]  # old at once: each asks for a rebuild
    assert time.monotonic() - t < 1.0 and answers == ["page 1"] * 20
    assert started.wait(WAIT_S)
    assert len(built) == 2  # one rebuild, however many visitors asked meanwhile
    release.set()
    _until(lambda: cache.get(("r", 0), build) == "page 2", "the rebuilt page served")
    assert cache.builds >= 2 and all(s >= 0 for s in cache.build_s)


def test_the_server_builds_pages_at_start_and_an_old_page_is_caught_up_exactly(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    run = _story(ledger)
    start = _head(ledger, "live-r")
    with serving(ledger, page_max_age_s=3600.0) as url:
        _until(lambda: httpx.get(url + "/healthz", timeout=WAIT_S).json()["pages_built"] == 1, "warmed")
        head = _commit_steps(ledger, run, range(61, 71))
        _until(lambda: httpx.get(url + "/healthz", timeout=WAIT_S).json()["commit"] == 2, "commit seen")
        page = httpx.get(url + "/runs/live-r", timeout=WAIT_S)
        live = _page_live_data(page.text)
        assert live["after"] == start - 1  # the page kept from the start: older than the commit
        assert httpx.get(url + "/healthz", timeout=WAIT_S).json()["pages_built"] == 1
        messages = read_sse(url + "/runs/live-r/events", ids=head - start, params={"after": live["after"]})
        assert [m["id"] for m in messages if "id" in m] == list(range(start, head))  # nothing missed
        steps = [m["data"]["step"] for m in messages if m["event"] == "step"]
        assert steps == list(range(61, 71))
    with serving(ledger, warm=False) as url:
        time.sleep(0.5)
        assert httpx.get(url + "/healthz", timeout=WAIT_S).json()["pages_built"] == 0
        assert _page_live_data(httpx.get(url + "/runs/live-r", timeout=WAIT_S).text)["after"] == head - 1
