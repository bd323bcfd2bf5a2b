"""The driver's in-process path with ``environment:``: multi-turn rollouts are trained on.

A short run of the tiny config with the calculator environment. The tiny random student
never writes a tool call on its own, so its engine's first turn of every episode is
replaced by a calculator call (the engine is wrapped, nothing else): the environment runs
the call, the observation is appended, and the real engine writes the second turn. The
test checks what reaches the teacher and the trainer (prompts that list the tool, a
``token_mask`` with the observation as a hole, the sampler's log-probs only on the
student's tokens) and that the episode metrics are logged. Under ``one_step_off`` (in one
process: the engine is a snapshot refit a step behind) the rollout runs to its end when
its batch is started, and is trained a step later. A one_step_off run killed during step 3
resumes from step 2's checkpoint, which holds step 3's episodes sampled ahead, and trains
what the uninterrupted run trains (sampled turns: the RNG streams and the in-flight
episodes must both be restored), bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from opd_test_helpers import REPO_ROOT, first_turn_calls_the_tool, short_run_overrides

from opd.distillation.config import MasterConfig
from opd.distillation.setup import setup
from opd.distillation.step import distillation_train
from opd.utils.config import load_config

TINY_CONFIG = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'


@pytest.mark.parametrize("scheduler", ["sync", "one_step_off"])
def test_run_trains_on_multi_turn_rollouts(tmp_path, scheduler):
    overrides = [
        f"training.scheduler={scheduler}",
        *short_run_overrides(tmp_path),
        "checkpointing.enabled=false",
        "training.batch_size=2",
        "training.micro_batch_size=null",
        "training.warmup_steps=0",
        "training.max_num_steps=2",
        "distillation.num_samples_per_prompt=1",
        "distillation.generate_strategy.max_length=6",
        "environment.max_turns=2",
        "data.max_train_examples=4",
        "loss_fn.compile_kernels=false",  # compiling the loss kernels would take most of the test
        "data.max_prompt_length=1024",  # the tools section is about 700 bytes of the byte-level tokenizer
    ]
    config = load_config(MasterConfig, TINY_CONFIG, overrides)
    parts = setup(config)
    tokenizer, generation = parts.tokenizer, parts.student_generation
    first_turn_calls_the_tool(generation, tokenizer, CALL)
    scored = []
    real_score = parts.teacher_policy.score

    def recording_score(batch, request):
        scored.append({key: batch[key].clone() for key in ("input_ids", "input_lengths", "token_mask")})
        return real_score(batch, request)

    parts.teacher_policy.score = recording_score  # type: ignore[method-assign]
    distillation_train(parts)

    assert scored, "the teacher scored the trajectories"
    for batch in scored:
        for row in range(batch["input_ids"].shape[0]):
            length = int(batch["input_lengths"][row])
            text = tokenizer.decode(batch["input_ids"][row, :length])
            assert '"name": "calculator"' in text.split("<|im_start|>user")[0], "the prompt lists the tool"
            assert "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>" in text, "the tool's answer"
            mask = batch["token_mask"][row, :length]
            changes = int((mask[1:] != mask[:-1]).sum())
            assert changes >= 2, "the observation between the turns is a hole in the mask"
    records = [json.loads(line) for line in (Path(config.logger.log_dir) / "metrics.jsonl").read_text().splitlines()]
    train = [record for record in records if "train/on_policy" in record]
    assert len(train) == 2
    for record in train:
        assert record["env/turns"] == 2.0 and record["env/tool_calls"] == 1.0
        assert record["env/well_formed_share"] == 1.0 and record["env/success_share"] == 1.0
        assert record["timing/environment"] >= 0.0 and "env/reward" in record
        assert torch.isfinite(torch.tensor(record["train/loss"]))


class Crash(RuntimeError):
    """Stands for the process dying in the middle of a step."""


def killed_run_config(tmp_path: Path, run_name: str) -> MasterConfig:
    """5 steps of one_step_off with 2-turn episodes, sampled (the RNG streams matter), a checkpoint every 2 steps."""
    return load_config(MasterConfig, TINY_CONFIG, [
        "training.scheduler=one_step_off",
        *short_run_overrides(tmp_path, run_name),
        "checkpointing.enabled=true",
        "checkpointing.keep_top_k=null",
        "training.save_freq=2",
        "training.batch_size=2",
        "training.micro_batch_size=null",
        "training.warmup_steps=0",
        "training.max_num_steps=5",
        "training.learning_rate=0.05",
        "distillation.num_samples_per_prompt=1",
        "distillation.generate_strategy.decoding_method=top_p",
        "distillation.generate_strategy.temperature=1.0",
        "distillation.generate_strategy.max_length=6",
        "environment.max_turns=2",
        "data.max_train_examples=12",
        "loss_fn.compile_kernels=false",
        "data.max_prompt_length=1024",
    ])


def test_a_run_killed_with_episodes_in_flight_resumes_to_the_uninterrupted_run(tmp_path):
    # The reference: 5 uninterrupted steps.
    reference_config = killed_run_config(tmp_path, "reference")
    reference = setup(reference_config)
    first_turn_calls_the_tool(reference.student_generation, reference.tokenizer, CALL)
    distillation_train(reference)

    # The same run killed during step 3: step_2's checkpoint holds step 3's episodes, sampled ahead.
    config = killed_run_config(tmp_path, "killed")
    first = setup(config)
    first_turn_calls_the_tool(first.student_generation, first.tokenizer, CALL)
    original, steps = first.student_policy.train, []

    def crash_at_step_3(batch, loss_fn, teacher_signal=None, timer=None):
        steps.append(batch)
        if len(steps) == 3:
            raise Crash("killed during step 3")
        return original(batch, loss_fn, teacher_signal, timer)

    first.student_policy.train = crash_at_step_3  # type: ignore[method-assign]
    with pytest.raises(Crash):
        distillation_train(first)
    first.close()

    resumed = setup(config)
    assert resumed.distillation_save_state["step"] == 2
    first_turn_calls_the_tool(resumed.student_generation, resumed.tokenizer, CALL)
    distillation_train(resumed)

    def logged(run_config: MasterConfig) -> list[dict]:
        lines = (Path(run_config.logger.log_dir) / "metrics.jsonl").read_text().splitlines()
        return [record for record in map(json.loads, lines) if "train/loss" in record]

    expected, actual = logged(reference_config), logged(config)
    assert [record["step"] for record in expected] == [1, 2, 3, 4, 5]
    by_step = {record["step"]: record for record in actual}  # steps 1-2 from the killed run, 3-5 resumed
    for record in expected:
        mine = by_step[record["step"]]
        assert mine["train/loss"] == record["train/loss"], record["step"]
        assert mine["env/turns"] == record["env/turns"] == 2.0
    final = resumed.student_policy.model.state_dict()
    for name, tensor in reference.student_policy.model.state_dict().items():
        assert torch.equal(final[name], tensor), name


def test_fixed_data_steps_train_on_recorded_episodes_with_the_assistant_turns_alone(tmp_path):
    episode = [
        {"role": "user", "content": "What is 6 * 7?"},
        {"role": "assistant", "content": CALL},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "\\boxed{42}"},
    ]
    data = tmp_path / "episodes.jsonl"
    data.write_text("".join(json.dumps({"messages": episode, "ground_truth": "42"}) + "\n" for _ in range(4)))
    config = load_config(MasterConfig, TINY_CONFIG, [
        *short_run_overrides(tmp_path),
        f"data.train_path={data}",
        "checkpointing.enabled=false",
        "training.batch_size=2",
        "training.micro_batch_size=null",
        "training.warmup_steps=0",
        "training.max_num_steps=2",
        "distillation.lambda=0.0",  # every step draws the recorded episodes
        "environment.max_turns=2",
        "loss_fn.compile_kernels=false",
        "data.max_prompt_length=1024",
    ])
    parts = setup(config)
    scored = []
    real_score = parts.teacher_policy.score

    def recording_score(batch, request):
        scored.append({key: batch[key].clone() for key in ("input_ids", "input_lengths", "prompt_lengths", "token_mask")})
        return real_score(batch, request)

    parts.teacher_policy.score = recording_score  # type: ignore[method-assign]
    distillation_train(parts)
    tokenizer = parts.tokenizer
    assert scored
    for batch in scored:
        for row in range(batch["input_ids"].shape[0]):
            start, end = int(batch["prompt_lengths"][row]), int(batch["input_lengths"][row])
            ids, mask = batch["input_ids"][row, start:end], batch["token_mask"][row, start:end]
            learned = tokenizer.decode(ids[mask.bool()])
            assert learned == CALL + "<|im_end|>" + "\\boxed{42}<|im_end|>"  # the two assistant turns, nothing else
            assert "<tool_response>\n42\n</tool_response>" in tokenizer.decode(ids[~mask.bool()])
    records = [json.loads(line) for line in (Path(config.logger.log_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [record["train/on_policy"] for record in records if "train/on_policy" in record] == [0.0, 0.0]


def test_validation_plays_episodes_for_the_student_and_the_baselines(tmp_path):
    """With ``environment:``, validation (and the teacher / student-before baselines) runs whole
    episodes through the training rollout: the tool's result reaches the episode, the teacher
    scores the student's turns only, and the episode metrics are logged under each prefix."""
    config = load_config(MasterConfig, TINY_CONFIG, [
        *short_run_overrides(tmp_path),
        f"data.val_path={REPO_ROOT / 'examples' / 'data' / 'tiny_arithmetic' / 'val.jsonl'}",
        "data.max_val_examples=2",
        "data.max_train_examples=2",
        "data.max_prompt_length=1024",
        "validation.val_at_start=true",
        "validation.generate_strategy.max_length=6",
        "validation.teacher_baseline=true",
        "validation.eval_baseline=true",
        "distillation.teacher_context=Answer with the number only.",  # the teacher's baseline uses its own prompt
        "checkpointing.enabled=false",
        "training.batch_size=2",
        "training.micro_batch_size=null",
        "training.warmup_steps=0",
        "training.max_num_steps=1",
        "distillation.num_samples_per_prompt=1",
        "distillation.generate_strategy.max_length=6",
        "environment.max_turns=2",
        "loss_fn.compile_kernels=false",
    ])
    parts = setup(config)
    first_turn_calls_the_tool(parts.student_generation, parts.tokenizer, CALL)
    for engine in parts.teacher_generation:
        first_turn_calls_the_tool(engine.generation, engine.tokenizer, CALL)
    scored = []
    real_score_async = parts.teacher_policy.score_async

    def recording_score_async(batch, request):  # how validation and each step ask the teacher
        scored.append({key: batch[key].clone() for key in ("input_ids", "input_lengths", "token_mask")})
        scored[-1]["teacher_prompt_ids"] = batch["teacher_prompt_ids"]
        return real_score_async(batch, request)

    parts.teacher_policy.score_async = recording_score_async  # type: ignore[method-assign]
    distillation_train(parts)

    for batch in scored:  # the teacher's own prompt (with its context) lists the tools too
        for prompt in batch["teacher_prompt_ids"]:
            assert '"name": "calculator"' in parts.tokenizer.decode(prompt)
    # The first batch the teacher scores is the start validation's: episodes, with the tool's answer.
    validation_batch, tokenizer = scored[0], parts.tokenizer
    for row in range(validation_batch["input_ids"].shape[0]):
        length = int(validation_batch["input_lengths"][row])
        text = tokenizer.decode(validation_batch["input_ids"][row, :length])
        assert "<tool_response>\n42\n</tool_response>" in text
        mask = validation_batch["token_mask"][row, :length]
        assert int((mask[1:] != mask[:-1]).sum()) >= 2, "the observation is a hole in validation's KL mask"
    records = [json.loads(line) for line in (Path(config.logger.log_dir) / "metrics.jsonl").read_text().splitlines()]
    logged = {key: value for record in records for key, value in record.items() if key.startswith("val/")}
    for prefix in ("val/", "val/teacher_"):
        assert logged[f"{prefix}turns"] == 2.0 and logged[f"{prefix}tool_calls"] == 1.0, prefix
        assert logged[f"{prefix}well_formed_share"] == 1.0 and logged[f"{prefix}success_share"] == 1.0, prefix
        assert logged[f"{prefix}truncated_share"] == 0.0, prefix
        assert 0.0 <= logged[f"{prefix}accuracy"] <= 1.0 and logged[f"{prefix}reward"] == logged[f"{prefix}accuracy"]
    assert torch.isfinite(torch.tensor(logged["val/kl_forward"]))
    assert logged["val/baseline_student_accuracy"] == logged["val/accuracy"]  # the same episodes, before training


def test_opd_eval_plays_episodes(tmp_path, monkeypatch):
    """``opd eval`` with ``environment:`` validates on episodes; the teacher evaluated against
    itself has zero KL over its own turns (the episode's ids and mask reach it as sampled)."""
    import opd.evaluate as evaluation

    def build_and_force_the_call(config, model, tokenizer):
        generation = real_build(config, model, tokenizer)
        first_turn_calls_the_tool(generation, tokenizer, CALL)
        return generation

    real_build = evaluation.build_generation
    monkeypatch.setattr(evaluation, "build_generation", build_and_force_the_call)
    config = load_config(MasterConfig, TINY_CONFIG, [
        *short_run_overrides(tmp_path),
        f"data.val_path={REPO_ROOT / 'examples' / 'data' / 'tiny_arithmetic' / 'val.jsonl'}",
        "data.max_val_examples=2",
        "data.max_prompt_length=1024",
        "validation.model_path=tiny:teacher",
        "validation.generate_strategy.max_length=6",
        "environment.max_turns=2",
        "loss_fn.compile_kernels=false",
    ])
    metrics = evaluation.evaluate(config)
    assert metrics["val/turns"] == 2.0 and metrics["val/tool_calls"] == 1.0 and metrics["val/success_share"] == 1.0
    assert abs(metrics["val/kl_forward"]) <= 1e-5 and abs(metrics["val/kl_reverse"]) <= 1e-5
