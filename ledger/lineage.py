"""A run's lineage across run ids (issue 44), as ``Reader.lineage`` reads it (``lineage_of``).

A relaunch under a new run id names the run it continues and the step it forked or resumed from
(``run.started``'s ``parent_run``/``fork_step``). "The run" is the line through its ancestors, itself
and, at each generation, the child started last (``runledger.ledger.views``: ``lineage``); each member
supplies the steps after its fork step up to where a later member forked from the line. This module
holds that line's members and answers which member supplies a step or a time; ``Reader.state``, ``history``,
``blame`` and ``diff`` follow it.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import msgspec


class LineageMember(msgspec.Struct, frozen=True):
    """One run id on a run's line: where it forked from, and the steps it supplies (None: open)."""

    run_id: str
    depth: int  # < 0: an ancestor of the run asked about; 0: the run; > 0: a descendant
    started_at: datetime
    parent_run: str | None
    fork_step: int | None
    from_step: int | None  # first step it supplies (None: from its first)
    to_step: int | None  # last step it supplies (None: to its last)

    def supplies(self, step: int) -> bool:
        """Whether step ``step`` of the lineage is this member's."""
        after_start = self.from_step is None or step >= self.from_step
        return after_start and (self.to_step is None or step <= self.to_step)

    def steps_within(self, lo: int, hi: int) -> tuple[int, int] | None:
        """The steps of ``lo``..``hi`` that it supplies, as (first, last); None: none of them."""
        first = max(lo, self.from_step or 0)
        last = hi if self.to_step is None else min(hi, self.to_step)
        return (first, last) if first <= last else None


# When a run started, and how many launches name it as their parent or name a parent of its own.
CLAIMS_QUERY = (
    "SELECT min(time) FILTER (WHERE run_id = ?), "
    "count(*) FILTER (WHERE (run_id = ? AND parent_run IS NOT NULL) OR parent_run = ?) "
    "FROM launches WHERE run_id = ? OR parent_run = ?"
)

# The members of a run's line, eldest first (the `lineage_of` macro: only the run's family is walked).
LINE_QUERY = (
    "SELECT member, depth, started_at, parent_run, fork_step, from_step, to_step "
    "FROM lineage_of(?) WHERE on_line ORDER BY depth"
)


def members_of_rows(rows: Sequence[Sequence[Any]]) -> list[LineageMember]:
    """``LINE_QUERY``'s rows as members."""
    return [LineageMember(*row) for row in rows]


def member_at_step(line: Sequence[LineageMember], step: int | None) -> LineageMember:
    """The member that supplies ``step`` (None: the last step, the youngest member's): the youngest
    whose range holds it, as a later attempt supersedes an earlier one; else the youngest."""
    if step is not None:
        for member in reversed(line):
            if member.supplies(step):
                return member
    return line[-1]


def member_at_time(line: Sequence[LineageMember], at: datetime) -> LineageMember:
    """The member live at ``at``: the youngest started by then (else the eldest)."""
    started = [m for m in line if m.started_at <= at]
    return started[-1] if started else line[0]


def line_text(line: Sequence[LineageMember]) -> str:
    """``A → B (from step 60) → C (from step 120)``: the line as one phrase."""
    parts = [
        m.run_id if m.fork_step is None or m is line[0] else f"{m.run_id} (from step {m.fork_step:,})"
        for m in line
    ]
    return " → ".join(parts)
