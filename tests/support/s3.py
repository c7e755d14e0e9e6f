"""A real S3-compatible server for tests: versitygw, built from the Go module proxy into .go/ and
started, stopped and restarted by scripts/s3.sh in a folder of the test's tmp dir (its port and keys
kept there), on 127.0.0.1 with generated credentials. One helper for every S3 test module."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from runledger.ledger.publish_dest import S3Config

S3_SH = Path(__file__).resolve().parents[2] / "scripts" / "s3.sh"
# AWS variables a developer's shell may hold that would point a client elsewhere.
AWS_CLEARED = ("AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION", "AWS_PROFILE")


class S3Server:
    """versitygw in ``folder``: ``env`` holds its AWS_* variables once started."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.env: dict[str, str] = {}
        self.buckets = 0

    def start(self) -> None:
        done = subprocess.run(
            [str(S3_SH), "start", str(self.folder)], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        lines = (self.folder / "s3.env").read_text().splitlines()
        self.env = dict(line.removeprefix("export ").split("=", 1) for line in lines if line)

    def stop(self) -> None:
        subprocess.run([str(S3_SH), "stop", str(self.folder)], capture_output=True, timeout=60, check=True)

    @property
    def config(self) -> S3Config:
        return S3Config.from_env(self.env)

    def make_bucket(self, name: str) -> str:
        """Bucket ``name``, made through the S3 API (CreateBucket)."""
        self.config.filesystem(allow_bucket_creation=True).create_dir(name)  # type: ignore[attr-defined]
        return name

    def new_bucket(self) -> str:
        """A fresh bucket of its own name."""
        self.buckets += 1
        return self.make_bucket(f"pub{self.buckets}")


def running_s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """The body of a module-scoped fixture: versitygw built (or the test skipped, saying why),
    started, and stopped after the module."""
    built = subprocess.run([str(S3_SH), "build"], capture_output=True, text=True, timeout=600)
    if built.returncode != 0:
        pytest.skip(f"versitygw cannot be built here: {built.stderr.strip()[-300:]}")
    server = S3Server(tmp_path_factory.mktemp("s3"))
    server.start()
    try:
        yield server
    finally:
        server.stop()
