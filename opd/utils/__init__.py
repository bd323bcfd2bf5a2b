"""Utilities: config parsing, errors, paths, RNG, signals, timers, the compile cache."""
