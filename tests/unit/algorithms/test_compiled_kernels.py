"""``loss_fn.compile_kernels``: the compiled kernels compute what the eager ones do, and
the setting resolves (or stops setup) according to the compiler toolchain."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from opd.distillation.config import MasterConfig
from opd.distillation.setup import setup
from opd.kernels.compiled_kernels import kl_metrics_from_logits
from opd.kernels.fused_lm_head import LMHeadInput
from opd.losses import config as loss_config_module
from opd.losses.config import CPU_COMPILE_MIN_VOCAB, compile_loss_kernels
from opd.losses.distillation_losses import JSDLossFn, KLLossFn
from opd.utils import compile_cache
from opd.utils.compile_cache import resolve_compile_kernels
from opd.utils.config import load_config
from opd.utils.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[3]
TINY_CONFIG = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"


# auto compiles only where inductor can build CPU kernels (a C++ compiler and Python's headers):
# on a machine without them these tests have nothing to check.
needs_cpu_toolchain = pytest.mark.skipif(
    compile_cache.compiler_toolchain_problem("cpu") is not None,
    reason=f"no CPU compiler toolchain here: {compile_cache.compiler_toolchain_problem('cpu')}",
)


def float64_kl_sums(student: torch.Tensor, teacher: torch.Tensor) -> tuple[float, float]:
    log_q = torch.log_softmax(student.double(), -1)
    log_p = torch.log_softmax(teacher.double(), -1)
    forward = sum(float(p * (lp - lq)) for p, lp, lq in zip(log_p.exp().flatten(), log_p.flatten(), log_q.flatten())
                  if p > 0)
    reverse = sum(float(q * (lq - lp)) for q, lq, lp in zip(log_q.exp().flatten(), log_q.flatten(), log_p.flatten())
                  if q > 0)
    return forward, reverse


def test_kl_metric_kernel_equals_the_float64_reference_with_masked_and_extreme_logits():
    generator = torch.Generator().manual_seed(0)
    student = torch.randn(5, 40, generator=generator) * 4
    teacher = torch.randn(5, 40, generator=generator) * 4
    teacher[0, :10] = -math.inf  # P = 0 there: 0·log 0 terms
    student[1, 30:] = -math.inf  # Q = 0 there while P > 0: the forward KL of that row is +inf
    student[2] *= 50.0  # a nearly one-hot row
    forward, reverse, log_norm_q, log_norm_p = kl_metrics_from_logits(student[[0, 2, 3, 4]], teacher[[0, 2, 3, 4]])
    expected_forward, expected_reverse = float64_kl_sums(student[[0, 2, 3, 4]], teacher[[0, 2, 3, 4]])
    assert float(forward) == pytest.approx(expected_forward, rel=1e-5)
    assert float(reverse) == pytest.approx(expected_reverse, rel=1e-5)
    torch.testing.assert_close(log_norm_q.double(), torch.logsumexp(student[[0, 2, 3, 4]].double(), -1))
    torch.testing.assert_close(log_norm_p.double(), torch.logsumexp(teacher[[0, 2, 3, 4]].double(), -1))
    infinite_forward, _, _, _ = kl_metrics_from_logits(student[1:2], teacher[1:2])
    assert float(infinite_forward) == math.inf


@pytest.mark.parametrize(
    ("loss_class", "settings", "temperature"),
    [(KLLossFn, {"kl_type": "reverse"}, 1.0), (KLLossFn, {"kl_type": "mixed", "mixed_kl_weight": 0.3}, 1.5),
     (JSDLossFn, {"beta": 0.5}, 1.0)],
    ids=["reverse-T1", "mixed-T1.5", "jsd-T1"],
)
def test_compiled_fused_loss_equals_eager(loss_class, settings, temperature):
    generator = torch.Generator().manual_seed(1)
    vocab, hidden, teacher_hidden = 700, 16, 24
    student_states = torch.randn(3, 9, hidden, generator=generator)
    student_weight = torch.randn(vocab, hidden, generator=generator) * 0.3
    teacher_states = torch.randn(3, 9, teacher_hidden, generator=generator)
    teacher_weight = torch.randn(vocab, teacher_hidden, generator=generator) * 0.3
    token_mask = torch.ones(3, 9)
    token_mask[:, :3] = 0  # prompt
    token_mask[2, 7:] = 0  # padding
    data = {"token_mask": token_mask}
    results = {}
    for compile_kernels in (False, True):
        states = student_states.clone().requires_grad_()
        weight = student_weight.clone().requires_grad_()
        loss_fn = loss_class(temperature=temperature, fused_lm_head=True, chunk_size=7,
                             compile_kernels=compile_kernels, metrics_topk=5, **settings)
        loss, metrics = loss_fn(LMHeadInput(states, weight, None), data, int(token_mask[:, 1:].sum()), 3,
                                teacher_output=LMHeadInput(teacher_states, teacher_weight, None))
        loss.backward()
        results[compile_kernels] = (loss.detach(), states.grad, weight.grad, metrics)
    eager, compiled = results[False], results[True]
    assert float(eager[0]) > 1e-3
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(compiled[1], eager[1], rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(compiled[2], eager[2], rtol=1e-4, atol=1e-7)
    for key, value in eager[3].items():
        assert compiled[3][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


@pytest.fixture
def no_compiler(monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(compile_cache.shutil, "which", lambda name: None)


def test_auto_follows_the_toolchain(no_compiler):
    assert resolve_compile_kernels("auto", "cpu") is False
    assert resolve_compile_kernels(False, "cpu") is False
    with pytest.raises(ConfigError, match=r"loss_fn\.compile_kernels.*C\+\+ compiler"):
        resolve_compile_kernels(True, "cpu")


def test_missing_python_headers_are_a_missing_toolchain(monkeypatch, tmp_path):
    """A C++ compiler without Python.h cannot build inductor's CPU wrappers: auto must not compile."""
    monkeypatch.setenv("CXX", "g++")
    monkeypatch.setattr(compile_cache.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(compile_cache.sysconfig, "get_paths", lambda: {"include": str(tmp_path)})
    assert "Python headers are missing" in compile_cache.compiler_toolchain_problem("cpu")
    assert resolve_compile_kernels("auto", "cpu") is False
    (tmp_path / "Python.h").write_text("")
    assert compile_cache.compiler_toolchain_problem("cpu") is None


@needs_cpu_toolchain
def test_auto_compiles_where_a_compiler_exists():
    assert resolve_compile_kernels("auto", "cpu") is True


@needs_cpu_toolchain
def test_auto_leaves_a_small_vocabulary_eager_on_cpu_only():
    """``auto`` compiles the loss from CPU_COMPILE_MIN_VOCAB entries up on CPU; ``true`` at any size."""
    assert compile_loss_kernels("auto", "cpu", CPU_COMPILE_MIN_VOCAB - 1) is False
    assert compile_loss_kernels("auto", "cpu", CPU_COMPILE_MIN_VOCAB) is True
    assert compile_loss_kernels(True, "cpu", 8) is True
    assert compile_loss_kernels(False, "cpu", 151_669) is False


@needs_cpu_toolchain
def test_a_built_loss_follows_the_vocabulary_rule(tmp_path):
    loss_config = run_config(tmp_path, "loss_fn.compile_kernels=auto").loss_fn
    assert loss_config.build(CPU_COMPILE_MIN_VOCAB - 1, "cpu").compile_kernels is False
    assert loss_config.build(151_669, "cpu").compile_kernels is True


def test_the_vocabulary_rule_is_for_cpu_only(monkeypatch):
    monkeypatch.setattr(loss_config_module, "resolve_compile_kernels", lambda setting, device, *, pays_off: pays_off)
    assert compile_loss_kernels("auto", "cuda", 8) is True
    assert compile_loss_kernels("auto", "cpu", 8) is False


def run_config(tmp_path: Path, *overrides: str) -> MasterConfig:
    base = [f"output_dir={tmp_path / 'run'}", f"logger.log_dir={tmp_path / 'run' / 'logs'}"]
    return load_config(MasterConfig, TINY_CONFIG, base + list(overrides))


def test_required_compilation_without_a_compiler_stops_setup(tmp_path, no_compiler):
    with pytest.raises(ConfigError, match=r"loss_fn\.compile_kernels"):
        setup(run_config(tmp_path, "loss_fn.compile_kernels=true"))
    assert not (tmp_path / "run").exists()
    assert run_config(tmp_path).loss_fn.build(100, "cpu").compile_kernels is False  # auto, no compiler


def test_unknown_compile_setting_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"loss_fn\.compile_kernels"):
        run_config(tmp_path, "loss_fn.compile_kernels=sometimes")
