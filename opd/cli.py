"""The ``opd`` command line: ``train``, ``plan``, ``eval``, ``sft``, ``generate``, ``export``, ``prune``, ``plot``
and ``serve-teacher`` (``opd SUBCOMMAND --help`` lists each one's options).

User mistakes (config, data, incompatible models) end with one ``error:`` line and exit status 2, before any
model loads where possible; ``opd --debug`` or ``OPD_DEBUG=1`` shows the traceback. A diverged run exits with 1.
Bugs in opd itself show their traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opd.utils.errors import ConfigError, OpdError, TrainingDivergedError

if TYPE_CHECKING:  # importing the logger pulls in torch; `opd --help` should not wait for it
    from opd.run.logger import LoggerConfig

EXIT_USER_ERROR = 2
EXIT_TRAINING_FAILED = 1


def _add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="YAML config file")
    parser.add_argument(
        "overrides", nargs="*", metavar="key.sub=value", help="config overrides, e.g. training.learning_rate=1e-5"
    )


def _add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument(
        "--quick", action="store_true", help="dry-run only the configured activation checkpointing, not both"
    )
    parser.add_argument(
        "--every-layer",
        action="store_true",
        help="trace every decoder layer instead of 3 and 4 and extrapolating (slower; the same bytes for alike layers)",
    )
    parser.add_argument(
        "--reserved-factor",
        type=_reserved_factor,
        metavar="F",
        help="the caching allocator's reserved peak over the dry run's allocated peak, which the verdicts count "
        "(default: the plan's stated assumption, printed with its verdict; a GPU's max_memory_reserved() / "
        "max_memory_allocated() measures it)",
    )


def _reserved_factor(text: str) -> float:
    """``--reserved-factor``'s value: a number of at least 1 (the allocator reserves at least what it allocates)."""
    try:
        factor = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not factor >= 1.0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be at least 1 (reserved memory includes the allocated), got {text}")
    return factor


def _add_harness_arguments(parser: argparse.ArgumentParser) -> None:
    """``opd eval --harness``'s options: each stands for a ``validation.harness`` key (:func:`harness_overrides`)."""
    parser.add_argument(
        "--harness",
        choices=["lm-eval"],
        help="score the model with an external harness instead (pip install 'opd[eval]')",
    )
    parser.add_argument("--tasks", help="the harness's tasks, comma-separated (validation.harness_tasks)")

    def option(key: str, text: str, **options: Any) -> None:
        """``--<key with dashes>``, its help naming ``validation.harness.<key>``."""
        parser.add_argument("--" + key.replace("_", "-"), help=f"{text} (validation.harness.{key})", **options)

    option("include_path", "a directory of local task definitions")
    option("limit", "only the first N documents of each task", type=int)
    option("compare", "also score these models beside it, comma-separated: teacher, student_before")
    option("backend", "how lm-eval runs each model", choices=["hf", "vllm"])
    option("num_fewshot", "few-shot examples per prompt", type=int)
    option("max_gen_toks", "the most tokens per response", type=int)
    option("temperature", "sampling temperature, 0 = greedy", type=float)
    option("top_p", "nucleus sampling's top-p", type=float)
    option("repeats", "samples per document, for avg@n / pass@k", type=int)
    option(
        "chat_template_kwargs",
        "the chat template's keyword arguments, e.g. '{\"enable_thinking\": false}'",
        metavar="JSON",
    )
    option("system_instruction", "a system message before each prompt")
    option(
        "fewshot_as_multiturn",
        "few-shot examples as chat turns, or one user turn",
        action=argparse.BooleanOptionalAction,
    )
    option("output_path", "where lm-eval writes its own results of each model", metavar="DIR")
    option("log_samples", "also write lm-eval's per-sample JSONL under --output-path", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``opd`` command."""
    parser = argparse.ArgumentParser(prog="opd", description="On-policy knowledge distillation for LLMs.")
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of user errors too (or set OPD_DEBUG=1)"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = commands.add_parser("train", help="run on-policy distillation (student learns from teacher)")
    _add_config_arguments(train)
    train.add_argument("--dry-run", action="store_true", help="print the memory plan instead of training (opd plan)")
    # opd plan's options, off for --dry-run
    train.set_defaults(json=False, quick=False, every_layer=False, reserved_factor=None)
    plan = commands.add_parser(
        "plan", help="memory per device of a cluster run: its real step on fake tensors, no weights, no GPU"
    )
    _add_config_arguments(plan)
    _add_plan_arguments(plan)
    evaluate = commands.add_parser("eval", help="validate a model (validation.model_path) against the teacher")
    _add_config_arguments(evaluate)
    _add_harness_arguments(evaluate)
    sft = commands.add_parser("sft", help="supervised fine-tuning on the dataset's assistant answers")
    _add_config_arguments(sft)
    generate = commands.add_parser("generate", help="write a model's answers to the prompts as fixed data (JSONL)")
    _add_config_arguments(generate)
    export = commands.add_parser(
        "export", help="write a checkpoint's student, or a GGUF model, as a Hugging Face model directory"
    )
    export.add_argument("checkpoint", help="a step_N checkpoint directory, or a GGUF file (or a directory holding one)")
    export.add_argument("output", help="the model directory to create")
    export.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default="float32",
        help="the dtype a GGUF model is dequantised to (a checkpoint keeps its run's dtype)",
    )
    _add_prune_parser(commands)
    plot = commands.add_parser("plot", help="draw curves.png and summary.txt from a run's metrics.jsonl")
    plot.add_argument("arguments", nargs=argparse.REMAINDER, help="LOG_DIR_OR_JSONL [--output PNG]")
    serve = commands.add_parser(
        "serve-teacher", help="serve a teacher's prompt log-probs over HTTP (127.0.0.1)", add_help=False
    )
    serve.add_argument("arguments", nargs=argparse.REMAINDER, help="--model DIR [--port 8000] ... (see --help)")
    return parser


def _add_prune_parser(commands: argparse._SubParsersAction) -> None:
    prune = commands.add_parser(
        "prune", help="make a student from a model by keeping some of its layers (depth pruning, as Minitron)"
    )
    prune.add_argument("source", help="a Hugging Face model directory, a GGUF file (or a directory holding one)")
    prune.add_argument("output", help="the model directory to create")
    prune.add_argument("--layers", type=int, help="how many decoder layers to keep")
    prune.add_argument(
        "--method",
        choices=["even", "importance"],
        default="even",
        help="evenly spaced, or the layers of highest block importance on --calibration (default: even)",
    )
    prune.add_argument("--keep", help="the layer indices to keep, comma-separated (instead of --layers)")
    prune.add_argument("--calibration", help="chat examples (JSONL, ...) on which --method importance measures")
    prune.add_argument("--calibration-examples", type=int, default=64, help="how many examples to use (default 64)")
    prune.add_argument("--max-tokens", type=int, default=512, help="each example cut to this many tokens")
    prune.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="the dtype written"
    )


def run_prune(args: argparse.Namespace) -> None:
    """``opd prune``: writes the pruned model and says which layers it kept."""
    import torch

    from opd.models.depth_pruning import prune_source

    quiet_third_party_output()
    try:
        keep = None if args.keep is None else [int(item) for item in args.keep.split(",") if item.strip()]
    except ValueError:
        raise ConfigError(f"opd prune: --keep takes comma-separated layer indices, got {args.keep!r}") from None
    output, plan = prune_source(
        args.source,
        args.output,
        layers=args.layers,
        method=args.method,
        keep=keep,
        calibration=args.calibration,
        calibration_examples=args.calibration_examples,
        max_tokens=args.max_tokens,
        dtype=getattr(torch, args.dtype),
    )
    print(
        f"opd: wrote {output}: {len(plan.kept_layers)} of {plan.source_layers} layers ({plan.method}): "
        f"{','.join(map(str, plan.kept_layers))}"
    )


def run_export(args: argparse.Namespace) -> None:
    """``opd export``: a checkpoint's student, or a GGUF model dequantised, as a Hugging Face directory."""
    import torch

    from opd.models.gguf_source import export_gguf, gguf_source
    from opd.run.checkpoint_export import export_checkpoint

    quiet_third_party_output()
    source = gguf_source(args.checkpoint)
    if source is not None:
        written = export_gguf(source, Path(args.output), getattr(torch, args.dtype))
    else:
        written = export_checkpoint(args.checkpoint, args.output)
    print(f"opd: wrote {written}")


def quiet_third_party_output() -> None:
    """Keeps the console to opd's own lines (no transformers shard progress bars, no torchdata start-up warning)."""
    import warnings

    import transformers

    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message=".*set_vital.*")


def harness_overrides(args: argparse.Namespace) -> list[str]:
    """``opd eval --harness``'s options as the config overrides they stand for."""

    def listed(text: str) -> str:
        return "[" + ",".join(item.strip() for item in text.split(",") if item.strip()) + "]"

    overrides = [f"validation.harness.name={args.harness}"]
    if args.tasks is not None:
        overrides.append(f"validation.harness_tasks={listed(args.tasks)}")
    if args.compare is not None:
        overrides.append(f"validation.harness.compare={listed(args.compare)}")
    for key in ("include_path", "limit", "backend", "num_fewshot", "max_gen_toks", "temperature", "top_p", "repeats"):
        if getattr(args, key) is not None:
            overrides.append(f"validation.harness.{key}={getattr(args, key)}")
    for key in ("output_path", "system_instruction"):
        if getattr(args, key) is not None:
            # A JSON string is a quoted YAML scalar: the text stays text (a colon or a leading dash included).
            overrides.append(f"validation.harness.{key}={json.dumps(getattr(args, key))}")
    if args.fewshot_as_multiturn is not None:
        overrides.append(f"validation.harness.fewshot_as_multiturn={str(args.fewshot_as_multiturn).lower()}")
    if args.log_samples:
        overrides.append("validation.harness.log_samples=true")
    if args.chat_template_kwargs is not None:
        try:
            kwargs = json.loads(args.chat_template_kwargs)
        except json.JSONDecodeError as error:
            raise ConfigError(f"--chat-template-kwargs is not JSON: {error}") from None
        if not isinstance(kwargs, dict):
            raise ConfigError("--chat-template-kwargs must be a JSON object, e.g. '{\"enable_thinking\": false}'")
        overrides.append(f"validation.harness.chat_template_kwargs={json.dumps(kwargs)}")
    return overrides


def run_harness(config_path: str, overrides: list[str]) -> None:
    """``opd eval --harness``: score one model (and its comparisons) with an external harness."""
    _check_config_keys("train", config_path, overrides)
    from opd.distillation.config import MasterConfig
    from opd.evaluate import evaluate_with_harness_tasks
    from opd.utils.config import load_config

    _prepare_console()
    evaluate_with_harness_tasks(load_config(MasterConfig, config_path, overrides))


def run_train(config_path: str, overrides: list[str], val_only: bool = False) -> None:
    """Loads and validates the config, then trains (or only validates, for ``opd eval``)."""
    _check_config_keys("train", config_path, overrides)
    # Imported after the config loads, so `opd --help` and config errors do not wait for the training stack.
    from opd.distillation.config import MasterConfig
    from opd.utils.config import load_config

    _prepare_console()
    config = load_config(MasterConfig, config_path, overrides)
    from opd.distillation.setup import setup
    from opd.distillation.step import distillation_train
    from opd.evaluate import evaluate

    if val_only or config.val_only:
        evaluate(config)
        return
    components = setup(config)
    try:
        distillation_train(components)
    finally:
        components.close()  # a vLLM engine: a later run in this process opens its own
    _draw_curves(config.logger)


def run_plan(
    config_path: str,
    overrides: list[str],
    as_json: bool = False,
    quick: bool = False,
    every_layer: bool = False,
    reserved_factor: float | None = None,
) -> None:
    """Loads the config and prints its teacher plan and memory plan (``opd plan``, ``opd train --dry-run``).

    ``reserved_factor``: the reserved peak over the allocated peak; None keeps the plan's stated assumption.
    """
    _check_config_keys("train", config_path, overrides)
    from dataclasses import replace

    from opd.distillation.config import MasterConfig
    from opd.distillation.teacher_plan import plan_teacher
    from opd.plan.memory_plan import plan_memory, render_plan
    from opd.utils.config import load_config

    quiet_third_party_output()
    config = load_config(MasterConfig, config_path, overrides)
    configured = config.cluster.trainer.activation_checkpointing if config.cluster is not None else False
    plan = plan_memory(config, (configured,) if quick else (False, True), every_layer=every_layer)
    if reserved_factor is not None:
        plan = replace(plan, reserved_factor=reserved_factor)
    teacher_plan = plan_teacher(config).lines()
    if as_json:
        print(json.dumps({**plan.as_dict(), "teacher_plan": teacher_plan}, indent=1))
    else:
        print("\n".join(teacher_plan), render_plan(plan), sep="\n\n")


def run_sft(config_path: str, overrides: list[str]) -> None:
    """Loads and validates an SFT config, then fine-tunes."""
    _check_config_keys("sft", config_path, overrides)
    from opd.sft import SFTMasterConfig, setup, sft_train
    from opd.utils.config import load_config

    _prepare_console()
    config = load_config(SFTMasterConfig, config_path, overrides)
    sft_train(setup(config))
    _draw_curves(config.logger)


def run_generate(config_path: str, overrides: list[str]) -> None:
    """Loads a config with a ``generate`` section, writes the answers and prints the summary line."""
    _check_config_keys("generate", config_path, overrides)
    from opd.generate import GenerateMasterConfig, generate_data
    from opd.utils.config import load_config

    _prepare_console()
    config = load_config(GenerateMasterConfig, config_path, overrides)
    print(generate_data(config).line())


def _check_config_keys(root: str, config_path: str, overrides: list[str]) -> None:
    """Refuses a misspelt key before the config models, which import torch and transformers, are imported."""
    from opd.utils.config_keys import check_config_keys

    check_config_keys(root, config_path, overrides)


def _prepare_console() -> None:
    from opd.run.logger import setup_console_logging

    setup_console_logging()
    quiet_third_party_output()


def _draw_curves(logger_config: LoggerConfig) -> None:
    """Writes summary.txt and curves.png next to metrics.jsonl; a failure here is only a warning."""
    from opd.run.plotting import plot_curves, write_summary

    metrics_file = Path(logger_config.log_dir) / "metrics.jsonl"
    if not (logger_config.jsonl and metrics_file.is_file()):
        return
    # The run itself succeeded; a plot that cannot be drawn must not turn it into an error.
    try:
        print(write_summary(metrics_file))
        print(f"curves: {plot_curves(metrics_file)}")
    except OpdError as error:
        print(f"opd: warning: no curves drawn: {error}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``opd`` console script; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve-teacher"]:
        # Its options are the server's own (argparse's REMAINDER would not pass a leading --model on).
        from opd.teachers.served.server import main as serve_main

        return serve_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "plot":
        from opd.run.plotting import main as plot_main

        return plot_main(args.arguments)
    try:
        if args.command == "export":
            run_export(args)
        elif args.command == "prune":
            run_prune(args)
        elif args.command == "sft":
            run_sft(args.config, args.overrides)
        elif args.command == "generate":
            run_generate(args.config, args.overrides)
        elif args.command == "plan" or getattr(args, "dry_run", False):
            run_plan(args.config, args.overrides, args.json, args.quick, args.every_layer, args.reserved_factor)
        elif args.command == "eval" and args.harness is not None:
            run_harness(args.config, [*args.overrides, *harness_overrides(args)])
        else:
            run_train(args.config, args.overrides, val_only=args.command == "eval")
    except OpdError as error:
        if args.debug or os.environ.get("OPD_DEBUG") == "1":
            traceback.print_exc()
        print(f"opd: error: {error}", file=sys.stderr)
        return EXIT_TRAINING_FAILED if isinstance(error, TrainingDivergedError) else EXIT_USER_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
