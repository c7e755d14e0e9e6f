"""The hostile corpus, grown (issue 40): attempts not tried before, each through the real entrance.

- request smuggling and header floods, over raw sockets on 127.0.0.1, against the GitHub webhook
  receiver (uvicorn as ``ledger serve webhooks`` builds it) and the live page (as ``ledger serve page``
  builds it): never a 5xx, a 4xx or a close within a bound, the server still answers afterwards, and
  no event is recorded from a smuggled request;
- ``fork()`` after ``runledger.init`` (a DataLoader worker): the parent's run is recorded once, the
  child neither writes to the spool nor finishes the parent's run;
- two processes logging one run id: both recorded without loss, or a clear refusal.

Each test checks that no file outside its own ledger or spool changed (``Outside``)."""

from __future__ import annotations

import gc
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from runledger.ledger.live_page import create_app as create_page_app
from runledger.ledger.live_page import page_server
from tests.client.conftest import LAUNCH_VARS
from tests.github.test_webhook_doors import body_of, headers_for, receiver, serving
from tests.support.factory import RunBuilder
from tests.support.github import read_events

ROOT = Path(__file__).resolve().parents[2]
BOUND_S = 10.0  # how long any answer (or close) may take on a loaded 2-core machine
HEADER_TIMEOUT_S = 1.0  # the servers' deadline for a request head, in these tests


# ------------------------------------------------------------------------------ nothing else touched
class Outside:
    """The files beside the allowed folders (this test's tmp tree and its siblings), with their sizes
    and mtimes: ``assert_unchanged`` fails if any was created, changed or removed."""

    def __init__(self, tmp_path: Path, allowed: list[Path]) -> None:
        self.top = tmp_path.parent
        self.allowed = [a.resolve() for a in allowed]
        # What earlier tests left to the collector goes now, not under the watch: an unclosed
        # ledger's SQLite index checkpoints its WAL (rewrites its files) whenever it is collected.
        gc.collect()
        self.before = self._snapshot()

    def _is_allowed(self, path: Path) -> bool:
        resolved = path.resolve()
        return any(resolved == a or a in resolved.parents for a in self.allowed)

    def _snapshot(self) -> dict[str, tuple[int, int]]:
        files: dict[str, tuple[int, int]] = {}
        for folder, dirs, names in os.walk(self.top):
            dirs[:] = [d for d in dirs if not self._is_allowed(Path(folder) / d)]
            for name in names:
                path = Path(folder) / name
                if self._is_allowed(path):
                    continue
                with_stat = path.lstat()
                files[str(path)] = (with_stat.st_size, with_stat.st_mtime_ns)
        return files

    def assert_unchanged(self) -> None:
        after = self._snapshot()
        changed = sorted(p for p in set(self.before) | set(after) if self.before.get(p) != after.get(p))
        assert not changed, f"files outside the ledger/spool changed: {changed[:10]}"


# ------------------------------------------------------------------------------ raw HTTP over a socket
def exchange(port: int, raw: bytes, wait_s: float = BOUND_S) -> tuple[bytes, bool]:
    """Send ``raw`` on a new connection and read until the server closes it or ``wait_s`` passes
    without more bytes: (what came back, whether the server closed). A send the server cut short
    (it closed or reset mid-request) counts as closed."""
    with socket.create_connection(("127.0.0.1", port), timeout=BOUND_S) as sock:
        try:
            sock.sendall(raw)
        except OSError:
            return _drain(sock, 1.0)[0], True
        return _drain(sock, wait_s)


def _drain(sock: socket.socket, wait_s: float) -> tuple[bytes, bool]:
    """Bytes until EOF/reset (closed) or a quiet ``wait_s`` (open)."""
    sock.settimeout(wait_s)
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return data, False
        except OSError:
            return data, True
        if not chunk:
            return data, True
        data += chunk


def statuses(answer: bytes) -> list[int]:
    return [int(code) for code in re.findall(rb"HTTP/1\.[01] (\d{3}) ", answer)]


def assert_refused(answer: bytes, closed: bool, what: str) -> None:
    """Never a 5xx, nor a 2xx (a request smuggled behind the refused one answered); a 4xx or a
    close (within the bound ``exchange`` waited)."""
    codes = statuses(answer)
    assert not [c for c in codes if c >= 500], f"{what}: a 5xx answer {answer[:300]!r}"
    assert not [c for c in codes if c < 300], f"{what}: a smuggled request was answered {answer[:300]!r}"
    assert closed or any(400 <= c < 500 for c in codes), (
        f"{what}: neither a 4xx nor a close: {answer[:300]!r}"
    )


def head(request_line: str, headers: list[tuple[str, str]]) -> bytes:
    lines = [request_line, "Host: 127.0.0.1", *[f"{k}: {v}" for k, v in headers]]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def signed_post(body: bytes, delivery: str) -> bytes:
    """A whole signed delivery: what a smuggler hides behind a request the server should refuse."""
    headers = headers_for(body, "issues", delivery)
    return head("POST /webhook HTTP/1.1", [("Content-Length", str(len(body))), *headers.items()]) + body


def attacks(path: str, smuggled: bytes) -> dict[str, bytes]:
    """The smuggling and flood attempts against ``path`` (``smuggled``: a request to hide)."""
    mib = 1024 * 1024
    n = len(smuggled)
    get = f"GET {path} HTTP/1.1"
    post = f"POST {path} HTTP/1.1"
    return {
        # CL.TE / TE.CL: a front end and this server disagreeing on where the body ends.
        "cl_and_te": head(post, [("Content-Length", str(n + 5)), ("Transfer-Encoding", "chunked")])
        + b"0\r\n\r\n"
        + smuggled,
        "te_and_cl": head(post, [("Transfer-Encoding", "chunked"), ("Content-Length", "4")])
        + f"{n:x}\r\n".encode()
        + smuggled
        + b"\r\n0\r\n\r\n",
        "two_content_lengths": head(post, [("Content-Length", "0"), ("Content-Length", str(n))]) + smuggled,
        "te_obfuscated": head(post, [("Transfer-Encoding", "xchunked"), ("Content-Length", "0")]) + smuggled,
        "te_space_before_colon": head(post, [("Transfer-Encoding ", "chunked")]) + b"0\r\n\r\n" + smuggled,
        "te_chunked_then_identity": head(post, [("Transfer-Encoding", "chunked, identity")])
        + b"0\r\n\r\n"
        + smuggled,
        "obs_fold_header": (
            f"{post}\r\nHost: 127.0.0.1\r\nX-GitHub-Event: issues\r\n chunked\r\nContent-Length: {n}\r\n\r\n"
        ).encode()
        + smuggled,
        "obs_fold_transfer_encoding": (
            f"{post}\r\nHost: 127.0.0.1\r\nTransfer-Encoding:\r\n chunked\r\nContent-Length: 0\r\n\r\n"
        ).encode()
        + b"0\r\n\r\n"
        + smuggled,
        "bad_chunk_size": head(post, [("Transfer-Encoding", "chunked")])
        + b"zz\r\nhello\r\n0\r\n\r\n"
        + smuggled,
        "oversized_chunk_size": head(post, [("Transfer-Encoding", "chunked")])
        + b"f" * 40
        + b"\r\nhello\r\n0\r\n\r\n"
        + smuggled,
        "negative_content_length": head(post, [("Content-Length", "-1")]) + smuggled,
        "ten_thousand_headers": head(get, [(f"X-Flood-{i}", "v") for i in range(10_000)]),
        "one_mib_header_line": head(get, [("X-Big", "a" * mib)]),
        "one_mib_request_line": head(f"GET {path}?{'a' * mib} HTTP/1.1", []),
        "get_with_body_then_smuggled": head(get, [("Content-Length", str(n))]) + smuggled,
    }


# The attacks that are a request the server may legitimately answer (a GET with a body it then
# reads and drops): for these, a 2xx/3xx/4xx is fine, and the smuggled request is body, never a request.
ANSWERABLE = {"get_with_body_then_smuggled"}


def assert_held(name: str, answer: bytes, closed: bool) -> None:
    """What every attack must get: a refusal (``assert_refused``), or, for one the server may answer,
    one answer and no 5xx (the request hidden in its body never answered)."""
    if name not in ANSWERABLE:
        assert_refused(answer, closed, name)
        return
    codes = statuses(answer)
    assert len(codes) == 1 and codes[0] < 500, f"{name}: {answer[:300]!r}"


def assert_answers_normally(port: int, path: str) -> None:
    answer, _ = exchange(port, head(f"GET {path} HTTP/1.1", [("Connection", "close")]))
    assert statuses(answer)[:1] == [200], f"no normal answer after the attacks: {answer[:300]!r}"


def drip_is_cut(port: int, bound_s: float) -> bool:
    """Slowloris: a request head one byte every 100 ms, never finished; whether the server closes
    the connection within ``bound_s`` (bounded: the drip stops there)."""
    raw = head("GET / HTTP/1.1", [(f"X-Drip-{i}", "v" * 20) for i in range(200)])
    with socket.create_connection(("127.0.0.1", port), timeout=BOUND_S) as sock:
        deadline = time.monotonic() + bound_s
        for byte in raw:
            if time.monotonic() > deadline:
                return False
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                return True
            sock.settimeout(0.1)
            try:
                if sock.recv(65536) == b"":
                    return True
            except TimeoutError:
                continue
            except OSError:
                return True
    return False


# ------------------------------------------------------------------------------ the webhook receiver
def receiver_files(tmp_path: Path) -> list[Path]:
    """The receiver's delivery log (SQLite and its WAL files): beside the spool, its own."""
    return [tmp_path / f"deliveries.sqlite{suffix}" for suffix in ("", "-wal", "-shm", "-journal")]


def test_webhook_receiver_refuses_smuggling_and_floods_and_records_nothing_smuggled(tmp_path: Path) -> None:
    app, spool, deliveries = receiver(tmp_path, header_timeout_s=HEADER_TIMEOUT_S)
    outside = Outside(tmp_path, [spool, *receiver_files(tmp_path)])
    body = body_of("webhook_issues_edited.json")
    smuggled_ids = []
    try:
        with serving(app) as served:
            for name in attacks("/webhook", b""):
                delivery = str(uuid.uuid4())
                smuggled_ids.append(delivery)
                attack = attacks("/webhook", signed_post(body, delivery))[name]
                assert_held(name, *exchange(served.port, attack))
            assert drip_is_cut(served.port, HEADER_TIMEOUT_S + BOUND_S), "slowloris kept its connection"
            # Nothing smuggled was accepted; a normal signed delivery still is, once.
            assert served.health()["counts"]["accepted"] == 0
            assert not spool.exists() or read_events(spool) == []
            response, _ = exchange(
                served.port,
                signed_post(body, str(uuid.uuid4())).replace(
                    b"Host: 127.0.0.1", b"Host: 127.0.0.1\r\nConnection: close"
                ),
            )
            assert statuses(response)[:1] == [202], response[:300]
            assert_answers_normally(served.port, "/healthz")
    finally:
        app.state.receiver.sink.close()
        deliveries.close()
    events = read_events(spool)
    assert len(events) == 1
    assert not [e.envelope.id for e in events if any(d in e.envelope.id for d in smuggled_ids)]
    outside.assert_unchanged()


def test_webhook_pipelined_requests_are_each_answered_and_a_smuggled_post_is_only_ever_body(
    tmp_path: Path,
) -> None:
    app, spool, deliveries = receiver(tmp_path, header_timeout_s=HEADER_TIMEOUT_S)
    outside = Outside(tmp_path, [spool, *receiver_files(tmp_path)])
    body = body_of("webhook_issues_edited.json")
    hidden = signed_post(body, str(uuid.uuid4()))
    try:
        with serving(app) as served:
            # A GET that carries the signed POST as its body, then a real health check: two answers,
            # and the POST inside the first was never a request.
            first = head("GET /healthz HTTP/1.1", [("Content-Length", str(len(hidden)))]) + hidden
            second = head("GET /healthz HTTP/1.1", [("Connection", "close")])
            answer, closed = exchange(served.port, first + second)
            assert statuses(answer) == [200, 200], answer[:500]
            assert closed
            assert served.health()["counts"]["received"] == 0
    finally:
        app.state.receiver.sink.close()
        deliveries.close()
    assert not spool.exists() or read_events(spool) == []
    outside.assert_unchanged()


# ------------------------------------------------------------------------------ the live page
@contextmanager
def page_serving(ledger: Path) -> Iterator[int]:
    """The live page under uvicorn exactly as ``ledger serve page`` configures it (port 0)."""
    server = page_server(
        create_page_app(ledger, poll_s=0.1, warm=False), "127.0.0.1", 0, header_timeout_s=HEADER_TIMEOUT_S
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(1000):  # bounded: 10 s
        if server.started or not thread.is_alive():
            break
        time.sleep(0.01)
    assert server.started, "uvicorn did not start"
    try:
        yield int(server.servers[0].sockets[0].getsockname()[1])
    finally:
        server.should_exit = True
        thread.join(15)


def _small_ledger(path: Path) -> None:
    from runledger.ledger.store import Ledger, SourceRecord

    run = RunBuilder(run_id="corpus-r", config={"lr": 0.001})
    run.start()
    for step in range(1, 4):
        run.step(step, loss=1.0 / step)
    Ledger.create(path).commit([SourceRecord("spool:t", i, raw) for i, raw in enumerate(run.events)])


def test_live_page_refuses_smuggling_and_floods_and_cuts_slowloris(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    _small_ledger(ledger)
    outside = Outside(tmp_path, [ledger])
    smuggled = head("GET /runs/corpus-r HTTP/1.1", [])
    with page_serving(ledger) as port:
        for name, attack in attacks("/healthz", smuggled).items():
            assert_held(name, *exchange(port, attack))
        assert drip_is_cut(port, HEADER_TIMEOUT_S + BOUND_S), "slowloris kept its connection to the page"
        assert_answers_normally(port, "/healthz")
        assert_answers_normally(port, "/runs/corpus-r")
    outside.assert_unchanged()


# ------------------------------------------------------------------------------ fork() after init
FORKING_TRAINER = """
import os, sys, runledger
run = runledger.init("fork-r", config={"lr": 0.1})
for step in range(1, 6):
    run.log({"loss": 1.0 / step}, step=step)
child = os.fork()  # as a DataLoader worker (start method fork): after init, the emitter mid-flight
if child == 0:
    run.log({"loss": 99.0}, step=100)  # a worker that logs: it holds no run
    if sys.argv[1] == "raise":
        raise RuntimeError("a worker dies")  # the excepthook: no crash of the parent's run
    sys.exit(0)  # a normal exit: atexit hooks and buffered files flushed
_, status = os.waitpid(child, 0)
print("child exit", os.waitstatus_to_exitcode(status), flush=True)
for step in range(6, 11):
    run.log({"loss": 1.0 / step}, step=step)
run.finish()
"""


def client_env(tmp_path: Path) -> dict[str, str]:
    """This test's spool and state, no launcher variables: one process."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("RUNLEDGER_")}
    env.update(RUNLEDGER_SPOOL=str(tmp_path / "spool"), RUNLEDGER_STATE=str(tmp_path / "state"))
    return env


def ledger_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The installed ``ledger`` command (the real entrance), bounded."""
    command = [str(Path(sys.executable).parent / "ledger"), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)


def ingest_and_verify(spool: Path, ledger: Path) -> None:
    ingested = ledger_cli("ingest", "spool", "--spool", str(spool), "--ledger", str(ledger))
    assert ingested.returncode == 0, ingested.stdout + ingested.stderr
    verified = ledger_cli("verify", "--ledger", str(ledger))
    assert verified.returncode == 0, verified.stdout + verified.stderr


def step_rows(ledger: Path, run_id: str) -> list[tuple[int, int]]:
    sql = f"SELECT step, count(*) FROM metrics WHERE run_id = '{run_id}' AND name = 'loss' GROUP BY step ORDER BY step"
    out = ledger_cli("query", sql, "--ledger", str(ledger), "-f", "json")
    assert out.returncode == 0, out.stdout + out.stderr
    return [(row["step"], row["count_star()"]) for row in json.loads(out.stdout)]


@pytest.mark.parametrize("child_ends", ["exit", "raise"])
def test_a_child_forked_after_init_neither_corrupts_the_spool_nor_finishes_the_run(
    tmp_path: Path, child_ends: str
) -> None:
    env = client_env(tmp_path)
    spool, ledger = tmp_path / "spool", tmp_path / "ledger"
    outside = Outside(tmp_path, [spool, ledger, tmp_path / "state"])
    out = subprocess.run(
        [sys.executable, "-c", FORKING_TRAINER, child_ends],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert f"child exit {0 if child_ends == 'exit' else 1}" in out.stdout, out.stdout + out.stderr
    types = [e.type for e in spool_envelopes(spool)]  # fails on a corrupt record
    assert types.count("runledger.run.started") == 1, types
    assert types.count("runledger.run.finished") == 1 and types[-1] == "runledger.run.finished", types
    assert "runledger.run.crashed" not in types, types
    ingest_and_verify(spool, ledger)
    assert step_rows(ledger, "fork-r") == [(step, 1) for step in range(1, 11)]
    outside.assert_unchanged()


def spool_envelopes(spool: Path) -> list[Any]:
    from runledger.ingest.spool import SpoolReader
    from runledger.schemas import Event, decode_event

    envelopes = []
    for record in SpoolReader(spool).read():
        assert record.corrupt is None, record.corrupt
        decoded = decode_event(record.payload)
        assert isinstance(decoded, Event), getattr(decoded, "reason", decoded)
        envelopes.append(decoded.envelope)
    return envelopes


# ------------------------------------------------------------------------------ two processes, one run id
TWIN_TRAINER = """
import sys, time
from pathlib import Path
import runledger
base, hold = float(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) > 2 else None
run = runledger.init("twin-r", config={"lr": 0.1})
for step in range(1, 11):
    run.log({"loss": base + step}, step=step)
if hold is not None:  # stay alive (bounded: 60 s) until the test lets go, so the twin overlaps
    (hold.parent / "ready").touch()
    for _ in range(600):
        if hold.exists():
            break
        time.sleep(0.1)
run.finish()
"""


def trainer(env: dict[str, str], cwd: Path, *args: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-c", TWIN_TRAINER, *args]
    return subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def wait_for_file(path: Path, process: subprocess.Popen[str]) -> None:
    for _ in range(600):  # bounded: 60 s
        if path.exists() or process.poll() is not None:
            break
        time.sleep(0.1)
    assert path.exists(), f"the first trainer never got going: {process.communicate(timeout=60)}"


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1] if text.strip() else ""


@pytest.mark.parametrize("shared", ["spool and state", "spool only"])
def test_a_second_process_logging_a_live_run_id_is_refused_in_one_line(tmp_path: Path, shared: str) -> None:
    spool, ledger = tmp_path / "spool", tmp_path / "ledger"
    first_env = client_env(tmp_path)
    second_env = dict(first_env)
    if shared == "spool only":  # its own attempt register: only the spool's writer lock stands between them
        second_env["RUNLEDGER_STATE"] = str(tmp_path / "state-2")
    sync = tmp_path / "sync"  # the test's own signals to the first trainer
    sync.mkdir()
    outside = Outside(tmp_path, [spool, ledger, tmp_path / "state", tmp_path / "state-2", sync])
    first = trainer(first_env, tmp_path, "100", str(sync / "go"))
    try:
        wait_for_file(sync / "ready", first)
        second = subprocess.run(
            [sys.executable, "-c", TWIN_TRAINER, "200"],
            cwd=tmp_path,
            env=second_env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        (sync / "go").touch()
        _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    refusal = last_line(second.stderr)
    assert second.returncode == 1, second.stderr
    expected = {
        "spool and state": "RunExistsError: run 'twin-r' was launched before",
        "spool only": "SpoolLockedError: spool ",
    }[shared]
    assert expected in refusal, second.stderr
    types = [e.type for e in spool_envelopes(spool)]  # the first trainer's events, whole
    assert types.count("runledger.run.started") == 1 and types.count("runledger.run.finished") == 1
    ingest_and_verify(spool, ledger)
    assert step_rows(ledger, "twin-r") == [(step, 1) for step in range(1, 11)]
    outside.assert_unchanged()


def test_two_processes_with_their_own_spools_and_one_run_id_are_both_kept_and_flagged(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    spools = [tmp_path / "spool-1", tmp_path / "spool-2"]
    states = [tmp_path / "state-1", tmp_path / "state-2"]
    outside = Outside(tmp_path, [ledger, *spools, *states])
    for base, spool, state in zip(("100", "200"), spools, states, strict=True):
        env = client_env(tmp_path) | {"RUNLEDGER_SPOOL": str(spool), "RUNLEDGER_STATE": str(state)}
        done = subprocess.run(
            [sys.executable, "-c", TWIN_TRAINER, base],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr
    for spool in spools:
        ingest_and_verify(spool, ledger)
    # Nothing lost: every step event of both is in the ledger, each from its own spool.
    sql = (
        "SELECT ingest_source, count(*) AS n FROM events WHERE run_id = 'twin-r' "
        "AND type = 'runledger.step.metrics' GROUP BY ingest_source"
    )
    out = ledger_cli("query", sql, "--ledger", str(ledger), "-f", "json")
    assert out.returncode == 0, out.stderr
    assert sorted(row["n"] for row in json.loads(out.stdout)) == [10, 10]
    # Not silent: the second launch of attempt 1 is an incident the run's state names.
    answer = ledger_cli("state", "twin-r", "--ledger", str(ledger))
    assert answer.returncode == 0, answer.stderr
    assert "duplicate-launch" in answer.stdout, answer.stdout
    outside.assert_unchanged()


def test_launches_of_one_run_id_at_the_same_moment_let_exactly_one_through(tmp_path: Path) -> None:
    # Eight launches racing between "no attempt yet" and registering one: before the register was
    # checked again after writing, several became fresh "attempt 1, 2, …" launches of one run.
    import runledger
    from runledger.client import RunExistsError

    state = tmp_path / "state"
    outside = Outside(tmp_path, [state, tmp_path / "spools"])
    barrier = threading.Barrier(8)
    runs: list[runledger.Run] = []
    refused: list[str] = []

    def launch(i: int) -> None:
        barrier.wait(timeout=30)
        try:
            runs.append(
                runledger.init(
                    "race-r",
                    spool=tmp_path / "spools" / str(i),
                    state_dir=state,
                    rank=0,
                    world_size=1,
                    local_rank=0,
                    handle_signals=False,
                    capture_exceptions=False,
                )
            )
        except RunExistsError as exc:
            refused.append(str(exc))

    switch_s = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads interleave at every few bytecodes: the window is hit
    try:
        threads = [threading.Thread(target=launch, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        sys.setswitchinterval(switch_s)
        for run in runs:
            run.finish()
    assert len(runs) == 1 and len(refused) == 7, (len(runs), refused)
    assert all("\n" not in why and "race-r" in why for why in refused)
    assert runs[0].attempt == 1
    outside.assert_unchanged()
