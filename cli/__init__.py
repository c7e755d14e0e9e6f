"""runledger: cli."""
