"""Test helpers: a local GitHub REST stand-in serving recorded responses, and a uvicorn server in a thread.

Everything binds to 127.0.0.1 on an ephemeral port.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import tarfile
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import uvicorn

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "github"
REAL_API = "https://api.github.com"
ROOT = Path(__file__).resolve().parents[2]
FETCH_SCRIPT = ROOT / "scripts" / "fixtures.sh"


@dataclass
class Seen:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    at: float
    status: int = 0


@dataclass
class Route:
    path: str
    body: str
    status: int = 200
    query: dict[str, str] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    once: bool = False
    used: bool = False


def _updated(item: Any) -> str | None:
    if not isinstance(item, dict):
        return None
    if "updated_at" in item:
        return item["updated_at"]
    return ((item.get("commit") or {}).get("committer") or {}).get("date")


class FixtureGitHub:
    """Answers PyGithub's requests from ``tests/fixtures/github/routes.json`` like api.github.com would.

    Like GitHub it honours ``since`` on list endpoints (objects updated at or after it).
    """

    def __init__(self, fixtures: Path = FIXTURES, routes: list[dict[str, Any]] | None = None) -> None:
        self.fixtures = fixtures
        spec = routes if routes is not None else json.loads((fixtures / "routes.json").read_text())["routes"]
        self.routes = [Route(**r) for r in spec]
        self.seen: list[Seen] = []
        self._lock = threading.Lock()
        handler = self._handler()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    def __enter__(self) -> FixtureGitHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def requests_to(self, path: str) -> list[Seen]:
        return [s for s in self.seen if s.path.lower() == path.lower()]

    def _match(self, path: str, query: dict[str, str]) -> Route | None:
        wanted = dict(query)
        wanted.setdefault("page", "1")
        with self._lock:
            for route in self.routes:
                if route.path.lower() != path.lower() or (route.once and route.used):
                    continue
                needs = {"page": "1"} | route.query
                if all(wanted.get(k) == v for k, v in needs.items()):
                    route.used = route.used or route.once
                    return route
        return None

    def _load(self, route: Route) -> str:
        return (self.fixtures / route.body).read_text().replace(REAL_API, self.base_url)

    def _render(self, route: Route, path: str, query: dict[str, str]) -> tuple[bytes, dict[str, str]]:
        headers = {
            k: v.replace("{base}", self.base_url).replace("{reset}", str(int(time.time()) + 1))
            for k, v in route.headers.items()
        }
        text = self._load(route)
        if "since" in query and route.status == 200 and isinstance(json.loads(text), list):
            return self._since(route, path, query, headers)
        return text.encode(), headers

    def _since(
        self, route: Route, path: str, query: dict[str, str], headers: dict[str, str]
    ) -> tuple[bytes, dict[str, str]]:
        # As GitHub does: filter the whole listing by ``since``, then page what is left.
        pages = sorted(
            (
                r
                for r in self.routes
                if r.path.lower() == route.path.lower() and r.status == 200 and not r.once
            ),
            key=lambda r: int(r.query.get("page", "1")),
        )
        items = [item for r in pages for item in json.loads(self._load(r))]
        kept = [item for item in items if (_updated(item) or "") >= query["since"]]
        per_page = int(query.get("per_page", "30"))
        page = int(query.get("page", "1"))
        headers = {k: v for k, v in headers.items() if k.lower() != "link"}
        if page * per_page < len(kept):
            nxt = urllib.parse.urlencode(query | {"page": str(page + 1)})
            headers["Link"] = f'<{self.base_url}{path}?{nxt}>; rel="next"'
        return json.dumps(kept[(page - 1) * per_page : page * per_page]).encode(), headers

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                parsed = urllib.parse.urlsplit(self.path)
                query = dict(urllib.parse.parse_qsl(parsed.query))
                seen = Seen("GET", parsed.path, query, dict(self.headers.items()), time.monotonic())
                outer.seen.append(seen)
                route = outer._match(parsed.path, query)
                if route is None:
                    body = json.dumps(
                        {"message": "Not Found", "documentation_url": "https://docs.github.com/rest"}
                    ).encode()
                    status, headers = 404, {"Content-Type": "application/json; charset=utf-8"}
                else:
                    body, headers = outer._render(route, parsed.path, query)
                    status = route.status
                seen.status = status
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # quiet: pytest shows failures
                pass

        return Handler


@contextlib.contextmanager
def running_uvicorn(app: Any) -> Iterator[str]:
    """Serve an ASGI app with a real uvicorn on 127.0.0.1; yields its base URL. Runs the lifespan."""
    # Port 0 and uvicorn's own bind: a socket made here would lack proto=IPPROTO_TCP, and asyncio then
    # skips TCP_NODELAY on its connections (40 ms delayed-ACK stalls per request).
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, log_level="warning", lifespan="on", backlog=256, timeout_keep_alive=5
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)


def fixture_json(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name).read_text())


def read_events(spool_dir: Path) -> list[Any]:
    """Every record of a spool decoded; fails the test on a corrupt record or a quarantined event."""
    from runledger.ingest.spool import SpoolReader
    from runledger.schemas import Event, decode_event

    events = []
    for record in SpoolReader(spool_dir).read():
        assert record.corrupt is None, record.corrupt
        decoded = decode_event(record.payload)
        assert isinstance(decoded, Event), getattr(decoded, "reason", decoded)
        events.append(decoded)
    return events


def spool_bytes(spool_dir: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(spool_dir.iterdir()) if p.is_file())


class FixturesMissing(RuntimeError):
    """The downloaded fixtures are not on this machine (``scripts/fixtures.sh fetch`` gets them)."""


def _pinned(name: str) -> str:
    # scripts/fixtures.sh is the one place the package, its version and its integrity are pinned.
    match = re.search(rf'^{name}="([^"]+)"', FETCH_SCRIPT.read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"{FETCH_SCRIPT} pins no {name}")
    return match.group(1)


def octokit_examples_tarball() -> Path:
    directory = Path(os.environ.get("RUNLEDGER_FIXTURES_DIR") or ROOT / ".fixtures")
    return directory / f"octokit-webhooks-examples-{_pinned('VERSION')}.tgz"


def load_octokit_examples() -> list[dict[str, Any]]:
    """octokit's recorded webhook deliveries (``@octokit/webhooks-examples``, api.github.com), read from
    the tarball ``scripts/fixtures.sh fetch`` downloaded, after checking it against the pinned sha512.

    One entry per event type: ``{"name": "issues", "examples": [payload, …], …}``. Raises
    ``FixturesMissing`` if the tarball is absent, ``RuntimeError`` if it is not the pinned one.
    """
    tarball = octokit_examples_tarball()
    if not tarball.is_file():
        raise FixturesMissing(f"{tarball} is absent: run `scripts/fixtures.sh fetch` (or `make test`)")
    data = tarball.read_bytes()
    integrity = "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()
    if integrity != _pinned("INTEGRITY"):
        raise RuntimeError(f"{tarball} has integrity {integrity}, not the pinned {_pinned('INTEGRITY')}")
    with tarfile.open(tarball, "r:gz") as archive:
        member = archive.extractfile("package/api.github.com/index.json")
        if member is None:
            raise RuntimeError(f"{tarball} has no package/api.github.com/index.json")
        return json.loads(member.read())
