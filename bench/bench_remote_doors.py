"""What a hostile or broken server costs a reader of a published copy (issue 40): bytes fetched, bytes
left on disk and wall time of `ledger verify --remote` (``verify_remote``) and `ledger query
--remote` (``fetch_copy``), against

* a normal copy (the baseline, in the same run),
* an endless body (the first data file never ends: the reader stops at the manifest's bytes),
* a dripping server (the checkpoint, or the first data file, comes one byte every ``--drip-s``),

each with the library's default deadline and with a small one (``--small-s``). A simulated ledger of
``--events`` events is published into a temporary folder and served by a real http.server on
127.0.0.1 (a thread) that counts the bytes it sends.

    python -m bench.bench_remote_doors [--events 20000] [--small-s 3] [--drip-s 1] [--skip-default-drip]

The dripping legs with the default deadline (300 s) take that long each: ``--skip-default-drip``
leaves them out.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.server
import json
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.bench_publish import _grow
from runledger.ledger.monitor import DEFAULT_DEADLINE_S, MonitorError
from runledger.ledger.publish import publish
from runledger.ledger.remote import RemoteError, fetch_copy, verify_remote
from runledger.ledger.store import Ledger
from runledger.schemas.note import generate_keypair

ENDLESS_CAP_BYTES = 8 << 30  # the endless server's own bound (never reached by a reader that stops)


@dataclass
class Behaviour:
    """What the server does to some paths: a body that never ends, or one byte every ``drip_s``."""

    endless: set[str] = field(default_factory=set)
    drip: set[str] = field(default_factory=set)
    drip_s: float = 1.0
    bytes_sent: int = 0
    stop: threading.Event = field(default_factory=threading.Event)


class _Handler(http.server.SimpleHTTPRequestHandler):
    behaviour: Behaviour

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        rel = self.path.lstrip("/")
        if rel in self.behaviour.endless:
            self._answer(b"\0" * (64 << 10), 0.0)
        elif rel in self.behaviour.drip:
            self._answer(b"x", self.behaviour.drip_s)
        else:
            super().do_GET()

    def _answer(self, block: bytes, every_s: float) -> None:
        """``block`` again and again (every ``every_s``) until the reader hangs up or the server stops."""
        self.send_response(200)
        self.end_headers()
        with contextlib.suppress(OSError):
            while self.behaviour.bytes_sent < ENDLESS_CAP_BYTES and not self.behaviour.stop.wait(every_s):
                self.wfile.write(block)
                self.wfile.flush()
                self.behaviour.bytes_sent += len(block)
        self.close_connection = True

    def copyfile(self, source: Any, outputfile: Any) -> None:
        data = source.read()
        self.behaviour.bytes_sent += len(data)
        outputfile.write(data)


@contextlib.contextmanager
def serving(folder: Path, behaviour: Behaviour) -> Iterator[str]:
    handler = functools.partial(type("H", (_Handler,), {"behaviour": behaviour}), directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        behaviour.stop.set()
        server.shutdown()
        server.server_close()


def _bytes_on_disk(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


def _leg(
    dest: Path, behaviour: Behaviour, run: Callable[[str, Path], object], work: Path
) -> dict[str, object]:
    """One reader against one server: its outcome, the bytes the server sent, the bytes it left on
    disk (outside its state file) and its wall time."""
    with tempfile.TemporaryDirectory(dir=work) as scratch, serving(dest, behaviour) as url:
        started = time.perf_counter()
        try:
            run(url, Path(scratch))
            outcome = "OK"
        except (RemoteError, MonitorError) as exc:
            outcome = str(exc)
        wall_s = time.perf_counter() - started
        on_disk = _bytes_on_disk(Path(scratch) / "cache")
    return {
        "outcome": outcome[:110],
        "sent_bytes": behaviour.bytes_sent,
        "disk_bytes": on_disk,
        "wall_s": wall_s,
    }


def _readers(vkey: str, deadline_s: float) -> dict[str, Callable[[str, Path], object]]:
    return {
        "verify --remote": lambda url, scratch: verify_remote(
            url, vkey, scratch / "state.json", deadline_s=deadline_s
        ),
        "query --remote": lambda url, scratch: fetch_copy(
            url, vkey, scratch / "cache", deadline_s=deadline_s
        ),
    }


def _publish(events: int, work: Path) -> tuple[Path, str, dict[str, object]]:
    root, dest = work / "ledger", work / "site"
    ledger = Ledger.create(root, ledger_id="bench-doors")
    _grow(ledger, 0, events)
    skey, vkey = generate_keypair("bench-doors-log")
    publish(root, dest, skey)
    first = json.loads((dest / "manifest.json").read_bytes())["files"][0]
    return dest, vkey, first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--small-s", type=float, default=3.0, help="the small deadline, seconds")
    parser.add_argument("--drip-s", type=float, default=1.0, help="seconds between two dripped bytes")
    parser.add_argument("--skip-default-drip", action="store_true", help="leave out the 300 s dripping legs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-doors-") as tmp:
        work = Path(tmp)
        dest, vkey, first = _publish(args.events, work)
        data = str(first["path"])
        print(
            f"# {args.events} events; first data file {data}: {first['bytes']} bytes in the signed manifest"
        )
        servers: dict[str, Callable[[], Behaviour]] = {
            "normal": Behaviour,
            "endless data file": lambda: Behaviour(endless={data}),
            "dripping checkpoint": lambda: Behaviour(drip={"checkpoint"}, drip_s=args.drip_s),
            "dripping data file": lambda: Behaviour(drip={data}, drip_s=args.drip_s),
        }
        print("| server | reader | deadline s | outcome | bytes sent | bytes on disk | wall s |")
        print("|---|---|---|---|---|---|---|")
        for server, behaviour in servers.items():
            for deadline_s in (DEFAULT_DEADLINE_S, args.small_s):
                if (
                    args.skip_default_drip
                    and server.startswith("dripping")
                    and deadline_s == DEFAULT_DEADLINE_S
                ):
                    continue
                for reader, run in _readers(vkey, deadline_s).items():
                    got = _leg(dest, behaviour(), run, work)
                    print(
                        f"| {server} | {reader} | {deadline_s:g} | {got['outcome']} | {got['sent_bytes']:,} | "
                        f"{got['disk_bytes']:,} | {got['wall_s']:.2f} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
