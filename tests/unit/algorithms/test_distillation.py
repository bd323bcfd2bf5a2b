"""Tests for ``opd.distillation.step`` and the components one step is built from.

Everything runs on the locally built tiny Qwen2 models (``tiny:teacher``, ``tiny:student``)
on CPU, with a few steps and short responses, so the whole file takes seconds.

What is checked:

* the λ coin: λ = 0 never generates, λ = 1 always does, and 0 < λ < 1 follows
  ``random.Random(seed + 1)``;
* the two batch builders (fixed data and on-policy): ``[prompt | response | pad]`` layout,
  ``token_mask`` exactly on the response, EOS handling and the sampler's log-probs, which
  are compared with the student's own forward pass (greedy, top-p and top-k sampling);
* gradient accumulation gives the gradient, update and metrics of one large batch;
* distilling a model into itself gives zero loss and zero gradient;
* the teacher stays frozen;
* a short end-to-end run writes a loadable ``final_model/`` and finite metrics;
* ``resolve_micro_batching`` and the tokenizer compatibility check.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from opd_test_helpers import short_run_overrides

from opd.data.batches import build_fixed_data_batch
from opd.data.dataloaders import prepare_examples
from opd.data.sequences import attention_mask_from_lengths, encode_prompt
from opd.distillation.config import MasterConfig, resolve_micro_batching
from opd.distillation.setup import check_config_against_data, setup
from opd.distillation.step import RolloutSchedule, distillation_train
from opd.losses.distillation_losses import KLLossFn
from opd.models.decoding import GenerateStrategyConfig
from opd.models.loading import check_tokenizer_compatibility
from opd.models.tiny import build_tiny_model, build_tiny_tokenizer
from opd.policy.hf_policy import HFPolicy, OptimizerConfig
from opd.rollout.hf_generation import HFGeneration
from opd.teachers.local_teacher import LocalTeacher
from opd.utils.config import load_config, validate_config
from opd.utils.errors import ConfigError, ModelCompatibilityError

REPO_ROOT = Path(__file__).resolve().parents[3]
TINY_CONFIG = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
TRAIN_DATA = REPO_ROOT / "examples" / "data" / "tiny_arithmetic" / "train.jsonl"

# Chat examples of clearly different prompt and response lengths, so that padding,
# per-micro-batch width cutting and left-padding for generation are all exercised.
VARIED_EXAMPLES = [
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
    {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": "2 + 3 = 5. The answer is \\boxed{5}."},
        ]
    },
    {"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]},
    {
        "messages": [
            {"role": "user", "content": "Count to five, please, and then stop."},
            {"role": "assistant", "content": "1 2 3 4 5"},
        ]
    },
]
PROMPT_TEXTS = ["hi", "What is 2 + 3?", "Count to five, please, and then stop.", "abc"]


# --------------------------------------------------------------------------- helpers


def run_config(tmp_path: Path, *overrides: str) -> MasterConfig:
    """The tiny demo config cut down to a few fast steps: no validation, no checkpoints."""
    base = [
        *short_run_overrides(tmp_path),
        "checkpointing.enabled=false",
        "training.batch_size=2",
        "training.micro_batch_size=null",
        "training.warmup_steps=0",
        "training.max_num_steps=3",
        "distillation.num_samples_per_prompt=1",
        "distillation.generate_strategy.max_length=8",
    ]
    return load_config(MasterConfig, TINY_CONFIG, base + list(overrides))


def count_generate_calls(generation: HFGeneration) -> list[int]:
    """Wraps ``generation.generate``; returns a list that grows by one per call."""
    calls: list[int] = []
    original = generation.generate

    def counting_generate(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    generation.generate = counting_generate  # type: ignore[method-assign]
    return calls


def read_metrics(config: MasterConfig) -> list[dict]:
    path = Path(config.logger.log_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_records(config: MasterConfig) -> list[dict]:
    return [record for record in read_metrics(config) if "train/on_policy" in record]


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def chat_prompt(tokenizer, text: str) -> list[int]:
    return encode_prompt(tokenizer, [{"role": "user", "content": text}])


def add_lm_head_hook(model: torch.nn.Module, eos_id: int, scale: float = 20.0, eos_prob: float | None = None):
    """Reshapes the logits of the tiny (near-uniform) model for generation tests.

    The logits are multiplied by ``scale`` so the distribution is peaked (a log-prob taken
    at the wrong position or of the wrong token is then far off), and optionally the EOS
    logit is set so that P(EOS) = ``eos_prob`` at temperature 1 at every position, so
    sampled responses sometimes stop early and sometimes run to ``max_length``. The hook
    acts on every forward pass, so generation and the reference forward pass see the
    same model.
    """

    def hook(module, inputs, output):
        out = output * scale
        if eos_prob is not None:
            others = torch.cat([out[..., :eos_id], out[..., eos_id + 1 :]], dim=-1)
            out = out.clone()
            out[..., eos_id] = torch.logsumexp(others, dim=-1) + math.log(eos_prob / (1.0 - eos_prob))
        return out

    return model.lm_head.register_forward_hook(hook)


def forward_log_probs(model: torch.nn.Module, batch, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) of a right-padded batch, float64 [B, L, V]."""
    model.eval()
    with torch.no_grad():
        attention = attention_mask_from_lengths(batch["input_lengths"], batch["input_ids"].shape[1])
        logits = model(input_ids=batch["input_ids"], attention_mask=attention, use_cache=False).logits
    return torch.log_softmax(logits.double() / temperature, dim=-1)


def check_generated_layout(batch, prompts: list[list[int]], tokenizer, max_length: int) -> None:
    """Every row is ``[prompt | response | pad]`` with a consistent EOS / length / truncation."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    rows = batch["input_ids"].shape[0]
    assert rows == len(prompts)
    assert batch["input_ids"].shape[1] == int(batch["input_lengths"].max())
    for key in ("input_lengths", "prompt_lengths", "response_lengths", "truncated"):
        assert batch[key].shape == (rows,), key
    assert batch["generation_logprobs"].shape == batch["input_ids"].shape
    for row, prompt in enumerate(prompts):
        p = int(batch["prompt_lengths"][row])
        r = int(batch["response_lengths"][row])
        length = int(batch["input_lengths"][row])
        assert p == len(prompt)
        assert length == p + r
        assert 1 <= r <= max_length
        assert batch["input_ids"][row, :p].tolist() == prompt
        response = batch["input_ids"][row, p:length].tolist()
        assert (batch["input_ids"][row, length:] == pad).all()
        if bool(batch["truncated"][row]):
            assert eos not in response
            assert r == max_length
        else:
            assert response[-1] == eos
            assert eos not in response[:-1]
        logprobs = batch["generation_logprobs"][row]
        assert (logprobs[:p] == 0).all()
        assert (logprobs[length:] == 0).all()
        assert (logprobs[p:length] <= 0).all()


def manual_greedy(model: torch.nn.Module, prompt: list[int], max_length: int, eos: int) -> list[int]:
    """Arg-max decoding by repeated full forward passes (no cache, no padding)."""
    model.eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_length):
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
            token = int(logits.argmax())
            ids.append(token)
            if token == eos:
                break
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


# --------------------------------------------------------------------------- the λ coin


def test_lambda_zero_never_generates(tmp_path):
    config = run_config(tmp_path, "distillation.lambda=0")
    parts = setup(config)
    calls = count_generate_calls(parts.student_generation)
    distillation_train(parts)

    records = train_records(config)
    assert [record["step"] for record in records] == [1, 2, 3]
    assert all(record["train/on_policy"] == 0 for record in records)
    assert all(record["train/truncation_rate"] == 0 for record in records)
    assert all(record["timing/generation"] == 0 for record in records)
    assert calls == []


@pytest.mark.parametrize("decode_loop", ["opd", "generate"])
def test_generation_decode_loop_is_chosen_by_the_config(tmp_path, decode_loop):
    config = run_config(tmp_path, f"generation.decode_loop={decode_loop}")
    parts = setup(config)
    assert parts.student_generation.decode_loop == decode_loop
    distillation_train(parts)
    assert all(record["train/on_policy"] == 1 for record in train_records(config))


def test_generation_decode_loop_rejects_an_unknown_value(tmp_path):
    with pytest.raises(ConfigError, match=r"generation\.decode_loop"):
        run_config(tmp_path, "generation.decode_loop=vllm")


def test_lambda_half_follows_seeded_coin(tmp_path):
    steps = 8
    config = run_config(tmp_path, "distillation.lambda=0.5", f"training.max_num_steps={steps}")
    parts = setup(config)
    calls = count_generate_calls(parts.student_generation)
    distillation_train(parts)

    coin = random.Random(config.training.seed + 1)
    expected = [coin.random() < 0.5 for _ in range(steps)]
    assert any(expected) and not all(expected), "seed must give a mixed sequence for the test to mean anything"
    records = train_records(config)
    assert [bool(record["train/on_policy"]) for record in records] == expected
    assert len(calls) == sum(expected)
    # Fixed-data steps train on the dataset's responses, which are longer than max_length 8.
    for record, on_policy in zip(records, expected):
        if on_policy:
            assert record["train/mean_response_length"] <= 8
        else:
            assert record["train/mean_response_length"] > 8


def test_lambda_below_one_needs_assistant_messages(tmp_path):
    data = tmp_path / "prompts_only.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"What is {i} + {i}?"}]} for i in range(4)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = run_config(tmp_path, "distillation.lambda=0.5", f"data.train_path={data}")
    with pytest.raises(ConfigError, match=r"distillation\.lambda"):
        setup(config)

    # λ = 1 never needs fixed responses: the same data passes the check.
    ok = run_config(tmp_path, "distillation.lambda=1.0", f"data.train_path={data}")
    tokenizer = build_tiny_tokenizer()
    examples = prepare_examples(rows, tokenizer, None, str(data))
    assert all(example["response_ids"] is None for example in examples)
    check_config_against_data(ok, examples)


# --------------------------------------------------------------------------- end-to-end run (λ = 1)


E2E_STEPS = 4


@pytest.fixture(scope="module")
def e2e_run(tmp_path_factory):
    """One short on-policy run; records what tests need from before and after training."""
    tmp_path = tmp_path_factory.mktemp("e2e")
    config = run_config(
        tmp_path, "distillation.lambda=1.0", "training.learning_rate=1e-3", f"training.max_num_steps={E2E_STEPS}"
    )
    parts = setup(config)
    student_policy, teacher_policy, generation = parts.student_policy, parts.teacher_policy, parts.student_generation
    after_setup = {
        "teacher_requires_grad": [p.requires_grad for p in teacher_policy.model.parameters()],
        "teacher_training": teacher_policy.model.training,
        "teacher_params": snapshot(teacher_policy.model),
        "student_params": snapshot(student_policy.model),
    }
    calls = count_generate_calls(generation)
    generated: list = []
    scored: list[torch.Tensor] = []
    original_generate = generation.generate
    # The driver asks the teacher through score() (the default fused loss for hidden states).
    original_score = teacher_policy.score

    def recording_generate(*args, **kwargs):
        batch = original_generate(*args, **kwargs)
        generated.append({key: value.clone() for key, value in batch.items()})
        return batch

    def recording_score(batch, request):
        scored.append(batch["input_ids"].detach().cpu().clone())
        return original_score(batch, request)

    generation.generate = recording_generate  # type: ignore[method-assign]
    teacher_policy.score = recording_score  # type: ignore[method-assign]
    distillation_train(parts)
    return {
        "config": config,
        "parts": parts,
        "after_setup": after_setup,
        "calls": calls,
        "generated": generated,
        "scored": scored,
    }


def test_lambda_one_always_generates(e2e_run):
    records = train_records(e2e_run["config"])
    assert [record["step"] for record in records] == list(range(1, E2E_STEPS + 1))
    assert all(record["train/on_policy"] == 1 for record in records)
    assert len(e2e_run["calls"]) == E2E_STEPS
    # On-policy responses are at most generate_strategy.max_length long.
    assert all(0 < record["train/mean_response_length"] <= 8 for record in records)


def test_teacher_scores_exactly_the_generated_tokens(e2e_run):
    # micro_batch_size = null: one micro-batch per step, so one teacher call per step.
    generated, scored = e2e_run["generated"], e2e_run["scored"]
    assert len(generated) == len(scored) == E2E_STEPS
    records = train_records(e2e_run["config"])
    for batch, teacher_ids, record in zip(generated, scored, records):
        assert torch.equal(teacher_ids, batch["input_ids"])
        assert record["train/mean_response_length"] == pytest.approx(float(batch["response_lengths"].float().mean()))
        assert record["train/num_valid_tokens"] == int(batch["response_lengths"].sum())
        assert record["train/truncation_rate"] == pytest.approx(float(batch["truncated"].float().mean()))


def test_end_to_end_writes_loadable_final_model(e2e_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = e2e_run["config"]
    final_dir = Path(config.output_dir) / "final_model"
    assert final_dir.is_dir()
    model = AutoModelForCausalLM.from_pretrained(final_dir)
    tokenizer = AutoTokenizer.from_pretrained(final_dir)
    reference_tokenizer = build_tiny_tokenizer()
    assert tokenizer.get_vocab() == reference_tokenizer.get_vocab()
    assert tokenizer.eos_token_id == reference_tokenizer.eos_token_id
    assert tokenizer.chat_template == reference_tokenizer.chat_template

    loaded = dict(model.named_parameters())
    trained = dict(e2e_run["parts"].student_policy.model.named_parameters())
    initial = e2e_run["after_setup"]["student_params"]
    assert set(loaded) == set(initial)
    max_change = max(float((loaded[name].detach() - initial[name]).abs().max()) for name in initial)
    assert max_change > 1e-4, "the saved student should differ from its initialisation"
    for name, param in loaded.items():
        torch.testing.assert_close(param.detach(), trained[name].detach(), rtol=0, atol=0)
    # The initial snapshot is the deterministic tiny:student.
    fresh = dict(build_tiny_model("student").named_parameters())
    for name, param in initial.items():
        torch.testing.assert_close(param, fresh[name].detach(), rtol=0, atol=0)


REQUIRED_METRICS = [
    "train/loss",
    "train/kl_forward",
    "train/kl_reverse",
    "train/grad_norm",
    "train/lr",
    "train/on_policy",
    "train/mean_response_length",
    "perf/tokens_per_s",
    "timing/generation",
    "timing/teacher",
    "timing/training",
]


def test_end_to_end_metrics_are_complete_and_finite(e2e_run):
    records = train_records(e2e_run["config"])
    assert len(records) == E2E_STEPS
    for record in records:
        for key in REQUIRED_METRICS:
            assert key in record, key
            assert isinstance(record[key], (int, float)), (key, record[key])
            assert math.isfinite(record[key]), (key, record[key])
        assert record["train/loss"] >= 0
        assert record["train/kl_forward"] >= 0 and record["train/kl_reverse"] >= 0
        # kl_type = reverse in the tiny config: the loss is the reverse KL.
        assert record["train/loss"] == pytest.approx(record["train/kl_reverse"], rel=1e-5)
        assert record["train/lr"] == pytest.approx(1e-3)
        assert record["train/grad_norm"] > 0
        assert record["perf/tokens_per_s"] > 0
        assert record["timing/generation"] > 0 and record["timing/teacher"] > 0 and record["timing/training"] > 0


def test_teacher_is_frozen(e2e_run):
    after_setup = e2e_run["after_setup"]
    assert after_setup["teacher_requires_grad"] and not any(after_setup["teacher_requires_grad"])
    assert after_setup["teacher_training"] is False

    teacher_policy = e2e_run["parts"].teacher_policy
    student_policy = e2e_run["parts"].student_policy
    assert teacher_policy.model is not student_policy.model
    # Still frozen after training, and its weights never moved.
    assert not teacher_policy.model.training
    assert not any(p.requires_grad for p in teacher_policy.model.parameters())
    assert all(p.grad is None for p in teacher_policy.model.parameters())
    for name, param in teacher_policy.model.named_parameters():
        torch.testing.assert_close(param.detach(), after_setup["teacher_params"][name], rtol=0, atol=0)

    tokenizer = e2e_run["parts"].tokenizer
    examples = prepare_examples(VARIED_EXAMPLES, tokenizer, None, "varied")
    batch = build_fixed_data_batch(examples, tokenizer.pad_token_id, True)
    with torch.enable_grad():
        logits = teacher_policy.get_logits(batch)
    assert logits.grad_fn is None
    assert not logits.requires_grad
    assert not logits.is_inference()
    assert logits.shape == (*batch["input_ids"].shape, len(tokenizer))


def test_rerunning_a_finished_run_changes_nothing(tmp_path):
    config = run_config(tmp_path, "checkpointing.enabled=true", "training.save_freq=0", "training.max_num_steps=2")
    distillation_train(setup(config))
    checkpoint = Path(config.checkpointing.checkpoint_dir) / "step_2"
    save_state = json.loads((checkpoint / "save_state.json").read_text())
    assert save_state["step"] == 2
    assert save_state["consumed_samples"] == 2 * config.training.batch_size
    weights = (checkpoint / "policy" / "model.safetensors").read_bytes()
    log_lines = (Path(config.logger.log_dir) / "metrics.jsonl").read_text()

    # The same command again resumes at step 2 of 2: nothing to do, nothing rewritten.
    distillation_train(setup(config))
    assert json.loads((checkpoint / "save_state.json").read_text()) == save_state
    assert (checkpoint / "policy" / "model.safetensors").read_bytes() == weights
    assert (Path(config.logger.log_dir) / "metrics.jsonl").read_text() == log_lines


def test_setup_refuses_to_overwrite_a_final_model_without_checkpoints(tmp_path):
    config = run_config(tmp_path, "training.max_num_steps=1")  # checkpointing disabled
    distillation_train(setup(config))
    final_model = Path(config.output_dir) / "final_model"
    before = (final_model / "model.safetensors").read_bytes()
    with pytest.raises(ConfigError, match="final_model"):
        setup(config)
    assert (final_model / "model.safetensors").read_bytes() == before


# --------------------------------------------------------------------------- fixed-data batch


@pytest.mark.parametrize("mask_prompt_tokens", [True, False])
def test_fixed_data_batch_alignment(tokenizer, mask_prompt_tokens):
    examples = prepare_examples(VARIED_EXAMPLES, tokenizer, None, "varied")
    batch = build_fixed_data_batch(examples, tokenizer.pad_token_id, mask_prompt_tokens)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    lengths = [len(e["prompt_ids"]) + len(e["response_ids"]) for e in examples]
    assert batch["input_ids"].shape == (len(examples), max(lengths))
    assert batch["token_mask"].shape == batch["input_ids"].shape
    assert not batch["truncated"].any()
    for row, (example, raw) in enumerate(zip(examples, VARIED_EXAMPLES)):
        p, r = len(example["prompt_ids"]), len(example["response_ids"])
        assert int(batch["prompt_lengths"][row]) == p
        assert int(batch["response_lengths"][row]) == r
        assert int(batch["input_lengths"][row]) == p + r
        assert batch["input_ids"][row, : p + r].tolist() == example["prompt_ids"] + example["response_ids"]
        assert (batch["input_ids"][row, p + r :] == pad).all()
        # The response is exactly the assistant turn's text followed by EOS.
        assert example["response_ids"][-1] == eos
        assert eos not in example["response_ids"][:-1]
        assert tokenizer.decode(example["response_ids"][:-1]) == raw["messages"][-1]["content"]
        # The prompt is what the student would be given at generation time.
        assert example["prompt_ids"] == encode_prompt(tokenizer, raw["messages"][:-1])
        expected_mask = [0.0] * batch["input_ids"].shape[1]
        first = p if mask_prompt_tokens else 1
        for position in range(first, p + r):
            expected_mask[position] = 1.0
        assert batch["token_mask"][row].tolist() == expected_mask


# --------------------------------------------------------------------------- on-policy batch


@pytest.mark.parametrize("decode_loop", ["opd", "generate"])
def test_greedy_generation_matches_manual_argmax_and_forward_logprobs(tokenizer, decode_loop):
    model = build_tiny_model("student")
    generation = HFGeneration(model, tokenizer, decode_loop)
    prompts = [chat_prompt(tokenizer, text) for text in PROMPT_TEXTS]
    strategy = GenerateStrategyConfig(decoding_method="greedy", max_length=8)
    hook = add_lm_head_hook(model, tokenizer.eos_token_id, scale=20.0)
    try:
        batch = generation.generate(prompts, strategy, 1)
        check_generated_layout(batch, prompts, tokenizer, strategy.max_length)
        log_probs = forward_log_probs(model, batch)
        for row, prompt in enumerate(prompts):
            # Batched generation (left-padded prompts, KV cache) = unbatched arg-max loop.
            p, length = len(prompt), int(batch["input_lengths"][row])
            expected = manual_greedy(model, prompt, strategy.max_length, tokenizer.eos_token_id)
            assert batch["input_ids"][row, p:length].tolist() == expected
            for t in range(p, length):
                token = int(batch["input_ids"][row, t])
                assert int(log_probs[row, t - 1].argmax()) == token
                assert float(batch["generation_logprobs"][row, t]) == pytest.approx(
                    float(log_probs[row, t - 1, token]), abs=1e-4
                )
    finally:
        hook.remove()
    # With the peaked logits the greedy tokens are confident; a shifted or wrong-token
    # log-prob would be far from these.
    assert float(batch["generation_logprobs"][0, len(prompts[0])]) > -3.0


@pytest.mark.parametrize(
    "strategy",
    [
        GenerateStrategyConfig(decoding_method="top_p", top_p=1.0, temperature=0.7, max_length=8),
        GenerateStrategyConfig(decoding_method="top_p", top_p=0.9, temperature=1.3, max_length=8),
        GenerateStrategyConfig(decoding_method="top_k", top_k=5, temperature=0.7, max_length=8),
    ],
    ids=["top_p=1,T=0.7", "top_p=0.9,T=1.3", "top_k=5,T=0.7"],
)
@pytest.mark.parametrize("decode_loop", ["opd", "generate"])
def test_sampled_generation_logprobs_are_the_tempered_distribution(tokenizer, strategy, decode_loop):
    model = build_tiny_model("student")
    generation = HFGeneration(model, tokenizer, decode_loop)
    base_prompts = [chat_prompt(tokenizer, text) for text in PROMPT_TEXTS]
    num_samples = 6
    prompts = [prompt for prompt in base_prompts for _ in range(num_samples)]
    hook = add_lm_head_hook(model, tokenizer.eos_token_id, scale=5.0, eos_prob=0.12)
    try:
        torch.manual_seed(0)
        batch = generation.generate(base_prompts, strategy, num_samples)
        check_generated_layout(batch, prompts, tokenizer, strategy.max_length)
        log_probs = forward_log_probs(model, batch, temperature=strategy.temperature)
    finally:
        hook.remove()
    # Both ways a response can end occur, so both branches of the layout check ran.
    assert batch["truncated"].any() and not batch["truncated"].all()

    for row in range(len(prompts)):
        p, length = int(batch["prompt_lengths"][row]), int(batch["input_lengths"][row])
        for t in range(p, length):
            token = int(batch["input_ids"][row, t])
            tempered = log_probs[row, t - 1]
            if strategy.decoding_method == "top_k":
                keep = torch.zeros_like(tempered, dtype=torch.bool)
                keep[tempered.topk(strategy.top_k).indices] = True
            else:
                # Nucleus: drop the tokens whose ascending cumulative mass is <= 1 - top_p.
                probs, order = tempered.exp().sort()
                drop = probs.cumsum(0) <= 1.0 - strategy.top_p
                drop[-1] = False
                keep = torch.ones_like(tempered, dtype=torch.bool)
                keep[order[drop]] = False
            assert keep[token], (row, t, "sampled a token outside the allowed set")
            restricted = torch.log_softmax(tempered.masked_fill(~keep, -math.inf), dim=-1)
            assert float(batch["generation_logprobs"][row, t]) == pytest.approx(float(restricted[token]), abs=1e-4)


def test_generation_num_samples_gives_adjacent_rows(tokenizer):
    model = build_tiny_model("student")
    generation = HFGeneration(model, tokenizer)
    prompts = [chat_prompt(tokenizer, text) for text in PROMPT_TEXTS[:3]]
    strategy = GenerateStrategyConfig(decoding_method="top_p", top_p=1.0, temperature=1.0, max_length=8)
    torch.manual_seed(0)
    batch = generation.generate(prompts, strategy, 3)
    expanded = [prompt for prompt in prompts for _ in range(3)]
    check_generated_layout(batch, expanded, tokenizer, strategy.max_length)
    for index, prompt in enumerate(prompts):
        for row in range(3 * index, 3 * index + 3):
            assert batch["input_ids"][row, : len(prompt)].tolist() == prompt
    # Samples of one prompt are independent draws, not copies.
    first = [batch["input_ids"][row, len(prompts[0]) : int(batch["input_lengths"][row])].tolist() for row in range(3)]
    assert len({tuple(response) for response in first}) > 1


def test_sync_schedule_batch_masks_response_and_restores_mode(tmp_path, tokenizer):
    config = run_config(tmp_path, "distillation.num_samples_per_prompt=2")
    model = build_tiny_model("student")
    model.train()
    generation = HFGeneration(model, tokenizer)
    examples = prepare_examples(VARIED_EXAMPLES, tokenizer, None, "varied")
    modes: list[bool] = []
    original = generation.generate

    def recording_generate(*args, **kwargs):
        modes.append(model.training)
        return original(*args, **kwargs)

    generation.generate = recording_generate  # type: ignore[method-assign]
    torch.manual_seed(0)
    loss_fn = config.loss_fn.build(len(tokenizer), "cpu")
    schedule = RolloutSchedule("sync", generation, None, None, loss_fn, tokenizer, config, random.Random(0))
    scheduled = schedule.next_batch(lambda: examples, version=0)
    batch = scheduled.batch
    assert scheduled.on_policy and scheduled.sampled_version == 0 and scheduled.staleness == 0
    assert scheduled.teacher_signal is None and "staleness" not in batch  # sync: scored and weighted as before
    assert modes == [False], "generation must run in eval mode"
    assert model.training, "train mode must be restored afterwards"
    assert batch["input_ids"].shape[0] == 2 * len(examples)
    for row in range(batch["input_ids"].shape[0]):
        p, length = int(batch["prompt_lengths"][row]), int(batch["input_lengths"][row])
        assert p == len(examples[row // 2]["prompt_ids"])
        expected = [1.0 if p <= t < length else 0.0 for t in range(batch["input_ids"].shape[1])]
        assert batch["token_mask"][row].tolist() == expected


# --------------------------------------------------------------------------- one training step


def train_one_step(batch, micro_batch_size, teacher, loss_fn, max_grad_norm):
    """A fresh tiny:student trained one step; returns (metrics, grads seen by the optimizer, params)."""
    # float64: Adam's first update is lr·g/(|g| + eps), which turns float32 summation-order
    # noise in near-zero gradient entries into visible parameter differences. In float64
    # that noise is ~1e-16, so any real difference between the schedules stands out.
    model = build_tiny_model("student", dtype=torch.float64)
    policy = HFPolicy(
        model,
        OptimizerConfig(learning_rate=1e-3, warmup_steps=0, max_grad_norm=max_grad_norm),
        micro_batch_size=micro_batch_size,
        total_steps=1,
    )
    grads: dict[str, torch.Tensor] = {}
    names = {id(param): name for name, param in model.named_parameters()}

    def capture(optimizer, args, kwargs):
        for group in optimizer.param_groups:
            for param in group["params"]:
                grads[names[id(param)]] = param.grad.detach().clone()

    policy.optimizer.register_step_pre_hook(capture)
    metrics = policy.train(batch, loss_fn, teacher_signal=teacher.get_logits)
    return metrics, grads, snapshot(model)


@pytest.mark.parametrize("max_grad_norm", [None, 1e-3], ids=["no-clip", "clip"])
@pytest.mark.parametrize("kl_reduction", ["mean", "sum"])
def test_gradient_accumulation_matches_one_large_batch(tokenizer, kl_reduction, max_grad_norm):
    examples = prepare_examples(VARIED_EXAMPLES, tokenizer, None, "varied")
    batch = build_fixed_data_batch(examples, tokenizer.pad_token_id, True)
    teacher = LocalTeacher(build_tiny_model("teacher", dtype=torch.float64))
    loss_fn = KLLossFn(
        kl_type="mixed", mixed_kl_weight=0.3, kl_reduction=kl_reduction, vocab_size=len(tokenizer)
    )
    initial = snapshot(build_tiny_model("student", dtype=torch.float64))

    reference_metrics, reference_grads, reference_params = train_one_step(batch, 4, teacher, loss_fn, max_grad_norm)
    assert max(float((reference_params[n] - initial[n]).abs().max()) for n in initial) > 1e-4
    if max_grad_norm is not None:
        assert reference_metrics["grad_norm"] > max_grad_norm, "clipping must actually act in this case"
        clipped_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in reference_grads.values()]))
        assert float(clipped_norm) == pytest.approx(max_grad_norm, rel=1e-3)

    for micro_batch_size in (1, 2, 3):
        metrics, grads, params = train_one_step(batch, micro_batch_size, teacher, loss_fn, max_grad_norm)
        for key in ("loss", "kl_forward", "kl_reverse", "num_valid_tokens", "grad_norm", "lr"):
            assert metrics[key] == pytest.approx(reference_metrics[key], rel=1e-9, abs=1e-12), (micro_batch_size, key)
        for name, grad in reference_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-7, atol=1e-12)
        for name, param in reference_params.items():
            torch.testing.assert_close(params[name], param, rtol=0, atol=1e-8)


@pytest.mark.parametrize("kl_type", ["forward", "reverse", "mixed"])
def test_teacher_equal_to_student_gives_zero_loss_and_gradient(tokenizer, kl_type):
    examples = prepare_examples(VARIED_EXAMPLES, tokenizer, None, "varied")
    batch = build_fixed_data_batch(examples, tokenizer.pad_token_id, True)
    teacher = LocalTeacher(build_tiny_model("student"))
    loss_fn = KLLossFn(kl_type=kl_type, vocab_size=len(tokenizer))

    # Gradients computed by hand through the loss function, before any optimizer step.
    model = build_tiny_model("student")
    attention = attention_mask_from_lengths(batch["input_lengths"], batch["input_ids"].shape[1])
    student_logits = model(input_ids=batch["input_ids"], attention_mask=attention, use_cache=False).logits
    tokens = int(batch["token_mask"][:, 1:].sum())
    loss, _ = loss_fn(student_logits, batch, tokens, batch.size, teacher_output=teacher.get_logits(batch))
    assert tokens > 0
    assert abs(float(loss.detach())) <= 1e-6
    loss.backward()
    for name, param in model.named_parameters():
        assert float(param.grad.abs().max()) <= 1e-6, name

    # Through the policy: the reported loss and pre-clipping gradient norm are zero too.
    optimizer_config = OptimizerConfig(learning_rate=1e-3, warmup_steps=0)
    policy = HFPolicy(build_tiny_model("student"), optimizer_config, 2, 1)
    metrics = policy.train(batch, loss_fn, teacher_signal=teacher.get_logits)
    assert abs(metrics["loss"]) <= 1e-6
    assert metrics["kl_forward"] <= 1e-6 and metrics["kl_reverse"] <= 1e-6
    assert metrics["grad_norm"] <= 1e-6
    # Control: against a different teacher the same step has a clearly non-zero gradient.
    other = HFPolicy(build_tiny_model("student"), optimizer_config, 2, 1)
    other_teacher = LocalTeacher(build_tiny_model("student-b"))
    other_metrics = other.train(batch, loss_fn, teacher_signal=other_teacher.get_logits)
    assert other_metrics["loss"] > 1e-4 and other_metrics["grad_norm"] > 1e-4


# --------------------------------------------------------------------------- micro-batching knobs


def batching_config(batch_size: int, samples: int, micro: int | None, accumulation: int | None) -> MasterConfig:
    return validate_config(
        MasterConfig,
        {
            "model": {"teacher_model_path": "tiny:teacher", "student_model_path": "tiny:student"},
            "data": {"train_path": "unused.jsonl"},
            "distillation": {"num_samples_per_prompt": samples, "generate_strategy": {"decoding_method": "top_p"}},
            "training": {
                "batch_size": batch_size,
                "micro_batch_size": micro,
                "gradient_accumulation_steps": accumulation,
            },
        },
    )


@pytest.mark.parametrize(
    "batch_size, samples, micro, accumulation, expected",
    [
        (8, 2, None, None, (16, 1)),  # neither: one pass per step
        (8, 2, 4, None, (4, 4)),  # accumulation derived
        (8, 2, 3, None, (3, 6)),  # derived with a short last micro-batch
        (8, 2, 32, None, (32, 1)),
        (8, 2, None, 4, (4, 4)),  # micro-batch size derived
        (8, 1, None, 8, (1, 8)),
        (8, 2, 4, 4, (4, 4)),  # both, consistent
        (8, 2, 16, 1, (16, 1)),
    ],
)
def test_resolve_micro_batching(batch_size, samples, micro, accumulation, expected):
    assert resolve_micro_batching(batching_config(batch_size, samples, micro, accumulation)) == expected


def test_resolve_micro_batching_inconsistent_knobs():
    with pytest.raises(ConfigError) as error:
        resolve_micro_batching(batching_config(8, 2, 4, 2))
    message = str(error.value)
    assert "training.micro_batch_size" in message
    assert "training.gradient_accumulation_steps" in message
    assert "16" in message


@pytest.mark.parametrize(("micro", "accumulation"), [(4, None), (None, 2)])
def test_token_budget_excludes_the_count_knobs(micro, accumulation):
    config = batching_config(8, 1, micro, accumulation)
    config.training.micro_batch_tokens = 512
    with pytest.raises(ConfigError, match=r"training\.micro_batch_tokens.*micro_batch_size.*null"):
        resolve_micro_batching(config)
    config.training.micro_batch_size = config.training.gradient_accumulation_steps = None
    assert resolve_micro_batching(config) == (8, 1)  # the token budget decides the micro-batches


def test_resolve_micro_batching_accumulation_must_divide():
    with pytest.raises(ConfigError) as error:
        resolve_micro_batching(batching_config(8, 2, None, 3))
    assert "training.gradient_accumulation_steps" in str(error.value)


# --------------------------------------------------------------------------- tokenizer check


def test_tokenizer_compatibility():
    student, teacher = build_tiny_tokenizer(), build_tiny_tokenizer()
    check_tokenizer_compatibility(student, teacher, "s", "t")  # identical: passes

    teacher.add_tokens(["<extra_token>"])
    with pytest.raises(ModelCompatibilityError, match="different tokenizers"):
        check_tokenizer_compatibility(student, teacher, "s", "t")

    other_eos = build_tiny_tokenizer()
    other_eos.eos_token = "<|endoftext|>"
    with pytest.raises(ModelCompatibilityError, match="EOS"):
        check_tokenizer_compatibility(student, other_eos, "s", "t")
