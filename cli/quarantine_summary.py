"""What an ingest command says about the records it quarantined: the reasons with their counts and,
for the ones an operator fixes in the registry, the command that fixes them (at most 3 lines).

A ledger made by ``ledger init`` has a producer registry, so it refuses unsigned events (code
``unsigned``) except from sources its policy names: "ingested 0 events, 202 quarantined" alone does
not say that, nor that ``ledger producers policy --allow-unsigned`` or ``ledger producers add`` is the
way. The counts come from the ingest's own commits (``CommitResult.quarantined``), so they are this
run's, not the quarantine table's history. Stdlib only at import: the CLI starts fast.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runledger.cli.output import err_console

REASONS_SHOWN = 3  # the most frequent reasons named; the rest are counted as "other"
PREFIX_SEGMENTS = 2  # trainer/RUN covers every attempt and rank of a run (trainer/RUN/aN/rankR)
UNSIGNED = "unsigned"
KEY_CODES = ("unknown-key", "out-of-scope", "revoked-key")  # fixed by a registered key's scope


class QuarantineTally:
    """An ingester's ``on_commit`` that counts the quarantined records by reason code (and keeps
    the sources of the unsigned ones), then hands the result on to ``then``."""

    def __init__(self, then: Callable[[Any], None] | None = None) -> None:
        self.then = then
        self.codes: Counter[str] = Counter()
        self.sources: dict[str, set[str]] = {}  # by code: the event sources refused

    def __call__(self, result: Any) -> None:
        for _, quarantined in result.quarantined:
            code = quarantined.code or _code_of(quarantined.reason)
            self.codes[code] += 1
            if quarantined.source:
                self.sources.setdefault(code, set()).add(quarantined.source)
        if self.then is not None:
            self.then(result)


def _code_of(reason: str) -> str:
    """A reason without a code: its first word before a colon (``envelope: …``), else ``schema``."""
    head, sep, _ = reason.partition(":")
    return head if sep and " " not in head else "schema"


def source_prefixes(sources: set[str]) -> list[str]:
    """The source prefixes (whole segments, at most ``PREFIX_SEGMENTS``) that cover ``sources``:
    trainer/r5/a1/rank0 and trainer/r5/a2/rank3 give trainer/r5."""
    prefixes: set[str] = set()
    for source in sources:
        prefixes.add("/".join(source.split("/")[:PREFIX_SEGMENTS]))
    return sorted(prefixes)


def reasons_line(tally: QuarantineTally) -> str:
    """``quarantined: 202 unsigned, 3 schema, 1 other`` (the most frequent first)."""
    common = tally.codes.most_common()
    said = [f"{count} {code}" for code, count in common[:REASONS_SHOWN]]
    other = sum(count for _, count in common[REASONS_SHOWN:])
    if other:
        said.append(f"{other} other")
    return "quarantined: " + ", ".join(said) + " (the quarantine table has each record and its reason)"


def _ledger_arg(ledger: Path) -> str:
    return f" --ledger {ledger}"


def unsigned_fix(prefixes: list[str], allowed_now: list[str], ledger: Path) -> str:
    """The fix for unsigned events: allow their sources unsigned (keeping those allowed now: the
    policy is replaced as a whole), or register the producers' keys and sign."""
    allow = " ".join(f"--allow-unsigned {p}" for p in [*allowed_now, *prefixes] if p)
    sources = " ".join(f"--source {p}" for p in prefixes)
    return (
        "unsigned: this ledger's registry admits only signed events; from the next event on, allow "
        f"them with `ledger producers policy {allow}{_ledger_arg(ledger)}`, or sign them (producer "
        f"key in $RUNLEDGER_PRODUCER_KEY) and `ledger producers add NAME --public-key KEY.pub {sources}"
        f"{_ledger_arg(ledger)}`"
    )


def key_fix(code: str, prefixes: list[str], ledger: Path) -> str:
    """The fix for events signed by a key the registry does not hold, or holds with a narrower scope."""
    sources = " ".join(f"--source {p}" for p in prefixes)
    return (
        f"{code}: register the producer's key for these sources (`ledger producers add NAME --public-key "
        f"KEY.pub {sources}{_ledger_arg(ledger)}`; `ledger producers list{_ledger_arg(ledger)}` shows the registry)"
    )


def summary_lines(tally: QuarantineTally, ledger: Path, allowed_unsigned: list[str]) -> list[str]:
    """Nothing when nothing was quarantined; else the reasons line and the fix of the most frequent
    reason an operator fixes in the registry (at most 3 lines in all)."""
    if not tally.codes:
        return []
    lines = [reasons_line(tally)]
    if UNSIGNED in tally.codes:
        lines.append(
            unsigned_fix(source_prefixes(tally.sources.get(UNSIGNED, set())), allowed_unsigned, ledger)
        )
    keyed = [code for code, _ in tally.codes.most_common() if code in KEY_CODES]
    if keyed:
        lines.append(key_fix(keyed[0], source_prefixes(tally.sources.get(keyed[0], set())), ledger))
    return lines[:3]


def say_quarantined(tally: QuarantineTally, ledger: Path) -> None:
    """The reasons for this run's quarantined records and the fix of the main one, on stderr."""
    if not tally.codes:
        return
    for line in summary_lines(tally, ledger, _allowed_unsigned(ledger)):
        err_console.print(line, highlight=False, markup=False, emoji=False)


def _allowed_unsigned(ledger: Path) -> list[str]:
    """The sources the ledger's policy lets in unsigned now (a new policy replaces the list, so
    the suggested command keeps them); [] when it cannot be read: the summary is advice only."""
    from runledger.ledger.registry import producers
    from runledger.ledger.store import Ledger

    try:
        with Ledger.open(ledger) as opened:
            return list(producers(opened).unsigned_sources)
    except Exception:  # advice only: the ingest itself succeeded
        return []
