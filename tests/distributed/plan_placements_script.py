"""Plans the tiny pair on a cluster in several placements, in one process, and prints each plan as JSON.

``python plan_placements_script.py CONFIG`` prints one JSON object: case name → ``MemoryPlan.as_dict()``.
A dry run registers a stand-in accelerator for its whole process, hence a process of its own
(see :mod:`opd.plan.dry_run`).
"""

from __future__ import annotations

import json
import sys

from opd.distillation.config import MasterConfig
from opd.plan.memory_plan import plan_memory
from opd.utils.config import load_config

COMMON = ["cluster.trainer.workers=2", "data.max_prompt_length=8", "distillation.generate_strategy.max_length=8"]
CASES = {
    "colocated": [],
    "pool_full_vocab": [
        "cluster.teacher.placement=pool",
        "cluster.teacher.workers=2",
        "cluster.teacher.shards_per_replica=2",
    ],
    "pool_topk": ["cluster.teacher.placement=pool", "cluster.teacher.workers=1", "loss_fn.type=topk"],
    "served_full_vocab": ["teacher.backend=remote", "teacher.remote.url=http://127.0.0.1:9"],
    "served_topk": ["teacher.backend=remote", "teacher.remote.url=http://127.0.0.1:9", "loss_fn.type=topk"],
    "lora": ["model.lora.r=4"],
    "hsdp": ["cluster.trainer.workers=4", "cluster.trainer.shard_group_size=2"],
}


def main(config_path: str) -> None:
    plans = {}
    for name, overrides in CASES.items():
        config = load_config(MasterConfig, config_path, [*COMMON, *overrides])
        plans[name] = plan_memory(config, (False,)).as_dict()
    print(json.dumps(plans))


if __name__ == "__main__":
    main(sys.argv[1])
