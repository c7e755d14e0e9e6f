"""``ledger verify``'s re-derivation of the anomaly events (issue 44): the detectors of
``runledger.ledger.anomalies`` run again over the log, stream by stream in stream order, and every
anomaly event they make must be stored, byte for byte, and no other. A missing one (hidden), an
extra one (forged) and an altered one (its rule, parameters or values changed) is each a problem
naming it, so an operator who can write the ledger can neither forge nor hide one.

Verify streams event rows file by file, not in log order: the events a detector reads and the
anomaly events are spilled to a Parquet file in verify's scratch folder and read back sorted by
DuckDB (memory stays bounded). Only events whose bytes are the leaf the log recorded are fed here;
a changed row is named by the Merkle check already.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from runledger.ledger.anomalies import (
    RULE_SETS,
    WATCHED_TYPES,
    DetectorState,
    Rule,
    anomaly_event,
    detect,
)
from runledger.schemas import catalogue as c
from runledger.schemas.canonical import canonicalize_json
from runledger.schemas.codec import Envelope, Event, decode_event, encode_event

_SPILL_SCHEMA = pa.schema(
    [("stream", pa.string()), ("seq", pa.int64()), ("commit", pa.int64()), ("canonical", pa.string())]
)
_SPILL_ROWS = 2_000  # rows buffered before they are written, and read back at once
_READ_TYPES = frozenset((*WATCHED_TYPES, c.LEDGER_ANOMALY))


@dataclass(frozen=True)
class AnomalyProblem:
    """One anomaly event not as the log's detectors make it: what, where, and the anomaly's id."""

    stream: str
    seq: int | None  # the stored anomaly's stream_seq (None: missing, so never stored)
    event_id: str
    detail: str
    since_seq: int  # where in its stream the re-derivation differs: the stored anomaly, or the cause


@dataclass
class _StreamAnomalies:
    """One stream's anomaly events: as re-derived (id -> bytes, and what to call each) and as stored."""

    expected: dict[str, tuple[str, str, int]] = field(
        default_factory=dict
    )  # id -> (canonical, description, its cause's seq)
    stored: dict[str, tuple[str, int, str]] = field(
        default_factory=dict
    )  # id -> (canonical, seq, description)


class AnomalyCheck:
    """Fed the verified events (any order), then ``problems`` re-derives and compares, each commit's
    events judged by the rule set that judged them (the newest commit record says which, from when)."""

    def __init__(self, record: dict[str, Any] | None, spill: Path) -> None:
        self.damaged: str | None = None  # why the record's detector state cannot be read
        judged: DetectorState | None = None
        if record and "anomalies" in record:
            try:
                judged = DetectorState.from_json(record["anomalies"])
            except (AttributeError, KeyError, TypeError, ValueError) as exc:
                self.damaged = f"{type(exc).__name__}: {exc}"
        self.since = None if judged is None else judged.since  # None: never judged: nothing to check
        # (first commit, number) of each set, oldest first; events before ``since`` build windows
        # with the first set, as the writer that started judging did.
        self.rule_sets = [] if judged is None else judged.rule_set_history()
        self.unknown = [(first, n) for first, n in self.rule_sets if n not in RULE_SETS]
        self.path = spill / "anomaly_inputs.parquet"
        self._writer: pq.ParquetWriter | None = None
        self._rows: list[tuple[str, int, int, str]] = []

    def add(self, stream: str, seq: int, commit: int, event: Event) -> None:
        if self.since is None or event.envelope.type not in _READ_TYPES:
            return
        self._rows.append((stream, seq, commit, event.canonical.decode()))
        if len(self._rows) >= _SPILL_ROWS:
            self._flush()

    def _flush(self) -> None:
        if not self._rows:
            return
        if self._writer is None:
            self._writer = pq.ParquetWriter(self.path, _SPILL_SCHEMA)
        columns = [list(column) for column in zip(*self._rows, strict=True)]
        self._writer.write_table(pa.Table.from_arrays(columns, schema=_SPILL_SCHEMA))
        self._rows = []

    def problems(self, redacted_ids: set[str]) -> list[AnomalyProblem]:
        """Every missing, extra or altered anomaly event. ``redacted_ids``: events whose payload was
        erased, so the detectors cannot see them: an anomaly they caused is taken as stored."""
        self._flush()
        if self.damaged is not None:
            detail = f"the newest commit record's detector state is damaged ({self.damaged}): anomalies not checked"
            return [AnomalyProblem("?", None, "detector-state", detail, 0)]
        if self.unknown:  # a newer runledger judged: this one cannot re-derive what it made
            first, number = self.unknown[0]
            detail = (
                f"the detectors' rule set {number} (from commit {first}) is unknown to this runledger: "
                "its anomaly events are not checked; verify with a newer runledger"
            )
            return [AnomalyProblem("?", None, f"rule-set-{number}", detail, 0)]
        if self._writer is None:
            return []
        self._writer.close()
        out: list[AnomalyProblem] = []
        for stream, found in self._streams():
            out.extend(_compare(stream, found, redacted_ids))
        return out

    def _streams(self) -> Iterator[tuple[str, _StreamAnomalies]]:
        """(stream, its _StreamAnomalies) for each stream, re-derived in stream order."""
        con = duckdb.connect()
        try:
            cursor = con.execute(
                'SELECT stream, seq, "commit", canonical FROM read_parquet(?) ORDER BY stream, seq',
                [str(self.path)],
            )
            current: str | None = None
            found = _StreamAnomalies()
            state = DetectorState()
            while rows := cursor.fetchmany(_SPILL_ROWS):
                for stream, seq, commit, text in rows:
                    if stream != current:
                        if current is not None:
                            yield current, found
                        current, found, state = stream, _StreamAnomalies(), DetectorState()
                    self._one(found, state, seq, commit, text)
            if current is not None:
                yield current, found
        finally:
            con.close()

    def _one(self, found: _StreamAnomalies, state: DetectorState, seq: int, commit: int, text: str) -> None:
        decoded = decode_event(text.encode())
        if not isinstance(decoded, Event):
            return
        env = decoded.envelope
        if env.type == c.LEDGER_ANOMALY:
            found.stored[env.id] = (text, seq, _describe(env))
            return
        for finding in detect(self._rules_at(commit), state, env):
            made = anomaly_event(finding, env)
            if self.since is not None and commit >= self.since:
                # Compared as the store keeps it: the canonical bytes (sorted keys, as verify reads them).
                found.expected[made.id] = (
                    canonicalize_json(encode_event(made)).decode(),
                    _describe(made),
                    seq,
                )

    def _rules_at(self, commit: int) -> tuple[Rule, ...]:
        """The rules that judged ``commit`` (before the first set's first commit: the first set)."""
        number = self.rule_sets[0][1]
        for first, later in self.rule_sets[1:]:
            if first > commit:
                break
            number = later
        return RULE_SETS[number]


def _describe(env: Envelope) -> str:
    data: Any = env.data
    return f"{data.rule} v{data.rule_version} on {data.metric} at step {env.step}, caused by event {data.event_id}"


def _compare(stream: str, found: _StreamAnomalies, redacted_ids: set[str]) -> list[AnomalyProblem]:
    out = []
    for ident, (text, what, cause_seq) in found.expected.items():
        stored = found.stored.get(ident)
        if stored is None:
            detail = f"missing: {what} (re-derived from the log, not recorded)"
            out.append(AnomalyProblem(stream, None, ident, detail, cause_seq))
        elif stored[0] != text:
            detail = f"altered: {stored[2]} (re-derived from the log: {what}, with other bytes)"
            out.append(AnomalyProblem(stream, stored[1], ident, detail, stored[1]))
    for ident, (text, seq, what) in found.stored.items():
        if ident in found.expected:
            continue
        cause = _cause_of(text)
        if cause in redacted_ids:
            continue  # its cause's payload was erased: nothing to re-derive it from
        detail = f"extra: {what} (the log's detectors do not find it)"
        out.append(AnomalyProblem(stream, seq, ident, detail, seq))
    return sorted(out, key=lambda p: (p.seq if p.seq is not None else -1, p.event_id))


def _cause_of(text: str) -> str | None:
    decoded = decode_event(text.encode())
    if not isinstance(decoded, Event):
        return None
    return str(decoded.envelope.data.event_id)
