"""`ledger serve webhooks` / `ledger ingest github` / `ledger ingest wandb` through typer's CliRunner."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import typer
from typer.testing import CliRunner

from runledger.cli.main import app as ledger_app
from runledger.ingest.bus import SpoolSink
from runledger.ingest.github_webhook import signature_of
from tests.support.github import FixtureGitHub, fixture_json, read_events

TOKEN = "ghp_CliT0kenThatMustNotLeak000000000000"


@pytest.fixture
def app() -> typer.Typer:
    return ledger_app


def invoke(app: typer.Typer, *args: str, env: dict[str, str] | None = None) -> typer.testing.Result:
    return CliRunner().invoke(app, list(args), env=env or {"GITHUB_TOKEN": ""})


def one_line_error(result: typer.testing.Result) -> str:
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.output + result.stderr
    return lines[0]


def test_ingest_github_writes_events_to_the_spool(
    app: typer.Typer, github_api_no_limits: FixtureGitHub, tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    args = ["ingest", "github", "octo-org/hello-world", "--base-url", github_api_no_limits.base_url]
    args += ["--spool", str(spool), "--per-page", "2", "--request-interval", "0"]
    result = invoke(app, *args, env={"GITHUB_TOKEN": TOKEN})
    assert result.exit_code == 0, result.output
    stats = json.loads(result.stdout)
    assert stats["events"] == 12 and stats["repo"] == "octo-org/hello-world"
    assert len(read_events(spool)) == 12
    assert TOKEN not in result.output + result.stderr
    assert all(s.headers["Authorization"] == f"token {TOKEN}" for s in github_api_no_limits.seen)
    cursor_file = tmp_path / "spool.github-cursors.json"  # default: beside the spool
    assert (
        json.loads(cursor_file.read_text())["repos"]["octo-org/hello-world"]["issues"]
        == "2024-03-04T08:00:00Z"
    )

    # A second run without the cursor file resumes from the events on the spool.
    cursor_file.unlink()
    github_api_no_limits.seen.clear()
    result = invoke(app, *args, env={"GITHUB_TOKEN": TOKEN})
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["since"]["issues"] == "2024-03-04T08:00:00Z"


def test_ingest_github_token_file_and_since(
    app: typer.Typer, github_api_no_limits: FixtureGitHub, tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    args = ["ingest", "github", "octo-org/hello-world", "--base-url", github_api_no_limits.base_url]
    args += ["--spool", str(tmp_path / "spool"), "--token-file", str(token_file), "--request-interval", "0"]
    result = invoke(app, *args, "--since", "2024-03-03")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["since"]["issues"] == "2024-03-03T00:00:00Z"
    assert all(s.headers["Authorization"] == f"token {TOKEN}" for s in github_api_no_limits.seen)


def test_user_mistakes_are_one_line_and_exit_2(app: typer.Typer, tmp_path: Path) -> None:
    assert "repository name" in one_line_error(invoke(app, "ingest", "github", "just-a-name"))
    assert "not a date" in one_line_error(invoke(app, "ingest", "github", "a/b", "--since", "yesterday"))
    missing = tmp_path / "missing-token"
    assert "token file" in one_line_error(
        invoke(app, "ingest", "github", "a/b", "--token-file", str(missing))
    )
    assert "secret file" in one_line_error(
        invoke(app, "serve", "webhooks", "--secret-file", str(tmp_path / "missing-secret"))
    )
    empty = tmp_path / "empty-secret"
    empty.write_text("\n")
    assert "empty" in one_line_error(invoke(app, "serve", "webhooks", "--secret-file", str(empty)))
    assert "no such directory" in one_line_error(invoke(app, "ingest", "wandb", str(tmp_path / "nowhere")))


def test_unknown_repository_is_a_user_mistake(
    app: typer.Typer, github_api_no_limits: FixtureGitHub, tmp_path: Path
) -> None:
    args = ["ingest", "github", "octo-org/absent", "--base-url", github_api_no_limits.base_url]
    args += ["--spool", str(tmp_path / "spool"), "--request-interval", "0"]
    line = one_line_error(invoke(app, *args, env={"GITHUB_TOKEN": TOKEN}))
    assert "not found" in line


def test_a_spool_held_by_another_writer_is_reported(
    app: typer.Typer, github_api_no_limits: FixtureGitHub, tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    holder = SpoolSink(spool)  # e.g. the webhook receiver, running
    try:
        args = ["ingest", "github", "octo-org/hello-world", "--base-url", github_api_no_limits.base_url]
        assert "live writer" in one_line_error(invoke(app, *args, "--spool", str(spool)))
    finally:
        holder.close()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_serve_webhooks_runs_until_terminated_and_keeps_what_it_acknowledged(tmp_path: Path) -> None:
    secret = "It's a Secret to Everybody"
    (tmp_path / "secret").write_text(secret + "\n")
    spool, port = tmp_path / "spool", _free_port()
    command = [
        sys.executable,
        "-m",
        "runledger.cli.main",
        "serve",
        "webhooks",
        "--secret-file",
        str(tmp_path / "secret"),
    ]
    command += ["--port", str(port), "--spool", str(spool)]
    proc = subprocess.Popen(
        command, cwd=Path(__file__).resolve().parents[2], stderr=subprocess.PIPE, text=True
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"{url}/healthz", timeout=1).raise_for_status()
                break
            except httpx.HTTPError:
                assert proc.poll() is None and time.monotonic() < deadline, "receiver did not start"
                time.sleep(0.1)
        body = json.dumps(fixture_json("webhook_ping.json")).encode()
        headers = {
            "X-GitHub-Event": "ping",
            "X-GitHub-Delivery": "5a7f2c00-0000-4000-8000-000000000001",
            "X-Hub-Signature-256": signature_of(secret.encode(), body),
        }
        assert httpx.post(f"{url}/webhook", content=body, headers=headers).status_code == 202
        assert httpx.post(f"{url}/webhook", content=body, headers=headers).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)  # how a service manager stops it
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    assert secret not in stderr
    [event] = read_events(spool)
    assert event.envelope.type == "github.raw"
    assert (tmp_path / "spool.github-deliveries.sqlite").exists()
