"""Run a real single-node Kafka broker for tests, via ``scripts/kafka.sh``.

Importable without pytest::

    from tests.support.kafka import Broker
    with Broker(dir=".kafka/mytest", port=39192) as b:
        print(b.bootstrap)      # "127.0.0.1:39192"
        b.restart()             # same data dir, same ports

``broker_fixture()`` is the generator behind the ``kafka_broker`` pytest
fixture: it yields an owned, freshly started broker in a temp dir under the
repo's ``.kafka/`` (removed afterwards), or, when
``RUNLEDGER_TEST_KAFKA_BOOTSTRAP`` is set, an ``ExternalBroker`` that only
knows its bootstrap address (``owned`` is False; it cannot be stopped).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "kafka.sh"
KAFKA_HOME = REPO_ROOT / ".kafka"
EXTERNAL_ENV = "RUNLEDGER_TEST_KAFKA_BOOTSTRAP"

_BOOTSTRAP_RE = re.compile(r"^KAFKA_BOOTSTRAP=(\S+)$", re.M)


class BrokerError(RuntimeError):
    """``scripts/kafka.sh`` failed; the message carries its stderr."""


def free_ports(n: int = 2) -> list[int]:
    """Return ``n`` distinct currently free TCP ports on 127.0.0.1."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Broker:
    """A broker owned by the caller: state in ``dir``, listening on ``port``.

    ``controller_port`` defaults to a free port. Several instances can run
    side by side as long as dirs and ports differ; jars are shared.
    """

    owned = True

    def __init__(
        self,
        dir: str | os.PathLike[str],
        port: int | None = None,
        controller_port: int | None = None,
        script: str | os.PathLike[str] = SCRIPT,
        start_timeout: float = 180.0,
    ) -> None:
        self.dir = Path(dir).resolve()
        if port is None or controller_port is None:
            p, c = free_ports(2)
            port = port if port is not None else p
            controller_port = controller_port if controller_port is not None else c
        self.port = int(port)
        self.controller_port = int(controller_port)
        self.script = Path(script)
        self.start_timeout = start_timeout

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.dir / "broker.log"

    def _run(self, cmd: str, *extra: str, timeout: float = 120.0, check: bool = True):
        args = [str(self.script), cmd, "--dir", str(self.dir), *extra]
        env = dict(os.environ)
        env.pop("RUNLEDGER_KAFKA_DIR", None)  # --dir wins anyway; keep it unambiguous
        proc = subprocess.run(
            args,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
        if check and proc.returncode != 0:
            raise BrokerError(f"{' '.join(args)} exited {proc.returncode}\n{proc.stderr.strip()}")
        return proc

    def start(self) -> str:
        """Start (fetching jars if needed) and wait until ready; return bootstrap."""
        proc = self._run(
            "start",
            "--port",
            str(self.port),
            "--controller-port",
            str(self.controller_port),
            timeout=self.start_timeout,
        )
        m = _BOOTSTRAP_RE.search(proc.stdout)
        if not m:
            raise BrokerError(f"no KAFKA_BOOTSTRAP line from kafka.sh start:\n{proc.stdout}")
        return m.group(1)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after a timeout. Idempotent."""
        self._run("stop", timeout=90.0)

    def restart(self) -> str:
        self.stop()
        return self.start()

    def is_running(self) -> bool:
        return self._run("status", check=False).returncode == 0

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def __enter__(self) -> Broker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"Broker(dir={str(self.dir)!r}, bootstrap={self.bootstrap!r})"


class ExternalBroker:
    """A broker someone else runs; only the bootstrap address is known."""

    owned = False

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap

    def start(self) -> str:
        return self.bootstrap

    def stop(self) -> None:
        raise BrokerError("cannot stop an external broker (RUNLEDGER_TEST_KAFKA_BOOTSTRAP)")

    restart = stop

    def is_running(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"ExternalBroker(bootstrap={self.bootstrap!r})"


def make_temp_broker_dir(prefix: str = "test-") -> Path:
    """A fresh dir under the repo's ``.kafka/`` (git-ignored)."""
    KAFKA_HOME.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=KAFKA_HOME))


def broker_fixture(
    allow_external: bool = True,
    keep_dir: bool = False,
) -> Iterator[Broker | ExternalBroker]:
    """Generator for a pytest fixture: yield a ready broker, clean up after.

    With ``allow_external`` and ``RUNLEDGER_TEST_KAFKA_BOOTSTRAP`` set, yields
    an ``ExternalBroker`` for that address. Otherwise starts an owned broker on
    free ports in a temp dir under ``.kafka/``, stops it afterwards and
    removes the dir (kept if start failed, or with ``keep_dir``).
    """
    external = os.environ.get(EXTERNAL_ENV, "").strip()
    if allow_external and external:
        yield ExternalBroker(external)
        return
    broker = Broker(make_temp_broker_dir())
    try:
        broker.start()
    except Exception:
        with contextlib.suppress(Exception):
            broker.stop()
        raise
    try:
        yield broker
    finally:
        broker.stop()
        if not keep_dir:
            shutil.rmtree(broker.dir, ignore_errors=True)


def unique_topic_name(hint: str = "t", prefix: str | None = None) -> str:
    """A legal, unique Kafka topic name like ``rltest.my_test.1a2b3c4d``."""
    if prefix is None:
        prefix = os.environ.get("RUNLEDGER_TEST_KAFKA_TOPIC_PREFIX", "rltest.")
    hint = re.sub(r"[^A-Za-z0-9._-]+", "_", hint).strip("._-")[:80] or "t"
    return f"{prefix}{hint}.{uuid.uuid4().hex[:8]}"
