"""The built wheel: one top-level package, ``runledger``, whose subpackages are the repository's top-level
folders (``runledger.cli``, ``runledger.ingest``, ``runledger.ledger``, ``runledger.schemas``,
``runledger.trainer``: in the checkout the symlinks runledger/<folder> -> ../<folder>, in the wheel real
folders), the trainer's and the report's package data, both console scripts; installed into a fresh
venv, it imports from its own site-packages, and no bare folder name (``cli``, ``ledger``, …) imports:
nothing a user's folder can shadow or another distribution overwrite (issue 41).

The wheel is built from a copy of the sources (pyproject.toml, README.md, runledger/ with its symlinks
and the five folders), so the build never writes ``build/`` or ``*.egg-info`` into the shared checkout,
and a stale ``build/lib`` can never leak a deleted module into the wheel. It is built offline: ``pip
wheel --no-build-isolation --no-index`` with the dev venv's own setuptools.
"""

from __future__ import annotations

import configparser
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
TOP = "runledger"  # the one top-level import name
FOLDERS = ("cli", "ingest", "ledger", "schemas", "trainer")  # each runledger.<folder>
VERSION = PYPROJECT["project"]["version"]
APP = "runledger.cli.entry:main"
PIP = [sys.executable, "-m", "pip"]  # the dev venv's pip and setuptools: no network, no build isolation


def _clean_env() -> dict[str, str]:
    """The environment minus whatever could put the repository (or another tree) on sys.path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_", "VIRTUAL_ENV"))}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def run_checked(args: list[str], *, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(args, cwd=cwd, env=_clean_env(), capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, (
        f"{args} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    )
    return out


def skip_without_wheel_building() -> None:
    pytest.importorskip("setuptools", minversion="68", reason="the build backend (setuptools>=68)")
    can_bdist_wheel = importlib.util.find_spec("setuptools.command.bdist_wheel") or importlib.util.find_spec(
        "wheel"
    )
    if not can_bdist_wheel:
        pytest.skip("setuptools < 70.1 without the `wheel` package cannot build wheels offline")


def build_wheel(src: Path, out: Path) -> Path:
    """A wheel of the project in ``src`` (offline, no deps), into ``out``."""
    run_checked(
        [*PIP, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(out), str(src)], cwd=out
    )
    (built,) = out.glob("*.whl")
    return built


def build_runledger_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """runledger's wheel, from a copy of the checkout that keeps runledger/<folder>'s symlinks as symlinks
    (setuptools' package finder follows them, as it does in the checkout)."""
    skip_without_wheel_building()
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for folder in (TOP, *FOLDERS):
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
        shutil.copytree(REPO / folder, src / folder, symlinks=True, ignore=ignore)
    return build_wheel(src, tmp_path_factory.mktemp("wheelhouse"))


def fresh_venv(root: Path) -> tuple[Path, Path]:
    """A venv without the system's site-packages (python, its purelib) that borrows the dev venv's
    site-packages for the dependencies through a plain path .pth line: that adds the directory but runs
    none of its .pth files, so the editable install's finder (which points at the checkout) stays out."""
    env = root / "venv"
    run_checked([sys.executable, "-m", "venv", "--without-pip", str(env)], cwd=root)
    python = env / "bin" / "python"
    paths = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(run_checked([str(python), "-c", paths], cwd=root).stdout.strip())
    dev_site = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "zz_runledger_dev_deps.pth").write_text("".join(f"{p}\n" for p in sorted(dev_site)))
    return python, site


def pip_install(python: Path, *wheels: Path, cwd: Path) -> None:
    args = ["install", "--no-deps", "--no-index", "--no-compile", *map(str, wheels)]
    run_checked([*PIP, "--python", str(python), *args], cwd=cwd)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_runledger_wheel(tmp_path_factory)


def test_wheel_has_one_top_level_package_package_data_and_both_scripts(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        dist_info = f"runledger-{VERSION}.dist-info"
        entry_points = zf.read(f"{dist_info}/entry_points.txt").decode()
        top_level_txt = zf.read(f"{dist_info}/top_level.txt").decode().split()

    top = {name.split("/", 1)[0] for name in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {TOP}, sorted(top)
    assert top_level_txt == [TOP]

    # Every module of every folder, at runledger/<its checkout path> in the wheel.
    for folder in (TOP, *FOLDERS):
        modules = sorted(p.relative_to(REPO).as_posix() for p in (REPO / folder).rglob("*.py"))
        assert f"{folder}/__init__.py" in modules, folder
        wanted = [m if folder == TOP else f"{TOP}/{m}" for m in modules]
        missing = [m for m in wanted if m not in names]
        assert not missing, f"{folder}: {missing} not in the wheel"

    # The package data: every shipped corpus and config, and the report's assets.
    for package, patterns in PYPROJECT["tool"]["setuptools"]["package-data"].items():
        folder = REPO / package.split(".", 1)[1]
        for pattern in patterns:
            files = sorted(folder.glob(pattern))
            assert files, f"{package}: {pattern} matches nothing in the checkout"
            for path in files:
                rel = f"{package.replace('.', '/')}/{path.relative_to(folder).as_posix()}"
                assert rel in names, f"{rel} not in the wheel"

    parser = configparser.ConfigParser(delimiters=("=",))
    parser.optionxform = str  # keep the names' case
    parser.read_string(entry_points)
    scripts = dict(parser["console_scripts"])
    assert scripts.get("ledger") == APP, scripts
    assert scripts.get("runledger") == APP, scripts


# ---------------------------------------------------------------------------- installed, away from the repo
PROBE = r"""
import importlib, importlib.metadata, importlib.resources, json, sys
out = {"bare": {}}
for name in sys.argv[1:]:
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        out["bare"][name] = {"missing": exc.name}
    else:
        out["bare"][name] = {"file": getattr(module, "__file__", None), "path": list(getattr(module, "__path__", []))}
import runledger, runledger.ledger.verifier, runledger.cli.main
names = ("runledger", "runledger.ledger.verifier", "runledger.cli.main")
out["files"] = {m: sys.modules[m].__file__ for m in names}
out["version"] = importlib.metadata.version("runledger")
trainer = importlib.resources.files("runledger.trainer")
out["data"] = sorted(p.name for p in trainer.joinpath("data").iterdir())
out["configs"] = sorted(p.name for p in trainer.joinpath("configs").iterdir())
out["app"] = [kind.__name__ for kind in type(runledger.cli.main.app).__mro__]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The wheel installed (no deps) into a fresh venv; probed from a folder away from the checkout."""
    root = tmp_path_factory.mktemp("fresh")
    python, site = fresh_venv(root)
    pip_install(python, wheel, cwd=root)
    away = root / "elsewhere"
    away.mkdir()
    probe = json.loads(run_checked([str(python), "-c", PROBE, *FOLDERS], cwd=away).stdout)
    helps = {
        script: run_checked([str(python.parent / script), "--help"], cwd=away, timeout=60).stdout
        for script in ("ledger", "runledger")
    }
    return {"site": site, "probe": probe, "helps": helps}


@pytest.mark.slow
def test_installed_wheel_imports_from_its_own_site_packages(installed: dict) -> None:
    probe, site = installed["probe"], installed["site"]
    for module, file in probe["files"].items():
        assert Path(file).is_relative_to(site), f"{module} imported from {file}, not from {site}"
        assert not Path(file).is_relative_to(REPO), f"{module} imported from the checkout"
    assert probe["version"] == VERSION
    assert "Typer" in probe["app"]  # the app is a Typer (runledger.cli.main subclasses it)
    assert {p.name for p in (REPO / "trainer" / "data").glob("*.txt")} <= set(probe["data"])
    assert {p.name for p in (REPO / "trainer" / "configs").glob("*.toml")} <= set(probe["configs"])
    for script, text in installed["helps"].items():
        assert "Usage:" in text, f"{script} --help:\n{text}"


@pytest.mark.slow
@pytest.mark.parametrize("name", FOLDERS)
def test_no_bare_folder_name_imports_from_the_wheel(name: str, installed: dict) -> None:
    result = installed["probe"]["bare"][name]
    assert result == {"missing": name}, f"`import {name}` succeeded: {result}"
