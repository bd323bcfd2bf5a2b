"""opd.utils.devices: a device's type read from a torch device or its name."""

import pytest
import torch

from opd.utils.devices import is_cpu, is_cuda


@pytest.mark.parametrize(
    ("device", "cuda", "cpu"),
    [
        ("cuda", True, False),
        ("cuda:1", True, False),
        (torch.device("cuda", 0), True, False),
        ("cpu", False, True),
        (torch.device("cpu"), False, True),
        (torch.device("meta"), False, False),
    ],
)
def test_device_type(device: torch.device | str, cuda: bool, cpu: bool) -> None:
    assert is_cuda(device) is cuda
    assert is_cpu(device) is cpu


def test_tf32_is_set_for_cuda_loads_only():
    """``model.tf32``: process-wide torch flags, set where a model is loaded for CUDA, never for the CPU."""
    import torch

    from opd.models.config import ModelLoadingConfig
    from opd.utils.devices import use_tf32_matmuls

    assert ModelLoadingConfig().tf32 is True
    before = torch.backends.cuda.matmul.fp32_precision
    try:
        use_tf32_matmuls(True, "cpu")
        assert torch.backends.cuda.matmul.fp32_precision == before
        use_tf32_matmuls(True, "cuda:0")
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
        use_tf32_matmuls(False, torch.device("cuda", 1))
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"
    finally:
        torch.backends.cuda.matmul.fp32_precision = before
