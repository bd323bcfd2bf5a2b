"""opd: on-policy knowledge distillation for language models."""

__version__ = "0.1.0"
