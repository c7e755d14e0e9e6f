"""runledger: ledger."""
