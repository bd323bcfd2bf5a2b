"""The feature axes of issues 35 and 36 as config overrides on ``examples/configs/distillation_tiny.yaml``.

Each axis is one kind of feature (the loss, the teacher, where the roles run, the
scheduler, ...); each value of an axis is a list of ``key=value`` overrides, and the first
value of every axis is the default (no overrides: the tiny config as shipped, with the
exact full-vocabulary loss). A *choice* maps some axes to one of their values; the
axes it leaves out stay at their default.

Acceptance is read from opd's own config validation (:func:`refusal`), never written
down here, so the counts follow the validator as it changes.

Shared by ``scripts/feature_pairs.py`` (counts the accepted pairs) and
``tests/functional/test_feature_pairs.py`` (runs a covering array of them). A value
that needs something from the machine it runs on (a served teacher's URL, a teacher
with another tokenizer) takes it from :class:`Resources`; the placeholders of the
default resources are enough for validation, which reads no file and opens no socket.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cache, lru_cache
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY_CONFIG = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"

Choice = Mapping[str, str]
"""axis name -> value name; axes left out are at their default."""

Pair = tuple[tuple[str, str], tuple[str, str]]
"""Two (axis, value) settings of different axes, in axis order."""


@dataclass(frozen=True)
class Resources:
    """What some values need from the machine a run happens on.

    Attributes:
        served_url: base URL of an ``opd serve-teacher`` that serves the tiny teacher.
        other_tokenizer_teacher: a model directory whose tokenizer differs from the student's.
    """

    served_url: str = "http://127.0.0.1:1"
    other_tokenizer_teacher: str = "tiny:teacher"


@dataclass(frozen=True)
class Value:
    """One value of an axis.

    Attributes:
        overrides: ``key=value`` overrides; ``{served_url}`` and ``{other_tokenizer_teacher}``
            are filled from :class:`Resources`.
        loss_when_default: overrides of ``loss_fn`` this value needs when the loss axis is at
            its default (a cross-tokenizer teacher answers top-k, so alone it uses the top-k
            loss); a loss chosen on the loss axis replaces them.
        with_values: extra overrides when another axis has a given value
            (``(axis, value) -> overrides``).
    """

    name: str
    overrides: tuple[str, ...] = ()
    loss_when_default: tuple[str, ...] = ()
    with_values: Mapping[tuple[str, str], tuple[str, ...]] = field(default_factory=dict)


TOPK = ("loss_fn.type=topk", "loss_fn.k=8")
_TWO_TEACHERS = "[{name: a, model_path: 'tiny:teacher'}, {name: b, model_path: 'tiny:student-b'}]"
_ONE_TRAINER = ("cluster.trainer.workers=1", "cluster.rollout.workers=1")

AXES: dict[str, tuple[Value, ...]] = {
    "loss": (
        Value("full_vocab"),
        Value("topk", TOPK),
        Value("sampled_token", ("loss_fn.type=sampled_token",)),
        Value("hybrid_full_vocab", ("loss_fn.type=hybrid_full_vocab",)),
    ),
    "teacher": (
        Value("local"),
        # opd serve-teacher's protocol: hidden states for the exact loss; the output layer is
        # read from model.teacher_model_path (the tiny teacher the server serves).
        Value("served", ("teacher.backend=remote", "teacher.remote.url={served_url}", "teacher.remote.protocol=opd")),
        Value(
            "route",
            (
                "model.teacher_model_path=null",
                "teachers.mode=route",
                "teachers.route_key=task",
                "teachers.route_map={add: a, sub: b}",
                f"teachers.members={_TWO_TEACHERS}",
            ),
        ),
        Value(
            "mixture", ("model.teacher_model_path=null", "teachers.mode=mixture", f"teachers.members={_TWO_TEACHERS}")
        ),
        Value(
            "cross_tokenizer",
            ("teacher.cross_tokenizer=true", "model.teacher_model_path={other_tokenizer_teacher}"),
            loss_when_default=TOPK,
        ),
    ),
    "cluster": (
        Value("none"),
        Value("colocated", ("cluster.placement=colocated", *_ONE_TRAINER)),
        Value("split", ("cluster.placement=split", *_ONE_TRAINER)),
        Value("split_pool", ("cluster.placement=split", *_ONE_TRAINER, "cluster.teacher.placement=pool")),
    ),
    "scheduler": (
        Value("sync"),
        Value("one_step_off", ("training.scheduler=one_step_off",)),
        Value("two_step_off", ("training.scheduler=two_step_off",)),
    ),
    # vLLM's CPU attention takes heads of 32 dimensions or more: the demo's student shape has them.
    "engine": (Value("hf"), Value("vllm", ("generation.backend=vllm", "model.student_model_path=tiny:demo-student"))),
    "lora": (Value("off"), Value("on", ("model.lora.r=4",))),
    "packing": (Value("off"), Value("on", ("training.sequence_packing=true",))),
    "context": (Value("off"), Value("on", ("distillation.teacher_context=Answer with the number only.",))),
    # The teacher's baseline alone; with a teacher-only context also the student-versus-teacher one.
    "baselines": (
        Value("off"),
        Value(
            "on",
            ("validation.teacher_baseline=true",),
            with_values={("context", "on"): ("validation.eval_baseline=true",)},
        ),
    ),
    "lambda": (Value("1.0"), Value("0.5", ("distillation.lambda=0.5",))),
    # Multi-turn episodes with the calculator; the tools section is about 700 tokens of the
    # byte-level tokenizer. The combination test makes each episode's first turn a call.
    "environment": (
        Value("none"),
        Value(
            "tool",
            ("environment.max_turns=2", "environment.max_episode_tokens=1024", "data.max_prompt_length=1000"),
        ),
    ),
}
"""Every axis with its values, the default first."""

SPEC_AT_SCALE: dict[str, str] = {
    "cluster": "split_pool",
    "engine": "hf",  # HF rollout workers stand in for vLLM's on CPU
    "scheduler": "one_step_off",
    "packing": "on",
    "loss": "full_vocab",
    "lambda": "0.5",
}
"""The specification's case at scale: split pools, one-step-off, packing, a pooled teacher with the exact loss."""


def default(axis: str) -> str:
    return AXES[axis][0].name


def value(axis: str, name: str) -> Value:
    for candidate in AXES[axis]:
        if candidate.name == name:
            return candidate
    raise KeyError(f"axis {axis!r} has no value {name!r}; it has {[v.name for v in AXES[axis]]}")


def complete(choice: Choice) -> dict[str, str]:
    """The choice with every axis it leaves out at its default, in axis order."""
    unknown = set(choice) - set(AXES)
    if unknown:
        raise KeyError(f"unknown axes {sorted(unknown)}; the axes are {list(AXES)}")
    return {axis: choice.get(axis, default(axis)) for axis in AXES}


def overrides_for(choice: Choice, resources: Resources = Resources()) -> list[str]:
    """The config overrides of a choice (on :data:`TINY_CONFIG`)."""
    full = complete(choice)
    chosen = [value(axis, name) for axis, name in full.items()]
    out: list[str] = []
    for item in chosen:
        out.extend(item.overrides)
        for (axis, name), extra in item.with_values.items():
            if full[axis] == name:
                out.extend(extra)
    if full["loss"] == default("loss"):
        for item in chosen:
            out.extend(item.loss_when_default)
    fill = {"served_url": resources.served_url, "other_tokenizer_teacher": resources.other_tokenizer_teacher}
    filled = []
    for override in out:  # str.format would read the YAML braces of teachers.members
        for name, text in fill.items():
            override = override.replace("{" + name + "}", text)
        filled.append(override)
    return filled


def label(choice: Choice) -> str:
    """A short name of the non-default settings (``default`` when there are none)."""
    full = complete(choice)
    parts = [f"{axis}={name}" for axis, name in full.items() if name != default(axis)]
    return ",".join(parts) or "default"


@cache
def _refusal(key: tuple[tuple[str, str], ...]) -> str | None:
    from opd.distillation.config import MasterConfig
    from opd.utils.config import validate_config
    from opd.utils.errors import ConfigError

    try:
        validate_config(MasterConfig, _tree_with(overrides_for(dict(key))))
    except ConfigError as error:
        return str(error)
    return None


def _tree_with(overrides: list[str]) -> dict:
    """The config tree ``opd.utils.config.load_config`` builds from :data:`TINY_CONFIG` and ``overrides``.

    The same steps as the loader (overrides that set a ``type`` first, a section's keys that
    the new variant does not take dropped, then merged), with a plain deep merge in place of
    OmegaConf's: the loader merges the whole tree once per override, a tenth of a second
    for a choice, and the combination test validates hundreds of choices. The overrides
    hold no interpolation, and the base tree is resolved once.
    ``test_the_quick_tree_is_the_loaders`` checks the two agree.
    """
    from opd.utils.config import _drop_keys_of_other_variants, _override_layer

    tree = copy.deepcopy(_base_tree())
    ordered = sorted(overrides, key=lambda override: not override.split("=", 1)[0].endswith(".type"))
    for override in ordered:
        layer = _override_layer(override)
        tree = _deep_merge(_drop_keys_of_other_variants(tree, layer, _variant_keys), layer)
    return tree


def _deep_merge(base: dict, layer: dict) -> dict:
    merged = dict(base)
    for key, item in layer.items():
        if isinstance(item, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], item)
        else:
            merged[key] = copy.deepcopy(item)
    return merged


def _variant_keys(section: str, tag: str) -> set[str] | None:
    """The keys variant ``tag`` of ``section`` accepts (as ``load_config`` computes them)."""
    from opd.distillation.config import MasterConfig
    from opd.utils.config import _keys_of, _variants

    info = MasterConfig.model_fields.get(section)
    variants = _variants(info.annotation) if info is not None else {}
    if len(variants) < 2:
        return None
    chosen = variants.get(tag)
    return set(_keys_of(chosen)) if chosen is not None else None


@lru_cache(maxsize=1)
def _base_tree() -> dict:
    from opd.utils.config import load_config_tree

    return load_config_tree(TINY_CONFIG, [], _variant_keys)


def loader_refusal(choice: Choice) -> str | None:
    """:func:`refusal` through ``load_config`` itself (slow: for checking the quick path)."""
    from opd.distillation.config import MasterConfig
    from opd.utils.config import load_config
    from opd.utils.errors import ConfigError

    try:
        load_config(MasterConfig, TINY_CONFIG, overrides_for(choice))
    except ConfigError as error:
        return str(error)
    return None


def refusal(choice: Choice) -> str | None:
    """opd's config validation of the choice: its error message, or None when it is accepted.

    Validation only: no model is loaded, no file but the config is read.
    """
    return _refusal(tuple(complete(choice).items()))


def first_line(message: str) -> str:
    """The refusal's first line without the common ``invalid config:`` prefix."""
    return message.splitlines()[0].removeprefix("invalid config: ")


def non_default_settings() -> list[tuple[str, str]]:
    """Every (axis, value) that is not its axis's default."""
    return [(axis, item.name) for axis, values in AXES.items() for item in values[1:]]


def all_pairs() -> list[Pair]:
    """Every pair of non-default values from two different axes."""
    settings = non_default_settings()
    return [(a, b) for a, b in itertools.combinations(settings, 2) if a[0] != b[0]]


def pairs_of(choice: Choice) -> set[Pair]:
    """The pairs of non-default values a (complete) choice sets."""
    settings = [(axis, name) for axis, name in complete(choice).items() if name != default(axis)]
    return set(itertools.combinations(settings, 2))


def covering_array(
    to_cover: Iterable[Pair], allowed: Mapping[str, Iterable[str]] | None = None, tries: int = 6
) -> list[dict[str, str]]:
    """Runs (complete choices) that together set every pair of ``to_cover``, each one accepted.

    Greedy, in the manner of AETG: each new run starts from a not yet covered pair, then
    gives every other axis the value that covers the most not yet covered pairs with the
    values chosen so far, skipping values the validator refuses in that combination;
    of ``tries`` such runs (seeded by different uncovered pairs) the one covering most is
    kept. Pairs that no accepted run can set (``to_cover`` should hold accepted pairs only)
    are left out. Deterministic: the same pairs and validator give the same runs.

    Args:
        to_cover: the pairs the runs must set.
        allowed: axis -> the values a run may take there (all values where not given).
    """
    allowed_values = {
        axis: [item.name for item in values if allowed is None or axis not in allowed or item.name in allowed[axis]]
        for axis, values in AXES.items()
    }
    uncovered = sorted(set(to_cover))
    runs: list[dict[str, str]] = []
    while uncovered:
        best: dict[str, str] | None = None
        best_gain: set[Pair] = set()
        for seed in uncovered[:tries]:
            run = _grow(seed, allowed_values, set(uncovered))
            if run is None:
                continue
            gain = pairs_of(run) & set(uncovered)
            if len(gain) > len(best_gain):
                best, best_gain = run, gain
        if best is None:  # no seed in the first tries can be set in an accepted run: drop them
            uncovered = uncovered[tries:]
            continue
        runs.append(best)
        uncovered = [pair for pair in uncovered if pair not in best_gain]
    return runs


def _grow(seed: Pair, allowed: Mapping[str, list[str]], uncovered: set[Pair]) -> dict[str, str] | None:
    """One accepted run holding ``seed``, each other axis set to its most covering accepted value."""
    chosen = dict(seed)
    if any(name not in allowed[axis] for axis, name in chosen.items()) or refusal(chosen) is not None:
        return None
    for axis in AXES:
        if axis in chosen:
            continue

        def gain(name: str, axis: str = axis) -> int:
            setting = (axis, name)
            return sum(1 for other in chosen.items() if tuple(sorted((setting, other), key=_order)) in uncovered)

        for name in sorted(allowed[axis], key=lambda name: (-gain(name), name != default(axis))):
            if refusal({**chosen, axis: name}) is None:
                chosen[axis] = name
                break
        else:
            return None
    return complete(chosen)


def _order(setting: tuple[str, str]) -> tuple[int, int]:
    """Axis order, then value order: pairs are written in this order."""
    axis, name = setting
    return list(AXES).index(axis), [item.name for item in AXES[axis]].index(name)


def accepted_pairs() -> list[Pair]:
    """The pairs of :func:`all_pairs` that opd's config validation accepts."""
    return [pair for pair in all_pairs() if refusal(dict(pair)) is None]


def combination_runs() -> dict[str, list[dict[str, str]]]:
    """The combination test's runs, in three groups that together set every accepted pair.

    * ``in_process``: no cluster, HF rollouts; every accepted pair of the other axes.
    * ``cluster``: a cluster placement on every run, HF rollout workers; every accepted
      pair with a cluster value (a run costs a Ray cluster's start, so each covers many).
    * ``vllm``: ``generation.backend = vllm`` on every run; every accepted pair with it
      (these need vLLM installed).

    Each group also holds a run for each accepted value of its own that no pair sets
    (a value accepted alone but with nothing else).
    """
    accepted = accepted_pairs()
    cluster_values = [item.name for item in AXES["cluster"][1:]]

    def involves(pair: Pair, axis: str, names: Iterable[str] | None = None) -> bool:
        return any(setting[0] == axis and (names is None or setting[1] in names) for setting in pair)

    groups: dict[str, tuple[list[Pair], dict[str, list[str]]]] = {
        "in_process": (
            [pair for pair in accepted if not involves(pair, "cluster") and not involves(pair, "engine")],
            {"cluster": ["none"], "engine": ["hf"]},
        ),
        "cluster": (
            [pair for pair in accepted if involves(pair, "cluster") and not involves(pair, "engine")],
            {"cluster": cluster_values, "engine": ["hf"]},
        ),
        "vllm": ([pair for pair in accepted if involves(pair, "engine")], {"engine": ["vllm"]}),
    }
    runs: dict[str, list[dict[str, str]]] = {}
    for name, (to_cover, allowed) in groups.items():
        group_runs = covering_array(to_cover, allowed)
        covered = {setting for run in group_runs for setting in run.items()}
        for setting in non_default_settings():
            axis, value_name = setting
            lone = complete({**{key: names[0] for key, names in allowed.items()}, axis: value_name})
            if setting not in covered and value_name in allowed.get(axis, [value_name]) and refusal(lone) is None:
                group_runs.append(lone)
        runs[name] = group_runs
    return runs
