"""bench/bench_peer.py's max loads (issue 39): what it times must be what it claims.

The 48 per-layer max loads a step, logged through ``log_router``'s field or as named scalars through
the client library, must all land in a new ledger (the embedded lake ``Ledger.create`` makes), and the
pyarrow baseline must write the same 48 values a step; a small run of each, on real files.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from bench.base_tree import BASE_COMMIT, ROOT
from bench.bench_ledger import LAYERS, make_workload
from bench.bench_peer import (
    MAX_LOAD_NAMES,
    NEW_LEDGER,
    PART_FILES,
    measure_part_files,
    peer_steps,
    pyarrow_ceiling_max_load,
    run_peer,
    step_scalars,
)
from runledger.ledger.query import Reader

STEPS = 12


def test_max_load_scalars_all_land_in_a_new_ledger(tmp_path: Path) -> None:
    steps = peer_steps(make_workload(STEPS))
    times = run_peer(tmp_path / "peer", steps, store=NEW_LEDGER, max_load="scalars")
    assert (tmp_path / "peer" / "ledger" / "LAKE.json").exists()  # the default ledger is a lake
    assert times.metric_values == STEPS * (20 + LAYERS)
    reader = Reader(tmp_path / "peer" / "ledger")
    try:
        rows = reader.sql(
            "SELECT name, count(*), max(value) FROM metrics WHERE name LIKE 'router/max_load/%' GROUP BY 1"
        ).rows
    finally:
        reader.close()
    assert sorted(r[0] for r in rows) == MAX_LOAD_NAMES
    assert all(r[1] == STEPS for r in rows)
    loaded = {name: max(steps.max_load[i][k] for i in range(STEPS)) for k, name in enumerate(MAX_LOAD_NAMES)}
    assert all(abs(r[2] - loaded[r[0]]) < 1e-12 for r in rows)


def test_max_load_field_lands_in_the_router_rows(tmp_path: Path) -> None:
    steps = peer_steps(make_workload(STEPS))
    times = run_peer(tmp_path / "peer", steps, store=NEW_LEDGER, max_load="field")
    assert times.metric_values == STEPS * 20  # no scalar stands in for them
    reader = Reader(tmp_path / "peer" / "ledger")
    try:
        rows = reader.sql("SELECT step, layer, max_load FROM moe_layer_stats ORDER BY step, layer").rows
    finally:
        reader.close()
    assert [(r[0], r[1]) for r in rows] == [(i + 1, k) for i in range(STEPS) for k in range(LAYERS)]
    assert [r[2] for r in rows] == pytest.approx([v for step in steps.max_load for v in step], rel=1e-12)


def test_the_part_files_baseline_is_part_files(tmp_path: Path) -> None:
    """The part-file store is gone from this code (issue 39): its figures come from the last commit
    that had it, run by that commit's own bench in a subprocess, and this bench refuses to fake them."""
    steps = peer_steps(make_workload(STEPS))
    with pytest.raises(ValueError, match="measure_part_files"):
        run_peer(tmp_path / "peer", steps, store=PART_FILES)
    if subprocess.run(
        ["git", "-C", str(ROOT), "cat-file", "-e", f"{BASE_COMMIT}^{{commit}}"], check=False
    ).returncode:
        pytest.skip(f"commit {BASE_COMMIT} (the part-file baseline) is not in this clone's history")
    figures = measure_part_files(tmp_path / "work", STEPS, 1, max_load="off")
    assert figures["store"] == "part files" and figures["steps"] == STEPS, figures
    assert figures["events"] > 0 and figures["ratio"] > 0, figures


def test_pyarrow_baseline_writes_the_same_max_loads(tmp_path: Path) -> None:
    w = make_workload(STEPS)
    steps = peer_steps(w)
    assert len(step_scalars(steps, "scalars")[0]) == len(steps.scalars[0]) + LAYERS
    _, rows = pyarrow_ceiling_max_load(tmp_path, w, steps.max_load)
    layers = pq.read_table(tmp_path / "moe_layer_stats.parquet")
    assert layers.column("max_load").to_pylist() == [v for step in steps.max_load for v in step]
    assert rows == STEPS * 20 + STEPS * LAYERS + 2 * STEPS
