"""The objectives: distillation losses (forward, reverse, mixed KL; top-k; hybrid; several teachers), their config and
the off-policy correction.
"""
