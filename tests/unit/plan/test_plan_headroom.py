"""``opd plan``'s headroom: the reserved peak, the rollout worker's process and the colocated device's busier moment.

The plan is built without a dry run: the trainer rank's peak is given (40 GiB, which × 1.15 is 46 GiB exactly), and
the rest is what :func:`~opd.plan.memory_plan.plan_memory` adds from the config (the engine's budgets, its worker,
the placement), here the 8-GPU config's (Qwen2.5-1.5B student, 8 vLLM engines colocated with 8 trainer ranks, 16
rows each). Every expected figure is worked out here from the student's shapes and the config's numbers.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from opd_test_helpers import REPO_ROOT

from opd import cli
from opd.distillation.config import MasterConfig
from opd.models.model_shapes import model_config
from opd.plan import memory_plan
from opd.plan.dry_run import RankMemory
from opd.plan.fake_step import StepShape
from opd.plan.memory_plan import MemoryPlan, _add_engine_budgets, render_plan
from opd.utils.config import load_config

CONFIG = REPO_ROOT / "examples" / "configs" / "distillation_math_cluster.yaml"
GIB = 1024**3
PEAK = 40 * GIB
RESERVED_PEAK = 46 * GIB  # 40 GiB × 1.15
CONTEXT = 3 * GIB // 2  # 1.5 GiB of runtime, per process
H100, H200 = 81_559 * 2**20, 143_771 * 2**20  # the devices as nvidia-smi reports them
ROWS = 32 // 8 * 4  # training.batch_size over cluster.rollout.workers, × distillation.num_samples_per_prompt
PROMPT, RESPONSE = 1024, 2048


def student_parameters(student) -> int:
    """Qwen2-style decoder weights, counted from its config: tied embedding, biased q/k/v, gated MLP, RMS norms."""
    hidden, head_dim = student.hidden_size, student.hidden_size // student.num_attention_heads
    kv_width = student.num_key_value_heads * head_dim
    attention = (hidden * hidden + hidden) + 2 * (hidden * kv_width + kv_width) + hidden * hidden
    layer = attention + 3 * hidden * student.intermediate_size + 2 * hidden
    return student.vocab_size * hidden + student.num_hidden_layers * layer + hidden


def planned(*overrides: str, peak: int = PEAK) -> MemoryPlan:
    """The config's plan around a trainer rank whose dry run peaked at ``peak`` (standing state from the shapes)."""
    config = load_config(MasterConfig, CONFIG, list(overrides))
    student = model_config(config.model.student_model_path)
    shard = student_parameters(student) * 4 // 8  # fp32 over 8 ranks
    rank = RankMemory(0, peak, {}, shard, shard, 2 * shard, 7 * GIB, 0)
    plan = MemoryPlan(
        world_size=8,
        student=config.model.student_model_path,
        teacher=config.model.teacher_model_path,
        teacher_placement="colocated, sharded",
        micro_batch_size=2,
        prompt_tokens=PROMPT,
        response_tokens=RESPONSE,
        vocab_size=student.vocab_size,
        activation_checkpointing=False,
        student_parameters_total=student_parameters(student),
        teacher_parameters_total=0,
        ranks={"off": [rank]},
        ranks_equal=True,
        teacher_whole_bytes=0,
        loss_chunk_rows=222,
        loss_chunk_bytes=0,
        kv_bytes_per_token=28_672,
        shard_ranks=8,
    )
    shape = StepShape(2, PROMPT, RESPONSE, micro_batches=2)
    _add_engine_budgets(plan, config, config.cluster, student, shape)
    return plan


@pytest.fixture(scope="module")
def student():
    return model_config("Qwen/Qwen2.5-1.5B-Instruct")


@pytest.fixture(scope="module")
def vllm_plan() -> MemoryPlan:
    return planned()


def test_the_parameter_count_by_hand_is_the_students(student):
    assert student_parameters(student) == 1_543_714_304


def test_the_reserved_peak_is_the_allocated_peak_times_the_stated_factor(vllm_plan):
    assert memory_plan.RESERVED_FACTOR == 1.15 and vllm_plan.reserved_factor == 1.15
    assert vllm_plan.reserved_peak_of("off") == RESERVED_PEAK
    assert vllm_plan.as_dict()["reserved_peaks"] == {"off": RESERVED_PEAK}


def test_the_verdict_counts_the_reserved_peak():
    # 70 GiB allocated + 1.5 fits 80 GB (79.65 GiB); reserved, 80.5 + 1.5 does not.
    plan = planned(peak=70 * GIB)
    assert 70 * GIB + CONTEXT <= H100 < 80 * GIB + GIB // 2 + CONTEXT
    assert plan.verdicts() == {"80 GB": {"off": False}, "141 GB": {"off": True}}
    assert "activation checkpointing off: DOES NOT FIT (82.00 GiB)" in render_plan(plan)
    measured = replace(plan, reserved_factor=1.0)
    assert measured.verdicts()["80 GB"] == {"off": True}
    assert "activation checkpointing off: fits (71.50 GiB)" in render_plan(measured)


def test_a_vllm_worker_holds_its_context_and_no_copy_of_the_student(vllm_plan):
    worker = vllm_plan.rollout_worker
    assert worker is not None
    assert (worker.context, worker.student_copy, worker.total) == (CONTEXT, 0, CONTEXT)


def test_an_hf_worker_holds_its_context_and_its_copy_of_the_student_in_the_loading_dtype(student):
    parameters = student_parameters(student)
    for dtype, element_bytes in (("bfloat16", 2), ("float32", 4)):
        plan = planned("generation.backend=hf", f"model.dtype={dtype}")
        worker = plan.rollout_worker
        assert worker is not None
        assert (worker.context, worker.student_copy) == (CONTEXT, element_bytes * parameters), dtype
        assert plan.engine["80 GB"]["kept"].weights == element_bytes * parameters  # the same copy, counted once


def test_a_vllm_engine_in_float32_holds_four_bytes_a_weight(student):
    plan = planned("generation.vllm.dtype=float32")
    assert plan.engine["80 GB"]["kept"].weights == 4 * student_parameters(student)


def test_kept_trainer_state_beside_the_vllm_share_fits_at_03_and_not_at_06():
    fitting, crowded = planned(), planned("generation.vllm.gpu_memory_utilization=0.6")
    for plan, utilization in ((fitting, 0.3), (crowded, 0.6)):
        check = plan.colocated_checks()["80 GB"]["kept"]
        share = int(H100 * utilization)
        # No empty_cache runs before the engine wakes: the trainer still reserves its step's peak.
        assert check.moment == "while sampling"
        assert [part.size for part in check.parts] == [RESERVED_PEAK, share, CONTEXT, CONTEXT]
        assert check.total == RESERVED_PEAK + share + 2 * CONTEXT
        assert check.fits == (RESERVED_PEAK + share + 2 * CONTEXT <= H100)
    assert fitting.colocated_checks()["80 GB"]["kept"].fits
    refused = crowded.colocated_checks()["80 GB"]["kept"]
    assert not refused.fits
    assert refused.describe().endswith(
        "= 96.79 of 79.65 GiB: DOES NOT FIT (set cluster.trainer.offload_during_generation: true; "
        "lower generation.vllm.gpu_memory_utilization)"
    )
    assert crowded.colocated_checks()["141 GB"]["kept"].total == RESERVED_PEAK + int(H200 * 0.6) + 2 * CONTEXT


def test_offloaded_state_is_counted_allocated_and_the_refit_moment_can_be_the_busier(student):
    parameters = student_parameters(student)
    shard = parameters * 4 // 8
    for utilization in (0.3, 0.9):
        plan = planned(f"generation.vllm.gpu_memory_utilization={utilization}")
        check = plan.colocated_checks()["80 GB"]["offloaded"]
        # Offloading ends with empty_cache: the student's shard is what the trainer then reserves.
        sampling = shard + int(H100 * utilization) + 2 * CONTEXT
        # The refit wakes vLLM's 16-bit weights while the trainer's cache still holds its reserved peak.
        refit = RESERVED_PEAK + 2 * parameters + 2 * CONTEXT
        assert check.total == max(sampling, refit), utilization
        assert check.moment == ("at the refit" if refit > sampling else "while sampling")
    assert planned().colocated_checks()["80 GB"]["offloaded"].moment == "at the refit"
    too_much = planned("generation.vllm.gpu_memory_utilization=0.99").colocated_checks()["80 GB"]["offloaded"]
    assert not too_much.fits and "lower generation.vllm.gpu_memory_utilization)" in too_much.describe()


def test_a_trainer_peak_too_large_beside_the_woken_weights_names_the_trainers_settings(student):
    check = planned(peak=70 * GIB).colocated_checks()["80 GB"]["offloaded"]
    reserved = math.ceil(70 * GIB * 1.15)
    assert check.moment == "at the refit"
    assert check.total == reserved + 2 * student_parameters(student) + 2 * CONTEXT and not check.fits
    assert check.describe().endswith(
        "DOES NOT FIT (lower the trainer's peak (cluster.trainer.activation_checkpointing: true, or a smaller "
        "training.micro_batch_size))"
    )


def test_a_vllm_engine_without_sleep_mode_holds_its_share_at_the_refit():
    check = planned("generation.vllm.enable_sleep_mode=false").colocated_checks()["80 GB"]["offloaded"]
    # Awake throughout: its whole share sits beside the trainer's reserved peak, offloading or not.
    assert check.moment == "at the refit"
    assert check.total == RESERVED_PEAK + int(H100 * 0.3) + 2 * CONTEXT
    assert check.parts[1].what == "vLLM share (no sleep mode: held throughout)"


def test_an_hf_engine_beside_the_trainer_counts_its_copy_kv_cache_and_activations(student):
    plan = planned("generation.backend=hf")
    parameters = student_parameters(student)
    head_dim = student.hidden_size // student.num_attention_heads
    kv_per_token = 2 * student.num_hidden_layers * student.num_key_value_heads * head_dim * 2
    kv_cache = ROWS * (PROMPT + RESPONSE) * kv_per_token
    prefill = ROWS * PROMPT * 2 * (4 * student.hidden_size + 3 * student.intermediate_size)
    logits = 3 * ROWS * student.vocab_size * 4
    check = plan.colocated_checks()["80 GB"]["kept"]
    worker = CONTEXT + 2 * parameters
    assert check.total == RESERVED_PEAK + kv_cache + max(prefill, logits) + worker + CONTEXT
    assert check.fits


def test_a_split_placement_has_no_colocated_check(vllm_plan):
    split = planned("cluster.placement=split")
    assert split.colocated_checks() == {} and vllm_plan.colocated_checks() != {}
    assert "colocated check: does not apply (cluster.placement: split" in render_plan(split)


def test_the_rendered_plan_states_the_factor_the_worker_and_the_colocated_check():
    text = render_plan(planned("generation.vllm.gpu_memory_utilization=0.6"))
    lines = text.splitlines()
    reserved_row = next(line for line in lines if line.startswith("reserved (allocated peak × 1.15)"))
    assert reserved_row.split()[-1] == "46.00"
    assert "verdict (reserved peak + 1.50 GiB runtime reserve; reserved = allocated peak × 1.15" in text
    assert (
        "  rollout worker, per device: CUDA context and runtime 1.50 (the runtime reserve: a process of its own) "
        "= 1.50 GiB; no copy of the student (vLLM's weights are in its share)"
    ) in lines
    kept_80 = next(line for line in lines if line.startswith("   80 GB, trainer state kept on the device : while"))
    assert kept_80 == (
        "   80 GB, trainer state kept on the device : while sampling: trainer (reserved peak) 46.00 + vLLM share "
        "47.79 + rollout worker 1.50 + runtime reserve 1.50 = 96.79 of 79.65 GiB: DOES NOT FIT (set "
        "cluster.trainer.offload_during_generation: true; lower generation.vllm.gpu_memory_utilization)"
    )
    assert memory_plan.NOT_TRACED in lines and "beyond the reserved factor" in memory_plan.NOT_TRACED


def test_the_plan_as_json_carries_the_checks(vllm_plan):
    data = json.loads(json.dumps(vllm_plan.as_dict()))
    check = data["colocated_checks"]["80 GB"]["kept"]
    assert check["total"] == RESERVED_PEAK + int(H100 * 0.3) + 2 * CONTEXT and check["fits"]
    assert data["rollout_worker"]["context"] == CONTEXT and data["reserved_factor"] == 1.15


def test_the_command_line_sets_the_factor(vllm_plan, monkeypatch, capsys):
    monkeypatch.setattr(memory_plan, "plan_memory", lambda config, variants, every_layer: vllm_plan)
    arguments = ["plan", "--config", str(CONFIG), "--quick", "--json"]
    for extra, factor in (([], 1.15), (["--reserved-factor", "1.3"], 1.3)):
        assert cli.main([*arguments, *extra]) == 0
        data = json.loads(capsys.readouterr().out)
        assert data["reserved_factor"] == factor
        assert data["reserved_peaks"]["off"] == math.ceil(PEAK * factor)
    assert cli.build_parser().parse_args(["train", "--config", "x", "--dry-run"]).reserved_factor is None
    for wrong in ("0.9", "many"):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args([*arguments, "--reserved-factor", wrong])
    assert "reserved (allocated peak × 1.15)" in render_plan(vllm_plan)  # the plan itself was left as it was
