"""A small real ledger with rows in every table, published to a folder: what tests/engines reads.

Three runs (one crashes and resumes, one takes a MoE router's stats, one is left running), accepted
and refused config changes, checkpoints, notes, rank stats, summaries, GitHub events of two owners
(one an org-level event), and records the ledger quarantines; several commits, so partitions hold
several files.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from runledger.ledger.publish import publish
from runledger.ledger.store import Ledger, SourceRecord
from runledger.schemas import encode_event, make_event
from runledger.schemas import github as gh
from runledger.schemas import payloads as p
from runledger.schemas.note import write_keypair
from tests.support.factory import T0, RunBuilder

LEDGER_ID = "engines-test"


@dataclass(frozen=True)
class Site:
    root: Path  # the ledger
    dest: Path  # where it is published
    private_key: str
    log_key: str  # the verifier key of the log


def _moe(run: RunBuilder, step: int) -> None:
    layers = [
        p.MoeLayerStats(
            layer=layer,
            tokens=1024,
            top_k=2,
            dropped=7 + layer,
            token_drop_rate=(7 + layer) / 2048,
            sender_drops=3,
            receiver_drops=None,
            expert_counts=[300 + layer, 250, 0, 467 - layer],
            aux_loss=0.01,
            routing_entropy=1.25,
        )
        for layer in range(2)
    ]
    run._emit(p.MoeRouterStats(layers=layers), step)


def _run(run_id: str, *, crash: bool, moe: bool, finish: bool, repository: str | None) -> list[bytes]:
    run = RunBuilder(run_id=run_id)
    run.start(repository=repository)
    for step in range(1, 5):
        run.step(step, loss=2.0 / step)
        if moe:
            _moe(run, step)
    run.change(4, "lr", 0.0005)
    refused = p.PatchOp(op="replace", path="/lr", value=3.0)
    cause = p.ChangeCause(kind="api", detail="dashboard", actor="ana")
    run._emit(p.ConfigRejected(patch=[refused], reason="lr above 1.0", cause=cause), 4)
    run.checkpoint(4)
    run._emit(p.RankStats(rank=1, host="node-1", step_time_s=0.25, values={"mem_gb": 71.5}), 4)
    run._emit(p.Annotation(author="bo", text="loss spike after the lr change", tags=["lr", "spike"]), 4)
    if crash:
        run.crash(5)
        run.resume(4)
        run.step(5, loss=float("nan"))  # JSON has no NaN: the step's loss row is left out
    run._emit(p.StepSkipped(reason="nonfinite loss", value="nan"), 6)
    if not finish:  # a left-running run's producer skipped two seqs: a gap (an ingest_incidents row)
        run.seq += 2
    run.step(7, loss=0.1)
    if finish:
        run._emit(p.RunSummary(values={"best_loss": 0.1, "note": "ok"}), 7)
        run._emit(p.RunFinished(status="completed", final_step=7, total_tokens=4096, duration_s=12.5), 7)
    return run.events


def _github() -> list[bytes]:
    def event(i: int, payload: Any, stream: str) -> bytes:
        env = make_event(
            payload,
            source=f"github-webhook/{stream}",
            stream=stream,
            seq=0,
            id=f"delivery/d{i}/0",
            time=T0 + timedelta(minutes=i),
        )
        return encode_event(env)

    push = gh.GitHubPush(
        repo="octo/hello",
        ref="refs/heads/main",
        before="a" * 40,
        after="d" * 40,
        pusher="bo",
        commits=[gh.PushedCommit(sha="c" * 40, message="raise lr"), gh.PushedCommit(sha="d" * 40)],
        via="webhook",
    )
    pr = gh.GitHubPullRequest(
        action="closed", repo="octo/hello", number=7, title="Raise lr", merged=True, body="ü ✓", actor="ana"
    )
    issue = gh.GitHubIssue(action="opened", repo="lab/tools", number=3, title="flaky", labels=["bug"])
    raw = gh.GitHubRaw(
        event="organization", action="member_added", payload={"organization": {"login": "lab"}}
    )
    return [
        event(0, push, "octo/hello"),
        event(1, pr, "octo/hello"),
        event(2, issue, "lab/tools"),
        event(3, raw, "lab"),
    ]


def _quarantined() -> list[bytes]:
    """Records the ledger's door refuses, each kept with its raw bytes and reason."""
    return [b"{not json", b'{"specversion": "1.0"}', b"\xff\xfe binary \x00 bytes"]


def build_site(tmp: Path, *, one_run: bool = False) -> Site:
    """The ledger under ``tmp/ledger``, published to ``tmp/site`` with a fresh log key: a ledger as
    ``ledger init`` makes one (a lake: its embedded catalog and data files in the folder).
    ``one_run``: only run-b (no MoE stats, GitHub events or quarantined records: tables without rows)."""
    root, dest = tmp / "ledger", tmp / "site"
    ledger = Ledger.create(root, ledger_id=LEDGER_ID)
    batches = [
        _run("run-a", crash=True, moe=True, finish=True, repository="octo/hello"),
        _run("run-b", crash=False, moe=False, finish=True, repository=None),
        _github(),
        _run("run-c", crash=False, moe=True, finish=False, repository="lab/tools"),
        _quarantined(),
    ]
    if one_run:
        batches = [batches[1]]
    position = 0
    for batch in batches:
        ledger.commit([SourceRecord("spool:engines", position + i, raw) for i, raw in enumerate(batch)])
        position += len(batch)
    ledger.close()  # the writer done: publish and the readers open the ledger again
    private, public = write_keypair(tmp / "keys", f"runledger/{LEDGER_ID}")
    site = Site(root, dest, private.read_text().strip(), public.read_text().strip())
    publish(root, dest, site.private_key)
    return site
