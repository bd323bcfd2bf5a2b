"""Rollout: the student's generation engines (HF, vLLM), decoding, stop tokens, multi-turn episodes."""
