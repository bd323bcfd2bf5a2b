"""The objectives: the per-token divergences, the loss base class and its variants (full vocabulary, top-k,
sampled token, hybrid, NLL, several teachers), their config and the off-policy correction.
"""
