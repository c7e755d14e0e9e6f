"""Many threads logging to one run, with a producer key set (signed and chained events): events are
numbered in the order they enter the bus, so ingest finds no false gap or fork."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

import runledger
from runledger.schemas.note import write_keypair
from tests.client.ledger_support import cli_json, ingest

THREADS, PER_THREAD = 16, 250


def test_sixteen_threads_logging_to_one_run_make_no_false_incident(
    client_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    private, _ = write_keypair(tmp_path / "keys", "trainer")
    monkeypatch.setenv("RUNLEDGER_PRODUCER_KEY", str(private))
    run = runledger.init("threads-1", queue_size=THREADS * PER_THREAD + 16, handle_signals=False)
    start = threading.Barrier(THREADS)
    accepted: list[bool] = []

    def work(k: int) -> None:
        start.wait()
        for i in range(PER_THREAD):
            accepted.append(run.log({"loss": float(i), "worker": float(k)}, step=k * PER_THREAD + i))

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # threads switch far more often than by default: interleave them
    try:
        workers = [threading.Thread(target=work, args=(k,)) for k in range(THREADS)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    finally:
        sys.setswitchinterval(switch)
    run.finish()
    assert all(accepted) and len(accepted) == THREADS * PER_THREAD and run.dropped == 0

    ledger = tmp_path / "ledger"
    ingest(ledger, Path(client_env["RUNLEDGER_SPOOL"]))
    [counts] = cli_json(
        ledger,
        "query",
        "SELECT count(*) FILTER (WHERE type = 'ledger.incident') AS incidents, "
        "count(*) FILTER (WHERE type = 'runledger.step.metrics') AS metrics, "
        "count(*) FILTER (WHERE canonical LIKE '%\"key_id\":%') AS signed, count(*) AS events "
        # (the detectors' own findings on these made-up losses are the ledger's, not the producer's)
        "FROM events WHERE stream = 'threads-1' AND type <> 'ledger.anomaly'",
    )
    total = THREADS * PER_THREAD
    assert counts == {"incidents": 0, "metrics": total, "signed": total + 2, "events": total + 2}
    assert cli_json(ledger, "state", "threads-1")["incidents"] == []
