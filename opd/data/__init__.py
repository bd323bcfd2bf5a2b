"""Dataset loading and conversion to opd's chat format.

- :mod:`opd.data.datasets`: ``load_chat_dataset`` (JSONL, JSON, parquet, saved
  Hugging Face datasets, hub names) and ``split_prompt_and_response``.
- :mod:`opd.data.converters`: converters from task-specific layouts, e.g. math
  ``problem`` / ``ground_truth_answer`` rows, plus a command-line converter.

Import from those modules directly. Nothing is re-exported here on purpose:
``python -m opd.data.converters`` imports this package first, and a package that
already imported ``converters`` makes runpy warn about running it twice.
"""
