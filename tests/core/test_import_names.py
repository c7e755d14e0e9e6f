"""No import name a user's code can shadow or another distribution can overwrite (issue 41).

runledger's one top-level import name is ``runledger``; its folders are ``runledger.cli``,
``runledger.ingest``, ``runledger.ledger``, ``runledger.schemas`` and ``runledger.trainer``. Two real
situations: a training script run from a repository with its own ``trainer/``, ``schemas/``,
``ingest/``, ``cli/`` and ``ledger/`` packages (first on ``sys.path``, as Python puts the script's
folder), and runledger's wheel installed beside another distribution whose top-level package is
``cli``. (That no first-party file imports a bare folder name is tests/core/test_architecture.py's.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from runledger.ingest.spool import SpoolReader
from runledger.schemas import Event, decode_event
from tests.core.test_packaging import (
    FOLDERS,
    build_runledger_wheel,
    build_wheel,
    fresh_venv,
    pip_install,
    run_checked,
    skip_without_wheel_building,
)

REPO = Path(__file__).resolve().parents[2]
JUNK = "Envelope = 'a user thing'\nJUNK = {name!r}\n"  # what a user's own package of that name holds

CLIENT_SCRIPT = r"""
import json, sys
import runledger
with runledger.init("shadowed-1", config={"lr": 0.001}, repository="org/repo") as run:
    assert run.log({"loss": 1.5, "lr": 0.001}, step=1)
import cli, ingest, ledger, schemas, trainer  # the user's own, beside runledger's
print(json.dumps({
    "junk": {m.__name__: getattr(m, "JUNK", None) for m in (cli, ingest, ledger, schemas, trainer)},
    "ours": {n: sys.modules[n].__file__ for n in sorted(sys.modules) if n.startswith("runledger.")},
}))
"""


def _user_repository(root: Path) -> Path:
    """A user's folder: the five same-named packages, each with junk in its __init__, and the script."""
    for name in FOLDERS:
        (root / name).mkdir(parents=True)
        (root / name / "__init__.py").write_text(JUNK.format(name=name))
    (root / "train.py").write_text(CLIENT_SCRIPT)
    return root / "train.py"


def _client_env(tmp_path: Path) -> dict[str, str]:
    """The checkout on PYTHONPATH (after the script's own folder, as Python orders them), the spool and
    state in tmp, no launcher or producer-key variables: one process writing to its own spool."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RUNLEDGER_", "PYTHON"))}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    env |= {"PYTHONPATH": str(REPO), "RUNLEDGER_SPOOL": str(tmp_path / "spool")}
    env["RUNLEDGER_STATE"] = str(tmp_path / "state")
    return env


def test_a_client_script_runs_beside_its_own_same_named_packages(tmp_path: Path) -> None:
    script = _user_repository(tmp_path / "user-repo")
    out = subprocess.run(
        [sys.executable, str(script)],
        cwd=script.parent,
        env=_client_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, f"the client failed beside the user's packages:\n{out.stderr[-4000:]}"
    said = json.loads(out.stdout.strip().splitlines()[-1])
    assert said["junk"] == {name: name for name in FOLDERS}  # the user's packages stayed the user's
    assert said["ours"], "runledger imported none of its subpackages"
    for module, file in said["ours"].items():
        assert not Path(file).is_relative_to(script.parent), f"{module} came from the user's folder: {file}"
        assert Path(file).is_relative_to(REPO / "runledger"), f"{module} is not the checkout's: {file}"
    decoded = [decode_event(record.payload) for record in SpoolReader(tmp_path / "spool").read()]
    events = [d.envelope for d in decoded if isinstance(d, Event)]
    assert len(events) == len(decoded), decoded
    steps = [e for e in events if e.type == "runledger.step.metrics"]
    assert [(e.run_id, e.step) for e in steps] == [("shadowed-1", 1)]
    assert steps[0].data.loss == 1.5


def _other_cli_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another distribution ("othercli") whose one top-level package is ``cli``."""
    src = tmp_path_factory.mktemp("othercli")
    (src / "cli").mkdir()
    (src / "cli" / "__init__.py").write_text("OTHER = 'othercli'\n")
    (src / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "othercli"\nversion = "1.0"\n[tool.setuptools]\npackages = ["cli"]\n'
    )
    return build_wheel(src, tmp_path_factory.mktemp("otherhouse"))


def _record_files(python: Path, dist: str, cwd: Path) -> set[str]:
    code = f"import importlib.metadata as m; print('\\n'.join(str(f) for f in m.files({dist!r})))"
    return set(run_checked([str(python), "-c", code], cwd=cwd).stdout.split())


PROBE = r"""
import json, cli, runledger.cli.main
print(json.dumps({"cli": cli.__file__, "other": getattr(cli, "OTHER", None),
                  "ours": runledger.cli.main.__file__}))
"""


@pytest.mark.slow
def test_the_wheel_installs_beside_a_distribution_with_a_top_level_cli(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    skip_without_wheel_building()
    ours, other = build_runledger_wheel(tmp_path_factory), _other_cli_wheel(tmp_path_factory)
    with zipfile.ZipFile(ours) as zf:
        top_level = zf.read("runledger-0.1.0.dist-info/top_level.txt").decode().split()
        tops = {n.split("/", 1)[0] for n in zf.namelist() if not n.split("/", 1)[0].endswith(".dist-info")}
    assert top_level == ["runledger"] and tops == {"runledger"}, (top_level, sorted(tops))

    root = tmp_path_factory.mktemp("beside")
    python, site = fresh_venv(root)
    pip_install(python, ours, cwd=root)
    pip_install(python, other, cwd=root)  # after ours: it would overwrite a top-level cli of ours
    away = root / "elsewhere"
    away.mkdir()
    said = json.loads(run_checked([str(python), "-c", PROBE], cwd=away, timeout=120).stdout)
    assert said["other"] == "othercli" and Path(said["cli"]) == site / "cli" / "__init__.py"
    assert Path(said["ours"]) == site / "runledger" / "cli" / "main.py"
    mine, theirs = _record_files(python, "runledger", away), _record_files(python, "othercli", away)
    shared = {f for f in mine & theirs if not f.startswith("..")}  # the scripts' folder is not a package
    assert not shared, f"files both distributions install: {sorted(shared)}"
    help_text = run_checked([str(python.parent / "ledger"), "--help"], cwd=away, timeout=60).stdout
    assert "Usage:" in help_text


def test_no_module_named_by_a_string_is_a_bare_folder_name() -> None:
    """A module named in a string (``importlib.resources.files("…")``, ``import_module("…")``,
    ``find_spec("…")``) is found where Python finds it, not where the checkout is: a bare folder name
    worked only with the checkout's folder first on ``sys.path`` (the tests' working folder) and failed
    in ``ledger demo`` run from anywhere else (``No module named 'ledger'``)."""
    import re

    call = re.compile(r"""(?:resources\.files|import_module|find_spec)\(\s*["']([A-Za-z_][\w.]*)["']""")
    bare = []
    for folder in FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            for name in call.findall(path.read_text(encoding="utf-8")):
                if name.split(".")[0] in FOLDERS:
                    bare.append(f"{path.relative_to(REPO)}: {name}")
    assert bare == []
