"""Student generation backends (Hugging Face ``generate`` today)."""
