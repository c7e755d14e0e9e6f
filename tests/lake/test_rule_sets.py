"""Two writers of one lake judging anomalies with different rule sets (issue 44), on every catalog
backend: a host not yet upgraded (set 1) and an upgraded one (set 2) take turns committing. Each
commit record says which set judged from which commit on, every anomaly event carries its set's
rule versions, and ``verify`` from either folder re-derives each commit with the set that judged it."""

from __future__ import annotations

from pathlib import Path

import msgspec

from runledger.ledger.anomalies import RULES_V1
from runledger.ledger.integrity import verify_ledger
from runledger.ledger.store import Ledger
from tests.core.test_anomalies import _events, _records, _story
from tests.lake.conftest import Backend


def test_hosts_on_two_rule_sets_take_turns_and_each_commit_verifies_by_its_own(
    backend: Backend, tmp_path: Path
) -> None:
    records = _records(_story())
    old_host, new_host = tmp_path / "old-host", tmp_path / "new-host"
    Ledger.create_on_lake(old_host, backend.catalog, backend.data, ledger_id="rules").close()
    Ledger.create_on_lake(new_host, backend.catalog, backend.data, ledger_id="rules").close()
    for root, cut in ((old_host, slice(0, 40)), (new_host, slice(40, 70)), (old_host, slice(70, None))):
        with Ledger.open(root) as ledger:
            if root == old_host:
                ledger.anomaly_rules = RULES_V1
            ledger.commit(records[cut])
    for root in (old_host, new_host):
        with Ledger.open(root):  # (each folder takes the other's records)
            pass
        newest = msgspec.json.decode(sorted((root / "_commits").glob("*.json"))[-1].read_bytes())
        judged = newest["anomalies"]["rule_sets"]
        assert [number for _, number in judged] == [1, 2, 1], judged
        report = verify_ledger(root)
        assert report.ok, [pr.line() for pr in report.problems]
    found = [
        (e.data.rule, e.data.rule_version, e.step) for e, _ in _events(old_host) if e.type == "ledger.anomaly"
    ]
    assert found == [
        ("loss-spike", 1, 30),  # commit 0 (set 1)
        ("non-finite", 1, 33),
        ("throughput-drop", 2, 35),  # commit 1 (set 2)
        ("router-collapse", 1, 36),  # commit 2 (set 1 again)
        ("router-collapse", 1, 36),
        ("straggler", 1, 37),
        ("non-finite", 1, 38),
    ]
