"""Topics for an operator (issue 41), against the real broker: `ledger kafka topic create|describe|
add-partitions`, the ingester's warning when its group has more members than the topic has
partitions, and a topic that is not there as one line that names the command that makes it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kafka import KafkaAdminClient
from typer.testing import CliRunner

from runledger.cli.main import app
from tests.support.kafka import unique_topic_name
from tests.support.kafka_clients import IngesterProc, ingest_args, run_cli, wait_for

ENV = {"RUNLEDGER_PROGRESS_S": "off", "COLUMNS": "400"}


def invoke(*args: str, code: int = 0) -> tuple[str, str]:
    """(stdout, stderr) of a `ledger` command through the CLI runner, which must exit ``code``."""
    result = CliRunner().invoke(app, list(args), env=ENV)
    assert result.exit_code == code, result.output
    return result.stdout, result.stderr


@pytest.fixture
def new_topic(kafka_broker) -> Iterator[str]:
    """A topic name nobody made yet; deleted after the test if a command made it."""
    name = unique_topic_name("admin")
    yield name
    admin = KafkaAdminClient(bootstrap_servers=kafka_broker.bootstrap, request_timeout_ms=15000)
    try:
        admin.delete_topics([name], raise_errors=False)
    finally:
        admin.close()


def test_create_describe_and_add_partitions(kafka_broker, new_topic: str) -> None:
    at = ["--bootstrap", kafka_broker.bootstrap]
    _, err = invoke("kafka", "topic", "create", new_topic, "--config", "retention.ms", *at, code=2)
    assert err == "error: --config 'retention.ms': give KEY=VALUE, e.g. retention.ms=-1\n"
    out, _ = invoke(
        "kafka", "topic", "create", new_topic, "--partitions", "3", "--config", "retention.ms=-1", *at
    )
    assert out == f"topic {new_topic} created with 3 partitions\n"
    out, _ = invoke("kafka", "topic", "create", new_topic, "--partitions", "3", *at)
    assert out == f"topic {new_topic} exists with 3 partitions\n"
    _, err = invoke("kafka", "topic", "create", new_topic, "--partitions", "5", *at, code=1)
    assert err == (
        f"error: topic {new_topic} exists with 3 partitions, not 5 "
        f"(`ledger kafka topic add-partitions {new_topic} --partitions N` adds some)\n"
    )

    out, _ = invoke("kafka", "topic", "describe", new_topic, "--group", "nobody-yet", *at)
    assert out.splitlines() == [
        f"topic {new_topic}: 3 partitions, replication 1; group nobody-yet: 0 members",
        *(f"  partition {p}: end 0, committed -, lag -" for p in range(3)),
    ]

    out, err = invoke("kafka", "topic", "add-partitions", new_topic, "--partitions", "4", *at)
    assert out == f"topic {new_topic} 3 -> 4 partitions\n"
    assert err.startswith("note: keys now map to other partitions"), err
    _, err = invoke("kafka", "topic", "add-partitions", new_topic, "--partitions", "2", *at, code=1)
    assert err == f"error: topic {new_topic} has 4 partitions; Kafka cannot lower the count to 2\n"


def test_a_missing_topic_is_one_line_naming_the_command_that_makes_it(kafka_broker, tmp_path: Path) -> None:
    missing = unique_topic_name("missing")
    _, err = invoke("kafka", "topic", "describe", missing, "--bootstrap", kafka_broker.bootstrap, code=1)
    assert err == f"error: topic {missing} does not exist\n"

    out = run_cli("ingest", "kafka", *ingest_args(tmp_path / "ledger", kafka_broker.bootstrap, "g", missing))
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        f"error: topic {missing} does not exist on {kafka_broker.bootstrap} (PLAINTEXT); "
        f"`ledger kafka topic create {missing} --partitions 12` makes it, or --wait-for-topic SECONDS waits for it"
    ]
    assert out.stdout == ""


def test_two_ingesters_on_one_partition_warn_that_one_sits_idle(
    kafka_broker, make_topic, tmp_path: Path
) -> None:
    topic = make_topic(partitions=1)
    procs = [
        IngesterProc(
            ingest_args(tmp_path / "ledger", kafka_broker.bootstrap, "idle-group", topic, "--no-deadletter"),
            tmp_path / f"ingest-{i}.log",
        )
        for i in range(2)
    ]
    warning = (
        f"warning: consumer group idle-group has 2 members but topic {topic} has 1 partition: 1 sits idle; "
        f"`ledger kafka topic add-partitions {topic} --partitions 2` (or kafka-topics --alter --partitions 2) "
        "gives each one"
    )
    try:
        wait_for(lambda: any(warning in p.output() for p in procs), 120, "the idle-members warning", 0.5)
    finally:
        codes = [p.terminate() for p in procs]
    assert codes == [0, 0], [p.output() for p in procs]
    assert sum(p.output().count(warning) for p in procs) >= 1
