"""The one place that turns runledger's Kafka environment into kafka-python client settings.

Environment contract (also in docs/kafka_bus.md):

  RUNLEDGER_KAFKA_BOOTSTRAP            comma-separated host:port list (``bootstrap_servers``)
  RUNLEDGER_KAFKA_TOPIC_PREFIX         topic names are PREFIX + "events" / PREFIX + "deadletter";
                                       default "runledger." (so ``runledger.events``)
  RUNLEDGER_KAFKA_SECURITY_PROTOCOL    PLAINTEXT (default), SSL, SASL_PLAINTEXT, SASL_SSL
  RUNLEDGER_KAFKA_SASL_MECHANISM       PLAIN, SCRAM-SHA-256, SCRAM-SHA-512
  RUNLEDGER_KAFKA_SASL_USERNAME        SASL user
  RUNLEDGER_KAFKA_SASL_PASSWORD_FILE   file holding the SASL password (one trailing newline stripped)
  RUNLEDGER_KAFKA_SSL_CAFILE           PEM CA bundle that verifies the brokers

``client_kwargs`` is used by the producer, the ingester's consumer and producer, and admin clients,
so every client of a process talks to the cluster the same way.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from kafka import KafkaAdminClient

ENV_BOOTSTRAP = "RUNLEDGER_KAFKA_BOOTSTRAP"
ENV_TOPIC_PREFIX = "RUNLEDGER_KAFKA_TOPIC_PREFIX"
ENV_SECURITY_PROTOCOL = "RUNLEDGER_KAFKA_SECURITY_PROTOCOL"
ENV_SASL_MECHANISM = "RUNLEDGER_KAFKA_SASL_MECHANISM"
ENV_SASL_USERNAME = "RUNLEDGER_KAFKA_SASL_USERNAME"
ENV_SASL_PASSWORD_FILE = "RUNLEDGER_KAFKA_SASL_PASSWORD_FILE"
ENV_SSL_CAFILE = "RUNLEDGER_KAFKA_SSL_CAFILE"

DEFAULT_TOPIC_PREFIX = "runledger."
EVENTS = "events"
DEADLETTER = "deadletter"

# Records per ledger commit for the Kafka readers (group ingester and replay). Per-commit costs (a
# part file per partition, fsyncs, the commit record, tail merges) are spread over more events: the
# group ingester ran ~25% faster than at 5,000 (bench/bench_kafka.py). At the reference run's full
# size replay's peak RSS was 923 MB at 20,000 and 965 MB at 10,000: the batch is not what dominates.
COMMIT_BATCH_MAX = 20_000

PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")


class KafkaConfigError(ValueError):
    """The Kafka environment is incomplete or contradictory (a ValueError: the CLI prints one line)."""


class BrokerUnavailableError(RuntimeError):
    """No broker answered within the bounded wait."""


class TopicUnavailableError(RuntimeError):
    """A topic to read does not exist, has no partitions, or may not be read (the message names the
    topic and the broker)."""


def _env(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name, "").strip()
    return value or None


def topic_prefix(env: Mapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    # An explicitly empty prefix is allowed (topics "events"/"deadletter"), hence no strip-to-None.
    return env.get(ENV_TOPIC_PREFIX, DEFAULT_TOPIC_PREFIX)


def events_topic(env: Mapping[str, str] | None = None) -> str:
    return topic_prefix(env) + EVENTS


def deadletter_topic(env: Mapping[str, str] | None = None) -> str:
    return topic_prefix(env) + DEADLETTER


def bootstrap_from_env(env: Mapping[str, str] | None = None) -> str | None:
    return _env(os.environ if env is None else env, ENV_BOOTSTRAP)


def client_kwargs(bootstrap: str | None = None, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """kafka-python settings shared by every client: servers, TLS and SASL. Fails loudly, never downgrades."""
    env = os.environ if env is None else env
    servers = bootstrap or _env(env, ENV_BOOTSTRAP)
    if not servers:
        raise KafkaConfigError(f"no Kafka bootstrap servers: pass --bootstrap or set {ENV_BOOTSTRAP}")
    kwargs: dict[str, Any] = {"bootstrap_servers": [s.strip() for s in servers.split(",") if s.strip()]}
    protocol = (_env(env, ENV_SECURITY_PROTOCOL) or "PLAINTEXT").upper()
    if protocol not in PROTOCOLS:
        raise KafkaConfigError(f"{ENV_SECURITY_PROTOCOL}={protocol!r} is not one of {', '.join(PROTOCOLS)}")
    kwargs["security_protocol"] = protocol
    if protocol.startswith("SASL_"):
        mechanism = (_env(env, ENV_SASL_MECHANISM) or "").upper()
        username = _env(env, ENV_SASL_USERNAME)
        password_file = _env(env, ENV_SASL_PASSWORD_FILE)
        missing = [
            name
            for name, value in (
                (ENV_SASL_MECHANISM, mechanism),
                (ENV_SASL_USERNAME, username),
                (ENV_SASL_PASSWORD_FILE, password_file),
            )
            if not value
        ]
        if missing:
            raise KafkaConfigError(f"{ENV_SECURITY_PROTOCOL}={protocol} needs {', '.join(missing)}")
        if mechanism not in SASL_MECHANISMS:
            raise KafkaConfigError(
                f"{ENV_SASL_MECHANISM}={mechanism!r} is not one of {', '.join(SASL_MECHANISMS)}"
            )
        assert password_file is not None
        kwargs["sasl_mechanism"] = mechanism
        kwargs["sasl_plain_username"] = username
        kwargs["sasl_plain_password"] = _read_secret(Path(password_file))
    cafile = _env(env, ENV_SSL_CAFILE)
    if cafile:
        if not Path(cafile).is_file():
            raise KafkaConfigError(f"{ENV_SSL_CAFILE}: no such file {cafile}")
        kwargs["ssl_cafile"] = cafile
    return kwargs


def _read_secret(path: Path) -> str:
    try:
        text = path.read_text()
    except OSError as exc:
        raise KafkaConfigError(f"{ENV_SASL_PASSWORD_FILE}: cannot read {path}: {exc.strerror}") from None
    # Exactly one trailing newline goes: editors add it, a password may legitimately end in spaces.
    return text[:-1] if text.endswith("\n") else text


def describe(kwargs: Mapping[str, Any]) -> str:
    """Settings for logs and error messages, the password left out."""
    servers = ",".join(kwargs.get("bootstrap_servers", []))
    return f"{servers} ({kwargs.get('security_protocol', 'PLAINTEXT')})"


@contextlib.contextmanager
def admin_client_for(
    kwargs: dict[str, Any], connect_timeout_s: float, purpose: str = "admin"
) -> Iterator[KafkaAdminClient]:
    """An admin client for settings already resolved (``client_kwargs``), closed after;
    ``BrokerUnavailableError`` when no broker answers within ``connect_timeout_s``."""
    from kafka import KafkaAdminClient  # kafka-python only where a broker is asked
    from kafka.errors import KafkaTimeoutError

    timeout_ms = int(connect_timeout_s * 1000)
    try:
        admin = KafkaAdminClient(
            **kwargs,
            bootstrap_timeout_ms=timeout_ms,
            request_timeout_ms=timeout_ms,
            client_id=f"runledger-{purpose}-{os.getpid()}",
        )
    except KafkaTimeoutError:
        raise BrokerUnavailableError(
            f"no Kafka broker answered at {describe(kwargs)} within {connect_timeout_s:g} s"
        ) from None
    try:
        yield admin
    finally:
        with contextlib.suppress(Exception):
            answer_within(connect_timeout_s, admin.close)


_T = TypeVar("_T")


def answer_within(timeout_s: float, ask: Callable[[], _T]) -> _T:
    """``ask()``'s answer (or what it raised), or TimeoutError after ``timeout_s``. kafka-python's
    blocking calls wait on its IO thread without a bound of their own (``close`` joins that thread
    without one): an answer that never comes leaves one daemon thread behind, not a stuck caller."""
    answer: list[_T] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            answer.append(ask())
        except BaseException as exc:  # handed to the caller
            failed.append(exc)

    thread = threading.Thread(target=run, name="runledger-ask", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if failed:
        raise failed[0]
    if not answer:
        raise TimeoutError(f"no answer within {timeout_s:g} s")
    return answer[0]
