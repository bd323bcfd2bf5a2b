"""Tests for supervised fine-tuning: ``opd.sft`` and the ``opd sft`` command.

Everything runs on the locally built ``tiny:student`` on CPU with the shipped arithmetic
chat data, a few fast steps and short validation answers.

What is checked:

* SFT learns: the training loss falls, and the teacher-forced NLL of held-out answers
  (computed here from the model's logits, independently of opd's loss code) drops;
* the loss covers exactly the final assistant message plus its EOS: the tokens the loss
  function sees, ``train/num_valid_tokens``, and that logits at prompt and padding
  positions cannot change the loss or receive gradient;
* gradient accumulation: any ``micro_batch_size`` gives the update of one large batch;
* user mistakes (an example without an answer, a batch larger than the data) are
  ``ConfigError``\\ s naming the file / key;
* validation reports ``val/accuracy`` and no teacher KL;
* a run killed with SIGKILL and rerun with the same command ends bitwise where an
  uninterrupted run ends (``tests/functional/lifecycle_runner.py`` pauses the run at an
  exact step so the kill does not race a 0.02 s step);
* the command line: a bad value is one ``opd: error:`` line with exit status 2, and
  ``examples/run_sft.py`` writes ``final_model/``, ``metrics.jsonl``, the curves and the
  summary.

* SFT shares distillation's resume guards: a rerun without checkpoints refuses to
  overwrite ``final_model/``, and a resume with a changed config logs the changed keys.

The subprocesses (each pays a few seconds for importing torch and transformers) are all
started together once per module and checked by the tests one by one.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from opd_test_helpers import BackgroundProcess, short_run_overrides
from safetensors.torch import load_file

from opd.data.batches import build_fixed_data_batch
from opd.data.dataloaders import prepare_examples
from opd.losses.nll import NLLLossFn
from opd.models.step_metrics import read_metrics
from opd.models.tiny import build_tiny_model, build_tiny_tokenizer
from opd.policy.hf_policy import HFPolicy, OptimizerConfig
from opd.sft import SFTMasterConfig, setup, sft_train
from opd.utils.config import load_config
from opd.utils.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[3]
SFT_CONFIG = REPO_ROOT / "examples" / "configs" / "sft.yaml"
RUN_SFT = REPO_ROOT / "examples" / "run_sft.py"
RUNNER = REPO_ROOT / "tests" / "functional" / "lifecycle_runner.py"
TRAIN_DATA = REPO_ROOT / "examples" / "data" / "tiny_arithmetic" / "train.jsonl"
VAL_DATA = REPO_ROOT / "examples" / "data" / "tiny_arithmetic" / "val.jsonl"
ERROR_PREFIX = "opd: error:"
PROCESS_TIMEOUT = 180.0
# One intra-op thread per process: several runs share two cores, and runs compared
# bitwise must use the same thread count. PYTHONPATH makes the runner (started as a
# script, so its sys.path[0] is tests/functional) import this checkout's opd.
SUBPROCESS_ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
}

# Examples of clearly different prompt and response lengths (padding differs per row).
VARIED_ROWS = [
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
    {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": "2 + 3 = 5. The answer is \\boxed{5}."},
        ]
    },
    {"messages": [{"role": "user", "content": "Name a colour, please, any colour."}, {"role": "assistant", "content": "Blue."}]},
    {"messages": [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "1 2 3 4 5 6 7 8 9 10"}]},
]


# --------------------------------------------------------------------------- helpers


def sft_config(tmp_path: Path, *overrides: str) -> SFTMasterConfig:
    """``sft.yaml`` cut down to a few fast steps: no validation, no checkpoints."""
    base = [
        *short_run_overrides(tmp_path),
        "validation.generate_strategy.max_length=8",
        "checkpointing.enabled=false",
        "training.batch_size=8",
        "training.warmup_steps=0",
        "training.max_num_steps=3",
        "training.val_freq=0",
        "training.save_freq=0",
    ]
    return load_config(SFTMasterConfig, SFT_CONFIG, base + list(overrides))


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def train_records(log_dir: Path) -> list[dict]:
    return [record for record in read_jsonl(log_dir / "metrics.jsonl") if "train/loss" in record]


def val_records(log_dir: Path) -> list[dict]:
    return [record for record in read_jsonl(log_dir / "metrics.jsonl") if "val/mean_response_length" in record]


def encode_chat(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids) computed here, not with opd's data code.

    The tiny tokenizer is byte-level and its ChatML template closes the assistant turn
    with ``<|im_end|>`` (the EOS), so the response is the answer's bytes followed by EOS.
    """
    prompt_text = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    prompt_ids = list(tokenizer(prompt_text, add_special_tokens=False)["input_ids"])
    answer_ids = list(tokenizer(messages[-1]["content"], add_special_tokens=False)["input_ids"])
    return prompt_ids, answer_ids + [tokenizer.eos_token_id]


def teacher_forced_nll(model: torch.nn.Module, sequences: list[tuple[list[int], list[int]]]) -> float:
    """Mean NLL per response token: each response scored after its prompt, one row at a time."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for prompt_ids, response_ids in sequences:
            ids = torch.tensor([prompt_ids + response_ids])
            log_probs = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0].float(), dim=-1)
            # The logits at position t predict token t + 1.
            positions = torch.arange(len(prompt_ids) - 1, len(prompt_ids) + len(response_ids) - 1)
            targets = torch.tensor(response_ids)
            total -= float(log_probs[positions, targets].sum())
            count += len(response_ids)
    model.train(was_training)
    return total / count


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def spy_on_nll_loss(monkeypatch) -> list[dict]:
    """Records every call of ``NLLLossFn.loss_and_metrics`` (inputs and returned metrics, read)."""
    calls: list[dict] = []
    original = NLLLossFn.loss_and_metrics

    def spy(self, student_logits, data, global_valid_tokens, global_valid_seqs, teacher_output=None):
        loss, metrics = original(self, student_logits, data, global_valid_tokens, global_valid_seqs,
                                 teacher_output=teacher_output)
        calls.append({
            "input_ids": data["input_ids"].detach().clone(),
            "token_mask": data["token_mask"].detach().clone(),
            "input_lengths": data["input_lengths"].detach().clone(),
            "global_valid_tokens": global_valid_tokens,
            "global_valid_seqs": global_valid_seqs,
            "teacher_output": teacher_output,
            "metrics": read_metrics(metrics),
        })
        return loss, metrics

    monkeypatch.setattr(NLLLossFn, "loss_and_metrics", spy)
    return calls


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module", autouse=True)
def one_intra_op_thread():
    """Runs this module's in-process work on one thread, then restores the setting.

    The tiny models gain nothing from intra-op threads, and on a busy machine (this
    module's own subprocesses run alongside) OpenMP threads waiting for each other make a
    10 ms step take 0.3 s.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------- SFT learns

LEARN_STEPS = 30
HELD_OUT = 16


@pytest.fixture(scope="module")
def learned(tmp_path_factory):
    """A 30-step run with validation at start and end; the held-out NLL before and after."""
    tmp_path = tmp_path_factory.mktemp("learn")
    config = sft_config(
        tmp_path,
        f"training.max_num_steps={LEARN_STEPS}",
        f"data.val_path={VAL_DATA}",
        f"data.max_val_examples={HELD_OUT}",
        "validation.val_at_start=true",
        "validation.val_at_end=true",
    )
    tokenizer = build_tiny_tokenizer()
    held_out_rows = read_jsonl(VAL_DATA)[:HELD_OUT]
    held_out = [encode_chat(tokenizer, row["messages"]) for row in held_out_rows]
    parts = setup(config)
    policy = parts.policy
    initial = snapshot(policy.model)
    nll_before = teacher_forced_nll(policy.model, held_out)
    sft_train(parts)
    return {"config": config, "policy": policy, "initial": initial, "held_out": held_out, "nll_before": nll_before}


def test_sft_lowers_the_training_loss(learned):
    records = train_records(Path(learned["config"].logger.log_dir))
    assert [record["step"] for record in records] == list(range(1, LEARN_STEPS + 1))
    losses = [record["train/loss"] for record in records]
    assert all(math.isfinite(loss) and loss > 0 for loss in losses)
    assert not any(record["train/skipped_nonfinite"] for record in records)
    last_five = sum(losses[-5:]) / 5
    assert last_five < 0.5 * losses[0], f"loss did not fall enough: first {losses[0]:.3f}, last five {last_five:.3f}"
    # A near-uniform tiny model starts near log(vocab size) per token.
    assert losses[0] == pytest.approx(math.log(259), rel=0.05)


def test_sft_lowers_held_out_nll_of_the_final_model(learned):
    from transformers import AutoModelForCausalLM

    final_dir = Path(learned["config"].output_dir) / "final_model"
    final = AutoModelForCausalLM.from_pretrained(final_dir)
    # The saved model is the trained one, not the initialisation.
    trained = dict(learned["policy"].model.named_parameters())
    for name, param in final.named_parameters():
        torch.testing.assert_close(param.detach(), trained[name].detach(), rtol=0, atol=0)
    # The initial weights are the deterministic tiny:student.
    fresh = dict(build_tiny_model("student").named_parameters())
    for name, param in learned["initial"].items():
        torch.testing.assert_close(param, fresh[name].detach(), rtol=0, atol=0)

    nll_before = learned["nll_before"]
    nll_after = teacher_forced_nll(final, learned["held_out"])
    assert nll_before == pytest.approx(math.log(259), rel=0.05)
    assert nll_after < 0.6 * nll_before, f"held-out NLL {nll_before:.3f} -> {nll_after:.3f}"


def test_num_valid_tokens_is_the_summed_response_length(learned):
    config = learned["config"]
    for record in train_records(Path(config.logger.log_dir)):
        summed = record["train/mean_response_length"] * config.training.batch_size
        assert record["train/num_valid_tokens"] == pytest.approx(summed, abs=1e-6), record["step"]


def test_validation_reports_accuracy_and_no_teacher_kl(learned):
    records = val_records(Path(learned["config"].logger.log_dir))
    assert [record["step"] for record in records] == [0, LEARN_STEPS]
    for record in records:
        assert "val/accuracy" in record, record
        assert 0.0 <= record["val/accuracy"] <= 1.0
        assert not [key for key in record if key.startswith("val/kl_")], record
        assert not [key for key in record if key.startswith("val/teacher_")], record
        # validation.generate_strategy.max_length = 8 caps the answers.
        assert 0 < record["val/mean_response_length"] <= 8
    for record in train_records(Path(learned["config"].logger.log_dir)):
        assert not [key for key in record if "kl" in key], record


def test_validation_accuracy_grades_every_val_example(tmp_path, monkeypatch):
    """val/accuracy is the share of the val answers the verifier accepts."""
    import opd.rollout.environments.math_verifier as math_verifier

    graded: list[str] = []

    def accept_even(response: str, ground_truth: str) -> bool:
        graded.append(ground_truth)
        return int(ground_truth) % 2 == 0

    monkeypatch.setattr(math_verifier, "is_correct", accept_even)
    config = sft_config(tmp_path, "training.max_num_steps=1", f"data.val_path={VAL_DATA}",
                        "data.max_val_examples=6", "validation.val_at_end=true", "validation.batch_size=4")
    sft_train(setup(config))
    truths = [row["ground_truth"] for row in read_jsonl(VAL_DATA)[:6]]
    assert graded == truths
    [record] = val_records(Path(config.logger.log_dir))
    assert record["val/accuracy"] == pytest.approx(sum(int(t) % 2 == 0 for t in truths) / 6)


# --------------------------------------------------------------------------- what the loss covers


def test_loss_covers_exactly_the_assistant_answer(tmp_path, monkeypatch, tokenizer):
    answer = "Déjà vu: 12 + 30 = 42."  # two 2-byte characters: 24 bytes
    row = {
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What is 12 + 30?"},
            {"role": "assistant", "content": answer},
        ],
        "ground_truth": "42",
    }
    data = write_jsonl(tmp_path / "one.jsonl", [row])
    calls = spy_on_nll_loss(monkeypatch)
    config = sft_config(tmp_path, f"data.train_path={data}", "training.batch_size=1", "training.max_num_steps=2")
    sft_train(setup(config))

    prompt_ids, response_ids = encode_chat(tokenizer, row["messages"])
    response_length = len(answer.encode("utf-8")) + 1  # the answer's bytes and EOS
    assert len(response_ids) == response_length
    # opd's tokenization agrees with the independent one.
    [prepared] = prepare_examples([row], tokenizer, None, str(data))
    assert (prepared["prompt_ids"], prepared["response_ids"]) == (prompt_ids, response_ids)

    assert len(calls) == 2  # one micro-batch per step
    for call in calls:
        ids, mask = call["input_ids"][0], call["token_mask"][0]
        assert ids.tolist() == prompt_ids + response_ids
        assert call["teacher_output"] is None
        assert call["global_valid_seqs"] == 1
        assert call["global_valid_tokens"] == response_length
        assert call["metrics"]["num_valid_tokens"] == response_length
        # The tokens the loss is taken on are the answer followed by EOS, nothing else.
        targets = ids[1:][mask[1:].bool()].tolist()
        assert targets == response_ids
        assert tokenizer.decode(targets) == answer + tokenizer.eos_token
        assert mask[: len(prompt_ids)].sum() == 0

    records = train_records(Path(config.logger.log_dir))
    assert [record["train/num_valid_tokens"] for record in records] == [response_length] * 2
    assert [record["train/mean_response_length"] for record in records] == [response_length] * 2


def test_prompt_and_padding_logits_cannot_change_the_loss(tokenizer):
    examples = prepare_examples(VARIED_ROWS, tokenizer, None, "varied")
    batch = build_fixed_data_batch(examples, tokenizer.pad_token_id, mask_prompt_tokens=True)
    width = batch["input_ids"].shape[1]
    prompt_lengths = [len(example["prompt_ids"]) for example in examples]
    lengths = [len(example["prompt_ids"]) + len(example["response_ids"]) for example in examples]
    assert len(set(lengths)) == len(lengths) and max(lengths) == width  # every row but one is padded
    total_tokens = sum(len(example["response_ids"]) for example in examples)

    torch.manual_seed(0)
    logits = torch.randn(len(examples), width, len(tokenizer)) * 3
    loss_fn = NLLLossFn()
    leaf = logits.clone().requires_grad_(True)
    loss, metrics = loss_fn(leaf, batch, total_tokens, len(examples))
    loss.backward()
    assert metrics["num_valid_tokens"] == total_tokens

    # The loss by hand: the logits at t - 1 predict the response token t.
    log_probs = torch.log_softmax(logits.double(), dim=-1)
    expected = 0.0
    for row, example in enumerate(examples):
        for offset, token in enumerate(example["response_ids"]):
            expected -= float(log_probs[row, prompt_lengths[row] + offset - 1, token])
    assert float(loss.detach()) == pytest.approx(expected / total_tokens, rel=1e-5)

    # Positions before p - 1 predict prompt tokens; positions from length - 1 on predict
    # past the end (the last token's logits, then padding): none may carry loss or gradient.
    free = torch.zeros(len(examples), width, dtype=torch.bool)
    for row in range(len(examples)):
        free[row, : prompt_lengths[row] - 1] = True
        free[row, lengths[row] - 1 :] = True
    assert float(leaf.grad[free].abs().max()) == 0.0
    assert bool((leaf.grad[~free].abs().sum(dim=-1) > 0).all())

    scrambled = logits.clone()
    scrambled[free] = torch.randn(int(free.sum()), len(tokenizer)) * 50
    scrambled_loss, _ = loss_fn(scrambled, batch, total_tokens, len(examples))
    assert float(scrambled_loss) == float(loss.detach())

    # Control: the logits that predict the first answer token do count.
    moved = logits.clone()
    moved[0, prompt_lengths[0] - 1] += torch.randn(len(tokenizer)) * 50
    moved_loss, _ = loss_fn(moved, batch, total_tokens, len(examples))
    assert float(moved_loss) != float(loss.detach())


# --------------------------------------------------------------------------- gradient accumulation


def accumulation_batch(tokenizer):
    rows = read_jsonl(TRAIN_DATA)[:4] + VARIED_ROWS
    examples = prepare_examples(rows, tokenizer, None, "accumulation")
    return build_fixed_data_batch(examples, tokenizer.pad_token_id, mask_prompt_tokens=True)


def sft_steps(batch, micro_batch_size: int, steps: int = 2):
    """Trains a float64 tiny:student ``steps`` AdamW steps on ``batch`` (with clipping)."""
    # float64: Adam's first update is lr·g/(|g| + eps), which would turn float32
    # summation-order noise in near-zero gradients into visible weight differences.
    model = build_tiny_model("student", dtype=torch.float64)
    policy = HFPolicy(model, OptimizerConfig(learning_rate=1e-3, warmup_steps=0, max_grad_norm=1.0),
                      micro_batch_size=micro_batch_size, total_steps=steps)
    metrics = [policy.train(batch, NLLLossFn()) for _ in range(steps)]
    return metrics, snapshot(model)


def test_gradient_accumulation_matches_one_large_batch(tokenizer):
    batch = accumulation_batch(tokenizer)
    assert batch.size == 8
    initial = snapshot(build_tiny_model("student", dtype=torch.float64))
    reference_metrics, reference_params = sft_steps(batch, 8)
    assert max(float((reference_params[n] - initial[n]).abs().max()) for n in initial) > 1e-4
    assert reference_metrics[0]["grad_norm"] > 1.0, "clipping must act for the test to cover it"
    assert reference_metrics[0]["num_valid_tokens"] == float(batch["response_lengths"].sum())

    for micro_batch_size in (2, 3):
        metrics, params = sft_steps(batch, micro_batch_size)
        for step, (got, expected) in enumerate(zip(metrics, reference_metrics)):
            for key in ("loss", "num_valid_tokens", "grad_norm", "lr"):
                assert got[key] == pytest.approx(expected[key], rel=1e-9, abs=1e-12), (micro_batch_size, step, key)
        for name, param in reference_params.items():
            torch.testing.assert_close(params[name], param, rtol=0, atol=1e-8)


def test_micro_batch_size_setting_splits_each_step(tmp_path, monkeypatch):
    calls = spy_on_nll_loss(monkeypatch)
    config = sft_config(tmp_path, "training.micro_batch_size=2", "training.max_num_steps=2")
    sft_train(setup(config))
    assert len(calls) == 2 * 4
    records = train_records(Path(config.logger.log_dir))
    for step, record in enumerate(records):
        step_calls = calls[4 * step : 4 * step + 4]
        assert all(call["input_ids"].shape[0] == 2 for call in step_calls)
        # Every micro-batch normalises by the valid tokens of the whole step.
        assert {call["global_valid_tokens"] for call in step_calls} == {record["train/num_valid_tokens"]}
        assert sum(call["metrics"]["num_valid_tokens"] for call in step_calls) == record["train/num_valid_tokens"]
        assert sum(call["metrics"]["loss"] for call in step_calls) == pytest.approx(record["train/loss"], rel=1e-6)


# --------------------------------------------------------------------------- user mistakes


def test_example_without_assistant_message_is_a_config_error(tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"}]},
        {"messages": [{"role": "user", "content": "2 + 2?"}]},
        {"messages": [{"role": "user", "content": "3 + 3?"}, {"role": "assistant", "content": "6"}]},
    ]
    data = write_jsonl(tmp_path / "no_answer.jsonl", rows)
    config = sft_config(tmp_path, f"data.train_path={data}", "training.batch_size=1")
    with pytest.raises(ConfigError) as error:
        setup(config)
    message = str(error.value)
    assert str(data) in message
    assert "1 of 3" in message
    assert "assistant" in message


def test_batch_larger_than_the_data_is_a_config_error(tmp_path):
    config = sft_config(tmp_path, "data.max_train_examples=5", "training.batch_size=8")
    with pytest.raises(ConfigError) as error:
        setup(config)
    message = str(error.value)
    assert "training.batch_size" in message
    assert "5" in message
    assert str(TRAIN_DATA) in message


# --------------------------------------------------------------------------- subprocess runs

RESUME_STEPS = 8
KILL_AFTER_STEP = 5
# 40 examples in batches of 8: 5 steps an epoch, so the kill after step 5 resumes from the
# mid-epoch checkpoint at step 4 and the redone steps cross the epoch boundary.
RESUME_OVERRIDES = [
    f"data.train_path={TRAIN_DATA}",
    f"data.val_path={VAL_DATA}",
    "data.max_train_examples=40",
    "data.max_val_examples=4",
    "training.batch_size=8",
    "training.num_epochs=2",
    f"training.max_num_steps={RESUME_STEPS}",
    "training.save_freq=2",
    "training.val_freq=3",
    "validation.val_at_start=false",
    "validation.val_at_end=true",
    "validation.generate_strategy.max_length=8",
]
CLI_RUN_STEPS = 3


def Process(name: str, command: list[str], workdir: Path) -> BackgroundProcess:
    """Starts ``command`` in the background with this module's environment and timeout."""
    return BackgroundProcess(name, command, workdir, SUBPROCESS_ENV, PROCESS_TIMEOUT)


def logged_steps(log_dir: Path) -> list[int]:
    """Steps of the training records so far; empty while a line is still being written."""
    try:
        return [record["step"] for record in train_records(log_dir)]
    except json.JSONDecodeError:
        return []


def sft_argv(output_dir: Path) -> list[str]:
    return ["sft", "--config", str(SFT_CONFIG), f"output_dir={output_dir}", *RESUME_OVERRIDES]


@pytest.fixture(scope="module", autouse=True)
def started_runs(request, tmp_path_factory):
    """Starts every subprocess scenario when the module's first test runs.

    The processes spend most of their time importing torch; started first, they do that
    while the in-process tests run. A thread SIGKILLs the run paused after step 5 and
    reruns its command at once. Nothing is started when no selected test needs it.
    """
    if not any("runs" in item.fixturenames for item in request.session.items if item.module is request.module):
        yield None
        return
    tmp_path = tmp_path_factory.mktemp("sft_runs")
    dirs = {name: tmp_path / name for name in ("reference", "killed", "cli")}
    python = sys.executable
    hooks = {"pause_after_step": KILL_AFTER_STEP, "release_file": str(tmp_path / "never_released"),
             "pause_seconds": PROCESS_TIMEOUT}
    processes: dict[str, Process] = {}
    outcome: dict = {}

    def kill_and_resume() -> None:
        try:
            killed = processes["killed"]
            # The runner holds the run right after step 5's record is written, so the kill
            # cannot land anywhere else.
            killed.wait_until(lambda: KILL_AFTER_STEP in logged_steps(dirs["killed"] / "logs"),
                              f"the training record of step {KILL_AFTER_STEP}")
            killed.popen.send_signal(signal.SIGKILL)
            killed.popen.wait()
            outcome["at_kill"] = {
                "returncode": killed.popen.returncode,
                "steps": [r["step"] for r in train_records(dirs["killed"] / "logs")],
                "checkpoints": sorted(p.name for p in (dirs["killed"] / "checkpoints").glob("step_*")),
                "final_model": (dirs["killed"] / "final_model").exists(),
            }
            # The very same command again resumes.
            processes["resumed"] = Process("resumed", [python, "-m", "opd", *sft_argv(dirs["killed"])], tmp_path)
        except BaseException as error:  # reported by the tests that need the resumed run
            outcome["error"] = error

    try:
        processes["reference"] = Process("reference", [python, "-m", "opd", *sft_argv(dirs["reference"])], tmp_path)
        processes["killed"] = Process(
            "killed", [python, str(RUNNER), json.dumps(hooks), *sft_argv(dirs["killed"])], tmp_path
        )
        processes["bad_value"] = Process(
            "bad_value",
            [python, "-m", "opd", "sft", "--config", "examples/configs/sft.yaml", f"output_dir={tmp_path / 'bad'}",
             "training.batch_size=0"],
            tmp_path,
        )
        processes["wrapper"] = Process(
            "wrapper",
            [python, str(RUN_SFT), "--config", str(SFT_CONFIG), f"output_dir={dirs['cli']}",
             f"training.max_num_steps={CLI_RUN_STEPS}", "data.max_val_examples=4",
             "validation.generate_strategy.max_length=8", "training.save_freq=2"],
            tmp_path,
        )
        driver = threading.Thread(target=kill_and_resume, daemon=True)
        driver.start()
        yield {"dirs": dirs, "processes": processes, "driver": driver, "outcome": outcome}
    finally:
        for process in list(processes.values()):
            process.stop_if_running()


@pytest.fixture(scope="module")
def runs(started_runs):
    """Waits for every subprocess scenario (the resumed run included)."""
    started_runs["driver"].join(PROCESS_TIMEOUT)
    outcome = started_runs["outcome"]
    if "error" in outcome:
        raise outcome["error"]
    assert "at_kill" in outcome, "the kill-and-resume driver did not finish"
    for process in started_runs["processes"].values():
        process.wait()
    return {"dirs": started_runs["dirs"], "processes": started_runs["processes"], "at_kill": outcome["at_kill"]}


def test_cli_bad_value_is_one_error_line(runs):
    result = runs["processes"]["bad_value"]
    assert result.popen.returncode == 2, result.output()
    assert "Traceback" not in result.stderr + result.stdout
    lines = [line for line in result.stderr.splitlines() if line.startswith(ERROR_PREFIX)]
    assert len(lines) == 1, result.output()
    assert "training.batch_size" in lines[0]


def test_run_sft_wrapper_writes_model_logs_curves_and_summary(runs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    process = runs["processes"]["wrapper"]
    assert process.popen.returncode == 0, process.output()
    assert "Traceback" not in process.stderr
    output_dir = runs["dirs"]["cli"]
    final_dir = output_dir / "final_model"
    model = AutoModelForCausalLM.from_pretrained(final_dir)
    tokenizer = AutoTokenizer.from_pretrained(final_dir)
    assert tokenizer.get_vocab() == build_tiny_tokenizer().get_vocab()
    fresh = dict(build_tiny_model("student").named_parameters())
    change = max(float((param.detach() - fresh[name].detach()).abs().max()) for name, param in model.named_parameters())
    assert change > 1e-5, "final_model must hold the fine-tuned weights"

    logs = output_dir / "logs"
    records = train_records(logs)
    assert [record["step"] for record in records] == list(range(1, CLI_RUN_STEPS + 1))
    assert all(math.isfinite(record["train/loss"]) for record in records)
    assert [record["step"] for record in val_records(logs)] == [0, CLI_RUN_STEPS]
    curves = logs / "curves.png"
    assert curves.is_file() and curves.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = logs / "summary.txt"
    assert summary.is_file() and summary.read_text().strip()
    assert "curves:" in process.stdout, process.output()


def test_killed_run_resumes_to_the_uninterrupted_result(runs):
    dirs, processes, at_kill = runs["dirs"], runs["processes"], runs["at_kill"]
    for name in ("reference", "resumed"):
        assert processes[name].popen.returncode == 0, processes[name].output()
    # The kill landed after step 5 was logged, with step 4 the newest checkpoint.
    assert at_kill["returncode"] == -signal.SIGKILL
    assert at_kill["steps"] == list(range(1, KILL_AFTER_STEP + 1))
    assert "step_4" in at_kill["checkpoints"] and "step_6" not in at_kill["checkpoints"]
    assert not at_kill["final_model"]

    reference, resumed = train_records(dirs["reference"] / "logs"), train_records(dirs["killed"] / "logs")
    assert [record["step"] for record in resumed] == list(range(1, RESUME_STEPS + 1)), "each step logged once"
    assert [record["step"] for record in reference] == list(range(1, RESUME_STEPS + 1))
    for key in ("train/loss", "train/num_valid_tokens", "train/grad_norm", "train/lr", "train/epoch"):
        assert [r[key] for r in resumed] == [r[key] for r in reference], key
    assert [r["train/epoch"] for r in reference] == [0] * 5 + [1] * 3

    reference_val = [(r["step"], r["val/accuracy"], r["val/mean_response_length"]) for r in val_records(dirs["reference"] / "logs")]
    resumed_val = [(r["step"], r["val/accuracy"], r["val/mean_response_length"]) for r in val_records(dirs["killed"] / "logs")]
    assert [step for step, _, _ in reference_val] == [3, 6, RESUME_STEPS]
    assert resumed_val == reference_val

    expected = load_file(str(dirs["reference"] / "final_model" / "model.safetensors"))
    actual = load_file(str(dirs["killed"] / "final_model" / "model.safetensors"))
    assert actual.keys() == expected.keys()
    differing = [name for name in expected if not torch.equal(actual[name], expected[name])]
    assert not differing, f"{len(differing)} tensors of the final model differ from the uninterrupted run"
    assert (dirs["killed"] / "checkpoints" / f"step_{RESUME_STEPS}").is_dir()


# --------------------------------------------------------------------------- known gaps


def test_rerun_without_checkpoints_refuses_to_overwrite_final_model(tmp_path):
    config = sft_config(tmp_path, "training.max_num_steps=1")  # checkpointing disabled
    sft_train(setup(config))
    final_model = Path(config.output_dir) / "final_model" / "model.safetensors"
    before = final_model.read_bytes()
    try:
        with pytest.raises(ConfigError, match="final_model"):
            setup(config.model_copy(update={"training": config.training.model_copy(update={"learning_rate": 1e-2})}))
    finally:
        assert final_model.read_bytes() == before


def test_resume_with_a_changed_config_warns(tmp_path, caplog):
    config = sft_config(tmp_path, "checkpointing.enabled=true", "training.save_freq=1", "training.max_num_steps=2")
    sft_train(setup(config))
    changed = sft_config(tmp_path, "checkpointing.enabled=true", "training.save_freq=1", "training.max_num_steps=4",
                         "training.learning_rate=1e-2")
    with caplog.at_level(logging.WARNING, logger="opd"):
        setup(changed)
    warnings = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    assert any("training.learning_rate" in message for message in warnings), warnings


# --------------------------------------------------------------------------- time budget


def test_time_budget_ends_the_run_like_its_last_step(tmp_path, monkeypatch):
    """training.max_train_time_s stops at the first step past the budget, then ends normally.

    Each step is made to take at least 0.05 s, so a 0.12 s budget is crossed by step 3 at
    the latest (sooner if the real work is slow) and long before the 20 planned steps. The
    run writes its final model and a checkpoint of the step it ended on; rerunning the
    same command finds the run complete instead of training on.
    """
    import opd.sft as sft_module

    real_train = sft_module.HFPolicy.train

    def slow_train(self, *args, **kwargs):
        time.sleep(0.05)
        return real_train(self, *args, **kwargs)

    monkeypatch.setattr(sft_module.HFPolicy, "train", slow_train)
    run = tmp_path / "run"
    overrides = ["training.max_num_steps=20", "training.max_train_time_s=0.12", "checkpointing.enabled=true"]
    sft_train(setup(sft_config(tmp_path, *overrides)))
    steps = [record["step"] for record in read_jsonl(run / "logs" / "metrics.jsonl") if "train/loss" in record]
    assert 1 <= len(steps) <= 3 and steps == list(range(1, len(steps) + 1))
    saved = json.loads((run / "checkpoints" / f"step_{steps[-1]}" / "save_state.json").read_text())
    assert saved["step"] == steps[-1] and saved["train_time_s"] >= 0.12
    assert (run / "final_model" / "config.json").is_file()

    sft_train(setup(sft_config(tmp_path, *overrides)))  # the rerun resumes into a complete run
    steps_after = [record["step"] for record in read_jsonl(run / "logs" / "metrics.jsonl") if "train/loss" in record]
    assert steps_after == steps
