"""runledger: an event-sourced, verifiable transparency ledger around a large-model training run.

One importable name. The repository's folders are its subpackages (mapped in pyproject.toml):

- ``runledger.trainer``: a Megatron-Core MoE trainer that emits typed events
- ``runledger.schemas``: the event catalogue (one envelope, versioned payloads)
- ``runledger.ingest``: producers (the bus: spool or Kafka sinks, GitHub, W&B) and the ingesters
- ``runledger.ledger``: Parquet + DuckDB views, the fold, Merkle log, signed log checkpoints
- ``runledger.cli``: the ``ledger`` command (also installed as ``runledger``)

Kept light on purpose: ``python -m runledger.ledger.verifier`` imports only this file on the way.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("runledger")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["__version__"]
