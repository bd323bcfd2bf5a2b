"""Two teachers on CPU: a student distilled from an addition expert and a subtraction expert at once.

The student (``examples/demo/models/two_task_student``) writes both traces but gets most
answers wrong. It is distilled three ways, each with ``examples/configs/two_teachers_demo.yaml``'s
settings and data (both tasks mixed):

* ``routed``: each example goes to its task's expert (``teachers.mode: route`` on ``task``);
* ``add_only`` / ``sub_only``: every example goes to one expert (a plain single-teacher run).

Every model is scored on both test splits (``test_add.jsonl``, ``test_sub.jsonl``) with
``opd eval``. The script prints a table with each run's share of the gap closed to each
expert on that expert's split, ``(after - before) / (expert - before)``, and as its last line

    two_teachers routed add=<a> sub=<s> closed_add=<ga> closed_sub=<gs> minutes=<m>

It writes ``<output_dir>/two_teachers_results.json`` and each run's logs under ``<output_dir>``.

Usage: ``python examples/demo/run_two_teachers.py [--runs routed,add_only,sub_only] [key.sub=value ...]``
(the overrides go to every distillation run, e.g. ``training.max_num_steps=100``). The models
are built by ``python examples/demo/prepare_two_teachers.py``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from opd.cli import main as opd_main  # noqa: E402

DATA = REPO / "examples" / "data" / "arithmetic_two_tasks"
MODELS = REPO / "examples" / "demo" / "models"
CONFIG = REPO / "examples" / "configs" / "two_teachers_demo.yaml"
EXPERTS = {"add": MODELS / "teacher", "sub": MODELS / "sub_teacher"}
STUDENT = MODELS / "two_task_student"
ALONE = {"add_only": "add", "sub_only": "sub"}  # run name -> its single teacher


def single_teacher(expert: str) -> list[str]:
    """Overrides that turn the two-teacher config into a plain run with one teacher."""
    return ["teachers=null", f"model.teacher_model_path={EXPERTS[expert]}"]


def test_accuracy(model: Path, task: str, log_dir: Path) -> float:
    """Greedy accuracy of ``model`` on ``task``'s test split (``opd eval``, KL to that task's expert)."""
    status = opd_main([
        "eval", "--config", str(CONFIG), *single_teacher(task), f"validation.model_path={model}",
        f"data.val_path={DATA / f'test_{task}.jsonl'}", "data.max_val_examples=null", f"logger.log_dir={log_dir}",
    ])
    if status != 0:
        raise SystemExit(status)
    return json.loads((log_dir / "eval_metrics.json").read_text(encoding="utf-8"))["val/accuracy"]


def scores(model: Path, log_dir: Path) -> dict[str, float]:
    return {task: test_accuracy(model, task, log_dir / task) for task in EXPERTS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="routed,add_only,sub_only")
    parser.add_argument("--output-dir", default=str(REPO / "results" / "two_teachers_demo"))
    parser.add_argument("overrides", nargs="*", help="key.sub=value for every distillation run")
    args = parser.parse_args()
    if not (DATA / "train.jsonl").is_file():
        subprocess.run([sys.executable, str(REPO / "examples" / "data" / "make_two_task_arithmetic.py")], check=True)
    missing = [path for path in (*EXPERTS.values(), STUDENT) if not (path / "config.json").is_file()]
    if missing:
        raise SystemExit(f"missing {missing}: run python examples/demo/prepare_two_teachers.py first")
    output = Path(args.output_dir)
    started = time.perf_counter()
    results: dict[str, dict] = {
        "experts": {name: scores(path, output / "eval" / f"expert_{name}") for name, path in EXPERTS.items()},
        "before": scores(STUDENT, output / "eval" / "before"),
        "runs": {},
    }
    for run in args.runs.split(","):
        run_dir = output / run
        overrides = [] if run == "routed" else single_teacher(ALONE[run])
        run_started = time.perf_counter()
        status = opd_main(["train", "--config", str(CONFIG), *overrides, f"output_dir={run_dir}", *args.overrides])
        if status != 0:
            raise SystemExit(status)
        minutes = (time.perf_counter() - run_started) / 60
        after = scores(run_dir / "final_model", output / "eval" / run)
        closed = {
            task: (after[task] - results["before"][task]) / (results["experts"][task][task] - results["before"][task])
            for task in EXPERTS
        }
        results["runs"][run] = {"after": after, "closed": closed, "minutes": minutes}
    (output / "two_teachers_results.json").write_text(json.dumps(results, indent=2), encoding="utf-8")

    print(f"\n{'model':<22}{'test_add':>10}{'test_sub':>10}{'closed_add':>12}{'closed_sub':>12}{'minutes':>9}")
    for name in EXPERTS:
        row = results["experts"][name]
        print(f"{name + ' expert':<22}{row['add']:>10.3f}{row['sub']:>10.3f}")
    print(f"{'student before':<22}{results['before']['add']:>10.3f}{results['before']['sub']:>10.3f}")
    for run, row in results["runs"].items():
        print(f"{'student ' + run:<22}{row['after']['add']:>10.3f}{row['after']['sub']:>10.3f}"
              f"{row['closed']['add']:>12.2f}{row['closed']['sub']:>12.2f}{row['minutes']:>9.1f}")
    routed = results["runs"].get("routed")
    total = (time.perf_counter() - started) / 60
    if routed is not None:
        print(f"two_teachers routed add={routed['after']['add']:.3f} sub={routed['after']['sub']:.3f} "
              f"closed_add={routed['closed']['add']:.2f} closed_sub={routed['closed']['sub']:.2f} minutes={total:.1f}")


if __name__ == "__main__":
    main()
