"""The run folder and what is written into it: layout checks, identity, metrics, report."""
