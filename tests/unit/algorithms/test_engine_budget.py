"""The rollout engines' budgets in ``opd plan``: vLLM's with tensor parallel, HF's from its rows.

Over ``n`` devices a vLLM engine holds ``1/n`` of the weights and of the KV heads on each
(heads are replicated where there are fewer heads than devices), so for the same device
share it fits more tokens. Its KV cache is what its share leaves after its own weights and
activations (a colocated trainer does not shrink it), or the size set. The HF engine reserves nothing: it holds a copy of the
student and the KV cache of the rows it samples. Both checked against the arithmetic
written out here.
"""

from __future__ import annotations

from opd.models.model_shapes import model_config
from opd.plan.memory_plan import DEVICES
from opd.rollout.engine_kind import PlannedRollout
from opd.rollout.engines import ENGINES, GenerationConfig
from opd.rollout.vllm_generation import VllmGenerationConfig

STUDENT = "Qwen/Qwen2.5-1.5B-Instruct"  # 2 KV heads
PARAMETERS, VOCAB = 1_543_714_304, 151_936


def _rollout(student, rows=1, trainer_resident=0) -> PlannedRollout:
    return PlannedRollout(DEVICES["80 GB"], trainer_resident, student, PARAMETERS, VOCAB, 1024, 3072, rows)


def _whole_token(student) -> int:
    head_dim = student.hidden_size // student.num_attention_heads
    return 2 * student.num_hidden_layers * student.num_key_value_heads * head_dim * 2


def test_tensor_parallel_splits_the_weights_and_the_kv_heads():
    student = model_config(STUDENT)

    def budget(tensor_parallel: int):
        settings = GenerationConfig(backend="vllm", vllm=VllmGenerationConfig(tensor_parallel_size=tensor_parallel))
        return settings.engine.planned_memory(settings, _rollout(student))

    one, two, four = budget(1), budget(2), budget(4)
    assert one.share == int(DEVICES["80 GB"] * 0.3)
    assert two.weights == one.weights // 2 and four.weights == one.weights // 4
    whole_token = _whole_token(student)
    assert one.kv_tokens == one.kv_cache // whole_token
    assert two.kv_tokens == two.kv_cache // (whole_token // 2)
    # Four devices, two KV heads: each device keeps one whole head, as with two devices.
    assert four.kv_tokens == four.kv_cache // (whole_token // 2)
    assert two.kv_cache - one.kv_cache == one.weights - two.weights
    assert one.kv_sequences == one.kv_tokens // 4096


def test_vllm_sizes_its_kv_cache_within_its_own_share_whatever_else_the_device_holds():
    # vLLM (>= 0.32, the extra's floor) asks for gpu_memory_utilization x the device for the instance alone and
    # refuses to start where that much is not free; its profiling counts its own weights and activations only.
    student = model_config(STUDENT)
    settings = GenerationConfig(backend="vllm")
    alone, beside_a_trainer = (
        settings.engine.planned_memory(settings, _rollout(student, trainer_resident=resident))
        for resident in (0, 10 * 1024**3)
    )
    assert alone == beside_a_trainer
    assert alone.kv_cache == alone.share - alone.weights - alone.activations > 0
    assert "share" in alone.describe() and "trainer" not in alone.describe()


def test_a_set_kv_cache_size_is_the_cache_and_the_engine_holds_it_with_its_weights():
    student = model_config(STUDENT)
    settings = GenerationConfig(backend="vllm", vllm=VllmGenerationConfig(kv_cache_memory_bytes=2 * 1024**3))
    budget = settings.engine.planned_memory(settings, _rollout(student))
    assert budget.kv_cache == 2 * 1024**3 and budget.kv_tokens == 2 * 1024**3 // _whole_token(student)
    assert budget.while_sampling.size == budget.share == budget.weights + budget.activations + 2 * 1024**3
    assert "as set (generation.vllm.kv_cache_memory_bytes)" in budget.describe()


def test_the_hf_engine_holds_a_copy_of_the_student_and_its_rows_kv_cache():
    student = model_config(STUDENT)
    settings = GenerationConfig()
    eight, sixteen = (settings.engine.planned_memory(settings, _rollout(student, rows)) for rows in (8, 16))
    assert eight.weights == sixteen.weights == 2 * PARAMETERS
    assert eight.kv_cache == 8 * 4096 * _whole_token(student) and sixteen.kv_cache == 2 * eight.kv_cache
    assert sixteen.activations == 2 * eight.activations
    assert eight.total == eight.weights + eight.kv_cache + eight.activations
    assert "8 sequences of 4096" in eight.describe()


def test_every_engine_plans_its_memory():
    student = model_config(STUDENT)
    for name, engine in ENGINES.items():
        settings = GenerationConfig(backend=name)
        budget = engine.planned_memory(settings, _rollout(student))
        assert budget.describe()
        assert budget.while_sampling.size >= budget.at_refit.size > 0, name
        assert engine.worker_memory(settings, _rollout(student)).context == int(1.5 * 1024**3), name


def test_a_vllm_engine_wakes_its_share_to_sample_and_its_weights_for_the_refit():
    student = model_config(STUDENT)
    sleeping = GenerationConfig(backend="vllm", vllm=VllmGenerationConfig(gpu_memory_utilization=0.5))
    budget = sleeping.engine.planned_memory(sleeping, _rollout(student))
    assert budget.while_sampling.size == int(DEVICES["80 GB"] * 0.5)
    assert budget.at_refit.size == 2 * PARAMETERS  # 16-bit weights, woken alone
    awake = GenerationConfig(backend="vllm", vllm=VllmGenerationConfig(enable_sleep_mode=False))
    assert awake.engine.planned_memory(awake, _rollout(student)).at_refit.size == int(DEVICES["80 GB"] * 0.3)
    # Its weights are in its share: the worker's process adds its CUDA context alone.
    assert sleeping.engine.worker_memory(sleeping, _rollout(student)).student_copy == 0


def test_the_hf_engines_copy_is_the_workers_in_the_loading_dtype():
    student = model_config(STUDENT)
    settings = GenerationConfig()
    fp32 = PlannedRollout(DEVICES["80 GB"], 0, student, PARAMETERS, VOCAB, 1024, 3072, 8, student_element_bytes=4)
    budget = settings.engine.planned_memory(settings, fp32)
    worker = settings.engine.worker_memory(settings, fp32)
    assert budget.weights == worker.student_copy == 4 * PARAMETERS
    assert worker.total == int(1.5 * 1024**3) + 4 * PARAMETERS
    # Sampling adds the rows' KV cache and activations to the worker's copy; its cache keeps them after.
    assert budget.while_sampling.size == budget.at_refit.size == budget.kv_cache + budget.activations
