"""Fixtures for the GitHub tests: the recorded-API server, spools, a running webhook receiver."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.github import FixtureGitHub


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
