"""The objectives: per-token divergences, the loss classes and their variants, their config, off-policy correction."""
