"""Reading a W&B run's offline ``.wandb`` file in the test that wrote it."""

from __future__ import annotations


def close_wandb_files() -> None:
    """Wait until every finished run's ``.wandb`` file is whole on disk.

    ``run.finish()`` returns once wandb-core has handled the run's exit, but it only *sends* the
    request that closes the run's stream (``inform_finish`` is not awaited), and the transaction
    log's last block reaches the file on that close. Read at once on a loaded machine, a small run's
    file held no record at all. ``wandb.teardown()`` waits for the service to shut down, stream
    closed; the next ``wandb.init`` starts a new one.
    """
    import wandb

    wandb.teardown()
