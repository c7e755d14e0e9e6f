"""One install per user (issue 41), each installed from the built wheel into a fresh venv from PyPI
(pip's cache keeps it quick) and run there, away from the checkout:

- ``pip install runledger`` (a trainer's own environment): ``runledger.init`` logs a step to a spool;
  none of torch, DuckDB, pyarrow, typer, wandb is installed; ``ledger …`` says in one line which extra.
- ``pip install 'runledger[ledger]'`` (an analyst): at most 400 MB of site-packages; ``ledger --help``
  and ``ledger verify --help`` run; ``ledger verify --remote`` and ``ledger query --remote`` check and
  query a published copy (made here, served on 127.0.0.1); ``ledger demo`` names the trainer extra.

The venvs are made without pip and installed by the dev venv's pip (``pip --python``), so their
site-packages hold exactly what the install brought. Skipped, with the reason, when PyPI cannot be
reached.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
import tomllib
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PACKAGES = sorted(name.rstrip("*") for name in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"])
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
INSTALL_TIMEOUT_S = 600  # a cold pip cache downloads ~120 MB for [ledger]
RUN_TIMEOUT_S = 120
LEDGER_EXTRA_MAX_BYTES = 400 * 10**6
CLIENT_MAX_BYTES = 150 * 10**6  # numpy and cryptography are most of it
HEAVY = ["torch", "megatron", "duckdb", "pyarrow", "typer", "wandb", "matplotlib"]

pytestmark = pytest.mark.slow

# Run inside a base install: one step logged to a spool, read back; which heavy modules exist.
CLIENT_PROBE = r"""
import importlib.util, json, sys
from pathlib import Path

import runledger
from runledger.ingest.spool import SpoolReader

work = Path(sys.argv[1])
run = runledger.init("install-check", config={"lr": 0.1}, spool=work / "spool", state_dir=work / "state")
with run:
    run.log({"loss": 0.5, "lr": 0.1}, step=1)
types = [json.loads(record.payload)["type"] for record in SpoolReader(work / "spool").read(0)]
heavy = {name: importlib.util.find_spec(name) is not None for name in sys.argv[2:]}
print(json.dumps({"types": types, "heavy": heavy, "runledger": runledger.__file__}))
"""


def _env() -> dict[str, str]:
    """The environment minus whatever could put the checkout or another venv on sys.path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _run(args: list[str], *, cwd: Path, timeout: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)


def _ok(args: list[str], *, cwd: Path, timeout: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    out = _run(args, cwd=cwd, timeout=timeout)
    assert out.returncode == 0, (
        f"{args} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    )
    return out


def site_packages_bytes(venv: Path) -> int:
    """Bytes of every file under the venv's site-packages (what the install brought)."""
    (site,) = (venv / "lib").glob("python3*/site-packages")
    return sum((Path(folder) / name).lstat().st_size for folder, _, names in os.walk(site) for name in names)


@pytest.fixture(scope="module")
def pypi() -> None:
    """Skip (with the reason) when PyPI cannot be reached: these tests install from it."""
    try:
        with urllib.request.urlopen("https://pypi.org/simple/msgspec/", timeout=15) as response:
            response.read(1)
    except OSError as exc:
        pytest.skip(f"PyPI is unreachable ({exc}): the per-user installs cannot be made")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel, built offline from a copy of the sources (the checkout is never written)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for folder in PACKAGES:
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("wheelhouse")
    _ok(
        [*PIP, "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(out), str(src)],
        cwd=out,
    )
    (built,) = out.glob("runledger-*.whl")
    return built


def _fresh_install(root: Path, requirement: str) -> Path:
    """A venv without pip under ``root``, with ``requirement`` installed into it from PyPI."""
    venv = root / "venv"
    _ok([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=root)
    _ok(
        [*PIP, "--python", str(venv / "bin" / "python"), "install", "-q", requirement],
        cwd=root,
        timeout=INSTALL_TIMEOUT_S,
    )
    return venv


@pytest.fixture(scope="module")
def client_venv(pypi: None, wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _fresh_install(tmp_path_factory.mktemp("client"), str(wheel))


@pytest.fixture(scope="module")
def ledger_venv(pypi: None, wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _fresh_install(tmp_path_factory.mktemp("ledger"), f"{wheel}[ledger]")


def _one_line_error(out: subprocess.CompletedProcess[str]) -> str:
    """The command failed with exactly one line on stderr, no traceback; that line."""
    assert out.returncode != 0, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    return lines[0]


# -------------------------------------------------------------------------- pip install runledger


def test_client_install_logs_a_step_without_the_heavy_packages(client_venv: Path, tmp_path: Path) -> None:
    out = _ok([str(client_venv / "bin" / "python"), "-c", CLIENT_PROBE, str(tmp_path), *HEAVY], cwd=tmp_path)
    probe = json.loads(out.stdout)
    assert Path(probe["runledger"]).is_relative_to(client_venv), probe["runledger"]  # not the checkout
    assert probe["types"][0] == "runledger.run.started", probe["types"]
    assert "runledger.step.metrics" in probe["types"] and probe["types"][-1] == "runledger.run.finished"
    assert probe["heavy"] == dict.fromkeys(HEAVY, False), probe["heavy"]
    size = site_packages_bytes(client_venv)
    print(f"client install: {size / 1e6:.0f} MB of site-packages")
    assert size <= CLIENT_MAX_BYTES, f"the client install is {size / 1e6:.0f} MB"


def test_client_install_bridge_without_wandb_says_to_install_it(client_venv: Path, tmp_path: Path) -> None:
    out = _run([str(client_venv / "bin" / "python"), "-c", "import runledger.wandb"], cwd=tmp_path)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: runledger.wandb bridges a W&B run: install wandb"), (
        out.stderr
    )


def test_client_install_has_only_the_unpinned_base_dependencies() -> None:
    pinned = [dep for dep in PYPROJECT["project"]["dependencies"] if "==" in dep]
    assert not pinned, f"the client pins {pinned}: a trainer's environment pins its own"


@pytest.mark.parametrize(
    ("args", "extra"),
    [
        (["demo"], "trainer"),
        (["query", "SELECT 1"], "ledger"),
        (["--help"], "ledger"),
        (["ingest", "spool"], "operator"),
    ],
)
def test_ledger_in_a_client_install_names_the_extra(
    client_venv: Path, tmp_path: Path, args: list[str], extra: str
) -> None:
    line = _one_line_error(_run([str(client_venv / "bin" / "ledger"), *args], cwd=tmp_path))
    assert f"needs the {extra} extra: pip install 'runledger[{extra}]'" in line, line


# -------------------------------------------------------------------------- pip install 'runledger[ledger]'


def test_ledger_extra_is_at_most_400_mb(ledger_venv: Path) -> None:
    size = site_packages_bytes(ledger_venv)
    print(f"[ledger] install: {size / 1e6:.0f} MB of site-packages")
    assert size <= LEDGER_EXTRA_MAX_BYTES, f"the [ledger] install is {size / 1e6:.0f} MB"


@pytest.mark.parametrize(
    "args", [["--help"], ["verify", "--help"], ["query", "--help"], ["monitor", "--help"]]
)
def test_ledger_extra_runs_the_command(ledger_venv: Path, tmp_path: Path, args: list[str]) -> None:
    out = _ok([str(ledger_venv / "bin" / "ledger"), *args], cwd=tmp_path)
    assert "Usage:" in out.stdout, out.stdout


def test_ledger_extra_has_no_trainer(ledger_venv: Path, tmp_path: Path) -> None:
    probe = "import importlib.util, json, sys; print(json.dumps([n for n in sys.argv[1:] if importlib.util.find_spec(n)]))"
    out = _ok([str(ledger_venv / "bin" / "python"), "-c", probe, "torch", "megatron", "wandb"], cwd=tmp_path)
    assert json.loads(out.stdout) == []


@pytest.mark.parametrize(
    ("args", "command"),
    [
        (["demo", "--steps", "3"], "ledger demo"),
        (["study", "token-drop", "--quick"], "ledger study token-drop"),
    ],
)
def test_trainer_commands_in_a_ledger_install_name_the_trainer_extra(
    ledger_venv: Path, tmp_path: Path, args: list[str], command: str
) -> None:
    line = _one_line_error(_run([str(ledger_venv / "bin" / "ledger"), *args], cwd=tmp_path))
    assert line.endswith(f"`{command}` needs the trainer extra: pip install 'runledger[trainer]'"), line
    assert not (tmp_path / ".runledger").exists()  # nothing was made before the line


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def published(tmp_path: Path) -> Iterator[tuple[str, str, Path]]:
    """A ledger of 30 steps published here (the dev venv) and served on 127.0.0.1: (URL, log key,
    the lab's own ledger folder)."""
    from tests.merkle.test_publish import Site

    site = Site(tmp_path / "lab")
    site.add(30)
    site.publish()
    handler = functools.partial(_QuietHandler, directory=str(site.dest))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/", site.vkey, site.root
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_ledger_extra_verifies_and_queries_a_published_copy(
    ledger_venv: Path, published: tuple[str, str, Path], tmp_path: Path
) -> None:
    url, key, _ = published
    ledger = str(ledger_venv / "bin" / "ledger")
    state = tmp_path / "seen.json"
    out = _ok([ledger, "verify", "--remote", url, "--log-key", key, "--state", str(state)], cwd=tmp_path)
    assert out.stdout.startswith("OK ") and "from nothing" in out.stdout, out.stdout
    sql = "SELECT count(*) AS n, max(step) AS last FROM events"
    out = _ok([ledger, "query", "--remote", url, "--log-key", key, "--format", "json", sql], cwd=tmp_path)
    assert json.loads(out.stdout) == [{"n": 31, "last": 30}], out.stdout


@pytest.mark.parametrize(
    ("args", "command"),
    [
        (["ingest", "spool", "--spool", "s"], "ledger ingest spool"),
        (["init", "--ledger", "l"], "ledger init"),
    ],
)
def test_operator_commands_in_a_ledger_install_name_the_operator_extra(
    ledger_venv: Path, tmp_path: Path, args: list[str], command: str
) -> None:
    line = _one_line_error(_run([str(ledger_venv / "bin" / "ledger"), *args], cwd=tmp_path))
    assert line == f"error: `{command}` needs the operator extra: pip install 'runledger[operator]'", line
    assert list(tmp_path.iterdir()) == []  # nothing made
