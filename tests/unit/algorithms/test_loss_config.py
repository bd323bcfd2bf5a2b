"""The ``loss_fn:`` schema (:mod:`opd.losses.config`): one typed choice of objective.

* each variant's built loss asks the teacher for exactly what the variant says it needs
  (the config is checked against a teacher before any loss is built);
* every key of the old schema (:data:`MOVED_KEYS`) is refused with its new place;
* a key of another variant is refused naming the variant(s) it belongs to;
* setting ``loss_fn.type`` drops the keys the new type lacks that were inherited from
  parent files, and only those;
* cross-section checks raise pydantic's ``ValidationError`` from ``MasterConfig`` itself
  and a ``ConfigError`` with the same text through ``validate_config`` / ``load_config``.
"""

from __future__ import annotations

import re

import pytest
import yaml
from opd_test_helpers import REPO_ROOT
from pydantic import ValidationError

from opd.distillation.config import MOVED_KEYS, MasterConfig
from opd.losses.config import (
    LOSS_VARIANTS,
    FullVocabLossConfig,
    HybridFullVocabLossConfig,
    JSDLossConfig,
    SampledTokenLossConfig,
    TopKLossConfig,
)
from opd.models.interfaces import FullVocabRequest, TokenLogprobsRequest, TopKRequest
from opd.utils.config import load_config, load_config_tree, validate_config
from opd.utils.errors import ConfigError

CONFIGS = REPO_ROOT / "examples" / "configs"
TINY_CONFIG = CONFIGS / "distillation_tiny.yaml"
DEMO_CONFIG = CONFIGS / "demo.yaml"
V = 259  # the tiny tokenizer's vocabulary

# --------------------------------------------------------------------------- teacher requests

VARIANT_SETTINGS = [
    ("full_vocab", {}),
    ("full_vocab", {"fused_lm_head": False, "kl_type": "mixed", "temperature": 2.0, "metrics_topk": 3}),
    ("jsd", {}),
    ("jsd", {"fused_lm_head": False, "beta": 0.2, "temperature": 0.5, "compile_kernels": False}),
    ("topk", {}),
    ("topk", {"k": 7, "temperature": 1.5, "tail": False, "fused_lm_head": False}),
    ("sampled_token", {}),
    ("sampled_token", {"fused_lm_head": False, "clip_ratio": None, "adv_tau": 1.0}),
    ("hybrid_full_vocab", {}),
    ("hybrid_full_vocab", {"teacher_tau": 0.5, "student_tau": 2.0, "adv_tau": 1.0, "reduction": "sum"}),
]


def test_the_request_cases_cover_every_variant():
    assert {tag for tag, _ in VARIANT_SETTINGS} == set(LOSS_VARIANTS)


@pytest.mark.parametrize(("tag", "settings"), VARIANT_SETTINGS,
                         ids=[f"{tag}-{'defaults' if not s else 'set'}" for tag, s in VARIANT_SETTINGS])
def test_the_built_loss_asks_the_teacher_for_what_the_variant_says(tag, settings):
    variant = LOSS_VARIANTS[tag].model_validate({"type": tag, **settings})
    loss = variant.build(V, "cpu")
    assert loss.teacher_request == variant.teacher_request(V)
    assert type(loss.teacher_request) is type(variant.teacher_request(V))


@pytest.mark.parametrize(("variant", "expected"), [
    (FullVocabLossConfig(), FullVocabRequest(prefer_hidden_states=True)),
    (FullVocabLossConfig(fused_lm_head=False), FullVocabRequest(prefer_hidden_states=False)),
    (JSDLossConfig(), FullVocabRequest(prefer_hidden_states=True)),
    (TopKLossConfig(k=5, temperature=2.0), TopKRequest(5, 2.0, V)),
    (SampledTokenLossConfig(), TokenLogprobsRequest(V)),
    (HybridFullVocabLossConfig(), FullVocabRequest()),
])
def test_each_variant_names_its_teacher_signal(variant, expected):
    assert variant.teacher_request(V) == expected


# --------------------------------------------------------------------------- keys that moved

OLD_KEY_VALUES = {
    "distillation.kl_type": "forward",
    "distillation.mixed_kl_weight": "0.3",
    "distillation.kl_temperature": "1.0",
    "distillation.kl_reduction": "sum",
    "loss_fn.teacher_topk": "8",
    "loss_fn.topk_tail": "false",
    "loss_fn.divergence": "jsd",
    "loss_fn.jsd_beta": "0.5",
}


def test_every_moved_key_is_tested():
    assert set(OLD_KEY_VALUES) == set(MOVED_KEYS)


@pytest.mark.parametrize("old_key", sorted(MOVED_KEYS))
def test_an_old_key_says_where_it_moved(tmp_path, old_key):
    override = f"{old_key}={OLD_KEY_VALUES[old_key]}"
    with pytest.raises(ConfigError, match=re.escape(f"config key '{old_key}' has moved: it is now "
                                                    f"{MOVED_KEYS[old_key]}")):
        load_config(MasterConfig, TINY_CONFIG, [f"output_dir={tmp_path}", override])


def test_an_old_layout_file_lists_every_moved_key(tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump({
        "defaults": str(TINY_CONFIG),
        "distillation": {"kl_type": "forward", "kl_temperature": 1.0},
        "loss_fn": {"type": "topk", "teacher_topk": 8, "topk_tail": False},
    }))
    with pytest.raises(ConfigError) as error:
        load_config(MasterConfig, old)
    for key in ("distillation.kl_type", "distillation.kl_temperature", "loss_fn.teacher_topk", "loss_fn.topk_tail"):
        assert f"config key '{key}' has moved: it is now {MOVED_KEYS[key]}" in str(error.value)


# --------------------------------------------------------------------------- keys of another variant

_SAMPLE_VALUES = {
    "kl_type": "forward", "mixed_kl_weight": "0.3", "temperature": "1.0", "reduction": "sum",
    "fused_lm_head": "false", "chunk_size": "8", "compile_kernels": "false", "metrics_topk": "8", "beta": "0.5",
    "k": "4", "tail": "false", "teacher_tau": "1.0", "student_tau": "1.0", "adv_tau": "0.0", "discount": "0.5",
    "clip_ratio": "0.3", "token_clip": "2.0", "diagnostics_every": "4",
}
_ALL_KEYS = sorted({key for variant in LOSS_VARIANTS.values() for key in variant.model_fields} - {"type"})
FOREIGN_KEYS = [(tag, key) for tag, variant in LOSS_VARIANTS.items() for key in _ALL_KEYS
                if key not in variant.model_fields]


def test_the_sample_values_cover_every_loss_key():
    assert set(_SAMPLE_VALUES) == set(_ALL_KEYS)


@pytest.mark.parametrize(("tag", "key"), FOREIGN_KEYS, ids=[f"{key}-on-{tag}" for tag, key in FOREIGN_KEYS])
def test_a_key_of_another_variant_names_the_variant_it_belongs_to(tmp_path, tag, key):
    owners = sorted(other for other, variant in LOSS_VARIANTS.items() if key in variant.model_fields)
    expected = f"unknown key 'loss_fn.{key}' ({key} belongs to loss_fn.type = {' / '.join(owners)}, not {tag})"
    with pytest.raises(ConfigError, match=re.escape(expected)):
        load_config(MasterConfig, TINY_CONFIG,
                    [f"output_dir={tmp_path}", f"loss_fn.type={tag}", f"loss_fn.{key}={_SAMPLE_VALUES[key]}"])


def test_a_misplaced_key_in_a_validated_tree_names_its_variant():
    tree = {"model": {"teacher_model_path": "tiny:teacher", "student_model_path": "tiny:student"},
            "data": {"train_path": "unused.jsonl"}, "loss_fn": {"type": "full_vocab", "k": 8}}
    with pytest.raises(ConfigError, match=re.escape("unknown key 'loss_fn.k' (k belongs to loss_fn.type = topk, "
                                                    "not full_vocab)")):
        validate_config(MasterConfig, tree)


# --------------------------------------------------------------------------- switching type drops inherited keys


def test_demo_switched_to_topk_keeps_its_kl_type_and_drops_full_vocab_only_keys():
    inherited = load_config_tree(DEMO_CONFIG)["loss_fn"]
    # Without the switch the demo inherits the full-vocabulary keys from distillation.yaml.
    assert {"compile_kernels", "metrics_topk"} <= set(inherited) and inherited["kl_type"] == "forward"

    config = load_config(MasterConfig, DEMO_CONFIG, ["loss_fn.type=topk"])
    assert isinstance(config.loss_fn, TopKLossConfig)
    assert config.loss_fn.kl_type == "forward"  # demo.yaml's own choice, not distillation.yaml's reverse
    assert config.loss_fn.k == TopKLossConfig().k
    assert not hasattr(config.loss_fn, "compile_kernels") and not hasattr(config.loss_fn, "metrics_topk")


def test_the_type_override_applies_first_whatever_its_position():
    config = load_config(MasterConfig, DEMO_CONFIG, ["loss_fn.k=5", "loss_fn.type=topk"])
    assert isinstance(config.loss_fn, TopKLossConfig) and (config.loss_fn.k, config.loss_fn.kl_type) == (5, "forward")


def test_a_key_given_with_the_new_type_is_not_dropped_but_refused():
    with pytest.raises(ConfigError, match=re.escape("unknown key 'loss_fn.metrics_topk' (metrics_topk belongs to "
                                                    "loss_fn.type = full_vocab / jsd, not topk)")):
        load_config(MasterConfig, DEMO_CONFIG, ["loss_fn.type=topk", "loss_fn.metrics_topk=8"])


def test_a_file_that_sets_type_drops_its_parents_keys_of_other_types(tmp_path):
    child = tmp_path / "child.yaml"
    child.write_text(yaml.safe_dump({"defaults": str(DEMO_CONFIG), "loss_fn": {"type": "jsd", "beta": 0.3}}))
    config = load_config(MasterConfig, child)
    assert isinstance(config.loss_fn, JSDLossConfig) and config.loss_fn.beta == 0.3
    # kl_type (full_vocab / topk only) was inherited and dropped; compile_kernels is a jsd key and kept.
    assert not hasattr(config.loss_fn, "kl_type")
    assert config.loss_fn.compile_kernels == load_config(MasterConfig, DEMO_CONFIG).loss_fn.compile_kernels


# --------------------------------------------------------------------------- cross-section checks

BASE_TREE = {"model": {"teacher_model_path": "tiny:teacher", "student_model_path": "tiny:student"},
             "data": {"train_path": "unused.jsonl"}}
REMOTE = {"backend": "remote", "remote": {"url": "http://127.0.0.1:1"}}
# vLLM's JSON carries no hidden states: no full-vocabulary loss over it.
REMOTE_JSON = {"backend": "remote", "remote": {"url": "http://127.0.0.1:1", "protocol": "openai"}}


@pytest.mark.parametrize(("tree", "message"), [
    ({"loss_fn": {"type": "sampled_token"}, "distillation": {"lambda": 0.5}},
     "loss_fn.type = sampled_token needs the student's own samples on every step, but distillation.lambda = 0.5"),
    ({"loss_fn": {"type": "hybrid_full_vocab", "adv_tau": 1.0}, "distillation": {"lambda": 0.5}},
     "loss_fn.adv_tau = 1.0 rewards the student's own answers"),
    ({"loss_fn": {"type": "full_vocab"}, "teacher": REMOTE_JSON},
     "loss_fn.type = full_vocab with a served teacher needs its hidden states, which vLLM's JSON does not carry"),
    ({"loss_fn": {"type": "jsd"}, "teacher": REMOTE_JSON}, "loss_fn.type = jsd with a served teacher needs"),
    ({"loss_fn": {"type": "hybrid_full_vocab"}, "teacher": REMOTE,
      "model": {"teacher_model_path": None, "student_model_path": "tiny:student"}},
     "loss_fn.type = hybrid_full_vocab with a served teacher applies the teacher's output layer here"),
    ({"loss_fn": {"type": "topk", "temperature": 2.0}, "teacher": REMOTE},
     "teacher.backend = remote cannot serve loss_fn.type = topk"),
], ids=["sampled-token-lambda", "hybrid-reward-lambda", "remote-full-vocab", "remote-jsd", "remote-hybrid",
        "remote-topk-temperature"])
def test_cross_section_conflicts_are_refused_by_the_model_and_by_validate_config(tree, message):
    with pytest.raises(ValidationError, match=re.escape(message)):
        MasterConfig.model_validate({**BASE_TREE, **tree})
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_config(MasterConfig, {**BASE_TREE, **tree})


@pytest.mark.parametrize("loss_fn", [{"type": "topk"}, {"type": "topk", "k": 5}, {"type": "sampled_token"}])
def test_a_served_teacher_takes_the_objectives_it_can_answer(loss_fn):
    config = validate_config(MasterConfig, {**BASE_TREE, "model": {"student_model_path": "tiny:student"},
                                            "teacher": REMOTE, "loss_fn": loss_fn})
    assert config.loss_fn.type == loss_fn["type"]
