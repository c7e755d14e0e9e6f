"""End-to-end workflows: the pipelines that drive the trainer, the bus and the ledger together.

Above every other layer (the trainer, the bus and ingesters, the ledger); the CLI commands are thin
shells over them. ``demo``: ``ledger demo``; ``study``: the token-drop study; ``simulate``: the
reference run's simulated event stream.
"""
