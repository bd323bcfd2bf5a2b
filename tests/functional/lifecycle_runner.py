"""Runs ``opd.cli.main`` with fault-injection hooks, for ``test_run_lifecycle.py``.

Usage::

    python tests/functional/lifecycle_runner.py HOOKS_JSON train --config FILE [overrides ...]

``HOOKS_JSON`` is a JSON object; every key is optional:

* ``pause_after_step`` (int) and ``release_file`` (path): once the training record of that
  step has been written to ``metrics.jsonl``, wait until ``release_file`` exists (at most
  ``pause_seconds``, default 120). The test signals or kills the process meanwhile, so the
  interruption lands at a known step instead of racing a 0.05 s step.
* ``slow_checkpoint`` (int, 1-based) and ``slow_seconds``: the n-th checkpoint write sleeps
  that long between writing its files (``save_state.json`` included) and the rename, i.e.
  inside ``opd.run.checkpoint._fsync_tree``.
* ``slow_final_model_seconds``: sleep that long before ``final_model/`` is written (after the
  last checkpoint).

Everything else behaves exactly like ``python -m opd ...``: the exit status is ``main``'s.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def install_hooks(hooks: dict) -> None:
    import opd.run.checkpoint as checkpoint_module
    from opd.policy.hf_policy import HFPolicy
    from opd.run.logger import Logger

    if "pause_after_step" in hooks:
        pause_step = int(hooks["pause_after_step"])
        release = Path(hooks["release_file"])
        limit = float(hooks.get("pause_seconds", 120))
        original_log_metrics = Logger.log_metrics

        def log_metrics(self, metrics, step, *args, **kwargs):
            original_log_metrics(self, metrics, step, *args, **kwargs)
            if step == pause_step and "train/loss" in metrics:
                deadline = time.monotonic() + limit
                while not release.exists() and time.monotonic() < deadline:
                    time.sleep(0.02)

        Logger.log_metrics = log_metrics

    if "slow_checkpoint" in hooks:
        slow_index = int(hooks["slow_checkpoint"])
        slow_seconds = float(hooks.get("slow_seconds", 120))
        original_fsync_tree = checkpoint_module._fsync_tree
        calls = {"n": 0}

        def fsync_tree(directory):
            calls["n"] += 1
            if calls["n"] == slow_index:
                time.sleep(slow_seconds)
            return original_fsync_tree(directory)

        checkpoint_module._fsync_tree = fsync_tree

    if "slow_final_model_seconds" in hooks:
        final_seconds = float(hooks["slow_final_model_seconds"])
        original_save_pretrained = HFPolicy.save_pretrained

        def save_pretrained(self, directory, *args, **kwargs):
            # The final model is written to a temporary sibling (.tmp_final_model) first.
            if Path(directory).name.endswith("final_model"):
                time.sleep(final_seconds)
            return original_save_pretrained(self, directory, *args, **kwargs)

        HFPolicy.save_pretrained = save_pretrained


def main() -> int:
    hooks = json.loads(sys.argv[1])
    install_hooks(hooks)
    from opd.cli import main as opd_main

    return opd_main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
