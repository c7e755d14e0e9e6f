"""``runledger.init(parent_run=, fork_step=)``: a relaunch under a new run id, told as one lineage."""

from __future__ import annotations

from pathlib import Path

import pytest

import runledger
from tests.client.ledger_support import cli_json, ingest


def test_a_run_under_a_new_id_goes_on_from_its_parent(client_env: dict[str, str], tmp_path: Path) -> None:
    with runledger.init("lin-1", config={"lr": 1e-3}) as run:
        for step in range(1, 31):
            run.log({"loss": 10.0 - step / 10}, step=step)
    with runledger.init("lin-2", config={"lr": 5e-4}, parent_run="lin-1", fork_step=20) as run:
        for step in range(21, 41):
            run.log({"loss": 5.0 - step / 100}, step=step)
    ledger = tmp_path / "ledger"
    ingest(ledger, Path(client_env["RUNLEDGER_SPOOL"]))
    series = cli_json(
        ledger,
        "query",
        "SELECT member, step, value FROM lineage_metrics WHERE run_id = 'lin-2' AND name = 'loss' ORDER BY step",
    )
    assert [(r["member"], r["step"]) for r in series] == [("lin-1", s) for s in range(1, 21)] + [
        ("lin-2", s) for s in range(21, 41)
    ]
    history = cli_json(ledger, "history", "lin-2", "--full")
    assert any("continues run lin-1 from step 20" in item["what"] for item in history)
    assert cli_json(ledger, "state", "lin-2", "--step", "10")["config"] == {"lr": 1e-3}  # lin-1's step 10
    assert cli_json(ledger, "state", "lin-2", "--step", "30")["config"] == {"lr": 5e-4}


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"fork_step": 3}, "fork_step needs parent_run"),
        ({"parent_run": "same"}, "is this run"),
        ({"parent_run": "p", "resume_from_step": 3}, "resume_from_step"),
        ({"parent_run": "p", "fork_step": -1}, "non-negative int"),
        ({"parent_run": "p", "fork_step": True}, "non-negative int"),
        ({"parent_run": "not a run id"}, "is not valid"),
    ],
)
def test_lineage_arguments_are_checked_before_anything_starts(
    client_env: dict[str, str], tmp_path: Path, kwargs: dict[str, object], words: str
) -> None:
    with pytest.raises(ValueError, match=words):
        runledger.init("same", **kwargs)  # type: ignore[arg-type]
    assert not (tmp_path / "spool").exists() and not (tmp_path / "state").exists()
