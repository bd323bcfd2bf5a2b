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
