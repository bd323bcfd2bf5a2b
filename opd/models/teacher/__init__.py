"""Teacher backends (an in-process frozen model today)."""
