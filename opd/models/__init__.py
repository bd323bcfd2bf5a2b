"""The shared ground: the interfaces every backend implements, model loading (HF, GGUF, tiny), model config and
decoding settings.
"""
