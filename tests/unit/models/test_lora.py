"""Tests for LoRA students (``model.lora``, :mod:`opd.policy.lora`).

One short on-policy distillation run of ``tiny:student`` with adapters (module fixture)
answers most questions; the rest build an :class:`HFPolicy` directly. What is checked:

* the config: ``model.lora: null`` is full fine-tuning, any given section turns LoRA on,
  bad keys and values fail with one error naming the key, a missing peft says how to
  install it;
* only the adapters train: they alone require gradients and fill AdamW's param groups,
  and the base weights are bit-for-bit those of ``tiny:student`` after training;
* the run lowers the student's KL to the teacher on a fixed held-out batch;
* the fused LM-head step equals the plain step through a wrapped student;
* ``weights_for_refit`` is the merged plain model (base names, ``W + (alpha/r)·B·A``);
* ``final_model/`` loads with ``AutoModelForCausalLM`` (no peft keys), ``adapter/`` with
  peft, and both decode greedily to the same tokens as the trained in-process student;
* a run resumed from a checkpoint continues bit for bit like the uninterrupted run;
* the starting adapter depends on ``training.seed`` alone, not on torch's global state;
* ``one_step_off`` refits its own plain engine with the merged student;
* ``opd sft`` trains adapters too.
"""

from __future__ import annotations

import functools
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from opd_test_helpers import short_run_overrides
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from opd.data.batched_data_dict import BatchedDataDict
from opd.data.batches import build_fixed_data_batch
from opd.data.dataloaders import prepare_examples
from opd.data.datasets import load_chat_dataset
from opd.data.sequences import encode_prompt, pack_sequences, shift_token_mask
from opd.distillation.config import MasterConfig
from opd.distillation.setup import check_environment, setup
from opd.distillation.step import distillation_train
from opd.losses.distillation_losses import KLLossFn
from opd.losses.divergences import token_kl
from opd.models.config import DEFAULT_LORA_TARGETS, LoraConfig
from opd.models.decoding import GenerateStrategyConfig
from opd.models.tiny import build_tiny_model, build_tiny_tokenizer
from opd.policy.hf_policy import HFPolicy, OptimizerConfig
from opd.policy.lora import adapter_parameters
from opd.rollout.hf_generation import HFGeneration, SnapshotHFGeneration
from opd.sft import SFTMasterConfig, sft_train
from opd.sft import setup as sft_setup
from opd.teachers.local_teacher import LocalTeacher
from opd.utils.config import load_config
from opd.utils.errors import ConfigError, OpdError

REPO_ROOT = Path(__file__).resolve().parents[3]
TINY_CONFIG = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
SFT_CONFIG = REPO_ROOT / "examples" / "configs" / "sft.yaml"
TRAIN_DATA = REPO_ROOT / "examples" / "data" / "tiny_arithmetic" / "train.jsonl"

RUN_STEPS = 8
TRAIN_EXAMPLES = 4  # = training.batch_size: every step sees the same prompts
RESUME_FROM = 4  # save_freq: the rerun continues from step_4
LORA_RANK = 8
LORA = [f"model.lora.r={LORA_RANK}", "model.lora.alpha=16", "model.lora.dropout=0.1"]


def run_config(tmp_path: Path, *overrides: str) -> MasterConfig:
    """The tiny distillation config cut down to a few fast steps, without validation."""
    base = [
        *short_run_overrides(tmp_path),
        "training.batch_size=4",
        "training.micro_batch_size=2",
        "training.warmup_steps=0",
        "training.val_freq=0",
        "distillation.num_samples_per_prompt=1",
        "distillation.generate_strategy.max_length=12",
    ]
    return load_config(MasterConfig, TINY_CONFIG, base + list(overrides))


def train_batch(tokenizer) -> BatchedDataDict:
    """The run's training prompts with their reference answers: a fixed batch to measure the KL on."""
    rows = load_chat_dataset(str(TRAIN_DATA), max_examples=TRAIN_EXAMPLES)
    return build_fixed_data_batch(
        prepare_examples(rows, tokenizer, None, str(TRAIN_DATA)), tokenizer.pad_token_id, True
    )


def fixed_batch_kl(policy, teacher, batch: BatchedDataDict) -> float:
    """Token mean of KL(student ‖ teacher) over the batch's response tokens, in float64."""
    student_logits = policy.get_logits(batch).double()
    with torch.inference_mode():
        teacher_logits = teacher.model(input_ids=batch["input_ids"]).logits.double()
    mask = shift_token_mask(batch["token_mask"]).bool()
    kl = token_kl(student_logits[:, :-1], teacher_logits[:, :-1], "reverse")
    return float(kl[mask].mean())


def base_name(name: str) -> str:
    return name.replace(".base_layer", "")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """An 8-step LoRA run with checkpoints every 4 steps; records the student before and after."""
    tmp_path = tmp_path_factory.mktemp("lora")
    config = run_config(
        tmp_path,
        *LORA,
        f"data.max_train_examples={TRAIN_EXAMPLES}",
        "distillation.lambda=0.5",
        "training.learning_rate=1e-2",
        f"training.num_epochs={RUN_STEPS}",  # one step per epoch
        f"training.max_num_steps={RUN_STEPS}",
        f"training.save_freq={RESUME_FROM}",
    )
    parts = setup(config)
    policy = parts.student_policy
    assert isinstance(policy, HFPolicy)
    batch = train_batch(parts.tokenizer)
    kl_before = fixed_batch_kl(policy, parts.teacher_policy, batch)
    frozen_before = {name: p.detach().clone() for name, p in policy.model.named_parameters() if not p.requires_grad}
    distillation_train(parts)
    return {
        "config": config,
        "parts": parts,
        "kl_before": kl_before,
        "kl_after": fixed_batch_kl(policy, parts.teacher_policy, batch),
        "frozen_before": frozen_before,
    }


def train_losses(config: MasterConfig) -> list[tuple[int, float]]:
    lines = (Path(config.logger.log_dir) / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return [(record["step"], record["train/loss"]) for record in records if "train/loss" in record]


# --------------------------------------------------------------------------- config


def test_lora_is_off_by_default_and_on_when_the_section_is_given(tmp_path):
    assert run_config(tmp_path).model.active_lora() is None
    assert run_config(tmp_path, "model.lora=null").model.active_lora() is None
    lora = run_config(tmp_path, "model.lora.r=8").model.active_lora()
    assert lora is not None and lora.r == 8 and lora.alpha == 32.0 and lora.dropout == 0.0
    assert lora.target_modules == list(DEFAULT_LORA_TARGETS)
    assert run_config(tmp_path, "model.lora.enabled=true").model.active_lora() == LoraConfig()
    assert run_config(tmp_path, "model.lora={r: 4, target_modules: all-linear}").model.active_lora() == LoraConfig(
        r=4, target_modules="all-linear"
    )
    assert run_config(tmp_path, "model.lora.r=8", "model.lora.enabled=false").model.active_lora() is None


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            "model.lora.rank=8",
            "unknown key 'model.lora.rank'; allowed keys here: alpha, dropout, enabled, r, target_modules",
        ),
        ("model.lora.r=0", "model.lora.r = 0: Input should be greater than or equal to 1"),
        ("model.lora.dropout=1.0", "model.lora.dropout = 1.0: Input should be less than 1"),
        ("model.lora.dropout=-0.1", "model.lora.dropout = -0.1: Input should be greater than or equal to 0"),
        ("model.lora.alpha=0", "model.lora.alpha = 0: Input should be greater than 0"),
        ("model.lora.target_modules=[]", "model.lora.target_modules = []: needs at least one"),
        ("model.lora.target_modules=[q_proj,lm_head]", "['lm_head'] cannot take an adapter"),
        ("model.lora.target_modules=some-linear", "model.lora.target_modules = 'some-linear'"),
    ],
)
def test_invalid_lora_keys_give_one_clear_error(tmp_path, override, expected):
    with pytest.raises(ConfigError) as error:
        run_config(tmp_path, override)
    assert expected in str(error.value)


def test_target_modules_that_match_nothing_are_refused():
    with pytest.raises(ConfigError, match=r"model.lora.target_modules = \['qkv_proj'\]: Target modules"):
        HFPolicy(build_tiny_model("student"), OptimizerConfig(), 2, 1, lora=LoraConfig(target_modules=["qkv_proj"]))


def test_missing_peft_says_how_to_install_it(tmp_path, monkeypatch):
    config = run_config(tmp_path, "model.lora.r=8")
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft raises ImportError
    with pytest.raises(ConfigError, match=r"model.lora needs the peft package: pip install 'opd\[lora\]'"):
        check_environment(config)
    with pytest.raises(ConfigError, match=r"pip install 'opd\[lora\]'"):
        HFPolicy(build_tiny_model("student"), OptimizerConfig(), 2, 1, lora=LoraConfig())
    check_environment(run_config(tmp_path))  # full fine-tuning does not need peft


# --------------------------------------------------------------------------- what trains


def test_only_the_adapters_are_trainable_and_in_the_optimizer(lora_run):
    model = lora_run["parts"].student_policy.model
    optimizer = lora_run["parts"].student_policy.optimizer
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    # lora_A and lora_B of the seven projections of both layers.
    assert len(trainable) == 2 * len(DEFAULT_LORA_TARGETS) * 2
    assert all(".lora_A.default." in name or ".lora_B.default." in name for name in trainable)
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for name, p in model.named_parameters() if name in trainable}
    # The adapters are matrices: all in the weight-decay group.
    assert [len(group["params"]) for group in optimizer.param_groups] == [len(trainable), 0]
    assert all(state for state in optimizer.state.values())  # Adam moments exist: it stepped


def test_base_weights_are_unchanged_and_the_adapters_moved(lora_run):
    model = lora_run["parts"].student_policy.model
    frozen_before = lora_run["frozen_before"]
    fresh = dict(build_tiny_model("student").named_parameters())
    for name, param in model.named_parameters():
        if param.requires_grad:
            continue
        assert torch.equal(param, frozen_before[name]), name
        assert torch.equal(param, fresh[base_name(name)]), name
    assert {base_name(name) for name in frozen_before} == set(fresh)
    lora_b = [p for name, p in model.named_parameters() if ".lora_B." in name]
    # Every lora_B starts at zero: each must have trained.
    assert min(float(p.detach().abs().max()) for p in lora_b) > 1e-3


def test_lora_run_lowers_the_kl_to_the_teacher(lora_run):
    # The adapters cannot rescale the tiny student's tied embedding or final norm, which
    # bound how peaked its logits can get: 2.480 -> 2.439 nats here, where full fine-tuning
    # with the same settings reaches 2.384. A drop of 0.02 nats is ~10⁴ times any rounding
    # difference and would not happen if the adapters did not train.
    before, after = lora_run["kl_before"], lora_run["kl_after"]
    assert after < before - 0.02, f"KL(student‖teacher) on the training prompts {before:.4f} -> {after:.4f}"


def test_fused_lm_head_step_equals_plain_step_through_the_adapters():
    generator = torch.Generator().manual_seed(3)
    lengths, prompts = [9, 14, 6, 12], [4, 6, 5, 3]
    sequences = [torch.randint(3, 120, (n,), generator=generator).tolist() for n in lengths]
    batch = pack_sequences(sequences, prompts, 0, True)
    teacher = LocalTeacher(build_tiny_model("teacher", dtype=torch.float64))
    results = []
    for fused in (False, True):
        torch.manual_seed(0)  # the same lora_A initialisation in both
        policy = HFPolicy(
            build_tiny_model("student", dtype=torch.float64),
            OptimizerConfig(learning_rate=1e-3, max_grad_norm=None),
            3,
            1,
            lora=LoraConfig(r=4),
        )
        with torch.no_grad():  # lora_B starts at zero, which would give lora_A no gradient
            for name, param in policy.model.named_parameters():
                if ".lora_B." in name:
                    param.copy_(0.1 * torch.randn(param.shape, generator=torch.Generator().manual_seed(7)))
        grads: dict[str, torch.Tensor] = {}
        names = {id(p): n for n, p in policy.model.named_parameters()}
        policy.optimizer.register_step_pre_hook(
            lambda opt, *_, grads=grads, names=names: grads.update(
                {names[id(p)]: p.grad.clone() for g in opt.param_groups for p in g["params"]}
            )
        )
        loss_fn = KLLossFn(kl_type="reverse", fused_lm_head=fused, chunk_size=5)
        signal = functools.partial(teacher.score, request=loss_fn.teacher_request)
        results.append((policy.train(batch, loss_fn, teacher_signal=signal), grads))
    (plain_metrics, plain_grads), (fused_metrics, fused_grads) = results
    assert plain_metrics["loss"] > 0
    for key, value in plain_metrics.items():
        assert fused_metrics[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    assert len(plain_grads) == 2 * len(DEFAULT_LORA_TARGETS) * 2
    for name, grad in plain_grads.items():
        assert float(grad.abs().max()) > 0, name
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-9, atol=1e-12, msg=name)


# --------------------------------------------------------------------------- refit and saved model


def test_weights_for_refit_are_the_merged_plain_model(lora_run):
    policy = lora_run["parts"].student_policy
    refit = dict(policy.weights_for_refit())
    plain_names = [name for name, _ in build_tiny_model("student").named_parameters()]
    assert list(refit) == plain_names
    modules = dict(policy.model.named_modules())
    scale = 16 / LORA_RANK
    for projection in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        layer = modules[projection]
        expected = layer.base_layer.weight.double() + scale * (
            layer.lora_B["default"].weight.double() @ layer.lora_A["default"].weight.double()
        )
        torch.testing.assert_close(refit[f"{projection}.weight"].double(), expected, rtol=0, atol=1e-6)
        assert not torch.equal(refit[f"{projection}.weight"], layer.base_layer.weight)
        assert torch.equal(
            refit[f"{projection}.bias" if "q_proj" in projection else "model.norm.weight"],
            layer.base_layer.bias if "q_proj" in projection else modules["model.norm"].weight,
        )
    final = load_file(str(Path(lora_run["config"].output_dir) / "final_model" / "model.safetensors"))
    assert set(final) == set(refit)
    for name, tensor in final.items():
        assert torch.equal(tensor, refit[name]), name


def test_final_model_is_merged_and_the_adapter_loads_with_peft(lora_run):
    from peft import PeftModel

    final_dir = Path(lora_run["config"].output_dir) / "final_model"
    assert (final_dir / "adapter" / "adapter_config.json").is_file()
    assert not any("lora" in key or "base_layer" in key for key in load_file(str(final_dir / "model.safetensors")))
    adapter = load_file(str(final_dir / "adapter" / "adapter_model.safetensors"))
    assert len(adapter) == 2 * len(DEFAULT_LORA_TARGETS) * 2
    adapter_config = json.loads((final_dir / "adapter" / "adapter_config.json").read_text())
    assert (adapter_config["r"], adapter_config["lora_alpha"], adapter_config["lora_dropout"]) == (LORA_RANK, 16, 0.1)

    merged = AutoModelForCausalLM.from_pretrained(final_dir).eval()
    with_adapter = PeftModel.from_pretrained(build_tiny_model("student"), str(final_dir / "adapter")).eval()
    tokenizer = build_tiny_tokenizer()
    prompts = ["What is 12 + 30?", "hi", "Count to five.", "7 * 6 ="]
    strategy = GenerateStrategyConfig(decoding_method="greedy", max_length=16)
    prompt_ids = [encode_prompt(tokenizer, [{"role": "user", "content": text}]) for text in prompts]
    answers = {}
    student = lora_run["parts"].student_generation  # the trained in-process student, adapters unmerged
    for name, generation in (
        ("merged", HFGeneration(merged, tokenizer)),
        ("peft", HFGeneration(with_adapter, tokenizer)),
        ("student", student),
    ):
        generation.prepare_for_generation()
        answers[name] = generation.generate(prompt_ids, strategy, return_logprobs=False)["input_ids"]
        generation.finish_generation()
    assert torch.equal(answers["merged"], answers["peft"])
    assert torch.equal(answers["merged"], answers["student"])
    base = HFGeneration(build_tiny_model("student").eval(), tokenizer)
    assert not torch.equal(base.generate(prompt_ids, strategy, return_logprobs=False)["input_ids"], answers["merged"])


def test_hf_rollouts_sample_with_the_current_adapter(lora_run):
    generation = lora_run["parts"].student_generation
    assert isinstance(generation, HFGeneration)
    # The engine holds the very module the policy trains, adapters injected in place.
    assert generation.model is lora_run["parts"].student_policy.model
    assert any(".lora_A." in name for name, _ in generation.model.named_parameters())


# --------------------------------------------------------------------------- resume


def test_resume_continues_bit_for_bit(lora_run, tmp_path):
    config = lora_run["config"]
    output_dir = Path(config.output_dir)
    checkpoints = Path(config.checkpointing.checkpoint_dir)
    state = torch.load(checkpoints / f"step_{RESUME_FROM}" / "optimizer.pt", weights_only=True)
    assert len(state["lora_adapter"]) == 2 * len(DEFAULT_LORA_TARGETS) * 2
    assert (checkpoints / f"step_{RESUME_FROM}" / "policy" / "adapter" / "adapter_model.safetensors").is_file()
    reference_losses = train_losses(config)
    assert [step for step, _ in reference_losses] == list(range(1, RUN_STEPS + 1))
    reference = {
        name: load_file(str(output_dir / "final_model" / name))
        for name in ("model.safetensors", "adapter/adapter_model.safetensors")
    }
    # The run as if killed after step_4's checkpoint: the later checkpoint and final_model gone.
    shutil.rmtree(checkpoints / f"step_{RUN_STEPS}")
    shutil.move(output_dir / "final_model", tmp_path / "reference_final_model")

    distillation_train(setup(config))
    # The log is cut back to the checkpoint's step on resume: steps 5-8 are the rerun's.
    assert train_losses(config) == reference_losses
    for name, tensors in reference.items():
        resumed = load_file(str(output_dir / "final_model" / name))
        assert resumed.keys() == tensors.keys()
        differing = [key for key in tensors if not torch.equal(resumed[key], tensors[key])]
        assert not differing, f"{name}: {differing[:3]}"


def test_the_starting_adapter_depends_on_the_seed_alone():
    def start(seed: int, global_seed: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(global_seed)  # what loading models before the wrap would have drawn
        policy = HFPolicy(build_tiny_model("student"), OptimizerConfig(), 2, 1, lora=LoraConfig(r=4), seed=seed)
        return {name: param.detach().clone() for name, param in adapter_parameters(policy.model).items()}

    first, other_global, other_seed = start(3, 0), start(3, 1), start(4, 0)
    assert all(torch.equal(first[name], other_global[name]) for name in first)
    assert all(not tensor.any() for name, tensor in first.items() if ".lora_B." in name)
    drawn = [name for name in first if ".lora_A." in name]
    assert drawn and all(not torch.equal(first[name], other_seed[name]) for name in drawn)


def test_a_lora_checkpoint_needs_the_lora_setting_to_resume():
    lora_policy = HFPolicy(build_tiny_model("student"), OptimizerConfig(), 2, 1, lora=LoraConfig(r=4))
    plain_policy = HFPolicy(build_tiny_model("student"), OptimizerConfig(), 2, 1)
    with pytest.raises(OpdError, match=r"written with model\.lora and this run is configured without it"):
        plain_policy.load_state_dict(lora_policy.state_dict())
    with pytest.raises(OpdError, match=r"written without model\.lora and this run is configured with it"):
        lora_policy.load_state_dict(plain_policy.state_dict())
    other_rank = HFPolicy(build_tiny_model("student"), OptimizerConfig(), 2, 1, lora=LoraConfig(r=2))
    with pytest.raises(OpdError, match=r"has shape .* model\.lora\.r"):
        other_rank.load_state_dict(lora_policy.state_dict())


# --------------------------------------------------------------------------- SFT


def test_sft_trains_adapters_only(tmp_path):
    overrides = [
        *short_run_overrides(tmp_path, "sft"),
        "checkpointing.enabled=false",
        "training.batch_size=4",
        "training.max_num_steps=2",
        "training.val_freq=0",
        "training.save_freq=0",
        "model.lora.r=4",
    ]
    config = load_config(SFTMasterConfig, SFT_CONFIG, overrides)
    parts = sft_setup(config)
    sft_train(parts)
    final_dir = Path(config.output_dir) / "final_model"
    assert (final_dir / "adapter" / "adapter_model.safetensors").is_file()
    merged = dict(AutoModelForCausalLM.from_pretrained(final_dir).named_parameters())
    fresh = dict(build_tiny_model("student").named_parameters())
    assert set(merged) == set(fresh)
    changed = {name for name in fresh if not torch.equal(merged[name].detach(), fresh[name].detach())}
    # Exactly the adapted projections moved: embeddings, norms and biases are the base model's.
    assert changed == {
        f"model.layers.{layer}.{block}.{name}.weight"
        for layer in range(2)
        for block, names in (
            ("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
            ("mlp", ("gate_proj", "up_proj", "down_proj")),
        )
        for name in names
    }


# --------------------------------------------------------------------------- asynchronous schedule


def test_one_step_off_refits_its_own_engine_with_the_merged_student(tmp_path):
    config = run_config(
        tmp_path,
        "model.lora.r=4",
        "training.scheduler=one_step_off",
        "training.max_num_steps=2",
        "training.save_freq=0",
        "training.learning_rate=1e-2",
        "checkpointing.enabled=false",
        "distillation.lambda=1.0",
    )
    parts = setup(config)
    policy, engine = parts.student_policy, parts.student_generation
    assert isinstance(policy, HFPolicy) and isinstance(engine, SnapshotHFGeneration)
    # The engine samples from a plain copy of its own, not from the wrapped student.
    assert engine.model is not policy.model
    assert not any("lora" in name or "base_layer" in name for name, _ in engine.model.named_parameters())
    distillation_train(parts)
    losses = train_losses(config)
    assert [step for step, _ in losses] == [1, 2] and all(torch.isfinite(torch.tensor(loss)) for _, loss in losses)
    engine.refit(policy)
    merged = dict(policy.weights_for_refit())
    own = {name: tensor.detach() for name, tensor in engine.model.named_parameters()}
    assert own.keys() == merged.keys()
    assert [name for name in merged if not torch.equal(own[name], merged[name])] == []
    # The merged student has trained: its adapted projections moved away from the base model.
    base = dict(build_tiny_model("student").named_parameters())
    assert max(float((own[name] - base[name].detach()).abs().max()) for name in own) > 1e-3
