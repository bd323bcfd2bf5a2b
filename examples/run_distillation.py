"""Run on-policy distillation: ``python examples/run_distillation.py --config FILE [key=value ...]``.

A thin wrapper over ``opd train`` for users who prefer NeMo-RL's ``examples/run_*.py``
style. With no ``--config`` it runs the seconds-long smoke config
(``examples/configs/distillation_tiny.yaml``, random tiny models); the README's demo is
``examples/demo/run_demo.py``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from opd.cli import main

if __name__ == "__main__":
    arguments = sys.argv[1:]
    if "--config" not in arguments and not any(arg.startswith("--config=") for arg in arguments):
        arguments = ["--config", str(Path(__file__).parent / "configs" / "distillation_tiny.yaml"), *arguments]
    sys.exit(main(["train", *arguments]))
