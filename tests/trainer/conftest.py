"""Fixtures of the trainer tests (the shared helpers live in ``tests.support.trainer``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.sinks import ListSink

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Megatron-Core warns about the absent Transformer Engine / Apex and its own deprecations on
    # every model build: expected on CPU, noise in these tests' reports.
    for item in items:
        if HERE in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.filterwarnings("ignore:.*:UserWarning:megatron"))
            item.add_marker(pytest.mark.filterwarnings("ignore:.*:DeprecationWarning:megatron"))
            item.add_marker(pytest.mark.filterwarnings("ignore:.*:DeprecationWarning:torch"))


@pytest.fixture
def sink() -> ListSink:
    return ListSink()
