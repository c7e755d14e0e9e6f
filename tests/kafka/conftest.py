"""Fixtures for tests against a real Kafka broker (see tests/support/kafka.py).

- ``kafka_broker`` (session): a ready broker with ``.bootstrap``; started by
  ``scripts/kafka.sh`` on free ports in a temp dir under ``.kafka/`` and
  stopped afterwards, or an external one if RUNLEDGER_TEST_KAFKA_BOOTSTRAP
  is set. Never assumes a broker is already running.
- ``kafka_broker_factory`` (function): ``make(**kw) -> Broker``, isolated
  brokers the test may stop/start/restart; all stopped and removed after.
- ``make_topic`` (function): ``make_topic(partitions=1, hint=None, **configs)
  -> str`` creates a fresh uniquely named topic on ``kafka_broker``, waits
  for leaders, deletes it after. Pass ``bootstrap=`` for another broker.
- ``kafka_topic`` (function): one fresh topic name; partition count via
  indirect parametrisation: ``@pytest.mark.parametrize("kafka_topic", [4],
  indirect=True)`` (an int, or a dict ``{"partitions": 4, "configs": {...}}``).

``tests`` is a package, so this folder imports as ``tests.kafka`` and never
shadows kafka-python.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import pytest
from kafka import KafkaAdminClient

from tests.support.kafka import (
    Broker,
    broker_fixture,
    make_temp_broker_dir,
    unique_topic_name,
)


def pytest_collection_modifyitems(items):
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.kafka)


@pytest.fixture(scope="session")
def kafka_broker():
    yield from broker_fixture()


@pytest.fixture
def kafka_broker_factory():
    brokers: list[Broker] = []

    def make(**kwargs) -> Broker:
        b = Broker(kwargs.pop("dir", None) or make_temp_broker_dir("iso-"), **kwargs)
        brokers.append(b)
        b.start()
        return b

    yield make
    for b in brokers:
        try:
            b.stop()
        finally:
            shutil.rmtree(b.dir, ignore_errors=True)


@pytest.fixture
def make_topic(kafka_broker, request):
    admins: dict[str, KafkaAdminClient] = {}
    created: list[tuple[str, str]] = []

    def admin_for(bootstrap: str) -> KafkaAdminClient:
        if bootstrap not in admins:
            admins[bootstrap] = KafkaAdminClient(
                bootstrap_servers=bootstrap, client_id="runledger-tests", request_timeout_ms=15000
            )
        return admins[bootstrap]

    def make(
        partitions: int = 1,
        hint: str | None = None,
        bootstrap: str | None = None,
        replication_factor: int = 1,
        **configs: str,
    ) -> str:
        bootstrap = bootstrap or kafka_broker.bootstrap
        name = unique_topic_name(hint or request.node.name)
        admin_for(bootstrap).create_topics(
            {
                name: {
                    "num_partitions": partitions,
                    "replication_factor": replication_factor,
                    "configs": {k.replace("_", "."): str(v) for k, v in configs.items()},
                }
            },
            wait_for_metadata=True,
        )
        created.append((bootstrap, name))
        return name

    yield make
    for bootstrap, name in created:
        with contextlib.suppress(Exception):  # broker may have been stopped by the test
            admin_for(bootstrap).delete_topics([name], raise_errors=False)
    for a in admins.values():
        a.close()


@pytest.fixture
def kafka_topic(make_topic, request):
    param = getattr(request, "param", 1)
    if isinstance(param, int):
        return make_topic(partitions=param)
    param = dict(param)
    return make_topic(partitions=param.pop("partitions", 1), **param.pop("configs", {}), **param)
