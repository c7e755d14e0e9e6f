"""Where and what code runs: git commit and dirty flag, software versions, host, cluster, job.

Standard library only (and the catalogue's ``Provenance``): the client library asks it before anything
heavy (torch) is imported.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import socket
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

from runledger.schemas.launch import Provenance

CODE_ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str, cwd: Path = CODE_ROOT) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


@lru_cache(maxsize=8)
def git_info(root: Path = CODE_ROOT) -> tuple[str | None, bool | None, str | None]:
    """(commit, dirty, branch) of the code that runs (the checkout holding ``root``: runledger's own
    by default, the user's script for the client library); Nones outside a git checkout."""
    commit = _git("rev-parse", "HEAD", cwd=root)
    if commit is None:
        return None, None, None
    status = _git("status", "--porcelain", "--untracked-files=no", cwd=root)
    branch = _git("rev-parse", "--abbrev-ref", "HEAD", cwd=root)
    return commit, (bool(status) if status is not None else None), branch


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@lru_cache(maxsize=1)
def software() -> dict[str, str]:
    # torch only if the process has it already: a client-library process that never imported torch
    # does not pay for it here.
    torch = sys.modules.get("torch")
    found = {
        "python": platform.python_version(),
        "torch": str(torch.__version__) if torch is not None else _version("torch"),
        "megatron-core": _version("megatron-core"),
        "transformer-engine": _version("transformer-engine") or _version("transformer_engine"),
        "msgspec": _version("msgspec"),
        "numpy": _version("numpy"),
        "runledger": _version("runledger"),
        "cuda": str(torch.version.cuda) if torch is not None and torch.version.cuda else None,
        "platform": platform.platform(),
    }
    return {k: str(v) for k, v in found.items() if v}


def host() -> str:
    return socket.gethostname()


def cluster() -> str | None:
    return os.environ.get("RUNLEDGER_CLUSTER") or os.environ.get("SLURM_CLUSTER_NAME")


def job_id() -> str | None:
    return (
        os.environ.get("RUNLEDGER_JOB_ID")
        or os.environ.get("SLURM_JOB_ID")
        or os.environ.get("TORCHELASTIC_RUN_ID")
    )


def of_this_process(code_root: Path = CODE_ROOT, *, host_name: str | None = None) -> Provenance:
    """This process's: the git checkout holding ``code_root``, this host, the scheduler's ids."""
    commit, dirty, branch = git_info(code_root)
    return Provenance(
        host=host() if host_name is None else host_name,
        git_commit=commit,
        git_dirty=dirty,
        git_branch=branch,
        cluster=cluster(),
        job_id=job_id(),
        software=software(),
    )
