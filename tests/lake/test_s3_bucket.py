"""`ledger s3 bucket create` (issue 41) against a real S3-compatible server: versitygw (scripts/s3.sh)
on 127.0.0.1. It makes the bucket a lake or a publish needs, says so when it is there already, and
wrong credentials are one line."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ledger.publish_dest import S3Config

S3_SH = Path(__file__).resolve().parents[2] / "scripts" / "s3.sh"
AWS_CLEARED = ("AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION", "AWS_PROFILE")


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """versitygw started in a tmp folder (stopped at the end); its AWS_* variables."""
    built = subprocess.run([str(S3_SH), "build"], capture_output=True, text=True, timeout=600)
    if built.returncode != 0:
        pytest.skip(f"versitygw cannot be built here: {built.stderr.strip()[-300:]}")
    folder = tmp_path_factory.mktemp("s3")
    started = subprocess.run([str(S3_SH), "start", str(folder)], capture_output=True, text=True, timeout=60)
    try:
        assert started.returncode == 0, started.stderr
        lines = (folder / "s3.env").read_text().splitlines()
        yield dict(line.removeprefix("export ").split("=", 1) for line in lines if line)
    finally:
        subprocess.run([str(S3_SH), "stop", str(folder)], capture_output=True, timeout=60, check=True)


def invoke(env: dict[str, str], *args: str, code: int = 0) -> tuple[str, str]:
    result = CliRunner().invoke(app, list(args), env={**dict.fromkeys(AWS_CLEARED), **env, "COLUMNS": "400"})
    assert result.exit_code == code, result.output
    return result.stdout, result.stderr


def test_bucket_create_makes_it_once(s3: dict[str, str]) -> None:
    endpoint = s3["AWS_ENDPOINT_URL"]
    out, _ = invoke(s3, "s3", "bucket", "create", "s3://lake-data/runs")
    assert out == f"bucket s3://lake-data created at {endpoint}\n"
    out, _ = invoke(s3, "s3", "bucket", "create", "s3://lake-data")
    assert out == f"bucket s3://lake-data exists at {endpoint}\n"
    s3fs = S3Config.from_env(s3).filesystem()
    assert s3fs.get_file_info("lake-data").type.name == "Directory"  # type: ignore[attr-defined]

    wrong = {**s3, "AWS_SECRET_ACCESS_KEY": "not-the-key"}
    _, err = invoke(wrong, "s3", "bucket", "create", "s3://other", code=1)
    assert err.startswith(f"error: s3://other: {endpoint} refused the credentials"), err
    assert len(err.splitlines()) == 1

    _, err = invoke(s3, "s3", "bucket", "create", "lake-data", code=1)
    assert err == "error: 'lake-data': give s3://bucket/prefix\n"
