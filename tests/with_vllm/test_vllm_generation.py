"""The vLLM generation backend against the HF backend, with a real (CPU) vLLM engine.

* greedy rollouts equal the HF backend's token for token, in the same batch layout, and
  the sampler's log-probs agree;
* after a training step the engine is stale; after ``refit`` its greedy rollouts equal
  the updated HF student's again (tied embeddings included), also when the refit arrives
  in buckets that split decoder layers, with one post-load pass and one prefix-cache reset;
* every stop id (not only the tokenizer's EOS) ends a response, as in the HF backend;
* a LoRA student refits the engine with merged weights under the base names, after
  which the engine's greedy rollouts equal the adapter model's;
* sampled tokens carry the log-prob of the processed distribution (temperature, top-k,
  top-p), checked against a float64 reference; seeds come from torch's generator;
* a prompt too long for the engine, and a second engine in the process, are refused.

The models are the CPU demo's (real files, a trained student whose greedy traces end in
EOS at different steps).
"""

from __future__ import annotations

import copy
import json
import math

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here; run: bash scripts/test_vllm.sh")

import torch
from opd_test_helpers import REPO_ROOT
from transformers import AutoModelForCausalLM, AutoTokenizer

from opd.data.batched_data_dict import BatchedDataDict
from opd.data.converters import load_prompt_template, math_cl_to_chat
from opd.distillation.config import MasterConfig
from opd.losses.distillation_losses import KLLossFn
from opd.models.config import LoraConfig
from opd.models.decoding import GenerateStrategyConfig
from opd.policy.hf_policy import HFPolicy
from opd.rollout.hf_generation import HFGeneration
from opd.rollout.vllm_generation import VllmGeneration, VllmGenerationConfig
from opd.teachers.local_teacher import LocalTeacher
from opd.utils.config import load_config
from opd.utils.errors import ConfigError

STUDENT_DIR = REPO_ROOT / "examples" / "demo" / "models" / "student"
TEACHER_DIR = REPO_ROOT / "examples" / "demo" / "models" / "teacher"
DEMO_CONFIG = REPO_ROOT / "examples" / "configs" / "demo.yaml"
TEMPLATE = REPO_ROOT / "examples" / "prompts" / "math_think_answer.txt"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(STUDENT_DIR)


@pytest.fixture(scope="module")
def prompts(tokenizer, task_dir):
    """Four of the task's validation problems (the demo's template) and a shorter question."""
    template = load_prompt_template(TEMPLATE)
    rendered = []
    with open(task_dir / "val.jsonl", encoding="utf-8") as handle:
        rows = [json.loads(line) for line, _ in zip(handle, range(4))]
    conversations = [math_cl_to_chat(row, template)["messages"][:1] for row in rows]
    conversations.append([{"role": "user", "content": "What is 5 + 5?"}])  # a shorter prompt
    for messages in conversations:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        rendered.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    assert len({len(ids) for ids in rendered}) > 1
    return rendered


@pytest.fixture(scope="module")
def student():
    return AutoModelForCausalLM.from_pretrained(STUDENT_DIR, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(student, tokenizer):
    generation = VllmGeneration(student, tokenizer, VllmGenerationConfig(), seed=0)
    yield generation
    generation.close()


def greedy(max_length: int) -> GenerateStrategyConfig:
    return GenerateStrategyConfig(decoding_method="greedy", max_length=max_length)


def assert_same_rollouts(vllm_batch: BatchedDataDict, hf_batch: BatchedDataDict) -> None:
    for key in ("input_ids", "input_lengths", "prompt_lengths", "response_lengths", "truncated"):
        assert torch.equal(vllm_batch[key], hf_batch[key]), key
    if "generation_logprobs" in hf_batch:
        torch.testing.assert_close(vllm_batch["generation_logprobs"], hf_batch["generation_logprobs"],
                                   atol=1e-4, rtol=0)


def test_every_stop_id_ends_a_response_as_in_the_hf_backend(engine, student, tokenizer, prompts):
    """A second stop id (as a model's generation config lists several) ends vLLM's rollouts where HF's end."""
    unstopped = HFGeneration(student, tokenizer, stop_ids=[]).generate(prompts, greedy(40))
    # A token the first rollout emits at its fourth position becomes the second stop id.
    second = int(unstopped["input_ids"][0, int(unstopped["prompt_lengths"][0]) + 3])
    stops = (tokenizer.eos_token_id, second)
    hf_batch = HFGeneration(student, tokenizer, stop_ids=stops).generate(prompts, greedy(40))
    saved = engine.stop_ids
    engine.stop_ids = stops
    try:
        vllm_batch = engine.generate(prompts, greedy(40))
    finally:
        engine.stop_ids = saved
    assert_same_rollouts(vllm_batch, hf_batch)
    assert int(vllm_batch["response_lengths"][0]) <= 4 and not bool(vllm_batch["truncated"][0])
    for row in range(vllm_batch.size):
        last = int(vllm_batch["input_ids"][row, int(vllm_batch["input_lengths"][row]) - 1])
        assert (last in stops) == (not vllm_batch["truncated"][row])


def test_greedy_rollouts_equal_the_hf_backend(engine, student, tokenizer, prompts):
    hf = HFGeneration(student, tokenizer)
    # 80 new tokens: some traces end with EOS before that, others are cut.
    vllm_batch = engine.generate(prompts, greedy(80), num_samples=2)
    hf_batch = hf.generate(prompts, greedy(80), num_samples=2)
    assert_same_rollouts(vllm_batch, hf_batch)
    assert vllm_batch.size == 2 * len(prompts)
    assert vllm_batch["truncated"].any() and not vllm_batch["truncated"].all(), "want rows of both kinds"
    for row in range(vllm_batch.size):
        last = int(vllm_batch["input_lengths"][row]) - 1
        assert (int(vllm_batch["input_ids"][row, last]) == tokenizer.eos_token_id) == (not vllm_batch["truncated"][row])
    without = engine.generate(prompts, greedy(80), num_samples=2, return_logprobs=False)
    assert "generation_logprobs" not in without
    assert torch.equal(without["input_ids"], vllm_batch["input_ids"])


def one_training_step(model: torch.nn.Module, tokenizer, prompts, lora: LoraConfig | None = None) -> HFPolicy:
    """One optimizer step of forward-KL distillation from the demo teacher on the student's own rollouts."""
    teacher = LocalTeacher(AutoModelForCausalLM.from_pretrained(TEACHER_DIR, dtype=torch.float32).eval())
    config = load_config(MasterConfig, DEMO_CONFIG, ["training.learning_rate=0.05", "training.warmup_steps=0"])
    policy = HFPolicy(model, config.training, micro_batch_size=len(prompts), total_steps=1, lora=lora)
    batch = HFGeneration(model, tokenizer).generate(prompts, greedy(24), num_samples=1)
    batch["token_mask"] = torch.zeros_like(batch["input_ids"], dtype=torch.bool)
    for row in range(batch.size):
        batch["token_mask"][row, int(batch["prompt_lengths"][row]):int(batch["input_lengths"][row])] = True
    loss_fn = KLLossFn(kl_type="forward", vocab_size=len(tokenizer))
    policy.train(batch, loss_fn, teacher_signal=teacher.get_logits)
    return policy


def test_refit_after_a_training_step_matches_the_updated_student(engine, student, tokenizer, prompts):
    model = copy.deepcopy(student)
    assert model.config.tie_word_embeddings  # the head's repacked copy must follow the embedding
    engine.refit_from_model(model)
    try:
        before = engine.generate(prompts, greedy(48))
        embedding_before = model.get_input_embeddings().weight.detach().clone()
        one_training_step(model, tokenizer, prompts)
        assert not torch.equal(model.get_input_embeddings().weight, embedding_before)
        model.eval()
        updated = HFGeneration(model, tokenizer).generate(prompts, greedy(48))
        assert not torch.equal(updated["input_ids"], before["input_ids"]) or not torch.allclose(
            updated["generation_logprobs"], before["generation_logprobs"], atol=1e-3
        ), "the step should change what the student writes, else this test shows nothing"
        stale = engine.generate(prompts, greedy(48))
        assert torch.equal(stale["input_ids"], before["input_ids"])  # no refit yet: the old weights
        engine.refit_from_model(model)
        assert_same_rollouts(engine.generate(prompts, greedy(48)), updated)
    finally:
        engine.refit_from_model(student)  # the other tests use the engine with the student's weights


def test_a_refit_in_buckets_processes_and_resets_once(engine, student, tokenizer, prompts, monkeypatch):
    """A refit whose tensors arrive one per bucket, in an order that splits every decoder layer across buckets, each
    bucket's memory overwritten once it is loaded, leaves the updated student's weights; the post-load processing and
    the prefix-cache reset run once."""
    model = copy.deepcopy(student)
    one_training_step(model, tokenizer, prompts)
    model.eval()
    updated = HFGeneration(model, tokenizer).generate(prompts, greedy(48))
    calls: list[str] = []
    rpc, reset = engine.llm.collective_rpc, engine.llm.reset_prefix_cache

    def counted_rpc(method, *args, **kwargs):
        calls.append(method.__name__)
        return rpc(method, *args, **kwargs)

    def counted_reset():
        calls.append("reset_prefix_cache")
        return reset()

    monkeypatch.setattr(engine.llm, "collective_rpc", counted_rpc)
    monkeypatch.setattr(engine.llm, "reset_prefix_cache", counted_reset)
    pairs = [(name, parameter.detach()) for name, parameter in model.named_parameters()]
    try:
        engine.begin_refit()
        for name, tensor in reversed(pairs):  # last layer first, each of its tensors a bucket of its own
            bucket = tensor.clone()
            engine.load_weights([(name, bucket)])
            bucket.fill_(float("nan"))  # a refit reuses its buffer for the next bucket once the load returns
        engine.finish_refit()
        assert calls == [
            "_begin_worker_reload",
            *["_load_worker_part"] * len(pairs),
            "_finish_worker_reload",
            "reset_prefix_cache",
        ]
        assert_same_rollouts(engine.generate(prompts, greedy(48)), updated)
    finally:
        monkeypatch.undo()
        engine.refit_from_model(student)  # the other tests use the engine with the student's weights


def test_a_lora_student_refits_the_engine_with_merged_weights(engine, student, tokenizer, prompts):
    """The engine holds a plain model; a LoRA student's refit sends W + (alpha/r)·B·A under the base names."""
    pytest.importorskip("peft", reason="LoRA needs peft (the vllm-test extra installs it)")
    model = copy.deepcopy(student)
    try:
        before = engine.generate(prompts, greedy(48))
        policy = one_training_step(model, tokenizer, prompts, LoraConfig(r=8, alpha=16))
        names = [name for name, _ in policy.weights_for_refit()]
        assert names and not any("lora" in name or "base_layer" in name for name in names)
        model.eval()
        with_adapter = HFGeneration(model, tokenizer).generate(prompts, greedy(48))
        assert not torch.allclose(with_adapter["generation_logprobs"], before["generation_logprobs"], atol=1e-3), (
            "the adapter step should change the student's log-probs, else this test shows nothing"
        )
        engine.refit(policy)
        assert_same_rollouts(engine.generate(prompts, greedy(48)), with_adapter)
    finally:
        engine.refit_from_model(student)  # the other tests use the engine with the student's weights


def processed_logprob_reference(logits: torch.Tensor, token: int, strategy: GenerateStrategyConfig) -> float:
    """float64 log-prob of ``token`` under temperature, then top-k or top-p filtering."""
    scores = logits.double() / strategy.temperature
    if strategy.decoding_method == "top_k":
        kth = scores.topk(strategy.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, -math.inf)
    else:
        probs = torch.softmax(scores, dim=-1)
        order = probs.argsort(descending=True)
        before = probs[order].cumsum(0) - probs[order]  # mass strictly ahead of each token
        keep = torch.zeros_like(probs, dtype=torch.bool)
        keep[order] = before < strategy.top_p
        scores = scores.masked_fill(~keep, -math.inf)
    return float(torch.log_softmax(scores, dim=-1)[token])


@pytest.mark.parametrize("strategy", [
    GenerateStrategyConfig(decoding_method="top_k", temperature=0.8, top_k=5, max_length=24),
    GenerateStrategyConfig(decoding_method="top_p", temperature=1.3, top_p=0.9, max_length=24),
], ids=["top_k", "top_p"])
def test_sampled_tokens_carry_the_processed_distribution_logprob(engine, student, prompts, strategy):
    torch.manual_seed(0)
    batch = engine.generate(prompts, strategy, num_samples=2)
    with torch.no_grad():
        logits = student(batch["input_ids"]).logits
    checked = 0
    for row in range(batch.size):
        start, end = int(batch["prompt_lengths"][row]), int(batch["input_lengths"][row])
        for position in range(start, end):
            token = int(batch["input_ids"][row, position])
            reference = processed_logprob_reference(logits[row, position - 1], token, strategy)
            assert math.isfinite(reference), "a token outside the filtered set was sampled"
            assert batch["generation_logprobs"][row, position].item() == pytest.approx(reference, abs=1e-4)
            checked += 1
    assert checked >= batch.size


def test_rollout_seeds_come_from_torchs_generator(engine, prompts):
    strategy = GenerateStrategyConfig(decoding_method="top_k", temperature=1.5, top_k=50, max_length=24)
    torch.manual_seed(7)
    first = engine.generate(prompts, strategy, num_samples=2)
    torch.manual_seed(7)
    again = engine.generate(prompts, strategy, num_samples=2)
    torch.manual_seed(8)
    other = engine.generate(prompts, strategy, num_samples=2)
    assert torch.equal(first["input_ids"], again["input_ids"])
    assert not torch.equal(first["input_ids"], other["input_ids"])


def test_a_prompt_too_long_for_the_engine_is_refused(engine, prompts):
    with pytest.raises(ConfigError, match="generation.vllm.max_model_len"):
        engine.generate(prompts, greedy(engine.max_model_len - 5))


def test_a_second_engine_in_the_process_is_refused(engine, student, tokenizer):
    # vLLM's parallel state is process-global: a second engine would tear down the first.
    with pytest.raises(RuntimeError, match="already open in this process"):
        VllmGeneration(student, tokenizer, VllmGenerationConfig(), seed=0)
