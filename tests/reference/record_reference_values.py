"""Records the reference values that ``tests/reference/test_reference_*.py`` assert.

Run against any checkout; the values come from that checkout's ``opd`` (put it first on
``PYTHONPATH``) and are written next to this script::

    cd <checkout> && PYTHONPATH=$PWD OMP_NUM_THREADS=1 python tests/reference/record_reference_values.py \
        [--part losses|runs|demo|all] [--repeat N] [--output-dir DIR] [--demo-output DIR]

* ``losses`` -> ``reference_losses.json``: every case of ``test_reference_losses.LOSS_CASES``
  (loss, gradients, metrics), a second or so;
* ``runs`` -> ``reference_runs.json``: every tiny run of ``test_reference_runs.RUN_OVERRIDES``
  (about a minute on 2 CPU cores);
* ``demo`` -> ``reference_demo.json``, under the kind of CPU kernels it ran on (the other
  kinds' recordings are kept): the whole demo as ``bash scripts/demo.sh`` runs it, with
  torch's threads of ``test_reference_runs.DEMO_THREADS`` (about 5 minutes on 2 CPU cores), or
  read from the output directory of a finished ``demo.sh`` (``--demo-output``, e.g. CI's
  ``results/ci_demo``; the commit and interpreter that ran it are the caller's to note).

The inputs, configurations and the extraction of the values are the test modules' own
(imported from their files), so the tests and this script cannot drift apart. With
``--repeat N`` every part is computed N times and the script stops unless all N results
are bit-for-bit identical.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def load_module(name: str) -> ModuleType:
    """Imports ``tests/reference/<name>.py`` from its file (the test directories are no package)."""
    spec = importlib.util.spec_from_file_location(f"opd_reference_{name}", HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def provenance(command: str) -> dict[str, Any]:
    """Where and how the values were produced."""
    import torch
    import transformers

    import opd
    from opd.utils.compile_cache import compiler_toolchain_problem

    def git(*args: str) -> str:
        result = subprocess.run(["git", *args], check=False, cwd=REPO, capture_output=True, text=True)
        return result.stdout.strip() if result.returncode == 0 else "unknown"

    return {
        "command": command,
        "recorded_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git("rev-parse", "HEAD"),
        "working_tree_clean_outside_tests_reference": git("status", "--porcelain", "--", ".", ":!tests/reference") == "",
        "opd_imported_from": str(Path(opd.__file__).resolve().parent),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "cpu_compile_toolchain": compiler_toolchain_problem("cpu") or "available",
    }


def record_losses() -> dict[str, Any]:
    """Loss, gradients and metrics of every loss case, as JSON-ready lists of floats."""
    losses = load_module("test_reference_losses")
    cases = {}
    for name, case in losses.LOSS_CASES.items():
        loss, gradients, metrics = losses.compute_case(case)
        cases[name] = {
            "loss_class": case.loss_class,
            "constructor_kwargs": case.kwargs,
            "fused": case.fused,
            "task_reward": case.task_reward,
            "loss": float(loss),
            "gradients": {key: gradient.tolist() for key, gradient in gradients.items()},
            "metrics": metrics,
        }
    return {"inputs": losses.input_description(), "cases": cases}


def record_runs() -> dict[str, Any]:
    """The recorded values of every tiny run."""
    runs_module = load_module("test_reference_runs")
    runs = {}
    for name, overrides in runs_module.RUN_OVERRIDES.items():
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=f"opd-reference-{name}-") as tmp:
            values = runs_module.run_tiny(name, Path(tmp) / "run")
        print(f"run {name}: {time.perf_counter() - start:.1f} s", flush=True)
        runs[name] = {"overrides": [*runs_module.COMMON_RUN_OVERRIDES, *overrides, "output_dir=<tmp>"], **values}
    return {"config": runs_module.TINY_CONFIG, "runs": runs}


def record_demo(demo_output: Path | None = None) -> dict[str, Any]:
    """The recorded values of the whole demo: run here, or read from ``demo_output``."""
    runs_module = load_module("test_reference_runs")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="opd-reference-demo-") as tmp:
        output_dir = demo_output or Path(tmp) / "demo"
        if demo_output is None:
            runs_module.run_demo(output_dir)
        values = runs_module.demo_values(output_dir)
        capability = runs_module.demo_cpu_capability(output_dir)
    minutes = (time.perf_counter() - start) / 60
    print(f"demo: {minutes:.1f} min", flush=True)
    return {
        "command": "bash scripts/demo.sh output_dir=<dir>",
        "threads": runs_module.DEMO_THREADS,
        "read_from": str(demo_output) if demo_output else None,
        "cpu_capability": capability,
        "task_sha256": runs_module.demo_task_digests(),
        "minutes_on_recording_machine": None if demo_output else round(minutes, 2),
        **values,
    }


TIMING_KEYS = {"minutes_on_recording_machine"}
"""Wall-clock entries of a recording: kept (one per repeat), never compared between repeats."""


def _without_timings(result: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in result.items() if key not in TIMING_KEYS}


PARTS: dict[str, tuple[str, Callable[[], dict[str, Any]]]] = {
    "losses": ("reference_losses.json", record_losses),
    "runs": ("reference_runs.json", record_runs),
    "demo": ("reference_demo.json", record_demo),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=[*PARTS, "all"], default="all")
    parser.add_argument("--repeat", type=int, default=1, help="compute each part N times; all must be identical")
    parser.add_argument("--output-dir", type=Path, default=HERE)
    parser.add_argument("--demo-output", type=Path, help="read the demo part from this finished demo.sh output")
    args = parser.parse_args()
    command = "python tests/reference/record_reference_values.py " + " ".join(sys.argv[1:])
    for part in (PARTS if args.part == "all" else [args.part]):
        file_name, record = PARTS[part]
        if part == "demo" and args.demo_output is not None:
            results = [record_demo(args.demo_output.resolve())]
        else:
            results = [record() for _ in range(args.repeat)]
        dumped = [json.dumps(_without_timings(result), sort_keys=True) for result in results]
        if any(text != dumped[0] for text in dumped[1:]):
            for index, result in enumerate(results):
                debug = args.output_dir / f"{file_name}.repeat{index}"
                debug.write_text(json.dumps(result, indent=1, sort_keys=True), encoding="utf-8")
            raise SystemExit(f"{part}: the {args.repeat} recordings differ (written to {file_name}.repeat*)")
        document = {"provenance": {**provenance(command), "identical_recordings": args.repeat}, **results[0]}
        for key in TIMING_KEYS & set(document):
            document[key] = [result[key] for result in results]
        args.output_dir.mkdir(parents=True, exist_ok=True)
        path = args.output_dir / file_name
        if part == "demo":  # one recording per kind of CPU kernels, the others kept
            recordings = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
            # One recording per kind of CPU kernels: the bands test_reference_runs allows come from their spread.
            recordings.setdefault("by_cpu_capability", {})[document["cpu_capability"]] = document
            document = recordings
        path.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
        print(f"{part}: wrote {args.output_dir / file_name}", flush=True)


if __name__ == "__main__":
    main()
