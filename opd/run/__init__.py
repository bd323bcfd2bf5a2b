"""The run lifecycle shared by distillation and SFT: set-up, the training loop, validation, early stopping,
checkpoints, logs and export.
"""
