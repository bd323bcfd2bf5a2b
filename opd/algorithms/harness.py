"""Evaluation with an external harness (lm-evaluation-harness), on the models of a run.

opd's own validation measures the task the student was distilled on. A harness measures
everything else, with the task definitions the field shares (gsm8k, math500, MMLU, ...).
This module runs one on one or more model directories, one model at a time, and writes
their results side by side:

* ``harness_results.json``: ``{label: {task: {metric: value}}}`` plus the settings;
* ``harness_table.md``: one row per task and metric, one column per model.

The labels are ``model`` (the model evaluated), ``teacher`` and ``student_before`` (the
run's starting student), as ``compare`` asks. Each model is loaded on the run's device,
evaluated, and freed before the next one loads.

The harness is an optional dependency (``pip install 'opd[eval]'``); a run that asks for it
without it installed stops before any model loads. Tasks are the harness's own names, or
local task definitions under ``include_path`` (YAML files, as lm-eval reads them): a local
task over a local JSONL file runs with no network, as the tests do.
"""

from __future__ import annotations

import gc
import json
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from opd.models.config import ModelLoadingConfig
from opd.utils.config import StrictConfig
from opd.utils.errors import ConfigError

log = logging.getLogger(__name__)

RESULTS_FILENAME = "harness_results.json"
TABLE_FILENAME = "harness_table.md"
METRIC_PREFIX = "harness/"


class HarnessConfig(StrictConfig):
    """``validation.harness``: how an external harness evaluates the run's models."""

    name: Literal["lm-eval"] = Field("lm-eval", description="the harness: lm-eval (lm-evaluation-harness)")
    include_path: str | None = Field(
        None, description="a directory of local task definitions (YAML) added to the harness's own tasks"
    )
    limit: int | None = Field(None, ge=1, description="evaluate only the first N documents of each task")
    num_fewshot: int | None = Field(None, ge=0, description="few-shot examples per prompt; null = each task's own")
    batch_size: int = Field(16, ge=1, description="prompts per generation batch")
    apply_chat_template: bool = Field(
        True, description="render each prompt with the model's chat template (as opd's training prompts are)"
    )
    compare: list[Literal["teacher", "student_before"]] = Field(
        default_factory=list,
        description="also evaluate these models, in columns beside the model: the run's teacher, the starting student",
    )

    @field_validator("compare")
    @classmethod
    def _each_once(cls, compare: list[str]) -> list[str]:
        if len(set(compare)) != len(compare):
            raise ValueError(f"a model is named twice in {compare}")
        return compare


@dataclass
class HarnessResults:
    """What a harness measured: ``scores[label][task][metric]``, and for which model directories."""

    tasks: list[str]
    scores: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    model_paths: dict[str, str] = field(default_factory=dict)

    def metrics(self, label: str = "model") -> dict[str, float]:
        """One model's scores as flat metric names (``harness/<task>/<metric>``), for the metrics log."""
        return {
            f"{METRIC_PREFIX}{task}/{metric}": value
            for task, values in self.scores.get(label, {}).items()
            for metric, value in values.items()
        }

    def table(self) -> str:
        """The scores as a Markdown table: one row per task and metric, one column per model."""
        labels = list(self.scores)
        rows = sorted(
            {(task, metric) for per_task in self.scores.values() for task, v in per_task.items() for metric in v}
        )
        lines = ["| task | metric | " + " | ".join(labels) + " |", "|---|---|" + "---|" * len(labels)]
        for task, metric in rows:
            cells = [_format(self.scores[label].get(task, {}).get(metric)) for label in labels]
            lines.append(f"| {task} | {metric} | " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def write(self, directory: Path, settings: HarnessConfig) -> Path:
        """Writes the JSON and the table into ``directory``; returns the table's path."""
        directory.mkdir(parents=True, exist_ok=True)
        payload = {
            "harness": settings.name,
            "tasks": self.tasks,
            "settings": settings.model_dump(mode="json"),
            "models": self.model_paths,
            "scores": self.scores,
        }
        (directory / RESULTS_FILENAME).write_text(json.dumps(payload, indent=2), encoding="utf-8")
        table_path = directory / TABLE_FILENAME
        table_path.write_text(self.table() + "\n", encoding="utf-8")
        return table_path


def _format(value: float | None) -> str:
    return "—" if value is None else f"{value:.4f}"


def require_harness(settings: HarnessConfig) -> None:
    """Stops the run, before any model loads, when the harness is not installed.

    Raises:
        ConfigError: naming the package and the extra that installs it.
    """
    try:
        import lm_eval  # noqa: F401
    except ImportError as error:
        raise ConfigError(
            f"validation.harness.name = {settings.name} needs lm-evaluation-harness, which is not installed: "
            "pip install 'opd[eval]' (or pip install lm_eval)"
        ) from error


_TASK_MANAGERS: dict[tuple[str | None, bool], Any] = {}
"""lm-eval's task indexes built so far in this process, by (include_path, built-in tasks included)."""


def _task_manager(include_path: str | None, tasks: tuple[str, ...]) -> Any:
    """An lm-eval ``TaskManager`` that knows ``tasks``, built once per process and reused.

    Indexing lm-eval's thousands of built-in task files takes seconds, so where every task
    asked for is defined under ``include_path`` the built-in ones are left out; otherwise
    (or if one is missing there) the index holds both, ``include_path`` taking precedence.

    Raises:
        ConfigError: a task that neither index knows.
    """
    from lm_eval.tasks import TaskManager

    for include_defaults in [False, True] if include_path else [True]:
        key = (include_path, include_defaults)
        if key not in _TASK_MANAGERS:
            _TASK_MANAGERS[key] = TaskManager(include_path=include_path, include_defaults=include_defaults)
        manager = _TASK_MANAGERS[key]
        unknown = [task for task in tasks if task not in manager.all_tasks]
        if not unknown:
            return manager
    where = f" or under validation.harness.include_path ({include_path})" if include_path else ""
    raise ConfigError(f"lm-eval has no task {unknown} among its own tasks{where}")


def _lm_eval_scores(
    model: Any, tokenizer: Any, tasks: list[str], settings: HarnessConfig, device: str
) -> dict[str, dict[str, float]]:
    """lm-eval's scores for one loaded model: ``{task: {metric: value}}`` (standard errors left out)."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    manager = _task_manager(settings.include_path, tuple(tasks))
    wrapped = HFLM(pretrained=model, tokenizer=tokenizer, device=device, batch_size=settings.batch_size)
    output = simple_evaluate(
        model=wrapped,
        tasks=tasks,
        num_fewshot=settings.num_fewshot,
        limit=settings.limit,
        task_manager=manager,
        apply_chat_template=settings.apply_chat_template,
        log_samples=False,
        verbosity="WARNING",
    )
    assert output is not None  # None only on the non-zero ranks of a distributed harness run
    scores: dict[str, dict[str, float]] = {}
    for task, values in output["results"].items():
        scores[task] = {
            # lm-eval names a metric "<metric>,<filter>" (other keys, such as sample_len, are not
            # metrics); the filter stays in the name when it is not "none".
            key.removesuffix(",none"): float(value)
            for key, value in values.items()
            if "," in key and "_stderr" not in key and isinstance(value, (int, float)) and math.isfinite(value)
        }
    return scores


HARNESSES: dict[str, Callable[[Any, Any, list[str], HarnessConfig, str], dict[str, dict[str, float]]]] = {
    "lm-eval": _lm_eval_scores,
}
"""Each harness by its config name: the function that scores one loaded model."""


def load_for_harness(path: str, loading: ModelLoadingConfig) -> tuple[Any, Any]:
    """A model directory (or ``tiny:`` preset) and its tokenizer, loaded as the run loads its models, in eval mode."""
    from opd.models.loading import load_causal_lm, load_tokenizer, resolve_device, resolve_dtype

    device = resolve_device(loading.device)
    model = load_causal_lm(path, resolve_dtype(loading.dtype, device), device, loading)
    model.eval()
    return model, load_tokenizer(path)


def evaluate_with_harness(
    model_paths: Mapping[str, str],
    tasks: list[str],
    settings: HarnessConfig,
    load: Callable[[str], tuple[Any, Any]],
) -> HarnessResults:
    """Scores each model (``{label: directory}``, in order) on ``tasks``, one model in memory at a time.

    Args:
        model_paths: the models to evaluate, by column label.
        tasks: the harness's task names.
        settings: the harness's settings.
        load: loads a directory as ``(model, tokenizer)`` (:func:`load_for_harness`); the
            harness puts its inputs on the model's device.
    """
    require_harness(settings)
    results = HarnessResults(tasks=list(tasks), model_paths=dict(model_paths))
    for label, path in model_paths.items():
        model, tokenizer = load(path)
        device = str(next(model.parameters()).device)
        log.info("harness %s: %s (%s) on %s", settings.name, label, path, ", ".join(tasks))
        results.scores[label] = HARNESSES[settings.name](model, tokenizer, tasks, settings, device)
        del model
        gc.collect()
    return results
