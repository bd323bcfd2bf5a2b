"""Tests for ``opd.utils.config``: YAML loading with ``defaults``, overrides, validation.

Every user mistake must become one :class:`ConfigError` whose message names the dotted key
and what is allowed, before any model is loaded.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from opd.distillation.config import MasterConfig
from opd.losses.config import LOSS_VARIANTS
from opd.utils.config import config_to_yaml, load_config, load_config_tree
from opd.utils.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[3]
CONFIGS = REPO_ROOT / "examples" / "configs"
TINY = CONFIGS / "distillation_tiny.yaml"


def load(*overrides: str, path: Path = TINY) -> MasterConfig:
    return load_config(MasterConfig, path, list(overrides))


def config_error(*overrides: str, path: Path = TINY) -> str:
    with pytest.raises(ConfigError) as error:
        load(*overrides, path=path)
    return str(error.value)


# --------------------------------------------------------------------------- loading


def test_tiny_config_inherits_from_template():
    config = load()
    # The child's own keys.
    assert config.output_dir == "results/distillation_tiny"
    assert config.model.teacher_model_path == "tiny:teacher"
    assert config.model.student_model_path == "tiny:student"
    assert config.distillation.num_samples_per_prompt == 2
    assert config.training.batch_size == 8
    assert config.training.learning_rate == pytest.approx(3e-3)
    # Nested sections merge key by key: the child changes some generate_strategy keys and
    # inherits the rest from distillation.yaml.
    assert config.distillation.generate_strategy.decoding_method == "top_p"
    assert config.distillation.generate_strategy.max_length == 32
    assert config.distillation.generate_strategy.top_k == 50
    assert config.validation.generate_strategy.decoding_method == "greedy"
    assert config.validation.generate_strategy.top_p == pytest.approx(0.95)
    # Keys only in the parent.
    assert config.training.adam_beta2 == pytest.approx(0.999)
    assert config.training.max_grad_norm == pytest.approx(1.0)
    assert config.checkpointing.keep_top_k == 3
    assert config.loss_fn.reduction == "mean"
    # Interpolations resolve after the merge, against the child's output_dir.
    assert config.logger.log_dir == "results/distillation_tiny/logs"
    assert config.checkpointing.checkpoint_dir == "results/distillation_tiny/checkpoints"


def test_template_config_loads():
    config = load(path=CONFIGS / "distillation.yaml")
    assert config.model.student_model_path == "Qwen/Qwen2.5-1.5B-Instruct"
    assert config.distillation.lambda_ == 1.0
    assert config.logger.log_dir == "results/distillation/logs"


def test_defaults_list_later_parents_win(tmp_path):
    (tmp_path / "a.yaml").write_text("x: 1\ny: {p: 1, q: 1}\n")
    (tmp_path / "b.yaml").write_text("y: {q: 2, r: 2}\n")
    (tmp_path / "child.yaml").write_text("defaults: [a.yaml, b.yaml]\nz: 3\ny: {r: 3}\n")
    tree = load_config_tree(tmp_path / "child.yaml")
    assert tree == {"x": 1, "y": {"p": 1, "q": 2, "r": 3}, "z": 3}


def test_overrides_apply_with_types():
    config = load("training.learning_rate=1e-4", "distillation.lambda=0.5", "training.batch_size=4",
                  "data.shuffle=false", "distillation.generate_strategy.top_p=0.5")
    assert isinstance(config.training.learning_rate, float)
    assert config.training.learning_rate == pytest.approx(1e-4)
    assert isinstance(config.distillation.lambda_, float)
    assert config.distillation.lambda_ == pytest.approx(0.5)
    assert config.training.batch_size == 4 and isinstance(config.training.batch_size, int)
    assert config.data.shuffle is False
    assert config.distillation.generate_strategy.top_p == pytest.approx(0.5)


def test_overrides_feed_interpolations_and_null():
    config = load("output_dir=/tmp/elsewhere", "data.val_path=null", "training.max_grad_norm=null")
    assert config.logger.log_dir == "/tmp/elsewhere/logs"
    assert config.checkpointing.checkpoint_dir == "/tmp/elsewhere/checkpoints"
    assert config.data.val_path is None
    assert config.training.max_grad_norm is None


def test_dumped_config_loads_back_identically(tmp_path):
    config = load("distillation.lambda=0.25", "loss_fn.kl_type=mixed")
    text = config_to_yaml(config)
    assert "lambda: 0.25" in text
    path = tmp_path / "dumped.yaml"
    path.write_text(text)
    assert load(path=path) == config


# --------------------------------------------------------------------------- unknown keys


def test_unknown_top_level_key():
    message = config_error("trainig.batch_size=4")
    assert "'trainig'" in message
    assert "did you mean 'training'" in message


def test_unknown_nested_key_suggests_the_right_one():
    message = config_error("distillation.lamda=0.5")
    assert "distillation.lamda" in message
    assert "did you mean 'lambda'" in message
    assert "num_samples_per_prompt" in message  # the allowed keys are listed with their YAML spelling
    message = config_error("loss_fn.kl_typ=forward")
    assert "loss_fn.kl_typ" in message
    assert "did you mean 'kl_type'" in message
    assert "mixed_kl_weight" in message


def test_unknown_deeply_nested_key():
    message = config_error("distillation.generate_strategy.top_kk=3")
    assert "distillation.generate_strategy.top_kk" in message
    assert "did you mean 'top_k'" in message


def test_unknown_key_in_yaml_file(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text(f"defaults: {TINY}\ntraining:\n  lerning_rate: 0.1\n")
    message = config_error(path=path)
    assert "training.lerning_rate" in message
    assert "did you mean 'learning_rate'" in message


# --------------------------------------------------------------------------- bad values


def test_wrong_type():
    message = config_error("training.batch_size=abc")
    assert "training.batch_size" in message
    assert "abc" in message
    assert "integer" in message


@pytest.mark.parametrize(
    "override, key, detail",
    [
        ("distillation.lambda=1.5", "distillation.lambda", "less than or equal to 1"),
        ("distillation.lambda=-0.1", "distillation.lambda", "greater than or equal to 0"),
        ("distillation.generate_strategy.top_p=0", "distillation.generate_strategy.top_p", "greater than 0"),
        ("distillation.generate_strategy.top_p=1.1", "distillation.generate_strategy.top_p", "less than or equal to 1"),
        ("distillation.num_samples_per_prompt=0", "distillation.num_samples_per_prompt", "greater than or equal to 1"),
        ("training.learning_rate=0", "training.learning_rate", "greater than 0"),
        ("loss_fn.temperature=0", "loss_fn.temperature", "greater than 0"),
    ],
)
def test_out_of_range(override, key, detail):
    message = config_error(override)
    assert key in message
    assert detail in message


def test_kl_type_lists_allowed_values():
    message = config_error("loss_fn.kl_type=fwd")
    assert "loss_fn.kl_type" in message
    assert "'fwd'" in message
    for allowed in ("forward", "reverse", "mixed"):
        assert allowed in message


def test_several_problems_are_reported_together():
    message = config_error("distillation.lambda=2", "training.batch_size=abc")
    assert "distillation.lambda" in message and "training.batch_size" in message


@pytest.mark.parametrize("override, detail", [
    ("training.batch_size=yes", "expected an integer, got the word 'yes'"),
    ("distillation.lambda=on", "expected a number, got the word 'on'"),
    ("training.batch_size=true", "expected an integer, got the boolean true"),
    ('training.learning_rate="1e-5"', "got the string '1e-5' (write it without quotes)"),
    ("training.max_num_steps='3'", "got the string '3' (write it without quotes)"),
])
def test_numbers_are_not_coerced_from_booleans_or_strings(override, detail):
    message = config_error(override)
    assert override.split("=")[0] in message and detail in message


def test_yaml_12_numbers_and_booleans(tmp_path):
    # YAML 1.1 reads 1e-5 as a string and 010 as 8; opd reads YAML 1.2's core scalars.
    path = tmp_path / "numbers.yaml"
    path.write_text(f"defaults: {TINY}\ntraining:\n  learning_rate: 1e-5\n  max_num_steps: 010\n"
                    "distillation:\n  mask_prompt_tokens: True\n", encoding="utf-8")
    config = load(path=path)
    assert config.training.learning_rate == 1e-5 and config.training.max_num_steps == 10
    assert config.distillation.mask_prompt_tokens is True
    assert load("training.learning_rate=2e-4").training.learning_rate == 2e-4


def test_types_beyond_json_are_strings_or_a_named_error(tmp_path):
    # YAML 1.2's core schema has no dates: an unquoted date is a string, refused where a number belongs (it
    # was a datetime.date, which OmegaConf could not hold: a traceback). An explicit tag is an error at its line.
    assert "training.seed = '2024-01-01': expected an integer, got the string '2024-01-01'" in config_error(
        "training.seed=2024-01-01")
    assert load("output_dir=2024-01-01").output_dir == "2024-01-01"
    dated = tmp_path / "dated.yaml"
    dated.write_text(f"defaults: {TINY}\ntraining:\n  seed: 2024-01-01\n", encoding="utf-8")
    assert "expected an integer, got the string '2024-01-01'" in config_error(path=dated)
    for tag, words in (("!!set {a, b}", "set (a set)"), ("!!binary aGk=", "binary (binary data)"),
                       ("!!timestamp 2024-01-01", "timestamp (a date)")):
        tagged = tmp_path / "tagged.yaml"
        tagged.write_text(f"defaults: {TINY}\ntraining:\n  seed: {tag}\n", encoding="utf-8")
        message = config_error(path=tagged)
        assert f"config file {tagged} is not valid YAML: {words} is not a config value" in message
        assert "(line 3, column 9)" in message
        assert f"override 'training.seed={tag}': the value is not valid YAML: {words}" in config_error(
            f"training.seed={tag}")


@pytest.mark.parametrize("override", ["training=[1]", "training=3", "training=null", "loss_fn=[]"])
def test_a_section_replaced_by_another_kind_of_value_is_one_line(override):
    # OmegaConf's merge raised a bare TypeError (a traceback) for a list in place of a section.
    message = config_error(override)
    assert override.split("=")[0] in message and "\n" not in message


def test_a_broken_interpolation_in_a_file_names_its_key(tmp_path):
    for value, detail in (("${", "no viable alternative"), ("${nope}", "Interpolation key 'nope' not found")):
        path = tmp_path / "interpolation.yaml"
        path.write_text(f"defaults: {TINY}\ncheckpointing:\n  checkpoint_dir: {value}\n", encoding="utf-8")
        message = config_error(path=path)
        assert message.startswith("config interpolation failed at checkpointing.checkpoint_dir: ") and detail in message


def _random_tree(generator, depth: int) -> dict:
    """A nested mapping over a few shared keys: scalars, lists, null, interpolations and sub-mappings."""
    tree = {}
    for key in generator.sample(["a", "b", "c", "d", "type"], generator.randint(0, 4)):
        kind = generator.choice(["int", "float", "str", "bool", "null", "list", "interpolation", "map", "map"])
        if kind == "map" and depth < 3:
            tree[key] = _random_tree(generator, depth + 1)
        elif kind == "list":
            tree[key] = [generator.randint(0, 9) for _ in range(generator.randint(0, 3))]
        else:
            tree[key] = {"int": generator.randint(-5, 5), "float": generator.random(), "str": "x",
                         "bool": True, "null": None, "interpolation": "${a}"}.get(kind, 7)
    return tree


def _scribble_over(tree) -> None:
    """Adds an entry to every mapping and list in ``tree``."""
    for value in list(tree.values()) if isinstance(tree, dict) else list(tree):
        if isinstance(value, (dict, list)):
            _scribble_over(value)
    if isinstance(tree, dict):
        tree["scribbled"] = 1
    else:
        tree.append("scribbled")


def test_the_merge_is_omegaconfs_on_random_trees():
    # The reference is OmegaConf's merge, which the config loader used before; the plain merge must equal it
    # wherever OmegaConf merges at all (it refuses a list meeting a mapping; there the later value now wins).
    import copy
    import json
    import random

    from omegaconf import OmegaConf

    from opd.utils.config import _merge

    generator = random.Random(0)
    compared = 0
    for _ in range(400):
        base, incoming = _random_tree(generator, 0), _random_tree(generator, 0)
        before = copy.deepcopy((base, incoming))
        try:
            expected = OmegaConf.to_container(
                OmegaConf.merge(OmegaConf.create(base), OmegaConf.create(incoming)), resolve=False)
        except TypeError:  # "Cannot merge incompatible container types": a list meets a mapping or interpolation
            continue
        merged = _merge(base, incoming)
        assert json.dumps(merged) == json.dumps(expected), (base, incoming)  # the values and every key's place
        _scribble_over(merged)  # the result shares no container with the inputs: they stay as they were
        assert (base, incoming) == before
        compared += 1
    assert compared > 300


@pytest.mark.parametrize("text, lines", [
    ("training:\n  batch_size: 4\ndata:\n  val_path: null\ntraining:\n  max_num_steps: 3\n", "lines 1 and 5"),
    ("training:\n  batch_size: 4\n  warmup_steps: 0\n  batch_size: 8\n", "lines 2 and 4"),
])
def test_a_key_written_twice_names_both_lines(tmp_path, text, lines):
    path = tmp_path / "twice.yaml"
    path.write_text(f"defaults: {TINY}\n" + text, encoding="utf-8")
    key = "training" if text.count("training:") == 2 else "batch_size"
    shifted = " and ".join(str(int(number) + 1) for number in lines.removeprefix("lines ").split(" and "))
    message = config_error(path=path)
    assert f"key '{key}' appears twice in one mapping (lines {shifted})" in message and str(path) in message


def test_a_config_that_is_not_utf8_or_empty_is_named(tmp_path):
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(f"defaults: {TINY}\n# caf\xe9\n".encode("latin-1"))
    assert config_error(path=latin1) == (f"config file {latin1} is not UTF-8 text: byte "
                                         f"{len(f'defaults: {TINY}') + 7} (line 2) cannot be decoded; save the file "
                                         "as UTF-8")
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing here\n\n", encoding="utf-8")
    assert "is empty" in config_error(path=empty)


# --------------------------------------------------------------------------- malformed input


@pytest.mark.parametrize("override", ["training.learning_rate", "=3"])
def test_malformed_override(override):
    message = config_error(override)
    assert override in message
    assert "key.sub=value" in message


@pytest.mark.parametrize(
    "override", ["training.batch_size=[1", "training.batch_size={a", 'model.student_model_path="abc']
)
def test_unparsable_override_value(override):
    message = config_error(override)
    assert override in message


def test_broken_interpolation_in_override_is_one_line():
    message = config_error("output_dir=${")
    assert "output_dir=${" in message
    assert "\n" not in message


def test_missing_config_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    message = config_error(path=missing)
    assert "not found" in message
    assert str(missing) in message


def test_missing_parent_config_file(tmp_path):
    path = tmp_path / "child.yaml"
    path.write_text("defaults: parent_missing.yaml\n")
    message = config_error(path=path)
    assert "not found" in message
    assert "parent_missing.yaml" in message


def test_invalid_yaml(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("training:\n  batch_size: [1, 2\n  seed: 3\n")
    message = config_error(path=path)
    assert "not valid YAML" in message
    assert str(path) in message


def test_invalid_yaml_error_is_one_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("training:\n  batch_size: [1, 2\n  seed: 3\n")
    message = config_error(path=path)
    assert "\n" not in message
    assert "line 2" in message or "line 3" in message


def test_top_level_must_be_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    assert "mapping" in config_error(path=path)


def test_defaults_cycle(tmp_path):
    (tmp_path / "a.yaml").write_text("defaults: b.yaml\nx: 1\n")
    (tmp_path / "b.yaml").write_text("defaults: a.yaml\ny: 2\n")
    message = config_error(path=tmp_path / "a.yaml")
    assert "cycle" in message


def test_self_referencing_defaults(tmp_path):
    (tmp_path / "self.yaml").write_text("defaults: self.yaml\n")
    assert "cycle" in config_error(path=tmp_path / "self.yaml")


def test_bad_interpolation(tmp_path):
    message = config_error("output_dir=${no_such_key}/x")
    assert "no_such_key" in message


def test_missing_required_key(tmp_path):
    path = tmp_path / "incomplete.yaml"
    path.write_text("model:\n  teacher_model_path: tiny:teacher\ndata:\n  train_path: x.jsonl\n")
    message = config_error(path=path)
    assert "model.student_model_path" in message
    assert "missing" in message


def _field_paths(model_cls, prefix=""):
    """Every leaf key of a config class, dotted, with YAML spellings."""
    paths = []
    for name, info in model_cls.model_fields.items():
        key = prefix + (info.alias or name)
        args = getattr(info.annotation, "__args__", None) or (info.annotation,)
        nested = [arg for arg in args if isinstance(arg, type) and hasattr(arg, "model_fields")]
        # A key that is a number or a section (distillation.lambda: 0.5, or a schedule) is
        # documented by its number; its section's keys are in the comment beside it.
        scalar_form = any(arg not in nested and arg is not type(None) for arg in args) and len(args) > 1
        paths += _field_paths(nested[0], key + ".") if nested and not scalar_form else [key]
    return paths


def test_template_documents_every_config_key():
    """examples/configs/distillation.yaml spells out every key MasterConfig accepts."""
    text = (REPO_ROOT / "examples" / "configs" / "distillation.yaml").read_text()
    tree = yaml.safe_load(text)
    missing = []
    for path in _field_paths(MasterConfig):
        node = tree
        for part in path.split("."):
            if node is None:  # an optional section, off (null) by default: its keys are listed in a comment
                if f"#   {part}:" not in text:
                    missing.append(path)
                break
            if not isinstance(node, dict) or part not in node:
                missing.append(path)
                break
            node = node[part]
    assert not missing, f"keys missing from distillation.yaml: {missing}"


def test_template_documents_every_loss_type_and_its_keys():
    """The default loss type's keys are live YAML; every other type and key is in the comment above them."""
    text = (REPO_ROOT / "examples" / "configs" / "distillation.yaml").read_text()
    section = text[text.index("# The objective: ONE choice"):text.index("\ntraining:")]
    live = yaml.safe_load(section)["loss_fn"]
    assert set(live) == set(LOSS_VARIANTS["full_vocab"].model_fields)
    for loss_type, variant in LOSS_VARIANTS.items():
        assert f"#   {loss_type}" in section, loss_type
        for key in variant.model_fields:
            assert key in section, (loss_type, key)


SPECIFICATION_KEYS = {
    "distillation": ["lambda"],
    "loss_fn": ["kl_type"],
    "distillation.generate_strategy": ["max_length", "temperature", "decoding_method"],
    "training": ["batch_size", "learning_rate", "num_epochs", "gradient_accumulation_steps", "weight_decay",
                 "val_freq"],
    "model": ["teacher_model_path", "student_model_path"],
}


def test_template_keeps_the_specification_key_names():
    """The specification's own key names stay spelled as it spells them, as live YAML keys of the template."""
    tree = yaml.safe_load((REPO_ROOT / "examples" / "configs" / "distillation.yaml").read_text())
    for section, keys in SPECIFICATION_KEYS.items():
        node = tree
        for part in section.split("."):
            node = node[part]
        assert set(keys) <= set(node), (section, set(keys) - set(node))


def test_the_pure_python_parser_reads_every_shipped_config_as_libyaml_does(monkeypatch):
    # opd parses with libyaml where PyYAML has it (its wheels do) and falls back to PyYAML's own parser.
    import importlib

    import opd.utils.strict_yaml as strict_yaml

    assert yaml.__with_libyaml__ and issubclass(strict_yaml.StrictYamlLoader, yaml.CSafeLoader)
    paths = sorted(CONFIGS.glob("*.yaml"))
    assert len(paths) > 10
    with_libyaml = [strict_yaml.read_yaml_file(path) for path in paths]
    monkeypatch.setattr(yaml, "__with_libyaml__", False)
    try:
        importlib.reload(strict_yaml)
        assert not issubclass(strict_yaml.StrictYamlLoader, yaml.CSafeLoader)
        assert [strict_yaml.read_yaml_file(path) for path in paths] == with_libyaml
        assert strict_yaml.parse_yaml_value("[1e-5, 010, yes, 2024-01-01]") == [1e-5, 10, "yes", "2024-01-01"]
    finally:
        monkeypatch.undo()
        importlib.reload(strict_yaml)
    assert strict_yaml.parse_yaml_value("[1e-5, 010, yes, 2024-01-01]") == [1e-5, 10, "yes", "2024-01-01"]
