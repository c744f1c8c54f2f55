"""The runtime: how the programs run together (prompt ledger, replica liveness, ...)."""
