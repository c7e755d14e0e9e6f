"""The built wheel: the repository's six top-level folders, each a package under its own folder's name
(``runledger``, ``cli``, ``ingest``, ``ledger``, ``schemas``, ``trainer``) and nothing else, the trainer's
package data, both console scripts; installed into a fresh venv, it imports from its own site-packages,
and the old mapped names (``runledger.ledger``, ``runledger.trainer``, …) do not import: one name for
each module, the one a tool reading the checkout sees.

The wheel is built from a copy of the sources (pyproject.toml, README.md and the package folders), so
the build never writes ``build/`` or ``*.egg-info`` into the shared checkout, and a stale ``build/lib``
can never leak a deleted module into the wheel. It is built offline: ``pip wheel --no-build-isolation
--no-index`` with the dev venv's own setuptools.
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
PACKAGES: list[str] = sorted(
    name.rstrip("*") for name in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
)
VERSION = PYPROJECT["project"]["version"]
FOLDERS = [name for name in PACKAGES if name != "runledger"]
APP = "cli.entry:main"
PIP = [sys.executable, "-m", "pip"]  # the dev venv's pip and setuptools: no network, no build isolation


def _clean_env() -> dict[str, str]:
    """The environment minus whatever could put the repository (or another tree) on sys.path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_", "VIRTUAL_ENV"))}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _run(args: list[str], *, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(args, cwd=cwd, env=_clean_env(), capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, (
        f"{args} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    )
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("setuptools", minversion="68", reason="the build backend (setuptools>=68)")
    can_bdist_wheel = importlib.util.find_spec("setuptools.command.bdist_wheel") or importlib.util.find_spec(
        "wheel"
    )
    if not can_bdist_wheel:
        pytest.skip("setuptools < 70.1 without the `wheel` package cannot build wheels offline")
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for folder in PACKAGES:
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("wheelhouse")
    _run(
        [*PIP, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(out), str(src)],
        cwd=out,
    )
    (built,) = out.glob("runledger-*.whl")
    return built


def test_wheel_has_the_six_folders_as_packages_package_data_and_both_scripts(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        dist_info = f"runledger-{VERSION}.dist-info"
        entry_points = zf.read(f"{dist_info}/entry_points.txt").decode()
        top_level_txt = zf.read(f"{dist_info}/top_level.txt").decode().split()

    top = {name.split("/", 1)[0] for name in names}
    assert {t for t in top if not t.endswith(".dist-info")} == set(PACKAGES), sorted(top)
    assert sorted(top_level_txt) == PACKAGES

    # Every module of every package folder, at the same path in the wheel as in the checkout.
    for folder in PACKAGES:
        modules = sorted(p.relative_to(REPO).as_posix() for p in (REPO / folder).rglob("*.py"))
        assert f"{folder}/__init__.py" in modules, folder
        missing = [m for m in modules if m not in names]
        assert not missing, f"{folder}: {missing} not in the wheel"

    # The trainer's package data: every shipped corpus and config.
    for pattern in PYPROJECT["tool"]["setuptools"]["package-data"]["trainer"]:
        files = sorted((REPO / "trainer").glob(pattern))
        assert files, f"trainer/{pattern} matches nothing in the checkout"
        for path in files:
            rel = path.relative_to(REPO / "trainer").as_posix()
            assert f"trainer/{rel}" in names, f"{rel} not in the wheel"

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
import runledger, ledger.verifier, cli.main
out["files"] = {m: sys.modules[m].__file__ for m in ("runledger", "ledger.verifier", "cli.main")}
out["version"] = importlib.metadata.version("runledger")
trainer = importlib.resources.files("trainer")
out["data"] = sorted(p.name for p in trainer.joinpath("data").iterdir())
out["configs"] = sorted(p.name for p in trainer.joinpath("configs").iterdir())
out["app"] = [kind.__name__ for kind in type(cli.main.app).__mro__]
print(json.dumps(out))
"""

OLD_NAMES = [f"runledger.{folder}" for folder in FOLDERS]  # the names of the former package-dir mapping


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The wheel installed (no deps) into a fresh venv that borrows the dev venv's site-packages for the
    dependencies through a plain path .pth line: that adds the directory but runs none of its .pth
    files, so the editable install's finder (which points at the checkout) stays out."""
    root = tmp_path_factory.mktemp("fresh")
    env = root / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(env)], cwd=root)
    python = env / "bin" / "python"
    site = Path(
        _run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=root
        ).stdout.strip()
    )
    dev_site = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "zz_runledger_dev_deps.pth").write_text("".join(f"{p}\n" for p in sorted(dev_site)))
    _run(
        [*PIP, "--python", str(python), "install", "--no-deps", "--no-index", "--no-compile", str(wheel)],
        cwd=root,
    )
    away = root / "elsewhere"
    away.mkdir()
    probe = json.loads(_run([str(python), "-c", PROBE, *OLD_NAMES], cwd=away).stdout)
    helps = {
        script: _run([str(env / "bin" / script), "--help"], cwd=away, timeout=60).stdout
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
    assert "Typer" in probe["app"]  # the app is a Typer (cli.main subclasses it)
    assert {p.name for p in (REPO / "trainer" / "data").glob("*.txt")} <= set(probe["data"])
    assert {p.name for p in (REPO / "trainer" / "configs").glob("*.toml")} <= set(probe["configs"])
    for script, text in installed["helps"].items():
        assert "Usage:" in text, f"{script} --help:\n{text}"


@pytest.mark.slow
@pytest.mark.parametrize("name", OLD_NAMES)
def test_the_old_mapped_name_does_not_import(name: str, installed: dict) -> None:
    result = installed["probe"]["bare"][name]
    assert result == {"missing": name}, f"`import {name}` succeeded: {result}"
