"""`ledger serve page --witness VKEY [--quorum N]`: cosignatures checked, not counted (issue 28).

A real litewitness (tests/merkle/test_publish.py's fixture: filippo.io/torchwood, on 127.0.0.1)
cosigns what `ledger publish` publishes; the live page checks the cosignatures on the checkpoint it
answers from against the witness keys it is given, over a published copy (``--remote``) and over
the ledger itself (its newest published checkpoint), and says which witnesses verified and whether
the quorum holds. A checkpoint short of the quorum is said so; over a copy, it is not shown as current."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ledger.live_page import Witnesses
from runledger.ledger.publish import log_origin
from runledger.ledger.witness import Witness, _save_policy, load_policy
from tests.merkle.test_publish import (
    Site,
    _cosignature_vkey,
    _free_port,
    _serving,
    _witness_knows,
    litewitness_built,  # noqa: F401 (a fixture the witness fixture needs)
    witness,  # noqa: F401 (the fixture)
)
from tests.web.test_live_page import WAIT_S, _chromium, _open, _page_live_data, _until, serving
from tests.web.test_live_page_remote import serving_published

W1 = "witness.test/w1"


@pytest.fixture()
def cosigned(witness: tuple[str, str, Path], tmp_path: Path) -> Iterator[tuple[Site, str]]:  # noqa: F811
    """A ledger whose published checkpoint litewitness w1 cosigned; (the site, w1's vkey)."""
    url, vkey, directory = witness
    site = Site(tmp_path / "a", key_name=log_origin("pub-test"))  # a witness wants key name = origin
    _witness_knows(directory, site)
    added = CliRunner().invoke(app, ["witness", "add", "w1", url, vkey, "--ledger", str(site.root)])
    assert added.exit_code == 0, added.output
    site.add(30)
    assert site.publish().witnesses == {"w1": "cosigned"}
    yield site, vkey


def _without_the_witness(site: Site) -> None:
    """The next publish asks w1 at an address where nothing listens, and needs no quorum."""
    policy = load_policy(site.root)
    policy.witnesses = [
        Witness(w.name, f"http://127.0.0.1:{_free_port()}/", w.vkey) for w in policy.witnesses
    ]
    policy.quorum = 0
    _save_policy(site.root, policy)


def _streamed_record(url: str) -> dict[str, Any]:
    """The first `record` message of the run's stream (sent when a stream opens)."""
    event = ""
    with httpx.stream("GET", url + "/runs/run-a/events", timeout=WAIT_S) as resp:
        for line in resp.iter_lines():
            event = line[7:] if line.startswith("event: ") else event
            if line.startswith("data: ") and event == "record":
                return dict(json.loads(line[6:]))
    raise AssertionError("the stream ended without a record message")


def _record(url: str) -> dict[str, Any]:
    page = httpx.get(url + "/runs/run-a", timeout=WAIT_S)
    assert page.status_code == 200, page.text
    return dict(_page_live_data(page.text)["record"])


def test_over_a_copy_the_page_checks_each_cosignature_and_holds_back_a_checkpoint_short_of_quorum(
    cosigned: tuple[Site, str], tmp_path: Path
) -> None:
    site, vkey = cosigned
    other = _cosignature_vkey("witness.test/other")  # a witness that never cosigned this log
    with _serving(site.dest) as copy:
        # w1 and another witness, quorum 1: w1's cosignature verifies, the other's is missing, the quorum holds.
        keys = Witnesses.of([vkey, other], 1)
        with serving_published(copy, site.vkey, tmp_path / "c1", witnesses=keys) as url:
            record = _record(url)
            check = record["cosigned"]
            assert check["witnesses"] == [
                {"name": W1, "verified": True},
                {"name": "witness.test/other", "verified": False},
            ]
            assert check["verified"] == [W1] and check["quorum"] == 1 and check["quorum_met"] is True
            assert check["summary"].startswith("quorum holds: 1 of 2 witnesses verified (witness.test/w1)")
            size = record["signed_size"]

            # A publish that w1 did not cosign: not shown as current; the page says the newer one lacks quorum.
            _without_the_witness(site)
            site.add(5)
            assert site.publish().witnesses["w1"].startswith("unreachable")
            told: list[dict[str, Any]] = []

            def newer_said() -> bool:
                told[:] = [_streamed_record(url)]
                return bool(told[-1].get("newer"))

            _until(newer_said, "the record says the newer checkpoint lacks quorum")
            assert (
                "lacks the witnesses' quorum" in told[-1]["newer"]
                and "0 valid cosignatures" in told[-1]["newer"]
            )
            assert told[-1]["signed_size"] == size  # still answering from the one with its quorum
            assert _page_live_data(httpx.get(url + "/runs/run-a", timeout=WAIT_S).text)["after"] == 30

        # Quorum 2 of (w1, other): no checkpoint of this copy has it, so nothing is shown, and that is said.
        with serving_published(
            copy, site.vkey, tmp_path / "c2", witnesses=Witnesses.of([vkey, other])
        ) as url:
            page = _until(
                lambda: (r := httpx.get(url + "/runs/run-a", timeout=WAIT_S)).status_code == 503 and r, "503"
            )
            assert (
                "lacks the witnesses' quorum" in page.text
                and "nothing is shown until one has it" in page.text
            )
            health = httpx.get(url + "/healthz", timeout=WAIT_S)
            assert health.status_code == 503 and "quorum" in health.json()["lost"]


def test_over_the_ledger_the_page_checks_its_newest_published_checkpoint(
    cosigned: tuple[Site, str], tmp_path: Path
) -> None:
    site, vkey = cosigned
    with serving(site.root, witnesses=Witnesses.of([vkey])) as url:
        published = _record(url)["published"]
        assert published["size"] == site.checkpoint()[0]
        assert published["signers"] == [log_origin("pub-test"), W1]
        assert published["cosigned"]["verified"] == [W1] and published["cosigned"]["quorum_met"] is True
        # A publish nobody cosigned: the open page's record turns to "lacks quorum" (no reload).
        _without_the_witness(site)
        site.add(5)
        site.publish()
        lacking = _until(
            lambda: (p := _streamed_record(url)["published"])["size"] > published["size"] and p,
            "the newer publish seen",
        )
        assert lacking["cosigned"]["quorum_met"] is False and lacking["cosigned"]["verified"] == []
        assert lacking["cosigned"]["summary"].startswith("LACKS QUORUM: 0 of 1 witnesses verified (none)")
    other = _cosignature_vkey("witness.test/other")
    with serving(site.root, witnesses=Witnesses.of([other], 1)) as url:  # a key that never cosigned
        assert _record(url)["published"]["cosigned"]["witnesses"] == [
            {"name": "witness.test/other", "verified": False}
        ]
    with serving(site.root) as url:  # no keys: counted and said to be unchecked
        summary = _record(url)["published"]["cosigned"]["summary"]
        assert summary == "no cosignatures"  # the newest publish had none


def test_the_browser_shows_which_witness_verified(cosigned: tuple[Site, str]) -> None:
    site, vkey = cosigned
    driver = _chromium()
    try:
        with serving(site.root, witnesses=Witnesses.of([vkey])) as url:
            _open(driver, url + "/runs/run-a")
            text = driver.find_element("id", "record-now").text
            assert f"witness {W1} cosignature verified" in text, text
            assert "quorum holds: 1 of 1 witnesses verified" in text, text
            cls = driver.execute_script(
                "return Array.prototype.filter.call(document.querySelectorAll('#record-now td'),"
                " function (td) { return /^quorum holds/.test(td.textContent); })[0].className"
            )
            assert cls == "ok"
            driver.get("about:blank")
    finally:
        driver.quit()


def test_cli_refuses_bad_witness_keys_and_quorums_in_one_line(tmp_path: Path) -> None:
    key = _cosignature_vkey("witness.test/k")
    ledger = ["--ledger", str(tmp_path / "nowhere")]
    for words, expected in [
        (["--witness", "not-a-key"], "bad --witness/--quorum: malformed witness key"),
        (["--witness", key, "--quorum", "2"], "bad --witness/--quorum: --quorum 2: give 0..1"),
        (["--quorum", "1"], "--quorum needs --witness VKEY"),
    ]:
        result = CliRunner().invoke(app, ["serve", "page", *ledger, *words], env={"COLUMNS": "200"})
        assert result.exit_code == 2, (words, result.output)
        assert result.output.strip().splitlines() == [result.output.strip()] and expected in result.output
    path = tmp_path / "w.vkey"
    path.write_text(key + "\n")
    result = CliRunner().invoke(app, ["serve", "page", *ledger, "--witness", str(path)])
    assert result.exit_code == 1 and "no ledger at" in result.output  # the key file read; then the ledger


def test_witnesses_of_checks_keys_and_quorum() -> None:
    key = _cosignature_vkey("witness.test/k")
    assert Witnesses.of([key]).quorum == 1 and Witnesses.of([key], 0).quorum == 0
    with pytest.raises(ValueError, match=r"give 0\.\.1"):
        Witnesses.of([key], -1)
    check = Witnesses().check("body\n\n— log AAAA\n— someone BBBB\n", {"log"})
    assert check["cosignatures"] == 1 and "not checked (no --witness keys given)" in check["summary"]
    assert json.dumps(check)  # what the page embeds
