"""Run supervised fine-tuning: ``python examples/run_sft.py --config FILE [key=value ...]``.

A thin wrapper over ``opd sft`` in NeMo-RL's ``examples/run_*.py`` style. With no
``--config`` it runs ``examples/configs/sft.yaml``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from opd.cli import main

if __name__ == "__main__":
    arguments = sys.argv[1:]
    if "--config" not in arguments and not any(arg.startswith("--config=") for arg in arguments):
        arguments = ["--config", str(Path(__file__).parent / "configs" / "sft.yaml"), *arguments]
    sys.exit(main(["sft", *arguments]))
