"""`ledger serve webhooks --producer-key` (or RUNLEDGER_PRODUCER_KEY): the receiver's sink signs every
event, each event says GitHub's HMAC was checked and for which hook, and a ledger that registered the
receiver admits them, authenticated, and verifies them; recorded deliveries, the real CLI process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ingest.github_webhook import hmac_attestation, signature_of
from runledger.ingest.spool_ingester import ingest_spool
from runledger.ledger.integrity import verify_ledger
from runledger.ledger.query import Reader
from runledger.ledger.registry import register_producer
from runledger.ledger.store import Ledger
from runledger.ledger.verifier import verify_producer_signature
from runledger.schemas.note import write_keypair
from runledger.schemas.payloads import ProducerScope
from tests.support.github import fixture_json, read_events

LEDGER_BIN = str(Path(sys.executable).parent / "ledger")
SECRET = "recorded deliveries, signed receiver\n"
HOOK_ID = "109948940"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _deliver(url: str, event: str, payload: dict, hook_id: str | None) -> httpx.Response:
    body = json.dumps(payload).encode()
    headers = {
        "Content-Type": "application/json",
        "User-Agent": "GitHub-Hookshot/044aadd",
        "X-GitHub-Event": event,
        "X-GitHub-Delivery": str(uuid.uuid4()),
        "X-Hub-Signature-256": signature_of(SECRET.strip().encode(), body),
    }
    if hook_id is not None:
        headers["X-GitHub-Hook-ID"] = hook_id
    return httpx.post(f"{url}/webhook", content=body, headers=headers, timeout=10, trust_env=False)


def test_the_receiver_process_signs_and_attests_real_deliveries(tmp_path: Path) -> None:
    private, public = write_keypair(tmp_path / "keys", "github-webhook")
    secret = tmp_path / "webhook.secret"
    secret.write_text(SECRET)
    spool, port = tmp_path / "spool", _free_port()
    env = {**os.environ, "RUNLEDGER_PRODUCER_KEY": str(private)}  # the trainer's mechanism
    server = subprocess.Popen(
        [
            LEDGER_BIN,
            "serve",
            "webhooks",
            "--secret-file",
            str(secret),
            "--port",
            str(port),
            "--spool",
            str(spool),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"{url}/healthz", timeout=1, trust_env=False)
                break
            except httpx.TransportError:
                assert server.poll() is None and time.monotonic() < deadline, "receiver did not start"
                time.sleep(0.2)
        sent = [
            ("pull_request", "webhook_pull_request_closed.json", HOOK_ID),
            ("push", "webhook_push.json", "not-a-hook-id"),  # hostile header: left out of the claim
            ("issues", "webhook_issues_edited.json", None),
        ]
        for event, name, hook in sent:
            assert _deliver(url, event, fixture_json(name), hook).status_code == 202
    finally:
        server.send_signal(signal.SIGTERM)
        output = server.communicate(timeout=60)[0].decode()
    assert server.returncode == 0, output
    # No key material: the note key is PRIVATE+KEY+<name>+<hash>+<base64>, and base64 itself may hold
    # a "+", so the material is everything after the fourth one (splitting at the last "+" could leave
    # a fragment as short as a newline, which any output contains).
    material = private.read_text().strip().split("+", 4)[4]
    assert len(material) >= 40 and "BEGIN" not in output and material not in output

    events = read_events(spool)
    attested = {e.envelope.type: e.envelope.attested for e in events}
    assert attested["github.pull_request"] == f"github-hmac-sha256 hook:{HOOK_ID}"
    assert {a for t, a in attested.items() if t != "github.pull_request"} == {"github-hmac-sha256"}
    for event in events:  # every event, the attestation included, under the receiver's signature
        assert verify_producer_signature(event.canonical, public.read_text()) == event.envelope.key_id

    ledger = Ledger.create(tmp_path / "ledger")
    scope = ProducerScope(sources=["github-webhook/"], types=["github."])
    register_producer(ledger, "github-webhook", public.read_text(), scope)
    stats = ingest_spool(ledger, spool)
    assert (stats.accepted, stats.quarantined) == (len(events), 0)
    marks = Reader(ledger.root).sql("SELECT type, authenticated FROM events").rows
    github_marks = [m for t, m in marks if t.startswith("github.")]
    assert github_marks == [True] * len(events)
    report = verify_ledger(ledger.root)
    assert report.ok, [p.line() for p in report.problems]


@pytest.mark.parametrize(
    ("header", "claim"),
    [
        ("109948940", "github-hmac-sha256 hook:109948940"),
        (None, "github-hmac-sha256"),
        ("", "github-hmac-sha256"),
        ("1" * 21, "github-hmac-sha256"),
        ("12 hook:999", "github-hmac-sha256"),
        ("١٢٣", "github-hmac-sha256"),  # Arabic-Indic digits: not GitHub's ids
    ],
)
def test_only_a_numeric_hook_id_joins_the_claim(header: str | None, claim: str) -> None:
    assert hmac_attestation(header) == claim


def test_a_bad_producer_key_is_one_line_before_listening(tmp_path: Path) -> None:
    secret = tmp_path / "webhook.secret"
    secret.write_text(SECRET)
    public = write_keypair(tmp_path / "keys", "github-webhook")[1]
    runner = CliRunner()
    base = ["serve", "webhooks", "--secret-file", str(secret), "--port", "1"]
    missing = runner.invoke(app, [*base, "--producer-key", str(tmp_path / "nope.key")])
    assert (missing.exit_code, missing.output) == (
        2,
        f"error: producer key file not found: {tmp_path / 'nope.key'}\n",
    )
    wrong = runner.invoke(app, [*base, "--producer-key", str(public)])  # the public half
    assert wrong.exit_code == 2 and wrong.output.startswith(f"error: producer key {public}: ")
    assert len(wrong.output.splitlines()) == 1
