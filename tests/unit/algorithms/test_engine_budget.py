"""The rollout engine's budget in ``opd plan`` with vLLM tensor parallel.

Over ``n`` devices each holds ``1/n`` of the weights and of the KV heads (heads are
replicated where there are fewer heads than devices), so for the same device share the
engine fits more tokens; checked against the arithmetic written out here.
"""

from __future__ import annotations

from opd.models.model_shapes import model_config
from opd.plan.memory_plan import DEVICES, _engine_budget


def test_tensor_parallel_splits_the_weights_and_the_kv_heads():
    student = model_config("Qwen/Qwen2.5-1.5B-Instruct")  # 2 KV heads
    parameters, vocab, row_tokens = 1_543_714_304, 151_936, 4096
    args = (DEVICES["80 GB"], 0.3, 0, student, parameters, vocab, row_tokens)
    one, two, four = (_engine_budget(*args, tensor_parallel=n) for n in (1, 2, 4))
    assert two.weights == one.weights // 2 and four.weights == one.weights // 4
    head_dim = student.hidden_size // student.num_attention_heads
    whole_token = 2 * student.num_hidden_layers * student.num_key_value_heads * head_dim * 2
    assert one.kv_tokens == one.kv_cache // whole_token
    assert two.kv_tokens == two.kv_cache // (whole_token // 2)
    # Four devices, two KV heads: each device keeps one whole head, as with two devices.
    assert four.kv_tokens == four.kv_cache // (whole_token // 2)
    assert two.kv_cache - one.kv_cache == one.weights - two.weights
