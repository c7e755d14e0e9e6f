"""runledger: ingest."""
