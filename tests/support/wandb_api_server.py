"""A local stand-in for W&B's GraphQL API, answering wandb's public client from recorded responses.

``wandb.Api(overrides={"base_url": server.base_url})`` (or ``WANDB_BASE_URL``) sends its GraphQL
documents here through ``wandb-core``; each is answered by operation name from
``tests/fixtures/wandb_api/`` in the shape api.wandb.ai returns. Knobs for failure tests:

* ``rate_limit(n, retry_after_s)``: the next ``n`` requests get 429 with ``Retry-After``;
* ``fail_history(run, after_pages)``: history pages of ``run`` past the first ``after_pages`` get a
  400 (a server refusing mid-scan, which the client does not retry), until ``heal()``;
* a run listed in ``project.json``'s ``refused`` answers reads with its recorded error.

A real ``ThreadingHTTPServer`` on 127.0.0.1, ephemeral port, in a daemon thread.
"""

from __future__ import annotations

import bisect
import json
import math
import re
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "wandb_api"
LIGHT_FIELDS = [
    "projectId",
    "id",
    "tags",
    "name",
    "displayName",
    "sweepName",
    "state",
    "group",
    "jobType",
    "commit",
    "readOnly",
    "createdAt",
    "heartbeatAt",
    "description",
    "notes",
    "historyLineCount",
    "user",
    "__typename",
]


_OPERATION_RE = re.compile(r"\b(?:query|mutation)\s+([A-Za-z_][A-Za-z0-9_]*)")


@dataclass
class Seen:
    operation: str
    variables: dict[str, Any]
    status: int


class _Reply(Exception):
    def __init__(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
        super().__init__(status)
        self.status, self.body, self.headers = status, body, headers or {}


class RecordedRun:
    """One run's recorded answers: its node (``run.json``), history rows and system samples, as the
    JSON-encoded lines W&B returns them in."""

    def __init__(self, node: dict[str, Any], history_lines: list[str], event_lines: list[str]) -> None:
        self.node = node
        self.history_lines = history_lines
        self.event_lines = event_lines
        # Pages are step ranges; a row without a usable _step (hostile fixtures) goes with the row before.
        self.history_steps: list[int] = []
        for line in history_lines:
            step = json.loads(line).get("_step")
            previous = self.history_steps[-1] if self.history_steps else 0
            self.history_steps.append(step if isinstance(step, int) else previous)

    @classmethod
    def load(cls, folder: Path) -> RecordedRun:
        return cls(
            json.loads((folder / "run.json").read_text()),
            (folder / "history.jsonl").read_text().splitlines(),
            (folder / "events.jsonl").read_text().splitlines(),
        )


class WandbApiServer:
    """``with WandbApiServer() as server: wandb.Api(overrides={"base_url": server.base_url})``"""

    def __init__(self, fixtures: Path = FIXTURES, *, api_key: str | None = None) -> None:
        listing = json.loads((fixtures / "project.json").read_text())
        self.entity: str = listing["entity"]
        self.project: str = listing["project"]
        self.internal_id: str = listing["internalId"]
        self.refused: dict[str, dict[str, Any]] = listing["refused"]
        self.run_names: list[str] = listing["runs"]
        self.runs = {
            name: RecordedRun.load(fixtures / "runs" / name)
            for name in self.run_names
            if name not in self.refused
        }
        self.viewer = json.loads((fixtures / "viewer.json").read_text())
        self.rate_limited_body = json.loads((fixtures / "rate_limited_429.json").read_text())
        self.api_key = api_key  # when set, requests must carry it (HTTP basic, user "api")
        self.seen: list[Seen] = []
        self._lock = threading.Lock()
        self._rate_limited_left = 0
        self._retry_after_s = 1
        self._failing: dict[str, int] = {}  # run name -> history pages still served before failing
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    def add_run(self, name: str, run: RecordedRun) -> None:
        """Serve another run (the benchmark makes projects of any size from the recorded ones)."""
        self.runs[name] = run
        self.run_names.append(name)

    def __enter__(self) -> WandbApiServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    # -- failure knobs ---------------------------------------------------------------------------

    def rate_limit(self, requests: int, retry_after_s: int = 1) -> None:
        with self._lock:
            self._rate_limited_left, self._retry_after_s = requests, retry_after_s

    def fail_history(self, run: str, after_pages: int) -> None:
        with self._lock:
            self._failing[run] = after_pages

    def heal(self) -> None:
        with self._lock:
            self._failing.clear()

    def operations(self, name: str) -> list[Seen]:
        return [s for s in self.seen if s.operation == name]

    # -- answering -------------------------------------------------------------------------------

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # keep test output clean
                pass

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                if not self.path.startswith("/graphql"):
                    self._send(200, b"{}", {})  # wandb-core's telemetry (/sdk/otel/…): accepted, dropped
                    return
                try:
                    request = json.loads(raw)
                    operation = _operation_name(request)
                    variables = request.get("variables") or {}
                    status, body, headers = outer._answer(
                        operation,
                        variables,
                        self.headers.get("Authorization"),
                        str(request.get("query") or ""),
                    )
                except (ValueError, AttributeError):
                    operation, variables = "?", {}
                    status, body, headers = 400, {"errors": [{"message": "malformed GraphQL request"}]}, {}
                with outer._lock:
                    outer.seen.append(Seen(operation, variables, status))
                self._send(status, json.dumps(body).encode(), headers)

            def do_GET(self) -> None:
                self._send(404, b'{"error": "not found"}', {})

            def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                for key, value in headers.items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(body)

        return Handler

    def _answer(
        self, operation: str, variables: dict[str, Any], auth: str | None, query: str = ""
    ) -> tuple[int, Any, dict]:
        if self.api_key is not None and not _carries_key(auth, self.api_key):
            return 401, {"errors": [{"message": "user is not logged in"}]}, {}
        with self._lock:
            if self._rate_limited_left > 0:
                self._rate_limited_left -= 1
                return 429, self.rate_limited_body, {"Retry-After": str(self._retry_after_s)}
        try:
            return 200, {"data": self._data(operation, variables, query)}, {}
        except _Reply as reply:
            return reply.status, reply.body, reply.headers

    def _data(self, operation: str, v: dict[str, Any], query: str) -> Any:
        if operation in ("Viewer", "GetDefaultEntity"):
            return self.viewer["data"]
        if operation == "ServerFeaturesQuery":
            return {"serverInfo": {"__typename": "ServerInfo", "features": []}}
        if v.get("entity") != self.entity or v.get("project") != self.project:
            return {"project": None}  # W&B answers an unknown project with null, not an error
        if operation == "Runs":
            return {"project": self._runs_page(v)}
        run = self._run(str(v.get("name") or v.get("run") or v.get("runName") or ""))
        if operation == "Run":
            return {"project": {"run": run.node}}
        if operation == "RunHistoryKeys":
            return {"project": {"run": {"historyKeys": run.node["historyKeys"]}}}
        if operation == "HistoryPage":
            return {"project": {"run": {"history": self._history_page(run, v)}}}
        if operation == "RunParquetHistory":
            # Nothing exported to parquet yet: the live rows' steps, which the client then pages.
            return {
                "project": {
                    "run": {
                        "parquetHistory": {
                            "parquetUrls": [],
                            "liveData": [{"_step": step} for step in run.history_steps],
                        }
                    }
                }
            }
        if operation == "RunFullHistory":
            # W&B samples these server-side down to ``samples`` rows (evenly here).
            samples = max(1, int(v.get("samples") or 500))
            node = "events" if "events(" in query else "history"
            lines = run.event_lines if node == "events" else run.history_lines
            stride = max(1, math.ceil(len(lines) / samples))
            return {"project": {"run": {node: lines[::stride]}}}
        raise _Reply(400, {"errors": [{"message": f"Cannot query operation {operation!r} on this server"}]})

    def _run(self, name: str) -> RecordedRun:
        if name in self.refused:
            spec = self.refused[name]
            raise _Reply(spec["status"], spec["body"])
        if name not in self.runs:
            raise _Reply(
                200, {"errors": [{"message": f"run {name} not found"}], "data": {"project": {"run": None}}}
            )
        return self.runs[name]

    def _runs_page(self, v: dict[str, Any]) -> dict[str, Any]:
        per_page = int(v.get("perPage") or 50)
        start = int(v["cursor"]) if v.get("cursor") else 0
        names = self.run_names[start : start + per_page]
        edges = []
        for offset, name in enumerate(names):
            node = self.runs[name].node if name in self.runs else _listed_only(name)
            edges.append(
                {"node": {k: node[k] for k in LIGHT_FIELDS if k in node}, "cursor": str(start + offset + 1)}
            )
        end = start + len(names)
        return {
            "__typename": "Project",
            "internalId": self.internal_id,
            "runCount": len(self.run_names),
            "readOnly": False,
            "runs": {
                "__typename": "RunConnection",
                "edges": edges,
                "pageInfo": {
                    "__typename": "PageInfo",
                    "endCursor": str(end),
                    "hasNextPage": end < len(self.run_names),
                },
            },
        }

    def _history_page(self, run: RecordedRun, v: dict[str, Any]) -> list[str]:
        name = str(v.get("run") or "")
        with self._lock:
            if name in self._failing:
                if self._failing[name] <= 0:
                    raise _Reply(400, {"errors": [{"message": "history temporarily unavailable"}]})
                self._failing[name] -= 1
        low, high, size = int(v["minStep"]), int(v["maxStep"]), int(v.get("pageSize") or 1000)
        first = bisect.bisect_left(run.history_steps, low)  # steps ascend, as W&B stores them
        last = bisect.bisect_left(run.history_steps, high, lo=first)
        return run.history_lines[first : min(last, first + size)]


def _operation_name(request: dict[str, Any]) -> str:
    """The operation's name: ``operationName`` when the client sends it (wandb-core does), else the
    name in the document (the public client's own queries arrive without ``operationName``)."""
    if request.get("operationName"):
        return str(request["operationName"])
    match = _OPERATION_RE.search(str(request.get("query") or ""))
    return match.group(1) if match else ""


def _listed_only(name: str) -> dict[str, Any]:
    user = {"__typename": "User", "name": "Ada Lovelace", "username": "ada"}
    return {
        "__typename": "Run",
        "projectId": 271828,
        "id": f"UnVuOnYxOn{name}",
        "name": name,
        "displayName": name,
        "state": "finished",
        "tags": [],
        "historyLineCount": 0,
        "user": user,
    }


def _carries_key(auth: str | None, api_key: str) -> bool:
    import base64

    if not auth or not auth.startswith("Basic "):
        return False
    try:
        return base64.b64decode(auth[6:]).decode() == f"api:{api_key}"
    except ValueError:
        return False
