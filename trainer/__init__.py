"""runledger: trainer."""
