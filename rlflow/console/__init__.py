"""The console: the `rlflow` command, its pre-start checks, the progress line, the config reference."""
