"""The feature axes of issue 35 as config overrides on ``examples/configs/distillation_tiny.yaml``.

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

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
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
        Value("route", (
            "model.teacher_model_path=null", "teachers.mode=route", "teachers.route_key=task",
            f"teachers.members={_TWO_TEACHERS}",
        )),
        Value("mixture", ("model.teacher_model_path=null", "teachers.mode=mixture", f"teachers.members={_TWO_TEACHERS}")),
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
    "engine": (Value("hf"), Value("vllm", ("generation.backend=vllm",))),
    "lora": (Value("off"), Value("on", ("model.lora.r=4",))),
    "packing": (Value("off"), Value("on", ("training.sequence_packing=true",))),
    "context": (Value("off"), Value("on", ("distillation.teacher_context=Answer with the number only.",))),
    # The teacher's baseline alone; with a teacher-only context also the student-versus-teacher one.
    "baselines": (
        Value("off"),
        Value("on", ("validation.teacher_baseline=true",), with_values={("context", "on"): (
            "validation.eval_baseline=true",
        )}),
    ),
    "lambda": (Value("1.0"), Value("0.5", ("distillation.lambda=0.5",))),
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


@lru_cache(maxsize=None)
def _refusal(key: tuple[tuple[str, str], ...]) -> str | None:
    from opd.algorithms.distillation_config import MasterConfig
    from opd.utils.config import load_config
    from opd.utils.errors import ConfigError

    try:
        load_config(MasterConfig, TINY_CONFIG, overrides_for(dict(key)))
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
            return sum(
                1 for other in chosen.items() if tuple(sorted((setting, other), key=_order)) in uncovered
            )

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
