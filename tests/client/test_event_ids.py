"""The emitter's event ids (issue 39: random parts drawn in batches) keep ``new_event_id``'s form,
never repeat, and a forked child never reuses its parent's pool."""

from __future__ import annotations

import os
import re
from datetime import UTC, datetime

from runledger.emitter import _EventIds
from runledger.schemas.envelope import new_event_id

ID_FORM = re.compile(r"^\d{8}T\d{12}-[0-9a-f]{16}$")  # ``new_event_id``'s: time to the µs, 16 hex digits


def test_ids_have_the_form_of_new_event_id_and_the_events_time() -> None:
    when = datetime(2026, 12, 6, 13, 5, 7, 42, tzinfo=UTC)
    made = _EventIds().next(when)
    assert ID_FORM.match(made) and ID_FORM.match(new_event_id())
    assert made.startswith("20261206T130507000042-")


def test_ids_never_repeat_across_many_batches() -> None:
    ids, when = _EventIds(), datetime(2026, 12, 6, tzinfo=UTC)
    made = [ids.next(when) for _ in range(5 * _EventIds.BATCH + 3)]
    assert len(set(made)) == len(made)


def test_a_forked_child_draws_its_own_pool() -> None:
    ids, when = _EventIds(), datetime(2026, 12, 6, tzinfo=UTC)
    ids.next(when)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the child: its next id, to the parent, then out at once
        try:
            os.write(write, ids.next(when).encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        child_id = os.read(read, 100).decode()
    finally:
        os.close(read)
        os.waitpid(child, 0)
    assert ID_FORM.match(child_id)
    assert child_id != ids.next(when)  # the id the parent's pool had next
