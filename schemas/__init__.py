"""runledger: schemas."""
