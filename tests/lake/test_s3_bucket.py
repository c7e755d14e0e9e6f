"""`ledger s3 bucket create` (issue 41) against a real S3-compatible server: versitygw (scripts/s3.sh)
on 127.0.0.1. It makes the bucket a lake or a publish needs, says so when it is there already, and
wrong credentials are one line."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ledger.publish_dest import S3Config
from tests.support.s3 import AWS_CLEARED, running_s3_server


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    for server in running_s3_server(tmp_path_factory):
        yield server.env


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
