"""Admission at ingest: who may write what (producer registry), and each source's order (seq + chain).

``Ledger.commit`` runs one ``AdmissionRound`` per commit: ``check`` sees every valid, new event in
log order and refuses it (a ``Quarantined``) or lets it in; ``incidents`` gives the commit the
incident events that ``check`` asked for, which it stores right after the record that caused them.

The store imports this module, never the other way round: admission sees the ledger only through
``LedgerView`` (what it reads of ``runledger.ledger.store.Ledger``) and a record through ``IngestRecord``.
Writing registry events into a ledger, and carrying them across a replay, is ``runledger.ledger.registry``'s
(it commits through the store).

**Registry.** Kept as events in the log (``ledger.producer.registered|rotated|revoked`` and
``ledger.policy.changed``, written by ``ledger producers``), so each key's addition, rotation and
revocation is on the record, and admission uses the registry *as of that point in the log*: a key
revoked at commit 7 refuses its events from commit 7 on, while its events already stored still
verify (``runledger.ledger.verifier``). The ledger's own types (``LEDGER_TYPES``) and sources named
``ledger:...`` are admitted only from the ledger's own ingest sources (``REGISTRY_INGEST``,
``INCIDENT_INGEST``): whoever can write to a topic cannot register a key.

**Policy.** A ledger with no registry event admits everything as before (unsigned allowed; signed
events are stored unverified, there is no key to verify them with). Once a registry exists, every
event must be signed by a registered, unrevoked key whose scope covers its source, stream, type and
time, except events from sources the policy names in ``unsigned_sources`` (unauthenticated).
Scopes and the policy match by whole path segments (``scope_matches``): ``trainer/r5`` covers
``trainer/r5/a1/rank0`` but not ``trainer/r5-evil``; ``trainer/run-*`` is an explicit string prefix.
Quarantine codes: ``unsigned``, ``unknown-key``, ``revoked-key``, ``bad-signature``,
``out-of-scope``, ``reserved``.

**Order.** An event that carries ``prev`` (its producer keeps a hash chain, see
``runledger.schemas.signing``) must follow its source's last stored event: ``seq`` one more than the
highest stored, ``prev`` that event's hash (``GENESIS`` and seq 0 for a source's first). Otherwise
it is still stored (never blocking) and a ``ledger.incident`` event is appended on its stream:
``gap`` (``missing`` seq numbers before it) or ``fork`` (its seq was already taken, or its ``prev``
is not the last event's hash). A source that keeps no chain (a producer without a key) still
numbers its events one by one: a ``seq`` more than one past the highest it stored is a ``gap`` too
(``unchained_gap``), so a stretch that a keyless producer lost, and died before it could report, is
on the record. Without a chain nothing tells a fork, so an earlier or repeated ``seq`` is none, and
its first event may have any ``seq`` (nothing was stored to count from). Bus positions
(``bus.positions_missing``, numbered by position) are not a producer's count.

**Authenticated.** Each admitted event's row says how it got in (``Admitted.authenticated``, the
events table's ``authenticated`` column): True, its signature verified against a registered key;
False, let in unsigned by the policy (answers show it as unauthenticated); None, the ledger had no
registry then (nothing was checked).

**State.** The registry, the policy, each source's head and each unchained source's highest seq
are saved with every commit record (``"admission"``, ``AdmissionState.to_json``): the commit point that stores the events stores the
heads they moved, exactly once, and opening a writer reads one record (O(sources)), not the events.
A ledger written before that is rebuilt once from its events table (``scan_state``).
"""

from __future__ import annotations

import bisect
import contextlib
import logging
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import msgspec

from runledger.schemas import catalogue as c
from runledger.schemas import payloads as p
from runledger.schemas.codec import (
    Event,
    Quarantined,
    decode_event,
    encode_event,
    make_event,
    refused_event,
)
from runledger.schemas.note import CheckpointError, NoteVerifier, parse_public_key
from runledger.schemas.signing import GENESIS, SignatureError, event_hash, key_id_of, verify_canonical

log = logging.getLogger("runledger.ledger")

REGISTRY_INGEST = "ledger:registry"  # ingest source (and event source) of registry and policy events
INCIDENT_INGEST = "ledger:incidents"  # ingest source (and event source) of incident events
REGISTRY_STREAM = "ledger:registry"  # their stream: the colon keeps it apart from every run id

UNSIGNED = "unsigned"
UNKNOWN_KEY = "unknown-key"
REVOKED_KEY = "revoked-key"
BAD_SIGNATURE = "bad-signature"
OUT_OF_SCOPE = "out-of-scope"
RESERVED = "reserved"
ADMISSION_REASONS = (UNSIGNED, UNKNOWN_KEY, REVOKED_KEY, BAD_SIGNATURE, OUT_OF_SCOPE, RESERVED)

REGISTRY_TYPES = (c.PRODUCER_REGISTERED, c.PRODUCER_ROTATED, c.PRODUCER_REVOKED, c.POLICY_CHANGED)


class IngestRecord(Protocol):
    """What admission reads of a record a commit consumes (``runledger.ledger.store.SourceRecord``)."""

    @property
    def source(self) -> str: ...  # the ingest source it was read from

    @property
    def raw(self) -> bytes: ...


class LedgerView(Protocol):
    """What admission reads (and keeps) of a ledger (``runledger.ledger.store.Ledger``)."""

    root: Path
    admission_state: AdmissionState | None  # the state as of a commit, kept here between commits

    @property
    def last_commit(self) -> int: ...

    def commit_paths(self) -> list[Path]: ...

    def events_reader(self) -> AbstractContextManager[Any]:
        """A connection on which ``events`` is the ledger's events table, at one moment."""
        ...


@dataclass(frozen=True)
class ProducerKey:
    key_id: str
    name: str
    public_key: str  # note vkey text
    verifier: NoteVerifier
    scope: p.ProducerScope
    revoked: bool = False


@dataclass
class AdmissionState:
    """The registry and each source's head as of commit ``commit`` (-1: an empty ledger)."""

    commit: int = -1
    registry: bool = False  # any registry or policy event seen: admission is on
    keys: dict[str, ProducerKey] = field(default_factory=dict)
    unsigned_sources: list[str] = field(default_factory=list)
    heads: dict[str, tuple[int, str]] = field(default_factory=dict)  # source -> (highest seq, hash)
    seqs: dict[str, int] = field(default_factory=dict)  # unchained source -> highest seq stored
    # "run/attempt" -> "source id" of its first launch: a second launch is a duplicate-launch incident
    launches: dict[str, str] = field(default_factory=dict)

    def copy(self) -> AdmissionState:
        return replace(
            self,
            keys=dict(self.keys),
            unsigned_sources=list(self.unsigned_sources),
            heads=dict(self.heads),
            seqs=dict(self.seqs),
            launches=dict(self.launches),
        )

    def to_json(self) -> dict[str, Any]:
        """What the commit record keeps (everything but ``commit``, which is the record's own)."""
        return {
            "registry": self.registry,
            "keys": [
                {
                    "name": k.name,
                    "public_key": k.public_key,
                    "scope": msgspec.to_builtins(k.scope),
                    "revoked": k.revoked,
                }
                for k in self.keys.values()
            ],
            "unsigned_sources": list(self.unsigned_sources),
            "heads": {source: [seq, digest] for source, (seq, digest) in sorted(self.heads.items())},
            "seqs": dict(sorted(self.seqs.items())),
            "launches": dict(sorted(self.launches.items())),
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any], commit: int) -> AdmissionState:
        state = cls(commit=commit, registry=bool(obj.get("registry")))
        for k in obj.get("keys", []):
            scope = msgspec.json.decode(msgspec.json.encode(k["scope"]), type=p.ProducerScope)
            key = _key(k["public_key"], k["name"], scope)
            state.keys[key.key_id] = replace(key, revoked=bool(k.get("revoked")))
        state.unsigned_sources = list(obj.get("unsigned_sources", []))
        state.heads = {
            source: (int(seq), str(digest)) for source, (seq, digest) in obj.get("heads", {}).items()
        }
        # A record written before unchained sources were counted has none: they count from their next event.
        state.seqs = {str(source): int(seq) for source, seq in (obj.get("seqs") or {}).items()}
        state.launches = {str(k): str(v) for k, v in (obj.get("launches") or {}).items()}
        return state

    def apply(self, env_type: str, payload: msgspec.Struct) -> None:
        """Fold one registry or policy event in."""
        self.registry = True
        if isinstance(payload, p.ProducerRegistered):
            key = _key(payload.public_key, payload.name, payload.scope)
            self.keys[key.key_id] = key
        elif isinstance(payload, p.ProducerRotated):
            old = self.keys.get(payload.old_key_id)
            if old is not None:
                self.keys[old.key_id] = replace(old, revoked=True)
                new = _key(payload.public_key, old.name, old.scope)
                self.keys[new.key_id] = new
        elif isinstance(payload, p.ProducerRevoked):
            old = self.keys.get(payload.key_id)
            if old is not None:
                self.keys[old.key_id] = replace(old, revoked=True)
        elif isinstance(payload, p.PolicyChanged):
            self.unsigned_sources = list(payload.unsigned_sources)


@dataclass(frozen=True)
class Admitted:
    """An event let in, and how: ``authenticated`` True (signature verified), False (unsigned, let
    in by the policy), None (no registry yet: nothing checked)."""

    authenticated: bool | None


SIGNED_IN = Admitted(True)
UNSIGNED_IN = Admitted(False)
UNCHECKED = Admitted(None)


def _key(public_key: str, name: str, scope: p.ProducerScope) -> ProducerKey:
    verifier = parse_public_key(public_key)
    return ProducerKey(key_id_of(verifier), name, public_key.strip(), verifier, scope)


# Where a name's path segments end: sources and streams are ``/``-paths (``trainer/<run>/a1/rank0``,
# ``owner/repo``; ``wandb-api:`` and ``ledger:`` end a segment with ``:``), types are ``.``-paths.
PATH_SEPARATORS = "/:"
TYPE_SEPARATORS = "."


def scope_matches(value: str, prefix: str, separators: str = PATH_SEPARATORS) -> bool:
    """Whether ``prefix`` covers ``value`` by whole segments: ``trainer/r5`` covers ``trainer/r5`` and
    ``trainer/r5/a1/rank0``, never ``trainer/r5-evil/…`` (a plain string prefix would). ``*`` covers
    everything; a prefix ending in ``*`` (``trainer/run-*``) is the explicit plain string prefix."""
    if prefix == "*":
        return True
    if not prefix:
        return False  # an empty prefix names nothing (it is no wildcard)
    if prefix.endswith("*"):
        return value.startswith(prefix[:-1])
    if not value.startswith(prefix):
        return False
    rest = value[len(prefix) :]
    return not rest or prefix[-1] in separators or rest[0] in separators


def _matches(value: str, prefixes: Iterable[str], separators: str = PATH_SEPARATORS) -> bool:
    return any(scope_matches(value, prefix, separators) for prefix in prefixes)


def _utc(t: datetime) -> datetime:
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


class AdmissionRound:
    """One commit's admission: works on a copy of the state, kept only if the commit succeeds."""

    def __init__(self, ledger: LedgerView, state: AdmissionState, positions: dict[str, int]) -> None:
        self.ledger = ledger
        self.state = state
        self.positions = positions  # the commit's own (live) positions: incidents take the next one
        self._pending: list[tuple[p.LedgerIncident, Event]] = []

    # -- the hook's three calls -----------------------------------------------------------------
    def incidents(self) -> Iterator[tuple[str, int, bytes]]:
        """The incident events the checks so far asked for, as records to commit next: (ingest
        source, position, bytes). Lazy: each is made when asked for, at the next position of
        ``INCIDENT_INGEST`` in the commit's own ``positions``, which the commit moves on as it
        consumes each one (the store asks after every record)."""
        while self._pending:
            incident, cause = self._pending.pop(0)
            position = self.positions.get(INCIDENT_INGEST, 0)
            env = cause.envelope
            envelope = make_event(
                incident,
                source=INCIDENT_INGEST,
                stream=env.stream,
                seq=position,
                run_id=env.run_id,
                attempt=env.attempt,
                step=env.step,
                subject=env.source,
                id=f"incident-{position}-{env.id}"[:1000],
                time=env.time,  # the cause's: a replay that meets the same cause writes the same bytes
            )
            yield INCIDENT_INGEST, position, encode_event(envelope)

    def check(self, event: Event, record: IngestRecord, leaf: bytes) -> Quarantined | Admitted:
        """Refuse ``event`` (a ``Quarantined`` with its reason) or admit it (how: ``Admitted``) and
        note its place in its source's order. ``leaf``: its Merkle leaf hash (the store has it)."""
        env = event.envelope
        internal = record.source in (REGISTRY_INGEST, INCIDENT_INGEST)
        if internal or is_own(env):
            if not internal or env.source != record.source:
                return _refuse(
                    event, record, RESERVED, f"{env.type} from {env.source} is the ledger's own record"
                )
            if env.type in REGISTRY_TYPES:
                try:
                    self.state.apply(env.type, env.data)
                except CheckpointError as exc:
                    return _refuse(event, record, RESERVED, f"registry event with a bad key: {exc}")
            return UNCHECKED
        verdict = authenticate(self.state, env, event.canonical)
        if isinstance(verdict, tuple):
            return _refuse(event, record, *verdict)
        self._order(event, leaf)
        self._launch(event)
        return verdict

    def keep(self, commit: int) -> None:
        """The commit succeeded: its state is the ledger's."""
        self.state.commit = commit
        self.ledger.admission_state = self.state

    # -- order -----------------------------------------------------------------------------------
    def _order(self, event: Event, leaf: bytes) -> None:
        env = event.envelope
        if env.prev is None:
            self._count(event)
            return
        head = self.state.heads.get(env.source)
        expected_seq, expected_prev = (0, GENESIS) if head is None else (head[0] + 1, head[1])
        if env.seq > expected_seq:
            self._pending.append(
                (_incident("gap", env, expected_seq, expected_prev, env.seq - expected_seq), event)
            )
        elif env.seq < expected_seq or env.prev != expected_prev:
            self._pending.append((_incident("fork", env, expected_seq, expected_prev, 0), event))
        if head is None or env.seq > head[0]:
            self.state.heads[env.source] = (env.seq, leaf.hex())  # = event_hash(canonical)

    def _count(self, event: Event) -> None:
        """An event of a source that keeps no chain: a gap incident if its ``seq`` skips past the
        highest this source stored (the module docstring says why only that)."""
        env = event.envelope
        if env.type == c.BUS_POSITIONS_MISSING:
            return  # numbered by bus position, not by a producer
        last = self.state.seqs.get(env.source)
        gap = unchained_gap(last, env.seq)
        if gap:
            self._pending.append((_incident("gap", env, env.seq - gap, None, gap), event))
        if last is None or env.seq > last:
            self.state.seqs[env.source] = env.seq

    def _launch(self, event: Event) -> None:
        """A second launch of one attempt of a run (two producers recording one run: the W&B bridge
        and a later import, two processes claiming one run id): stored, and a ``duplicate-launch``
        incident says so. The views keep the first (``runledger.ledger.views``)."""
        env = event.envelope
        if env.type not in (c.RUN_STARTED, c.RUN_RESUMED) or not env.run_id:
            return
        key = f"{env.run_id}/{env.attempt or 1}"
        first = self.state.launches.setdefault(key, f"{env.source} {env.id}")
        if first == f"{env.source} {env.id}":
            return
        detail = f"attempt {env.attempt or 1} of run {env.run_id} was launched already by {first}"
        log.warning("ledger: duplicate launch from %s: %s", env.source, detail)
        incident = p.LedgerIncident(
            kind="duplicate-launch",
            source=env.source,
            expected_seq=env.seq,
            got_seq=env.seq,
            expected_prev=first,  # the attempt's first launch, "source id"
            event_id=env.id,
        )
        self._pending.append((incident, event))


def is_own(env: Any) -> bool:
    """An event of the ledger's own record (registry, policy, incidents): never a producer's."""
    return env.type in c.LEDGER_TYPES or env.source.startswith("ledger:") or env.stream == REGISTRY_STREAM


def authenticate(state: AdmissionState, env: Any, canonical: bytes) -> Admitted | tuple[str, str]:
    """How a producer's event is admitted under the registry and policy of ``state``, or why not
    (quarantine code, reason). Ingest and ``ledger verify`` both judge events with it."""
    if not state.registry:
        return UNCHECKED  # no registry in this ledger yet: everything is admitted, as before admission
    if env.signature is None or env.key_id is None:
        if _matches(env.source, state.unsigned_sources):
            return UNSIGNED_IN
        return UNSIGNED, f"unsigned event from {env.source}, not allowed unsigned"
    key = state.keys.get(env.key_id)
    if key is None:
        return UNKNOWN_KEY, f"signed by {env.key_id}, not a registered producer key"
    if key.revoked:
        return REVOKED_KEY, f"signed by {env.key_id}, revoked before this event"
    try:
        verify_canonical(canonical, key.verifier)
    except SignatureError as exc:
        return BAD_SIGNATURE, str(exc)
    scope = key.scope
    problem = None
    if not _matches(env.source, scope.sources):
        problem = f"source {env.source}"
    elif scope.streams and not _matches(env.stream, scope.streams):
        problem = f"stream {env.stream}"
    elif scope.types and not _matches(env.type, scope.types, TYPE_SEPARATORS):
        problem = f"type {env.type}"
    elif scope.valid_from is not None and _utc(env.time) < _utc(scope.valid_from):
        problem = f"time {env.time.isoformat()} before the key's validity"
    elif scope.valid_until is not None and _utc(env.time) > _utc(scope.valid_until):
        problem = f"time {env.time.isoformat()} after the key's validity"
    if problem is not None:
        return OUT_OF_SCOPE, f"{problem} is outside key {key.key_id}'s scope"
    return SIGNED_IN


def unchained_gap(last_seq: int | None, seq: int) -> int:
    """How many seq numbers an unchained source skipped before ``seq``, its highest stored being
    ``last_seq`` (None: nothing stored yet, so nothing to count from)."""
    return 0 if last_seq is None else max(0, seq - last_seq - 1)


def _incident(
    kind: str, env: Any, expected_seq: int, expected_prev: str | None, missing: int
) -> p.LedgerIncident:
    return p.LedgerIncident(
        kind=kind,  # type: ignore[arg-type]
        source=env.source,
        expected_seq=expected_seq,
        got_seq=env.seq,
        missing=missing,
        expected_prev=expected_prev,
        got_prev=env.prev,
        event_id=env.id,
    )


def _refuse(event: Event, record: IngestRecord, code: str, reason: str) -> Quarantined:
    return refused_event(event.envelope, record.raw, code, f"{code}: {reason}")


# ---------------------------------------------------------------------------------------- state


def admission_round(ledger: LedgerView, positions: dict[str, int]) -> AdmissionRound:
    """The admission of the commit ``ledger`` is about to make (under its writer lock)."""
    state: AdmissionState | None = ledger.admission_state
    if state is None or state.commit != ledger.last_commit:
        state = ledger.admission_state = load_state(ledger)
    return AdmissionRound(ledger, state.copy(), positions)


def load_state(ledger: LedgerView) -> AdmissionState:
    """The admission state as of the ledger's last commit, from that commit's record (O(sources));
    from the events table for a ledger whose records predate it (``scan_state``)."""
    paths = ledger.commit_paths()
    if not paths:
        return AdmissionState()
    record = msgspec.json.decode(paths[-1].read_bytes())
    saved = record.get("admission")
    if saved is not None:
        return AdmissionState.from_json(saved, record["commit"])
    return scan_state(ledger, record["commit"])


def scan_state(ledger: LedgerView, commit: int) -> AdmissionState:
    """The admission state as of ``commit`` (the last), from the events table: for a ledger written
    before commit records kept it, read through ``events_reader`` (a lake snapshot, or part files):
    the registry's events in log order, and each source's head (its highest seq, the first stored if
    a fork repeated it)."""
    state = AdmissionState(commit=commit)
    with ledger.events_reader() as con:
        registry = con.execute(
            'SELECT canonical FROM events WHERE ingest_source = ? ORDER BY "commit", ingest_position',
            [REGISTRY_INGEST],
        ).fetchall()
        heads = con.execute(
            "SELECT source, seq, canonical FROM events WHERE source IS NOT NULL "
            'QUALIFY row_number() OVER (PARTITION BY source ORDER BY seq DESC, "commit", ingest_position) = 1'
        ).fetchall()
    for (text,) in registry:
        decoded = decode_event(text.encode())
        if isinstance(decoded, Event) and decoded.envelope.type in REGISTRY_TYPES:
            with contextlib.suppress(CheckpointError):  # refused when written: never in the table
                state.apply(decoded.envelope.type, decoded.envelope.data)
    for source, seq, text in heads:
        state.heads[source] = (seq, event_hash(text.encode()))
        state.seqs[source] = seq  # read only for the sources that keep no chain
    return state


# ---------------------------------------------------------------------------------- the registry's past


class RegistryTimeline:
    """The registry and policy as they stood at each commit, for judging stored events again
    (``ledger verify``): an event stored in commit ``n`` was admitted under the registry events of
    the commits before ``n`` (``runledger.ledger.registry.append_registry_event`` commits each one alone)."""

    def __init__(self, registry_events: Iterable[tuple[int, str, msgspec.Struct]]) -> None:
        """``registry_events``: (commit, type, payload) of each registry or policy event, in log order."""
        self._commits: list[int] = []
        self._states: list[AdmissionState] = []
        state = AdmissionState()
        for commit, env_type, payload in registry_events:
            with contextlib.suppress(CheckpointError):  # refused when written: never in the table
                state.apply(env_type, payload)
            if self._commits and self._commits[-1] == commit:
                self._states[-1] = state.copy()
            else:
                self._commits.append(commit)
                self._states.append(state.copy())

    def __bool__(self) -> bool:
        return bool(self._commits)

    def state_at(self, commit: int) -> AdmissionState:
        """The registry an event stored in ``commit`` was admitted under."""
        i = bisect.bisect_left(self._commits, commit) - 1
        return self._states[i] if i >= 0 else AdmissionState()
