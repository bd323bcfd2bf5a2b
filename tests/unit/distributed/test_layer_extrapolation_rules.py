"""The rules of :mod:`opd.plan.layer_extrapolation`: which models qualify, and the per-phase arithmetic."""

from __future__ import annotations

from torch import nn
from transformers import GPT2Config, Qwen2Config

from opd.models.tiny import build_tiny_model
from opd.plan.layer_extrapolation import (
    Trace,
    decoder_layers,
    extrapolate,
    extrapolated_depths,
    largest_phase_peak,
    uniform_depth,
    with_depth,
)


def test_a_qwen2_model_with_one_attention_kind_is_uniform():
    assert uniform_depth(Qwen2Config(num_hidden_layers=28)) == 28


def test_sliding_and_full_attention_interleaved_is_not_uniform():
    config = Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=16, max_window_layers=2)
    assert len(set(config.layer_types)) == 2
    assert uniform_depth(config) is None


def test_a_model_type_opd_does_not_know_to_be_uniform_is_traced_whole():
    assert uniform_depth(GPT2Config(n_layer=12)) is None


def test_with_depth_cuts_the_layer_list_and_leaves_the_config_alone():
    config = Qwen2Config(num_hidden_layers=28)
    cut = with_depth(config, 3)
    assert cut.num_hidden_layers == 3 and len(cut.layer_types) == 3
    assert config.num_hidden_layers == 28 and len(config.layer_types) == 28


def test_only_models_deeper_than_4_layers_are_extrapolated():
    assert extrapolated_depths({"a": 4, "b": 5, "c": 64}) == {"b": 5, "c": 64}


def test_decoder_layers_are_found_under_the_model_and_absent_elsewhere():
    model = build_tiny_model("student")
    layers = decoder_layers(model, model.config.num_hidden_layers)
    assert layers == list(model.model.layers)
    assert decoder_layers(nn.Sequential(nn.Linear(2, 2)), 2) == []


def _trace(student: int, teacher: int) -> Trace:
    """Figures of a made-up step, affine in both depths, whose peak moves from one phase to another with depth."""
    return Trace(
        {"weights": 100 * student + 300 * teacher + 7},
        {
            # The teacher's forward: its gathered layer, whatever the student's depth.
            (0, "in", "teacher0", "forward", "middle"): {"fakegpu": {"Total": 500 + 2 * teacher, "All Gather": 500}},
            # The loss: every student layer's activations.
            (1, "after", "student", "forward", "last"): {
                "fakegpu": {"Total": 40 * student + 10, "Activation": 40 * student},
                "cpu": {"Total": 16},
            },
        },
    )


def test_each_phase_is_extrapolated_and_the_largest_is_the_peak():
    base, deeper = _trace(3, 3), {"student": _trace(4, 3), "teacher": _trace(3, 4)}
    result = extrapolate(base, deeper, {"student": 28 - 3, "teacher": 64 - 3})
    assert result is not None
    assert result.scalars == _trace(28, 64).scalars
    assert result.peaks == _trace(28, 64).peaks
    # At 3 and 4 layers the teacher's phase holds the peak; at 28 the student's loss does.
    # Extrapolating the peak itself would have given 500 + 2 · 64 = 628.
    assert largest_phase_peak(base.peaks)["fakegpu"]["Total"] == 506
    assert largest_phase_peak(result.peaks)["fakegpu"] == {"Total": 40 * 28 + 10, "Activation": 40 * 28}
    assert largest_phase_peak(result.peaks)["cpu"] == {"Total": 16}


def test_traces_with_different_phases_are_not_extrapolated():
    base = _trace(3, 3)
    deeper = _trace(4, 3)
    deeper.peaks[(2, "after", "student", "backward", "first")] = {"fakegpu": {"Total": 1}}
    assert extrapolate(base, {"student": deeper}, {"student": 25}) is None
