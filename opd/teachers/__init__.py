"""Teachers: their backends (in process, self, vLLM, served), their config, batching, scoring and the wrappers
(context, cross-tokenizer, several).
"""
