"""Fixtures for the GitHub tests: the recorded-API server, spools, a running webhook receiver."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.github import FixtureGitHub, FixturesMissing, load_octokit_examples


@pytest.fixture
def github_api() -> Iterator[FixtureGitHub]:
    with FixtureGitHub() as api:
        yield api


@pytest.fixture
def github_api_no_limits() -> Iterator[FixtureGitHub]:
    """The same recorded responses without the one-off rate-limit answers (fast)."""
    import json

    from tests.support.github import FIXTURES

    routes = [r for r in json.loads((FIXTURES / "routes.json").read_text())["routes"] if not r.get("once")]
    with FixtureGitHub(routes=routes) as api:
        yield api


@pytest.fixture
def spool_dir(tmp_path: Path) -> Path:
    return tmp_path / "spool"


@pytest.fixture(scope="session")
def octokit_examples() -> list[dict[str, Any]]:
    """octokit's real webhook deliveries (58 event types), downloaded by ``scripts/fixtures.sh fetch``.

    Absent: the tests using them are skipped, loudly, unless RUNLEDGER_REQUIRE_FIXTURES is set (as
    ``make test`` sets it), where they fail instead.
    """
    try:
        return load_octokit_examples()
    except FixturesMissing as missing:
        reason = f"REAL GITHUB PAYLOADS NOT TESTED: {missing}"
        if os.environ.get("RUNLEDGER_REQUIRE_FIXTURES"):
            pytest.fail(f"{reason} (RUNLEDGER_REQUIRE_FIXTURES is set)", pytrace=False)
        warnings.warn(reason, stacklevel=1)
        pytest.skip(reason)
