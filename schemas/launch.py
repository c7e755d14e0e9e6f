"""The launch record: one builder of ``run.started`` / ``run.resumed`` for every producer.

The client library (``runledger.init``), runledger's own trainer (``runledger.trainer.loop``), the reference
simulator (``runledger.workflows.simulate``) and the W&B importers (``runledger.ingest.wandb_import``,
``runledger.ingest.wandb_online``) all announce an attempt through ``launch_fields`` and ``launch_event``, so a
launch record has one shape whoever writes it; they differ only in where the ``Provenance`` comes
from (this process's, ``runledger.provenance.of_this_process``; the published facts the simulator
replays; what W&B recorded).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from runledger.schemas.payloads import RunResumed, RunStarted


@dataclass(frozen=True)
class Provenance:
    """What a launch record says about the code and the machine (``run.started``/``run.resumed``)."""

    host: str
    git_commit: str | None = None
    git_dirty: bool | None = None
    git_branch: str | None = None
    cluster: str | None = None
    job_id: str | None = None
    software: dict[str, str] = field(default_factory=dict)


def launch_fields(
    *,
    config: dict[str, Any],
    config_hash: str,
    provenance: Provenance,
    repository: str | None,
    world_size: int,
    parallelism: Mapping[str, int] | None = None,
    external: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The fields ``run.started`` and ``run.resumed`` share."""
    return {
        "config": config,
        "config_hash": config_hash,
        "git_commit": provenance.git_commit,
        "git_dirty": provenance.git_dirty,
        "git_branch": provenance.git_branch,
        "repository": repository,
        "host": provenance.host,
        "cluster": provenance.cluster,
        "job_id": provenance.job_id,
        "world_size": world_size,
        "parallelism": {str(k): int(v) for k, v in (parallelism or {}).items()},
        "software": dict(provenance.software),
        "external": {str(k): str(v) for k, v in (external or {}).items()},
    }


def launch_event(
    fields: dict[str, Any],
    *,
    attempt: int,
    name: str | None = None,
    resumed_from_step: int | None = None,
    checkpoint_path: str | None = None,
    parent_run: str | None = None,
    fork_step: int | None = None,
) -> tuple[RunStarted | RunResumed, int]:
    """(payload, step) announcing attempt ``attempt``: ``run.started`` at step 0 for a fresh run
    (``parent_run``, ``fork_step``: the run it goes on from under this new run id, and the step),
    ``run.resumed`` at the step it resumes from otherwise (a resume always follows an attempt)."""
    if resumed_from_step is None:
        return RunStarted(name=name, parent_run=parent_run, fork_step=fork_step, **fields), 0
    payload = RunResumed(
        from_checkpoint_step=resumed_from_step,
        checkpoint_path=checkpoint_path,
        previous_attempt=max(1, attempt - 1),
        **fields,
    )
    return payload, resumed_from_step
