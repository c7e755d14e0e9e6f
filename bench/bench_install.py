"""Fresh-venv install size and time for each user (issue 41), beside the full install.

Builds the project's wheel once (offline, from a copy of the sources: the checkout is never written),
then for each user makes a venv without pip under a temporary folder and installs the wheel with
the extra from PyPI through this venv's pip (``pip --python``), so the venv's site-packages holds
exactly what the install brought. pip's cache (``~/.cache/pip``) is used as it is: run twice to see
a warm-cache time. Prints one JSON line per user: seconds, site-packages MB, packages.

The users: ``client`` (``pip install runledger``: a trainer's own environment), ``ledger`` (an
analyst), ``operator`` (a ledger of one's own), ``trainer`` (the Megatron trainer and the demo; the
full install but for the test tools; several GB of torch and NVIDIA libraries). Before issue 41 every
user installed the full set: 6.0 GB in 285 s.

    python -m bench.bench_install [--users client,ledger,operator,trainer] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("runledger", "cli", "ingest", "ledger", "schemas", "trainer")
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
EXTRA_OF_USER = {"client": "", "ledger": "[ledger]", "operator": "[operator]", "trainer": "[trainer]"}
BUILD_TIMEOUT_S = 300
INSTALL_TIMEOUT_S = 1800  # the trainer's install downloads ~3 GB on a cold cache


def _env() -> dict[str, str]:
    """The environment minus whatever could point pip or Python at the checkout or this venv."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _check(args: list[str], *, cwd: Path, timeout_s: float) -> None:
    out = subprocess.run(args, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        raise SystemExit(
            f"error: {' '.join(args[:6])} … failed ({out.returncode}): {out.stderr.strip()[-500:]}"
        )


def build_wheel(work: Path) -> Path:
    """The wheel, built offline with this venv's setuptools from a copy of the sources."""
    src, out = work / "src", work / "wheelhouse"
    src.mkdir()
    out.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for folder in PACKAGES:
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    wheel_args = ["wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(out), str(src)]
    _check([*PIP, *wheel_args], cwd=work, timeout_s=BUILD_TIMEOUT_S)
    (wheel,) = out.glob("runledger-*.whl")
    return wheel


def site_packages_bytes(venv: Path) -> int:
    (site,) = (venv / "lib").glob("python3*/site-packages")
    return sum((Path(d) / n).lstat().st_size for d, _, names in os.walk(site) for n in names)


def package_count(venv: Path) -> int:
    (site,) = (venv / "lib").glob("python3*/site-packages")
    return len(list(site.glob("*.dist-info")))


def measure_user(user: str, wheel: Path, work: Path) -> dict[str, object]:
    """Venv creation plus the install, timed; then the site-packages' size and package count."""
    venv = work / f"venv-{user}"
    started = time.perf_counter()
    _check([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=work, timeout_s=120)
    install = [
        *PIP,
        "--python",
        str(venv / "bin" / "python"),
        "install",
        "-q",
        f"{wheel}{EXTRA_OF_USER[user]}",
    ]
    _check(install, cwd=work, timeout_s=INSTALL_TIMEOUT_S)
    seconds = time.perf_counter() - started
    size = site_packages_bytes(venv)
    return {
        "user": user,
        "install": f"pip install 'runledger{EXTRA_OF_USER[user]}'",
        "seconds": round(seconds, 1),
        "site_packages_mb": round(size / 1e6, 1),
        "packages": package_count(venv),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--users", default="client,ledger,operator", help="comma-separated: " + ",".join(EXTRA_OF_USER)
    )
    parser.add_argument("--keep", type=Path, default=None, help="make the venvs here and keep them")
    args = parser.parse_args()
    users = [u for u in args.users.split(",") if u]
    unknown = [u for u in users if u not in EXTRA_OF_USER]
    if unknown:
        raise SystemExit(f"error: unknown user {', '.join(unknown)}: give some of {', '.join(EXTRA_OF_USER)}")
    # Each user in its own fresh venv under one work folder, removed after unless --keep names it.
    with tempfile.TemporaryDirectory(prefix="bench-install-") as tmp:
        work = args.keep if args.keep is not None else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        wheel = build_wheel(Path(tempfile.mkdtemp(dir=tmp)))
        for user in users:
            print(json.dumps(measure_user(user, wheel, work)), flush=True)
    print(
        json.dumps(
            {"user": "full (before issue 41)", "seconds": 285, "site_packages_mb": 6000, "baseline": True}
        )
    )


if __name__ == "__main__":
    main()
