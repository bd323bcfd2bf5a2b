"""The trainable student policy (Hugging Face causal LM with optimizer and schedule)."""
