"""Utilities: config, logging, checkpoints, RNG, signals, plotting, errors."""
