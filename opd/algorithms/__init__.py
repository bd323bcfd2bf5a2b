"""Algorithms: on-policy distillation, SFT, their losses and the shared run lifecycle."""
