"""Trust on real input: any bytes, any size up to the maximum, any nesting, are accepted or quarantined
with a clear reason, by ``decode_event``, by ``Ledger.commit`` (with valid events around them) and by
the spool ingester; and nothing a record holds can stop a commit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runledger.ingest.spool import SpoolWriter
from runledger.ingest.spool_ingester import ingest_spool
from runledger.ledger.query import Reader
from runledger.ledger.store import Ledger, SourceRecord
from runledger.schemas import canonical_bytes, config_hash, encode_event, make_event
from runledger.schemas import payloads as p
from runledger.schemas.canonical import canonicalize_json
from runledger.schemas.codec import MAX_DEPTH, Event, Quarantined, decode_event, nesting_depth, too_deep
from tests.support.hostile import ACCEPT, T0, Hostile, corpus, valid_events

CORPUS = corpus()
SOURCE = "spool:hostile"


def _records(items: list[tuple[bytes | None, str]]) -> list[SourceRecord]:
    return [SourceRecord(SOURCE, i, raw or b"", tombstone=raw is None) for i, (raw, _) in enumerate(items)]


def _stream(
    before: int = 5, after: int = 5
) -> tuple[list[tuple[bytes | None, str]], list[str], list[Hostile]]:
    """Valid events, the whole corpus, valid events: (raw, label) in order, the valid ids, the corpus."""
    head = valid_events(before)
    tail = valid_events(after, start=before)
    items = [(raw, ident) for ident, raw in head]
    items += [(h.raw, h.name) for h in CORPUS]
    items += [(raw, ident) for ident, raw in tail]
    return items, [i for i, _ in head + tail], CORPUS


def _quarantine_rows(root: Path) -> dict[int, dict]:
    reader = Reader(root)
    try:
        return {row["ingest_position"]: row for row in reader.sql("SELECT * FROM quarantine").records()}
    finally:
        reader.close()


@pytest.mark.parametrize("item", CORPUS, ids=[h.name for h in CORPUS])
def test_decode_gives_each_item_its_outcome(item: Hostile) -> None:
    if item.raw is None:
        pytest.skip("a tombstone never reaches decode_event (the Kafka ingester marks it)")
    result = decode_event(item.raw)
    if "unstorable" in item.outcomes or item.accepted:  # valid JSON events (only the ledger may refuse)
        assert isinstance(result, Event), result.reason
        return
    assert isinstance(result, Quarantined)
    assert result.raw == item.raw
    item.check(result.code, result.reason)
    if item.readable_id:
        assert result.id == f"hostile-{item.name}" and result.source == "hostile/corpus"
        assert result.stream == f"h-{item.name}" and result.type == "runledger.step.metrics"


def test_the_corpus_through_one_commit(tmp_path: Path) -> None:
    items, valid_ids, hostile = _stream()  # 5 valid events, then the corpus from position 5
    records = _records(items)
    ledger = Ledger.create(tmp_path / "l")
    result = ledger.commit(records)
    assert result.commit is not None
    by_position = {record.position: q for record, q in result.quarantined}
    landed = set(valid_ids)
    for offset, item in enumerate(hostile):
        q = by_position.get(5 + offset)
        item.check(q.code if q else ACCEPT, q.reason if q else "")
        if q is None:
            landed.add(item.id)
    assert not set(valid_ids) & {q.id for q in by_position.values()}
    assert (result.accepted, len(result.quarantined)) == (len(landed), len(hostile) + 10 - len(landed))

    reader = Reader(tmp_path / "l")
    assert {row[0] for row in reader.sql("SELECT id FROM events").rows} == landed
    assert reader.sql("SELECT count(*) FROM events").rows == [(len(landed),)]
    rows = _quarantine_rows(tmp_path / "l")
    assert sorted(rows) == sorted(by_position)
    for offset, item in enumerate(hostile):
        row = rows.get(5 + offset)
        if row is None:
            continue
        item.check(by_position[5 + offset].code, row["reason"])
        assert row["raw"] == (item.raw or b""), f"{item.name}: the raw bytes are not kept whole"
        if item.readable_id:
            assert row["event_id"] == f"hostile-{item.name}" and row["stream"] == f"h-{item.name}"

    # The same positions again: nothing happens.
    again = ledger.commit(records)
    assert (again.commit, again.accepted, again.skipped) == (None, 0, len(records))
    assert Ledger.open(tmp_path / "l").commit(records).commit is None


def test_each_item_alone_between_valid_events(tmp_path: Path) -> None:
    """One commit per hostile record (small batches, as a live ingester makes them)."""
    ledger = Ledger.create(tmp_path / "l")
    position = 0
    for i, item in enumerate(CORPUS):
        before, after = valid_events(1, start=2 * i), valid_events(1, start=2 * i + 1)
        batch = [
            SourceRecord(SOURCE, position, before[0][1]),
            SourceRecord(SOURCE, position + 1, item.raw or b"", tombstone=item.raw is None),
            SourceRecord(SOURCE, position + 2, after[0][1]),
        ]
        position += 3
        result = ledger.commit(batch)
        assert len(result.quarantined) <= 1 and result.accepted == 3 - len(result.quarantined)
        q = result.quarantined[0][1] if result.quarantined else None
        item.check(q.code if q else ACCEPT, q.reason if q else "")
    assert ledger.positions() == {SOURCE: position}


def test_a_record_that_fails_half_way_leaves_nothing_behind(tmp_path: Path) -> None:
    """A launch whose row can't be stored (world_size beyond int64) is quarantined whole: no launch,
    no config row, and the config it would have set is not folded into the change after it."""
    config = {"lr": 0.001}
    changed = {"lr": 0.0005}

    def event(payload: object, seq: int, run: str = "poisoned") -> bytes:
        return encode_event(
            make_event(
                payload, source=f"t/{run}", stream=run, run_id=run, attempt=1, step=seq, seq=seq, time=T0
            )
        )

    patch = [p.PatchOp(op="replace", path="/lr", value=0.0005)]
    change = p.ConfigChanged(
        patch=patch,
        previous_hash=config_hash(config),
        config_hash=config_hash(changed),
        cause=p.ChangeCause(kind="file_edit"),
    )
    raws = [
        event(p.RunStarted(config=config, config_hash=config_hash(config), world_size=2**70), 0),
        event(change, 1),
        event(p.RunStarted(config=config, config_hash=config_hash(config)), 0, run="healthy"),
        event(change, 1, run="healthy"),
    ]
    ledger = Ledger.create(tmp_path / "l")
    result = ledger.commit([SourceRecord(SOURCE, i, raw) for i, raw in enumerate(raws)])
    assert result.accepted == 3
    [(record, q)] = result.quarantined
    assert record.position == 0 and q.code == "unstorable" and "cannot store this event" in q.reason
    assert (q.id, q.stream, q.type) == (json.loads(raws[0])["id"], "poisoned", "runledger.run.started")
    reader = Reader(tmp_path / "l")
    assert reader.sql("SELECT run_id FROM launches ORDER BY run_id").rows == [("healthy",)]
    assert reader.sql("SELECT DISTINCT run_id FROM configs ORDER BY run_id").rows == [("healthy",)]
    rows = reader.sql("SELECT run_id, hash_matches FROM config_changes ORDER BY run_id").rows
    assert rows == [("healthy", True), ("poisoned", None)]


@pytest.mark.parametrize("chunk_rows", [None, 2], ids=["at the commit", "in a chunk as rows come"])
def test_an_unstorable_event_among_good_ones_of_the_same_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk_rows: int | None
) -> None:
    """Rows beyond int64 fail only when the batch becomes Arrow tables (at the commit, or when a
    group's rows are made Arrow in chunks as they come): the commit goes round again and quarantines
    exactly the culprits, the events sharing their table and partition land."""
    if chunk_rows is not None:
        monkeypatch.setattr("runledger.ledger.projectors.CHUNK_ROWS", chunk_rows)

    def stats(step: int, tokens: int) -> bytes:
        layer = p.MoeLayerStats(layer=0, tokens=tokens, top_k=1, dropped=0, token_drop_rate=0.0)
        return encode_event(
            make_event(
                p.MoeRouterStats(layers=[layer]), source="t/r", stream="r", run_id="r", step=step, seq=step
            )
        )

    raws = [stats(s, 2**70 if s in (3, 6) else 4096) for s in range(8)]
    ledger = Ledger.create(tmp_path / "l")
    result = ledger.commit([SourceRecord(SOURCE, i, raw) for i, raw in enumerate(raws)])
    assert result.accepted == 6
    assert sorted(record.position for record, _ in result.quarantined) == [3, 6]
    assert {q.code for _, q in result.quarantined} == {"unstorable"}
    rows = Reader(tmp_path / "l").sql("SELECT step, tokens FROM moe_layer_stats ORDER BY step").rows
    assert rows == [(s, 4096) for s in (0, 1, 2, 4, 5, 7)]


def test_the_spool_ingester_finishes_on_the_corpus(tmp_path: Path) -> None:
    items, valid_ids, hostile = _stream()
    spooled = [(raw, label) for raw, label in items if raw is not None]  # a spool has no tombstones
    with SpoolWriter(tmp_path / "spool") as writer:
        for raw, _ in spooled:
            writer.append(raw)
    ledger = Ledger.create(tmp_path / "l")
    stats = ingest_spool(ledger, tmp_path / "spool", batch_size=16)
    in_spool = [h for h in hostile if h.raw is not None]
    assert stats.accepted + stats.quarantined == len(spooled)
    assert len(valid_ids) + sum(h.code == ACCEPT and h.alt is None for h in in_spool) <= stats.accepted
    assert stats.accepted <= len(valid_ids) + sum(ACCEPT in h.outcomes for h in in_spool)
    ids = {row[0] for row in Reader(tmp_path / "l").sql("SELECT id FROM events").rows}
    assert set(valid_ids) <= ids
    again = ingest_spool(ledger, tmp_path / "spool")
    assert (again.commits, again.accepted, again.quarantined) == (0, 0, 0)
    reasons = Reader(tmp_path / "l").sql("SELECT reason FROM quarantine").rows
    assert len(reasons) == stats.quarantined and all(r[0] for r in reasons)


def test_max_event_bytes_is_configurable(tmp_path: Path) -> None:
    small = corpus(64 * 1024, tombstone=False)
    sizes = {h.name: h for h in small if h.name.startswith("string-just")}
    ledger = Ledger.create(tmp_path / "l")
    records = [SourceRecord(SOURCE, i, h.raw) for i, h in enumerate(sizes.values())]
    result = ledger.commit(records, max_event_bytes=64 * 1024)
    assert result.accepted == 1
    [(_, q)] = result.quarantined
    assert q.code == "too-large"
    assert q.reason == f"record of {64 * 1024 + 1} bytes exceeds the maximum event size of {64 * 1024} bytes"


# ------------------------------------------------------------------------- the depth check itself


def _depth(value: object) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


_tricky_text = st.text(alphabet='[]{}"\\ab\n\u00e9', max_size=8)
_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | _tricky_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_tricky_text, inner, max_size=4),
    max_leaves=40,
)


@settings(max_examples=400, deadline=None)
@given(_json_values, st.integers(min_value=0, max_value=1200), st.booleans())
def test_nesting_depth_matches_the_decoded_value(value: object, wrap: int, ascii_only: bool) -> None:
    # Wrapped in many single-element arrays: long narrow chains (the running-sum path). As text: a
    # JSON encoder would itself recurse too deeply.
    inner = json.dumps(value, ensure_ascii=ascii_only).encode()
    raw = b"[" * wrap + inner + b"]" * wrap
    depth = wrap + _depth(value)
    assert nesting_depth(raw) == depth
    assert too_deep(raw) == (depth > MAX_DEPTH)
    assert too_deep(raw, limit=3) == (depth > 3)


@settings(max_examples=300, deadline=None)
@given(_json_values)
def test_canonicalize_json_equals_canonical_bytes_of_the_value(value: object) -> None:
    """decode_event takes the canonical bytes (the Merkle leaf) from canonicalize_json(raw): it must
    give exactly canonical_bytes(decoded value), as before."""
    raw = json.dumps({"v": value}).encode()
    assert canonicalize_json(raw) == canonical_bytes(json.loads(raw))
