"""The AdamW kernel choice: ``auto`` picks the fused kernel on CPU, and every kernel takes
the same step (float64 reference: torch's per-tensor loop)."""

from __future__ import annotations

import pytest
import torch

from opd.models.tiny import build_tiny_model
from opd.policy.hf_policy import HFPolicy, OptimizerConfig, adam_kernel_kwargs
from opd.utils.config import validate_config
from opd.utils.errors import ConfigError


def test_auto_is_fused_on_cpu_and_explicit_choices_pass_through():
    params = list(build_tiny_model("student").parameters())
    assert adam_kernel_kwargs("auto", params) == {"fused": True}
    assert adam_kernel_kwargs("fused", params) == {"fused": True}
    assert adam_kernel_kwargs("foreach", params) == {"foreach": True}
    assert adam_kernel_kwargs("for_loop", params) == {"foreach": False}
    policy = HFPolicy(build_tiny_model("student"), OptimizerConfig(), 1, 1)
    assert policy.optimizer.defaults["fused"] is True


def test_integer_parameters_fall_back_to_foreach():
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, dtype=torch.long),
                                                                     requires_grad=False)]
    assert adam_kernel_kwargs("auto", params) == {"foreach": True}


def steps_with(implementation: str, steps: int = 4) -> dict[str, torch.Tensor]:
    model = build_tiny_model("student", dtype=torch.float64)
    config = OptimizerConfig(learning_rate=1e-2, weight_decay=0.1, adam_implementation=implementation,
                             max_grad_norm=None)
    policy = HFPolicy(model, config, 1, steps)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        for param in model.parameters():
            param.grad = torch.randn(param.shape, generator=generator, dtype=param.dtype)
        policy.optimizer.step()
    return {name: param.detach().clone() for name, param in model.named_parameters()}


@pytest.mark.parametrize("implementation", ["auto", "fused", "foreach"])
def test_every_kernel_takes_the_same_steps_as_the_loop(implementation):
    reference = steps_with("for_loop")
    other = steps_with(implementation)
    moved = max(float((reference[name] - build_tiny_model("student", dtype=torch.float64).state_dict()[name])
                      .abs().max()) for name in reference)
    assert moved > 1e-3  # the steps did something
    for name, value in reference.items():
        torch.testing.assert_close(other[name], value, rtol=0, atol=1e-12)


def test_unknown_kernel_is_a_config_error():
    with pytest.raises(ConfigError, match="adam_implementation"):
        validate_config(OptimizerConfig, {"adam_implementation": "apex"})
