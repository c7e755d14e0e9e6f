"""runledger: an event-sourced, verifiable transparency ledger around a large-model training run.

One importable name. The repository's folders are its subpackages (runledger/<folder> -> ../<folder>):

- ``runledger.trainer``: a Megatron-Core MoE trainer that emits typed events
- ``runledger.schemas``: the event catalogue (one envelope, versioned payloads)
- ``runledger.ingest``: producers (the bus: spool or Kafka sinks, GitHub, W&B) and the ingesters
- ``runledger.ledger``: the DuckLake tables, the fold, Merkle log, signed log checkpoints
- ``runledger.cli``: the ``ledger`` command (also installed as ``runledger``)

The client library (docs/client.md): ``runledger.init(...)`` → ``runledger.Run``, and the W&B
bridge ``runledger.wandb.tee()``.

Kept light on purpose: ``python -m runledger.ledger.verifier`` imports only this file on the way, so
the client library is loaded on first use of one of its names (module ``__getattr__``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    __version__: str
    from runledger.client import NonFiniteError, Placement, Run, RunConfig, RunExistsError, init

# name → the module that defines it, imported on first access
_LAZY = {
    "init": "runledger.client",
    "Run": "runledger.client",
    "RunConfig": "runledger.client",
    "RunExistsError": "runledger.client",
    "NonFiniteError": "runledger.client",
    "Placement": "runledger.client",
}

__all__ = ["NonFiniteError", "Placement", "Run", "RunConfig", "RunExistsError", "__version__", "init"]


def __getattr__(name: str) -> Any:
    import importlib

    if name == "wandb":  # the W&B bridge, a submodule: ``runledger.wandb.tee()``
        return importlib.import_module("runledger.wandb")
    if name == "__version__":  # importlib.metadata costs ~30 ms: only `--version` and the client ask
        globals()[name] = _installed_version()
        return globals()[name]
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'runledger' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def _installed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("runledger")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "0+unknown"
