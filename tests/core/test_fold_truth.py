"""Issue 16: the answers tell the truth. A config whose recomputed hash is not the one its producer
recorded is flagged by `state`, `diff` and `blame`; a live change without a known actor is "unknown",
never the author of the code commit the run ran (here: a real recorded push names that author); and
what the ledger admitted unsigned under its policy says "(unauthenticated)" beside the fact in
`state`, `diff`, `blame` and `history`. Real ledger, real registry and keys, the CLI through CliRunner."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ingest.github_events import webhook_events
from runledger.ledger import registry
from runledger.ledger.integrity import verify_ledger
from runledger.ledger.store import Ledger, SourceRecord
from runledger.schemas import Envelope, encode_event, make_event
from runledger.schemas import payloads as p
from runledger.schemas.canonical import config_hash
from runledger.schemas.note import write_keypair
from runledger.schemas.signing import Sealer
from tests.support.github import fixture_json

RUN = "r"
TRAINER = "trainer/r/a1/rank0"
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
COMMIT = "553c2077f0edc3d5dc5d17262f6aa498e69d6f8e"  # in the recorded push, by The Octocat
CONFIG = {"lr": 0.1, "moe": {"capacity_factor": 1.0}}
AFTER_EDIT = {"lr": 0.1, "moe": {"capacity_factor": 1.25}}
WRONG_HASH = config_hash({"lr": 0.1, "moe": {"capacity_factor": 9.0}})  # not what the patch gives


def _at(seq: int, payload: object, *, step: int | None, source: str = TRAINER) -> Envelope:
    return make_event(
        payload,  # type: ignore[arg-type]
        source=source,
        stream=RUN,
        run_id=RUN,
        attempt=1,
        step=step,
        seq=seq,
        time=T0 + timedelta(minutes=seq),
    )


def _commit(ledger: Ledger, envelopes: list[Envelope], feed: str = "spool:t") -> None:
    start = ledger.positions().get(feed, 0)
    result = ledger.commit([SourceRecord(feed, start + i, encode_event(e)) for i, e in enumerate(envelopes)])
    assert not result.quarantined, [q.reason for _, q in result.quarantined]


@pytest.fixture(scope="module")
def ledger_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("truth")
    ledger = Ledger.create(tmp / "ledger")
    push = webhook_events(
        "push", fixture_json("webhook_push.json"), received_at=T0 - timedelta(days=1), delivery="d-1"
    )
    _commit(ledger, push, feed="spool:github")  # before any registry: admitted unchecked
    private, public = write_keypair(tmp / "keys", "trainer")
    registry.register_producer(ledger, "trainer", public.read_text(), p.ProducerScope(sources=["trainer/"]))
    registry.append_registry_event(ledger, p.PolicyChanged(unsigned_sources=["people/"]))
    sealer = Sealer(private.read_text())
    edit = p.ConfigChanged(
        patch=[p.PatchOp(op="replace", path="/moe/capacity_factor", value=1.25)],
        previous_hash=config_hash(CONFIG),
        config_hash=WRONG_HASH,  # the producer's hash disagrees with what the patch gives
        cause=p.ChangeCause(kind="file_edit", detail="configs/run.toml"),  # no actor recorded
    )
    by_ann = p.ConfigChanged(
        patch=[p.PatchOp(op="replace", path="/lr", value=0.05)],
        previous_hash=WRONG_HASH,
        config_hash=config_hash({**AFTER_EDIT, "lr": 0.05}),
        cause=p.ChangeCause(kind="api", detail="halve lr", actor="ann"),
    )
    started = p.RunStarted(
        config=CONFIG,
        config_hash=config_hash(CONFIG),
        git_commit=COMMIT,
        repository="octo-org/hello-world",
        host="node-1",
    )
    signed = [
        sealer.seal(_at(0, started, step=None)),
        *[sealer.seal(_at(i, p.StepMetrics(loss=1.0 / i), step=i)) for i in range(1, 11)],
        sealer.seal(_at(11, edit, step=5)),
    ]
    unsigned = [
        _at(0, by_ann, step=8, source="people/ann"),
        _at(1, p.Annotation(author="ann", text="lr halved by hand"), step=9, source="people/ann"),
    ]
    _commit(ledger, [*signed, *unsigned])
    ledger.close()  # (an open ledger's index changes its files whenever it is collected)
    report = verify_ledger(ledger.root)
    assert report.ok, [pr.line() for pr in report.problems]
    return ledger.root


def _cli(root: Path, *args: str) -> str:
    result = CliRunner().invoke(app, [*args, "--ledger", str(root)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result.output


def test_state_flags_the_hash_disagreement_and_the_unauthenticated_facts(ledger_root: Path) -> None:
    out = _cli(ledger_root, "state", RUN, "--step", "9")
    head = out.split("config\n", 1)[0] if "config\n" in out else out
    recomputed = config_hash(AFTER_EDIT)
    assert head.splitlines()[:8] == [
        f"{RUN} at step 9 (attempt 1)",
        "  commit: 553c207",
        f"  config hash: {config_hash({**AFTER_EDIT, 'lr': 0.05})[:7]}",
        f"  config hash mismatch: config.changed at step 5 (attempt 1): producer {WRONG_HASH[:7]}, "
        f"recomputed {recomputed[:7]}",
        "  last checkpoint: none",
        "  crashes so far: 0; config changes so far: 2 (1 unauthenticated)",
        "  unauthenticated: config.changed at step 8 (attempt 1)",
        "  unauthenticated: annotation at step 9 (attempt 1)",
    ]


def test_blame_names_no_one_for_an_actorless_edit_and_flags_its_hash(ledger_root: Path) -> None:
    out = _cli(ledger_root, "blame", RUN, "moe.capacity_factor", "--step", "9")
    lines = out.splitlines()
    assert lines[:4] == [
        f"moe.capacity_factor = 1.25 at step 9 of {RUN}",
        f"  set by config.changed at step 5 (attempt 1, {T0 + timedelta(minutes=11)}) by unknown "
        "(file_edit: configs/run.toml)",
        "  config hash mismatch: the config recomputed here does not hash to the one its producer recorded",
        "  code: 553c207 “Clip gradients before the optimizer step”",
    ]
    assert "  person: unknown" in lines
    assert "octocat" not in out.lower()  # the commit's author did not make this change
    # The launch's value is still put on the commit's author: that commit is what ran it.
    assert _cli(ledger_root, "blame", RUN, "moe.capacity_factor", "--step", "3").splitlines() == [
        f"moe.capacity_factor = 1.0 at step 3 of {RUN}",
        f"  set by start at step 0 (attempt 1, {T0})",
        "  code: 553c207 “Clip gradients before the optimizer step”",
        "  person: octocat",
    ]


def test_blame_marks_an_unauthenticated_setter(ledger_root: Path) -> None:
    out = _cli(ledger_root, "blame", RUN, "lr", "--step", "9").splitlines()
    assert out[1] == (
        f"  set by config.changed at step 8 (attempt 1, {T0}) by ann (api: halve lr) (unauthenticated)"
    )
    assert "  person: ann" in out


def test_diff_flags_the_mismatch_and_history_marks_unauthenticated_events(ledger_root: Path) -> None:
    out = _cli(ledger_root, "diff", RUN, "--from-step", "3", "--to-step", "9").splitlines()
    assert out[:4] == [
        f"{RUN} step 3 (attempt 1) → step 9 (attempt 1)",
        "  lr 0.1 → 0.05",
        "  moe.capacity_factor 1.0 → 1.25",
        f"  config hash mismatch: config.changed at step 5 (attempt 1): producer {WRONG_HASH[:7]}, "
        f"recomputed {config_hash(AFTER_EDIT)[:7]}",
    ]
    assert any("(unauthenticated)" in line and "note by ann" in line for line in out)
    history = _cli(ledger_root, "history", RUN, "--all", "--format", "csv").splitlines()
    marked = [line for line in history if "(unauthenticated)" in line]
    assert len(marked) == 2, history
    assert marked[0].endswith(
        "config changed at step 8: lr 0.1 → 0.05 (api halve lr by ann) (unauthenticated)"
    )
    assert marked[1].endswith("note by ann: lr halved by hand (unauthenticated)")
    # Nothing signed is marked.
    assert not any("(unauthenticated)" in line for line in history if "capacity_factor" in line)


def test_state_prints_a_recorded_value_as_it_is(tmp_path: Path) -> None:
    """The state's lines are plain text (no markup read, no rich): a checkpoint path holding rich's
    markup, an emoji code, an escape sequence and a line break prints as recorded, the controls shown
    as escapes, not obeyed, and no line is split."""
    ledger = Ledger.create(tmp_path / "ledger")
    hostile = "/ckpt/[bold]x[/] :rocket: \x1b[2J\nstep_10\t"
    started = p.RunStarted(config=CONFIG, config_hash=config_hash(CONFIG), git_commit=COMMIT)
    try:
        _commit(ledger, [_at(0, started, step=None), _at(1, p.CheckpointSaved(path=hostile), step=10)])
    finally:
        ledger.close()  # (left open, its index's SQLite files change when it is collected, mid another test)
    lines = _cli(ledger.root, "state", RUN).splitlines()
    assert lines[3] == "  last checkpoint: step 10 (/ckpt/[bold]x[/] :rocket: \\x1b[2J\\nstep_10\\t)"
    assert lines[0] == f"{RUN} at step 10 (attempt 1)"


def test_a_state_without_the_github_text_counts_the_same_events(ledger_root: Path) -> None:
    """``github_text=False`` (what the table, CSV and JSONL of ``ledger state`` read): the same GitHub
    events in the same order, their time alone."""
    from runledger.ledger.query import Reader

    reader = Reader(ledger_root)
    try:
        for step in (None, 3, 9):
            whole = reader.state(RUN, step=step)
            times = reader.state(RUN, step=step, github_text=False)
            assert whole.github, step  # (the check can fail: the push is there)
            assert times.github == [{"time": g["time"]} for g in whole.github]
            assert {**times.to_dict(), "github": None} == {**whole.to_dict(), "github": None}
    finally:
        reader.close()
