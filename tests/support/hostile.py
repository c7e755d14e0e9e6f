"""A corpus of structurally hostile records, each with the outcome the ledger's door must give it.

``corpus(max_event_bytes)`` returns ``Hostile`` items: depth (64, 65, 1000, 100000 levels, in the
envelope, inside ``data.config`` and inside a GitHub raw payload, and unclosed), width (an object with
100k keys, an array of 1M ints), strings just under and over the maximum event size, huge and tiny
numbers (2**64, 2**70, -2**70, 1e309, -0.0, 1e-400), duplicate keys, NaN/Infinity literals, a UTF-8
BOM, invalid UTF-8, lone surrogates, NUL bytes, empty, whitespace-only, ``null``, a bare number, a
top-level array, truncated JSON, a Kafka tombstone (``raw`` None) and valid events.

Each item says what must happen: ``code`` is ``"accept"`` or the reason code the record must be
quarantined with (``Quarantined.code``, the dead letter's ``reason``), and ``reason`` a piece of
text the quarantine reason must contain. Every item's event (if it has one) has its own id and its
own stream, so accepted ones can be counted exactly. Deep documents are built as text (a JSON
encoder would itself recurse too deeply).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec

from runledger.schemas import encode_event, make_event
from runledger.schemas import github as gh
from runledger.schemas import payloads as p
from runledger.schemas.codec import MAX_DEPTH, MAX_EVENT_BYTES

ACCEPT = "accept"
T0 = datetime(2026, 11, 2, tzinfo=UTC)
_HOLE = b'"@@HOLE@@"'  # where a deep or long value goes into an event's JSON text
_HASH = "0" * 64


@dataclass(frozen=True)
class Hostile:
    name: str
    raw: bytes | None  # None: a Kafka tombstone (a record with a null value)
    code: str  # "accept", or the reason code it must be quarantined with
    reason: str = ""  # text the quarantine reason must contain
    id: str | None = None  # the event id it carries (accepted ones land under it)
    readable_id: bool = False  # a rejected envelope whose id must still be recorded
    alt: str | None = None  # another outcome that is as right (the reason is then not checked)

    @property
    def accepted(self) -> bool:
        return self.code == ACCEPT

    @property
    def outcomes(self) -> tuple[str, ...]:
        return (self.code,) if self.alt is None else (self.code, self.alt)

    def check(self, code: str, reason: str = "") -> None:
        """Assert that ``code`` (``"accept"`` or a quarantine code) and ``reason`` are right for it."""
        assert code in self.outcomes, f"{self.name}: {code} ({reason}), expected {' or '.join(self.outcomes)}"
        if code != ACCEPT:
            assert reason, f"{self.name}: quarantined without a reason"
            if code == self.code:
                assert self.reason in reason, f"{self.name}: reason {reason!r} lacks {self.reason!r}"


def _run_event(name: str, payload: msgspec.Struct, **kw: Any) -> tuple[str, bytes]:
    stream = f"h-{name}"
    env = make_event(
        payload,
        source="hostile/corpus",
        stream=stream,
        run_id=stream,
        attempt=1,
        step=kw.pop("step", 1),
        seq=kw.pop("seq", 0),
        id=f"hostile-{name}",
        time=T0,
        **kw,
    )
    return env.id, encode_event(env)


def _github_event(name: str, payload: msgspec.Struct) -> tuple[str, bytes]:
    """A GitHub event in a stream of its own (GitHub events all have seq 0)."""
    stream = f"hostile/{name}"
    env = make_event(
        payload, source=f"github-test/{stream}", stream=stream, seq=0, id=f"hostile-{name}", time=T0
    )
    return env.id, encode_event(env)


def _started(name: str, config: dict[str, Any]) -> tuple[str, bytes]:
    return _run_event(name, p.RunStarted(config=config, config_hash=_HASH, host="h"), step=0)


def _metrics(name: str, **values: Any) -> tuple[str, bytes]:
    return _run_event(name, p.StepMetrics(**values))


def _patch(raw: bytes, **members: Any) -> bytes:
    """The event's JSON with top-level members replaced (or added), as text: the order is kept."""
    obj = json.loads(raw)
    obj.update(members)
    return json.dumps(obj).encode()


def _nest(levels: int, *, closed: bool = True) -> bytes:
    return b"[" * levels + (b"]" * levels if closed else b"")


def _deep_items() -> Iterator[Hostile]:
    too_deep = f"nested deeper than {MAX_DEPTH} levels"
    # Levels above the hole: envelope member 1; data.config 3; github raw data.payload 3.
    for where, above in (("envelope", 1), ("config", 3), ("github-payload", 3)):
        for total in (MAX_DEPTH, MAX_DEPTH + 1, 1000, 100_000):
            name = f"depth-{total}-{where}"
            if where == "envelope":
                ident, raw = _metrics(name, loss=1.0)
                raw = _patch(raw, deep="@@HOLE@@")
            elif where == "config":
                ident, raw = _started(name, {"deep": "@@HOLE@@"})
            else:
                ident, raw = _github_event(name, gh.GitHubRaw(event="ping", payload={"deep": "@@HOLE@@"}))
            raw = raw.replace(_HOLE, _nest(total - above))
            if total <= MAX_DEPTH:
                yield Hostile(name, raw, ACCEPT, id=ident)
            else:
                yield Hostile(name, raw, "too-deep", too_deep)
    ident, raw = _metrics("depth-unclosed", loss=1.0)
    yield Hostile("depth-unclosed", raw[:-1] + b',"x":' + _nest(100_000, closed=False), "too-deep", too_deep)


def _size_items(max_event_bytes: int) -> Iterator[Hostile]:
    ident, raw = _started("wide-object", {f"k{i}": i for i in range(100_000)})
    yield Hostile("wide-object-100k-keys", raw, ACCEPT, id=ident)
    ident, raw = _started("wide-array", {"ints": [i % 10 for i in range(1_000_000)]})
    yield Hostile("wide-array-1m-ints", raw, ACCEPT, id=ident)
    for name, size in (
        ("string-just-under-max", max_event_bytes - 1),
        ("string-just-over-max", max_event_bytes + 1),
    ):
        ident, raw = _started(name, {"s": "@@HOLE@@"})
        fill = size - (len(raw) - len(_HOLE)) - 2
        raw = raw.replace(_HOLE, b'"' + b"x" * fill + b'"')
        assert len(raw) == size
        if size <= max_event_bytes:
            yield Hostile(name, raw, ACCEPT, id=ident)
        else:
            reason = f"record of {size} bytes exceeds the maximum event size of {max_event_bytes} bytes"
            yield Hostile(name, raw, "too-large", reason)


def _number_items() -> Iterator[Hostile]:
    for field_name, value in (("seq", 2**64), ("seq", 2**70), ("attempt", 2**70), ("step", 2**70)):
        name = f"{field_name}-{value.bit_length() - 1}bits"
        ident, raw = _metrics(name, loss=1.0)
        yield Hostile(
            name, _patch(raw, **{field_name: value}), "envelope", f"`$.{field_name}`", readable_id=True
        )
    ident, raw = _metrics("step-negative-2-70", loss=1.0)
    yield Hostile("step-negative-2-70", _patch(raw, step=-(2**70)), "envelope", "`$.step`", readable_id=True)
    ident, raw = _metrics("schema-version-2-70", loss=1.0)
    yield Hostile(
        "schema-version-2-70",
        _patch(raw, schema_version=2**70),
        "envelope",
        "`$.schema_version`",
        readable_id=True,
    )
    # Numbers JSON allows but float64 can't hold, in a typed field and in a member no struct reads.
    ident, raw = _metrics("loss-1e309", loss=1.0)
    yield Hostile("loss-1e309", raw.replace(b'"loss":1.0', b'"loss":1e309'), "schema", "out of range")
    ident, raw = _metrics("member-1e309", loss=1.0)
    yield Hostile("member-1e309", raw[:-1] + b',"extra":1e309}', "decode", "out of range")
    ident, raw = _metrics("loss-negative-zero", loss=1.0)
    yield Hostile("loss-negative-zero", raw.replace(b'"loss":1.0', b'"loss":-0.0'), ACCEPT, id=ident)
    ident, raw = _metrics("loss-1e-400", loss=1.0)
    yield Hostile("loss-1e-400", raw.replace(b'"loss":1.0', b'"loss":1e-400'), ACCEPT, id=ident)
    ident, raw = _started("config-2-64", {"big": 2**64, "bigger": 2**70, "negative": -(2**70)})
    yield Hostile("config-2-64", raw, ACCEPT, id=ident)
    # Decodes (a Python int has no bound) but cannot be a Parquet int64: the commit's belt.
    layer = p.MoeLayerStats(layer=0, tokens=2**70, top_k=1, dropped=0, token_drop_rate=0.0)
    ident, raw = _run_event("moe-tokens-2-70", p.MoeRouterStats(layers=[layer]))
    yield Hostile("moe-tokens-2-70", raw, "unstorable", "cannot store this event")


def _text_items() -> Iterator[Hostile]:
    ident, raw = _metrics("duplicate-keys", loss=1.0)
    yield Hostile("duplicate-keys", b'{"seq":999,"loss":"x",' + raw[1:], ACCEPT, id=ident)
    for literal in (b"NaN", b"Infinity", b"-Infinity"):
        name = f"literal-{literal.decode().lower()}"
        _, raw = _metrics(name, loss=1.0)
        yield Hostile(name, raw.replace(b'"loss":1.0', b'"loss":' + literal), "decode", "malformed")
    _, raw = _metrics("utf8-bom", loss=1.0)
    yield Hostile("utf8-bom", b"\xef\xbb\xbf" + raw, "decode", "malformed")
    _, raw = _metrics("invalid-utf8", loss=1.0)
    yield Hostile(
        "invalid-utf8", raw.replace(b"hostile-invalid-utf8", b"hostile-\xff\xfe"), "decode", "UTF-8"
    )
    _, raw = _metrics("lone-surrogate", loss=1.0)
    yield Hostile("lone-surrogate", raw.replace(b"hostile-lone-surrogate", b"hostile-\\ud800"), "decode")
    _, raw = _metrics("nul-raw", loss=1.0)
    yield Hostile("nul-raw", raw.replace(b"hostile-nul-raw", b"hostile-\x00"), "decode", "malformed")
    _, raw = _metrics("nul-after", loss=1.0)
    yield Hostile("nul-after", raw + b"\x00", "decode", "trailing")
    ident, raw = _metrics("nul-escaped", loss=1.0)
    yield Hostile(
        "nul-escaped",
        raw.replace(b"hostile-nul-escaped", b"hostile-nul-escaped\\u0000"),
        ACCEPT,
        id=ident + "\x00",
    )
    _, raw = _metrics("truncated", loss=1.0)
    yield Hostile("truncated", raw[: len(raw) // 2], "decode", "truncated")
    yield Hostile("empty", b"", "empty", "empty record")
    yield Hostile("whitespace-only", b" \n\t\r ", "empty", "empty record")
    yield Hostile("tombstone", None, "tombstone", "tombstone (null value)")
    for name, raw, got in (
        ("null", b"null", "null"),
        ("bare-number", b"42", "int"),
        ("bare-string", b'"event"', "str"),
        ("top-level-array", b"[1,2,3]", "array"),
    ):
        yield Hostile(name, raw, "envelope", f"Expected `object`, got `{got}`")
    _, raw = _metrics("array-of-event", loss=1.0)
    yield Hostile("array-of-event", b"[" + raw + b"]", "envelope", "Expected `object`, got `array`")


def _envelope_items() -> Iterator[Hostile]:
    _, raw = _metrics("step-wrong-type", loss=1.0)
    yield Hostile("step-wrong-type", _patch(raw, step="three"), "envelope", "`$.step`", readable_id=True)
    _, raw = _metrics("id-too-long", loss=1.0)
    yield Hostile("id-too-long", _patch(raw, id="x" * 2000), "envelope", "`$.id`")
    _, raw = _metrics("time-beyond-9999", loss=1.0)
    yield Hostile(
        "time-beyond-9999",
        _patch(raw, time="9999-12-31T23:59:59-10:00"),
        "envelope",
        "out of range",
        readable_id=True,
    )
    _, raw = _metrics("unknown-type", loss=1.0)
    yield Hostile("unknown-type", _patch(raw, type="runledger.no.such"), "unknown-type", "unknown event type")
    # Valid events naming an owner that can't be a directory (the github table is partitioned by
    # owner): stored under another partition, or quarantined by the ledger; never a failed commit.
    for name, repo in (("github-nul-owner", "own\x00er/x"), ("github-long-owner", "o" * 300 + "/x")):
        ident, raw = _github_event(name, gh.GitHubCommit(repo=repo, sha="a" * 40))
        yield Hostile(name, raw, ACCEPT, id=ident, alt="unstorable")


def corpus(max_event_bytes: int = MAX_EVENT_BYTES, *, tombstone: bool = True) -> list[Hostile]:
    """Every hostile item (``tombstone=False`` leaves out the one only Kafka can carry)."""
    items = [
        *_deep_items(),
        *_size_items(max_event_bytes),
        *_number_items(),
        *_text_items(),
        *_envelope_items(),
    ]
    names = [item.name for item in items]
    assert len(names) == len(set(names)), "corpus item names must be unique"
    return [item for item in items if tombstone or item.raw is not None]


def valid_events(
    n: int, *, run_id: str = "valid-run", start: int = 0, seed: int = 7
) -> list[tuple[str, bytes]]:
    """Realistic step metrics (noisy floats, not constants): (id, raw) pairs, seq/step from ``start``."""
    rng = random.Random(seed * 1_000_003 + start)
    out = []
    for i in range(start, start + n):
        loss = 2.0 + 8.0 / (1 + i) + rng.gauss(0, 0.05)
        env = make_event(
            p.StepMetrics(
                loss=loss,
                grad_norm=abs(rng.gauss(1.0, 0.3)),
                lr=3e-4 * min(1.0, (i + 1) / 100),
                tokens=4096,
                total_tokens=4096 * (i + 1),
                tokens_per_second=rng.uniform(9e4, 1.1e5),
                step_time_s=rng.uniform(0.4, 0.6),
                scalars={f"s{j}": rng.random() for j in range(8)},
            ),
            source=f"trainer/{run_id}/rank0",
            stream=run_id,
            run_id=run_id,
            attempt=1,
            step=i + 1,
            seq=i,
            id=f"{run_id}-{i}",
            time=T0 + timedelta(seconds=i),
        )
        out.append((env.id, encode_event(env)))
    return out
