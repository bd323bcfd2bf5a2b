"""opd: on-policy knowledge distillation for language models."""

from opd.utils.compile_cache import separate_kernel_cache_for_forced_cpu_capability

# Before anything imports torch's compiler stack, which fixes inductor's cache directory
# for the process on import (see opd/utils/compile_cache.py).
separate_kernel_cache_for_forced_cpu_capability()

__version__ = "0.1.0"
