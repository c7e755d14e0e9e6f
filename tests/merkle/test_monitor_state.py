"""`ledger monitor`'s state file: a look that finds nothing new leaves it untouched (same inode, same
mtime, no rewrite and no fsync), a look that accepts a grown checkpoint replaces it. A real ledger,
published with a real log key, served over HTTP on 127.0.0.1."""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from runledger.ledger.monitor import check_log
from runledger.ledger.publish import publish
from runledger.ledger.store import Ledger, SourceRecord
from runledger.schemas.note import write_keypair
from tests.support.factory import RunBuilder


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def _serving(folder: Path) -> Iterator[str]:
    folder.mkdir(parents=True, exist_ok=True)
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_Quiet, directory=str(folder))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


class _Log:
    """A ledger that grows by ``add`` and is published to ``dest`` with its own key."""

    def __init__(self, tmp: Path) -> None:
        self.root, self.dest = tmp / "ledger", tmp / "site"
        self.ledger = Ledger.create(self.root, ledger_id="monitor-test")
        private, public = write_keypair(tmp / "keys", "runledger-log")
        self.skey, self.vkey = private.read_text().strip(), public.read_text().strip()
        self.run = RunBuilder()
        self.position = 0

    def add_and_publish(self, steps: int) -> None:
        first = len(self.run.events)
        if not first:
            self.run.start()
        for step in range(first + 1, first + 1 + steps):
            self.run.step(step)
        new = self.run.events[first:]
        self.ledger.commit([SourceRecord("spool:t", self.position + i, raw) for i, raw in enumerate(new)])
        self.position += len(new)
        publish(self.root, self.dest, self.skey)


def _identity(path: Path) -> tuple[int, int, bytes]:
    stat = os.stat(path)
    return stat.st_ino, stat.st_mtime_ns, path.read_bytes()


@pytest.fixture()
def log(tmp_path: Path) -> _Log:
    return _Log(tmp_path)


@pytest.mark.parametrize("entries", [False, True], ids=["checkpoint", "entries"])
def test_a_look_with_nothing_new_leaves_the_state_file_alone(
    log: _Log, tmp_path: Path, entries: bool
) -> None:
    state = tmp_path / "monitor" / "state.json"
    log.add_and_publish(30)
    with _serving(log.dest) as url:
        first = check_log(url, log.vkey, state, entries=entries)
        assert first.old_size is None and state.exists()
        before = _identity(state)
        for _ in range(3):  # quiet polls: the same checkpoint each time
            again = check_log(url, log.vkey, state, entries=entries)
            assert (again.old_size, again.size, again.entries, again.files) == (first.size, first.size, 0, 0)
        assert _identity(state) == before  # not rewritten: write_durably would give a new inode
        log.add_and_publish(40)
        grown = check_log(url, log.vkey, state, entries=entries)
    assert grown.old_size == first.size and grown.size > first.size
    after = _identity(state)
    assert after[0] != before[0] and json.loads(after[2])["size"] == grown.size
