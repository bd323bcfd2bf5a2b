"""Self-distillation with a teacher that follows the student: ``teacher.self_teacher`` live and ema.

* live: during each of K optimizer steps, every micro-batch's teacher signal (through a
  teacher-only context) equals, bit for bit, the signal of a copy of the weights that step
  trains, scored in eval mode (the student's attention dropout is on: a teacher scoring in
  train mode would not match); after the K steps it equals a float64 row-by-row forward
  of the student's current weights on ``[teacher prompt | completion]`` (1e-10) and differs
  from the initial weights' answer. The student still trains: every parameter still
  requires grad and moved, its own forwards run in train mode and the teacher's in eval
  mode, and the fused loss with the live teacher gives the very update a frozen copy of
  the same weights gives (no gradient through the teacher). A LoRA student's live teacher
  answers with base + current adapter (a plain model with the merged weights, 1e-10);
* ema: after K steps the teacher's weights equal a float64 EMA computed by hand from the
  student's weights after each step, θ_T ← d·θ_T + (1 − d)·θ_S, for d = 0.5 and 0.99, within
  6·K·u·max|θ| (u = 2⁻⁵³: each update rounds a product, a product and a sum, in the
  implementation and in the reference); an update is applied once per step and a skipped
  step is an error; a bfloat16 model keeps a float32 average and holds its rounding; a
  LoRA student is followed through its merged weights;
* a run with ``ema`` resumed from a mid-run checkpoint equals the uninterrupted run (the
  losses, the final model and the teacher's saved average, bit for bit), and a checkpoint
  of a run with another ``self_teacher`` is refused, naming the key, instead of the
  average being restarted;
* config mistakes name the keys (a live teacher without a teacher-only context is refused:
  it would be the student scoring its own tokens, every divergence 0);
* ``opd train`` of ``examples/configs/context_demo.yaml`` with live and with ema runs to
  the end with finite losses.
"""

from __future__ import annotations

import copy
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from opd_test_helpers import REPO_ROOT, load_script
from safetensors.torch import load_file

from opd.cli import main as opd_main
from opd.data.batched_data_dict import BatchedDataDict
from opd.distillation.config import MasterConfig
from opd.distillation.setup import setup
from opd.distillation.step import distillation_train
from opd.losses.distillation_losses import KLLossFn
from opd.models.config import LoraConfig, OptimizerConfig
from opd.models.tiny import build_tiny_model
from opd.policy.hf_policy import HFPolicy
from opd.teachers.context_teacher import ContextTeacher
from opd.teachers.local_teacher import LocalTeacher
from opd.teachers.self_teacher import EmaTeacher, LiveTeacher
from opd.utils.config import load_config
from opd.utils.errors import ConfigError, OpdError

TINY_CONFIG = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
CONTEXT_DEMO = REPO_ROOT / "examples" / "configs" / "context_demo.yaml"
STEPS = 3
UNIT_ROUNDOFF = 2.0**-53


def context_batch(seed: int = 0) -> BatchedDataDict:
    """Four rows of different prompt and completion lengths, each with a longer teacher prompt."""
    generator = torch.Generator().manual_seed(seed)
    prompt_lengths, completion_lengths, teacher_lengths = [5, 9, 3, 7], [6, 3, 8, 4], [11, 9, 20, 12]
    width = max(p + c for p, c in zip(prompt_lengths, completion_lengths))
    input_ids = torch.zeros((4, width), dtype=torch.long)
    token_mask = torch.zeros((4, width))
    for row, (p, c) in enumerate(zip(prompt_lengths, completion_lengths)):
        input_ids[row, : p + c] = torch.randint(3, 250, (p + c,), generator=generator)
        token_mask[row, p : p + c] = 1.0
    return BatchedDataDict(
        input_ids=input_ids,
        token_mask=token_mask,
        input_lengths=torch.tensor([p + c for p, c in zip(prompt_lengths, completion_lengths)]),
        prompt_lengths=torch.tensor(prompt_lengths),
        teacher_prompt_ids=[torch.randint(3, 250, (n,), generator=generator).tolist() for n in teacher_lengths],
    )


def student_model(dropout: float = 0.0):
    model = build_tiny_model("student").double()
    for module in model.modules():  # Qwen2 attention drops probabilities in train mode only
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = dropout
    return model


def policy_of(model, lora: LoraConfig | None = None) -> HFPolicy:
    return HFPolicy(model, OptimizerConfig(learning_rate=1e-2, warmup_steps=0), 2, STEPS, lora=lora)


def reference_log_probs(model, batch: BatchedDataDict) -> list[torch.Tensor]:
    """Per row: float64 log-softmax of ``model`` (eval) on [teacher prompt | completion], at the completion's positions."""
    model = copy.deepcopy(model).eval()
    out = []
    for row in range(batch.size):
        p, n = int(batch["prompt_lengths"][row]), int(batch["input_lengths"][row])
        teacher_prompt = batch["teacher_prompt_ids"][row]
        sequence = torch.tensor([teacher_prompt + batch["input_ids"][row, p:n].tolist()])
        with torch.no_grad():
            logits = model(input_ids=sequence).logits[0]
        q = len(teacher_prompt)
        out.append(torch.log_softmax(logits[q - 1 : q - 1 + n - p], dim=-1))
    return out


def completion_log_probs(logits: torch.Tensor, batch: BatchedDataDict) -> list[torch.Tensor]:
    rows = []
    for row in range(batch.size):
        p, n = int(batch["prompt_lengths"][row]), int(batch["input_lengths"][row])
        rows.append(torch.log_softmax(logits[row, p - 1 : n - 1], dim=-1))
    return rows


# ------------------------------------------------------------------ live


def test_a_live_teacher_scores_with_the_weights_of_the_step_it_scores():
    model = student_model(dropout=0.3)
    policy = policy_of(model)
    teacher = ContextTeacher(LiveTeacher(model), pad_token_id=0)
    loss_fn = KLLossFn("forward")
    request = loss_fn.teacher_request
    batch = context_batch()
    initial = copy.deepcopy(model).eval()
    forwards: list[tuple[bool, bool]] = []  # (with gradient, every module in train mode) per forward of the model
    model.register_forward_pre_hook(
        lambda module, args: forwards.append(
            (torch.is_grad_enabled(), all(sub.training for sub in module.modules()))
        )
    )
    for _ in range(STEPS):
        trained = copy.deepcopy(model).eval()  # the weights this step trains
        answers: list[tuple[BatchedDataDict, torch.Tensor]] = []

        def teacher_signal(micro_batch: BatchedDataDict) -> torch.Tensor:
            answer = teacher.score(micro_batch, request)
            answers.append((micro_batch, answer))
            return answer

        forwards.clear()
        metrics = policy.train(batch, loss_fn, teacher_signal)
        assert metrics["skipped_nonfinite"] == 0.0 and len(answers) == 2  # two micro-batches
        frozen_copy = ContextTeacher(LocalTeacher(trained), pad_token_id=0)
        for micro_batch, answer in answers:
            assert torch.equal(answer, frozen_copy.score(micro_batch, request))
        # The student's own forwards in train mode, the teacher's in eval mode, without gradient.
        assert {(True, True), (False, False)} == set(forwards)
        assert model.training and all(module.training for module in model.modules())
        assert all(param.requires_grad for param in model.parameters())
        moved = max(
            float((param.detach() - before).abs().max())
            for param, before in zip(model.parameters(), trained.parameters(), strict=True)
        )
        assert moved > 1e-4
    fresh = context_batch(seed=1)
    logits = teacher.score(fresh, request)
    for got, expected in zip(completion_log_probs(logits, fresh), reference_log_probs(model, fresh), strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)
    before_training = ContextTeacher(LocalTeacher(initial), pad_token_id=0).score(fresh, request)
    assert float((logits - before_training).abs().max()) > 1e-3


def test_the_live_teacher_passes_no_gradient_to_the_student():
    """A fused step with the live teacher moves the student exactly as with a frozen copy of the same weights."""
    live_model = student_model()
    copy_model = copy.deepcopy(live_model)
    loss_fn = KLLossFn("reverse", fused_lm_head=True)
    batch = context_batch(seed=2)
    live, frozen = policy_of(live_model), policy_of(copy_model)
    live_teacher = ContextTeacher(LiveTeacher(live_model), pad_token_id=0)
    frozen_teacher = ContextTeacher(LocalTeacher(copy.deepcopy(copy_model)), pad_token_id=0)
    live.train(batch, loss_fn, lambda micro_batch: live_teacher.score(micro_batch, loss_fn.teacher_request))
    frozen.train(batch, loss_fn, lambda micro_batch: frozen_teacher.score(micro_batch, loss_fn.teacher_request))
    for (name, got), expected in zip(live_model.named_parameters(), copy_model.parameters(), strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-13, msg=name)


def test_a_live_teacher_of_a_lora_student_answers_with_the_current_adapter():
    pytest.importorskip("peft")
    model = student_model()
    base = copy.deepcopy(model).eval()
    teacher = ContextTeacher(LiveTeacher(model), pad_token_id=0)  # built before the wrap, as setup does
    policy = policy_of(model, LoraConfig(r=4))
    loss_fn = KLLossFn("forward")
    batch = context_batch()
    policy.train(batch, loss_fn, lambda micro_batch: teacher.score(micro_batch, loss_fn.teacher_request))
    merged = copy.deepcopy(base)
    merged.load_state_dict(dict(policy.weights_for_refit()), strict=False)
    logits = teacher.score(batch, loss_fn.teacher_request)
    for got, expected in zip(completion_log_probs(logits, batch), reference_log_probs(merged, batch), strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)
    assert float((logits - ContextTeacher(LocalTeacher(base), 0).score(batch, loss_fn.teacher_request)).abs().max()) > 0


# ------------------------------------------------------------------ ema


@pytest.mark.parametrize("decay", [0.5, 0.99])
def test_an_ema_teacher_equals_the_average_computed_by_hand(decay):
    model = student_model()
    policy = policy_of(model)
    teacher = EmaTeacher(copy.deepcopy(model), decay)
    loss_fn = KLLossFn("forward")
    batch = context_batch()
    reference = {name: param.detach().clone() for name, param in model.named_parameters()}
    largest = max(float(value.abs().max()) for value in reference.values())
    context = ContextTeacher(teacher, pad_token_id=0)
    for step in range(1, STEPS + 1):
        policy.train(batch, loss_fn, lambda micro_batch: context.score(micro_batch, loss_fn.teacher_request))
        context.follow_student(policy, step)  # what the driver calls after the step
        for name, param in model.named_parameters():
            reference[name] = decay * reference[name] + (1 - decay) * param.detach()
            largest = max(largest, float(param.detach().abs().max()), float(reference[name].abs().max()))
    tolerance = 6 * STEPS * UNIT_ROUNDOFF * largest
    averaged = dict(teacher.model.named_parameters())
    for name, expected in reference.items():
        torch.testing.assert_close(averaged[name], expected, rtol=0, atol=tolerance, msg=name)
        assert not averaged[name].requires_grad
    # Neither the student nor its start: the average of the two and the steps between.
    student = dict(model.named_parameters())
    assert max(float((averaged[name] - student[name]).abs().max()) for name in reference) > 1e-4
    assert teacher.version == STEPS and context.state_dict()["ema_version"] == STEPS


def test_an_ema_update_happens_once_per_step_and_in_order():
    model = student_model()
    policy = policy_of(model)
    teacher = EmaTeacher(copy.deepcopy(model), 0.5)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.25)
    teacher.follow_student(policy, 1)
    after_one = {name: param.clone() for name, param in teacher.model.named_parameters()}
    teacher.follow_student(policy, 1)  # asked again for the same step: already in the average
    assert all(torch.equal(param, after_one[name]) for name, param in teacher.model.named_parameters())
    with pytest.raises(OpdError, match="asked to add step 3"):
        teacher.follow_student(policy, 3)


def test_a_bfloat16_ema_teacher_keeps_a_float32_average():
    model = build_tiny_model("student", torch.bfloat16)
    policy = policy_of(model)
    teacher = EmaTeacher(copy.deepcopy(model), 0.99)
    start = {name: param.detach().float() for name, param in model.named_parameters()}
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    teacher.follow_student(policy, 1)
    for name, param in teacher.model.named_parameters():
        average = teacher.average[name]
        assert average.dtype == torch.float32 and param.dtype == torch.bfloat16
        expected = 0.99 * start[name] + 0.01 * model.get_parameter(name).detach().float()
        torch.testing.assert_close(average, expected, rtol=0, atol=1e-5)
        assert torch.equal(param, average.to(torch.bfloat16))


def test_an_ema_teacher_follows_a_lora_students_merged_weights():
    pytest.importorskip("peft")
    model = student_model()
    teacher = EmaTeacher(copy.deepcopy(model), 0.5)
    start = {name: param.detach().clone() for name, param in teacher.model.named_parameters()}
    policy = policy_of(model, LoraConfig(r=4))
    loss_fn = KLLossFn("forward")
    context = ContextTeacher(teacher, pad_token_id=0)
    policy.train(context_batch(), loss_fn, lambda micro_batch: context.score(micro_batch, loss_fn.teacher_request))
    context.follow_student(policy, 1)
    merged = dict(policy.weights_for_refit())
    assert set(merged) == set(start)
    adapted = [name for name in merged if not torch.equal(merged[name], start[name])]
    assert adapted and all("proj" in name for name in adapted)
    for name, param in teacher.model.named_parameters():
        torch.testing.assert_close(param, 0.5 * start[name] + 0.5 * merged[name], rtol=0, atol=1e-15)


# ------------------------------------------------------------------ runs: resume


def run_config(tmp_path: Path, name: str, *overrides: str) -> MasterConfig:
    return load_config(MasterConfig, TINY_CONFIG, [
        f"output_dir={tmp_path / name}", "logger.console=false", "model.teacher_model_path=student",
        "distillation.teacher_context=Add the numbers column by column.",
        "training.batch_size=4", "training.micro_batch_size=2", "training.max_num_steps=4", "training.save_freq=2",
        "training.val_freq=0", "training.warmup_steps=0", "checkpointing.keep_top_k=null",
        "validation.val_at_start=false", "validation.val_at_end=false", "data.max_train_examples=16",
        "loss_fn.kl_type=forward", *overrides,
    ])


def train_losses(config: MasterConfig) -> list[tuple[int, float]]:
    lines = (Path(config.logger.log_dir) / "metrics.jsonl").read_text().splitlines()
    return [(record["step"], record["train/loss"]) for record in map(json.loads, lines) if "train/loss" in record]


def as_if_killed_after_step_2(config: MasterConfig, name: str, tmp_path: Path) -> Path:
    """A copy of the run's directory without what was written after step 2's checkpoint."""
    copied = tmp_path / name
    shutil.copytree(Path(config.output_dir), copied)
    shutil.rmtree(copied / "checkpoints" / "step_4")
    shutil.rmtree(copied / "final_model")
    return copied


EMA = ("teacher.self_teacher=ema", "teacher.ema_decay=0.5")


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("ema_run")
    config = run_config(tmp_path, "uninterrupted", *EMA)
    distillation_train(setup(config))
    return tmp_path, config


def test_a_resumed_ema_run_equals_the_uninterrupted_one(ema_run):
    tmp_path, config = ema_run
    checkpoints = Path(config.checkpointing.checkpoint_dir)
    saved = torch.load(checkpoints / "step_2" / "teacher_state.pt", weights_only=True)
    assert saved["ema_version"] == 2
    as_if_killed_after_step_2(config, "resumed", tmp_path)
    resumed = run_config(tmp_path, "resumed", *EMA)
    distillation_train(setup(resumed))
    assert train_losses(resumed) == train_losses(config)
    assert [step for step, _ in train_losses(config)] == [1, 2, 3, 4]
    for file in ("final_model/model.safetensors",):
        expected, got = load_file(Path(config.output_dir) / file), load_file(Path(resumed.output_dir) / file)
        assert all(torch.equal(got[key], expected[key]) for key in expected)
    expected = torch.load(checkpoints / "step_4" / "teacher_state.pt", weights_only=True)
    got = torch.load(Path(resumed.checkpointing.checkpoint_dir) / "step_4" / "teacher_state.pt", weights_only=True)
    assert got["ema_version"] == expected["ema_version"] == 4
    assert all(torch.equal(got["ema_weights"][key], expected["ema_weights"][key]) for key in expected["ema_weights"])
    # The teacher moved away from the student's start: the average was restored, not restarted.
    start = dict(build_tiny_model("student").named_parameters())
    assert any(not torch.equal(value, start[key].detach()) for key, value in got["ema_weights"].items())


def test_a_checkpoint_of_another_self_teacher_is_refused(ema_run, tmp_path):
    _, config = ema_run
    as_if_killed_after_step_2(config, "as_frozen", tmp_path)
    with pytest.raises(OpdError, match=re.escape("use the teacher settings it was written with")):
        distillation_train(setup(run_config(tmp_path, "as_frozen")))
    frozen = run_config(tmp_path, "frozen", "training.max_num_steps=2")
    distillation_train(setup(frozen))
    assert not (Path(frozen.checkpointing.checkpoint_dir) / "step_2" / "teacher_state.pt").exists()
    with pytest.raises(OpdError, match=re.escape("teacher.self_teacher = ema: the checkpoint holds no EMA teacher")):
        distillation_train(setup(run_config(tmp_path, "frozen", *EMA)))


# ------------------------------------------------------------------ config


STUDENT = "model.teacher_model_path=student"
CONTEXT = "distillation.teacher_context=Check each column."


@pytest.mark.parametrize("overrides, message", [
    (["teacher.self_teacher=live"], "set model.teacher_model_path = student"),
    ([STUDENT, "teacher.self_teacher=ema", "teacher.backend=remote", "teacher.remote.url=http://127.0.0.1:1"],
     "teacher.self_teacher = ema follows the student's weights in this process, which a served teacher "
     "(teacher.backend = remote) cannot"),
    ([STUDENT, "teacher.self_teacher=live", "teacher.cross_tokenizer=true", "loss_fn.type=topk"],
     "teacher.self_teacher = live: the student shares its own tokenizer; set teacher.cross_tokenizer = false"),
    ([STUDENT, "teacher.self_teacher=ema", "cluster.placement=colocated"],
     "teacher.self_teacher = ema is not supported on a cluster yet"),
    ([STUDENT, CONTEXT, "teacher.self_teacher=live", "training.scheduler=two_step_off"],
     "use training.scheduler = sync or one_step_off"),
    ([STUDENT, "teacher.self_teacher=live"],
     "teacher.self_teacher = live without a teacher-only context is the student scoring its own tokens"),
    ([STUDENT, "teacher.self_teacher=ema", "teacher.ema_decay=1.0"], "teacher.ema_decay = 1.0"),
    ([STUDENT, "teacher.ema_decay=0"], "teacher.ema_decay = 0"),
    ([STUDENT, "teacher.self_teacher=copy"], "teacher.self_teacher = 'copy'"),
])
def test_config_mistakes_name_the_keys(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(MasterConfig, TINY_CONFIG, [f"output_dir={tmp_path}", *overrides])


def test_several_teachers_with_a_following_teacher_are_refused(tmp_path):
    config = tmp_path / "several.yaml"
    config.write_text(
        f"defaults: {TINY_CONFIG}\n"
        "model: {teacher_model_path: null}\n"
        "teacher: {self_teacher: live}\n"
        "teachers: {mode: mixture, members: [{name: a, model_path: student}, {name: b, model_path: tiny:teacher}]}\n"
    )
    with pytest.raises(ConfigError, match=re.escape("teacher.self_teacher = live is for the one teacher")):
        load_config(MasterConfig, config, [f"output_dir={tmp_path}"])


def test_live_and_ema_combine_with_lora_and_one_step_off(tmp_path):
    for overrides in (["model.lora.r=4"], ["training.scheduler=one_step_off"]):
        for kind in ("live", "ema"):
            load_config(MasterConfig, TINY_CONFIG, [f"output_dir={tmp_path}", STUDENT, CONTEXT,
                                                    f"teacher.self_teacher={kind}", *overrides])
    # Without a context an EMA teacher still differs from the student (a slower copy of it).
    load_config(MasterConfig, TINY_CONFIG, [f"output_dir={tmp_path}", STUDENT, "teacher.self_teacher=ema"])


# ------------------------------------------------------------------ opd train: the context demo


@pytest.fixture(scope="module")
def small_hint_data(tmp_path_factory) -> Path:
    """16 training and 4 validation rows of the context demo's task, written as its prepare script writes them."""
    module = load_script(REPO_ROOT / "examples" / "demo" / "prepare_context_demo.py", register=True)
    from opd.data.converters import load_prompt_template, math_cl_to_chat

    template = load_prompt_template(REPO_ROOT / "examples" / "prompts" / "math_think_answer.txt")
    out = tmp_path_factory.mktemp("hints")
    task = REPO_ROOT / "examples" / "data" / "arithmetic"
    for split, count in (("train", 16), ("val", 4)):
        rows = [json.loads(line) for line in (task / f"{split}.jsonl").read_text().splitlines()[:count]]
        with open(out / f"{split}.jsonl", "w", encoding="utf-8") as handle:
            for row in rows:
                example = math_cl_to_chat(row, template)
                handle.write(json.dumps({"messages": example["messages"][:1], "ground_truth": example["ground_truth"],
                                         "hint": module.column_sums_hint(row["problem"])}) + "\n")
    return out


@pytest.mark.parametrize("kind", ["live", "ema"])
def test_the_context_demo_trains_with_a_following_teacher(kind, small_hint_data, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)  # the config names its model relative to the checkout
    output_dir = tmp_path / kind
    assert opd_main([
        "train", "--config", str(CONTEXT_DEMO), f"output_dir={output_dir}", f"teacher.self_teacher={kind}",
        f"data.train_path={small_hint_data / 'train.jsonl'}", f"data.val_path={small_hint_data / 'val.jsonl'}",
        "training.max_num_steps=3", "training.batch_size=4", "training.micro_batch_size=2", "training.val_freq=0",
        "training.save_freq=2", "training.warmup_steps=0", "validation.val_at_start=false",
        "validation.val_at_end=true", "validation.batch_size=4", "validation.generate_strategy.max_length=12",
        "distillation.generate_strategy.max_length=12", "logger.progress_bar=false",
    ]) == 0
    records = [json.loads(line) for line in (output_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [record for record in records if "train/loss" in record]
    assert [record["step"] for record in steps] == [1, 2, 3]
    assert all(math.isfinite(record["train/loss"]) and math.isfinite(record["train/kl_forward"]) for record in steps)
    assert "val/baseline_accuracy_gap" in records[0]  # the config's eval baseline, the teacher with the hint
    assert math.isfinite(next(r for r in records if "val/kl_forward" in r and r["step"] == 3)["val/kl_forward"])
    # The demo keeps its newest checkpoint only: the last step's, which holds the EMA teacher's average.
    assert (output_dir / "checkpoints" / "step_3" / "teacher_state.pt").is_file() == (kind == "ema")
    assert all(("timing/teacher_update" in record) == (kind == "ema") for record in steps)
