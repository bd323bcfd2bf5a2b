"""lm-evaluation-harness from opd, offline: ``opd eval --harness lm-eval`` and ``validation.harness_tasks``.

The tasks are the repo's own (``examples/eval_tasks/``) over local JSONL files, so nothing
is downloaded. The file's ground truth is wrong on every other row, so the committed demo
teacher, which answers every row right, scores 0.5 by both checks; the check that matters
is that lm-eval's score of each model equals opd's own validation accuracy on the same rows
(the same prompts, greedy decoding, the answer in ``\\boxed{}``: math-verify on opd's side;
lm-eval's regex and exact match for ``opd_arithmetic``, opd's own math-verify grading for
``opd_math``).

The evaluation settings practitioners use (generation settings, repeated samples, the chat
template's keyword arguments, a system instruction, few-shot turns, lm-eval's own results
and per-sample files) are checked on what lm-eval itself recorded and logged, and the
prompt it logged for each document is compared byte for byte with the one the tokenizer's
chat template renders for the same messages.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
from opd_test_helpers import REPO_ROOT, short_run_overrides, write_wrong_half_arithmetic_rows

from opd.cli import main
from opd.distillation.config import MasterConfig
from opd.run.harness import METRIC_PREFIX, HarnessConfig, HarnessResults
from opd.utils.config import load_config
from opd.utils.errors import ConfigError

DEMO_CONFIG = REPO_ROOT / "examples" / "configs" / "demo.yaml"
TINY_CONFIG = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
TEACHER = str(REPO_ROOT / "examples" / "demo" / "models" / "teacher")
STUDENT = str(REPO_ROOT / "examples" / "demo" / "models" / "student")
METRIC = "exact_match,boxed"


def _solved_rows(path: Path, count: int = 2) -> Path:
    """Rows with a worked solution in the specification's answer format, as the demo's train rows are."""
    with open(path, "w", encoding="utf-8") as handle:
        for index in range(count):
            a, b = 100 + index, 200 + index
            solution = f"So {a}+{b}={a + b}. </think> <answer> \\boxed{{{a + b}}} </answer>"
            row = {"problem": f"What is {a} + {b}?", "ground_truth_answer": str(a + b), "solution": solution}
            handle.write(json.dumps(row) + "\n")
    return path


def _tasks(directory: Path, data: Path, train: Path | None = None) -> Path:
    """The shipped task files, with the data paths pointed at ``data`` (and ``train``: few-shot rows)."""
    directory.mkdir()
    for source in (REPO_ROOT / "examples" / "eval_tasks").iterdir():
        if source.suffix in {".yaml", ".py"}:
            shutil.copy(source, directory / source.name)
    train = train or _solved_rows(directory / "train.jsonl")
    for name, paths in (("opd_arithmetic", {"test": data}), ("opd_math", {"test": data, "train": train})):
        task = directory / f"{name}.yaml"
        text = task.read_text()
        for split, path in paths.items():
            assert f"{split}: examples/data/arithmetic/{split}.jsonl" in text
            text = text.replace(f"{split}: examples/data/arithmetic/{split}.jsonl", f"{split}: {path}")
        task.write_text(text)
    return directory


def test_lm_eval_scores_equal_opd_validation(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)  # the task module reads the prompt template beside it; configs are repo-relative
    data = write_wrong_half_arithmetic_rows(tmp_path / "rows.jsonl")
    tasks = _tasks(tmp_path / "tasks", data)
    harness_logs = tmp_path / "harness"
    status = main(
        ["eval", "--config", str(DEMO_CONFIG), "--harness", "lm-eval", "--tasks", "opd_arithmetic,opd_math",
         "--include-path", str(tasks), "--compare", "teacher",
         f"validation.model_path={STUDENT}", f"logger.log_dir={harness_logs}"]
    )  # fmt: skip
    assert status == 0
    written = json.loads((harness_logs / "harness_results.json").read_text())
    assert written["models"] == {"model": STUDENT, "teacher": "examples/demo/models/teacher"}  # as the config says
    table = (harness_logs / "harness_table.md").read_text()
    assert table.splitlines()[0] == "| task | metric | model | teacher |"
    assert written["records"]["teacher"]["config"]["gen_kwargs"] is None  # greedy, as each task says

    for label, model in (("model", STUDENT), ("teacher", TEACHER)):
        opd_logs = tmp_path / f"opd_{label}"
        status = main(
            ["eval", "--config", str(DEMO_CONFIG), f"validation.model_path={model}", f"data.val_path={data}",
             f"logger.log_dir={opd_logs}", "validation.teacher_baseline=false"]
        )  # fmt: skip
        assert status == 0
        accuracy = json.loads((opd_logs / "eval_metrics.json").read_text())["val/accuracy"]
        assert written["scores"][label]["opd_arithmetic"][METRIC] == pytest.approx(accuracy, abs=1e-9), label
        # opd_math grades as opd's validation does (the last \\boxed{}, math-verify): the same number.
        assert written["scores"][label]["opd_math"]["math_verify"] == pytest.approx(accuracy, abs=1e-9), label
    assert written["scores"]["teacher"]["opd_arithmetic"][METRIC] == 0.5  # right on every row the data is


def test_a_run_ends_with_the_harness(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    tasks = _tasks(tmp_path / "tasks", write_wrong_half_arithmetic_rows(tmp_path / "rows.jsonl", count=4))
    overrides = [
        *short_run_overrides(tmp_path),
        "training.max_num_steps=1",
        "checkpointing.enabled=false",
        "validation.harness_tasks=[opd_arithmetic]",
        f"validation.harness.include_path={tasks}",
        "validation.harness.compare=[student_before]",
        "validation.harness.batch_size=4",
    ]
    config = load_config(MasterConfig, TINY_CONFIG, overrides)
    from opd.distillation.setup import setup
    from opd.distillation.step import distillation_train

    distillation_train(setup(config))
    log_dir = Path(config.logger.log_dir)
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    harness = [record for record in records if f"{METRIC_PREFIX}opd_arithmetic/{METRIC}" in record]
    assert len(harness) == 1 and harness[0]["step"] == 1
    written = json.loads((log_dir / "harness_results.json").read_text())
    assert set(written["scores"]) == {"model", "student_before"}
    assert written["models"]["model"] == str(Path(config.output_dir) / "final_model")
    card = (Path(config.output_dir) / "final_model" / "README.md").read_text()
    assert "## Evaluation" in card and "| opd_arithmetic | exact_match,boxed |" in card
    assert written["records"]["model"]["task_hashes"]["opd_arithmetic"]  # lm-eval's record, at the end of a run too


def test_results_table_and_metric_names():
    results = HarnessResults(
        tasks=["a", "b"],
        scores={"model": {"a": {"acc": 0.25}, "b": {"em": 1.0}}, "teacher": {"a": {"acc": 0.75}}},
    )
    assert results.metrics() == {"harness/a/acc": 0.25, "harness/b/em": 1.0}
    assert results.metrics("teacher") == {"harness/a/acc": 0.75}
    assert results.table().splitlines() == [
        "| task | metric | model | teacher |",
        "|---|---|---|---|",
        "| a | acc | 0.2500 | 0.7500 |",
        "| b | em | 1.0000 | — |",
    ]


def test_harness_errors_name_what_is_wrong(tmp_path, monkeypatch):
    from opd.cli import build_parser, harness_overrides
    from opd.models.config import ModelLoadingConfig
    from opd.run.harness import evaluate_with_harness, load_for_harness, require_harness
    from opd.sft import SFTMasterConfig

    with pytest.raises(ConfigError, match=r"validation.harness.compare names \['teacher'\].*student_before"):
        load_config(
            SFTMasterConfig,
            REPO_ROOT / "examples" / "configs" / "sft.yaml",
            ["validation.harness_tasks=[x]", "validation.harness.compare=[teacher]"],
        )
    with pytest.raises(ValueError, match="named twice"):
        HarnessConfig(compare=["teacher", "teacher"])
    with pytest.raises(ConfigError, match=r"validation.harness.log_samples needs validation.harness.output_path"):
        load_config(MasterConfig, DEMO_CONFIG, ["validation.harness.log_samples=true"])
    with pytest.raises(ConfigError, match=r"repeats = 4 with validation.harness.temperature = 0"):
        load_config(MasterConfig, DEMO_CONFIG, ["validation.harness.repeats=4", "validation.harness.temperature=0"])
    with pytest.raises(ConfigError, match=r"--chat-template-kwargs must be a JSON object"):
        harness_overrides(
            build_parser().parse_args(
                ["eval", "--config", "x", "--harness", "lm-eval", "--chat-template-kwargs", "[1]"]
            )
        )
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"pip install 'opd\[eval\]'"):
        require_harness(HarnessConfig())
    monkeypatch.undo()
    loading = ModelLoadingConfig(device="cpu", dtype="float32")
    with pytest.raises(ConfigError, match=r"no task \['no_such_task'\]"):
        evaluate_with_harness(
            {"model": "tiny:student"}, ["no_such_task"], HarnessConfig(), lambda path: load_for_harness(path, loading)
        )


def test_local_tasks_are_indexed_without_lm_evals_own_and_once_per_process(tmp_path):
    """Every task asked for is under include_path: lm-eval's built-in tasks (seconds to index) stay out."""
    from opd.run.harness import _task_manager

    tasks = str(_tasks(tmp_path / "tasks", write_wrong_half_arithmetic_rows(tmp_path / "rows.jsonl", count=4)))
    manager = _task_manager(tasks, ("opd_arithmetic",))
    assert "opd_arithmetic" in manager.all_tasks
    assert "gsm8k" not in manager.all_tasks and len(manager.all_tasks) < 10  # no built-in task indexed
    assert _task_manager(tasks, ("opd_arithmetic",)) is manager  # built once, reused for the next model


# Qwen3's switch, in a template small enough to read: with enable_thinking=false the
# assistant's turn opens with an empty thinking block.
THINKING_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
SYSTEM = "Answer with the sum only."


def _task_module(name: str):
    """A shipped task's Python hooks, imported from their file as lm-eval imports them."""
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "examples" / "eval_tasks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _harness_run(tmp_path: Path, name: str, model: Path, tasks: Path, *flags: str) -> tuple[dict, dict, list[dict]]:
    """``opd eval --harness`` on opd_math with ``flags``: opd's results, lm-eval's own results file, its samples."""
    output = tmp_path / f"{name}_lm_eval"
    status = main(
        ["eval", "--config", str(DEMO_CONFIG), "--harness", "lm-eval", "--tasks", "opd_math",
         "--include-path", str(tasks), "--output-path", str(output), "--log-samples", *flags,
         f"validation.model_path={model}", f"logger.log_dir={tmp_path / name}"]
    )  # fmt: skip
    assert status == 0
    written = json.loads((tmp_path / name / "harness_results.json").read_text())
    files = written["records"]["model"]["files"]
    assert set(files) == {"results", "samples/opd_math"}
    assert all(Path(file).parent == output / "model" for file in files.values())
    lm_eval_results = json.loads(Path(files["results"]).read_text())
    samples = [json.loads(line) for line in Path(files["samples/opd_math"]).read_text().splitlines()]
    return written, lm_eval_results, samples


def test_practitioners_settings_reach_lm_eval_and_its_prompts_are_the_templates(tmp_path, monkeypatch):
    """Generation settings, repeats, chat-template kwargs, system instruction, few-shot turns: as lm-eval ran them."""
    monkeypatch.chdir(REPO_ROOT)
    model = tmp_path / "teacher"
    shutil.copytree(TEACHER, model)
    (model / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    train = _solved_rows(tmp_path / "train.jsonl", count=3)
    tasks = _tasks(tmp_path / "tasks", write_wrong_half_arithmetic_rows(tmp_path / "rows.jsonl", count=4), train)
    written, lm_eval_results, samples = _harness_run(
        tmp_path, "multi_turn", model, tasks,
        "--limit", "3", "--num-fewshot", "2", "--max-gen-toks", "4", "--temperature", "0.8", "--top-p", "0.9",
        "--repeats", "2", "--chat-template-kwargs", '{"enable_thinking": false}', "--system-instruction", SYSTEM,
    )  # fmt: skip

    # lm-eval ran the task as set: its recorded task config, and what each request carried to the model.
    generation = {"until": [], "do_sample": True, "max_gen_toks": 4, "temperature": 0.8, "top_p": 0.9}
    task_config = lm_eval_results["configs"]["opd_math"]
    assert task_config["generation_kwargs"] == generation and task_config["repeats"] == 2
    assert lm_eval_results["n-shot"]["opd_math"] == 2
    assert lm_eval_results["system_instruction"] == SYSTEM and lm_eval_results["fewshot_as_multiturn"] is True
    assert lm_eval_results["chat_template_sha"] == hashlib.sha256(THINKING_TEMPLATE.encode()).hexdigest()
    assert len(samples) == 3
    for sample in samples:
        assert sample["arguments"]["gen_args_0"]["arg_1"] == generation
        assert len(sample["resps"][0]) == 2  # two samples of each document
    assert set(written["scores"]["model"]["opd_math"]) == {"math_verify", "avg@2", "pass@2"}
    assert written["settings"]["chat_template_kwargs"] == {"enable_thinking": False}

    # The prompt lm-eval logged is the chat template's rendering of the same messages, byte for byte.
    from opd.data.converters import load_prompt_template
    from opd.models.loading import load_tokenizer

    tokenizer = load_tokenizer(str(model))
    template = load_prompt_template("examples/prompts/math_think_answer.txt")
    shots = [json.loads(line) for line in train.read_text().splitlines()][:2]  # the first N rows, in order
    turns = [{"role": "system", "content": SYSTEM}]
    for shot in shots:
        turns += [
            {"role": "user", "content": template.format(prompt=shot["problem"])},
            {"role": "assistant", "content": shot["solution"]},
        ]
    for sample in samples:
        messages = [*turns, {"role": "user", "content": template.format(prompt=sample["doc"]["problem"])}]
        expected = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
        logged = sample["arguments"]["gen_args_0"]["arg_0"]
        assert logged == expected
        assert logged.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking reached it
        assert logged.count("<|im_start|>assistant\n") == 3  # two few-shot answers, then the open turn

    # Few-shot examples in one user turn instead, as lm-eval joins them (its delimiters: " " and a blank line).
    _, lm_eval_results, samples = _harness_run(
        tmp_path, "single_turn", model, tasks,
        "--limit", "1", "--num-fewshot", "2", "--max-gen-toks", "1", "--no-fewshot-as-multiturn",
    )  # fmt: skip
    assert lm_eval_results["fewshot_as_multiturn"] is False and lm_eval_results["system_instruction"] is None
    joined = "".join(f"{template.format(prompt=shot['problem'])} {shot['solution']}\n\n" for shot in shots)
    user = joined + template.format(prompt=samples[0]["doc"]["problem"])
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
    )
    assert samples[0]["arguments"]["gen_args_0"]["arg_0"] == expected


def test_repeated_samples_give_avg_and_pass_at_k_and_the_run_is_recorded(tmp_path, monkeypatch):
    """avg@n / pass@k from n sampled answers of the demo teacher, each graded by opd's check; lm-eval's record."""
    monkeypatch.chdir(REPO_ROOT)
    tasks = _tasks(tmp_path / "tasks", write_wrong_half_arithmetic_rows(tmp_path / "rows.jsonl", count=4))
    # At temperature 1.8 the demo teacher answers a problem right on some of its samples only.
    written, lm_eval_results, samples = _harness_run(
        tmp_path, "sampled", Path(TEACHER), tasks, "--temperature", "1.8", "--repeats", "4"
    )
    grading = _task_module("opd_math")
    from opd.rollout.environments.math_verifier import is_correct

    assert len(samples) == 4
    for sample in samples:
        grades = [is_correct(response, sample["doc"]["ground_truth_answer"]) for response in sample["resps"][0]]
        assert len(grades) == 4 and sample["avg@4"] == sum(grades) / 4 and sample["math_verify"] == float(grades[0])
        assert sample["pass@2"] == pytest.approx(grading.pass_at_k(4, sum(grades), 2))
        assert sample["pass@4"] == float(any(grades))
    scores = written["scores"]["model"]["opd_math"]
    for metric in ("math_verify", "avg@4", "pass@2", "pass@4"):
        assert scores[metric] == pytest.approx(sum(sample[metric] for sample in samples) / 4), metric
    # Every other row's ground truth is wrong, so no sample of those is right.
    assert 0 < scores["avg@4"] <= scores["pass@2"] <= scores["pass@4"] <= 0.5

    # What a reader needs to reproduce the run, in opd's own results.
    record = written["records"]["model"]
    assert record["lm_eval_version"] == importlib.metadata.version("lm_eval")
    assert record["task_hashes"] == lm_eval_results["task_hashes"] and len(record["task_hashes"]["opd_math"]) == 64
    seeds = {key: record["config"][key] for key in ("random_seed", "numpy_seed", "torch_seed", "fewshot_seed")}
    assert seeds == {"random_seed": 0, "numpy_seed": 1234, "torch_seed": 1234, "fewshot_seed": 1234}
    assert record["config"]["gen_kwargs"] == {"temperature": 1.8, "do_sample": True}
    assert record["configs"]["opd_math"]["repeats"] == 4 and record["versions"] == {"opd_math": 1.0}
    assert record["configs"]["opd_math"]["generation_kwargs"]["max_gen_toks"] == 96  # the task's own
    assert record["n-samples"] == {"opd_math": {"original": 4, "effective": 4}} and record["n-shot"] == {"opd_math": 0}
    assert record["chat_template_sha"] == lm_eval_results["chat_template_sha"] is not None


def test_math_task_grades_the_last_box_with_math_verify(monkeypatch):
    monkeypatch.chdir(REPO_ROOT)  # the task module reads the prompt template by a repository-relative path
    task = _task_module("opd_math")
    doc = {"problem": "What is 1/4 + 1/4?", "ground_truth_answer": "0.5"}
    correct = "1/4+1/4=2/4. </think> <answer> \\boxed{\\frac{1}{2}} </answer>"  # equal, not the same text
    incorrect = "1/4+1/4=2/8. </think> <answer> \\boxed{\\frac{1}{4}} </answer>"
    malformed = "1/4+1/4=2/4. </think> <answer> \\boxed{\\frac{1}{2} </answer>"  # the box never closes
    assert task.process_results(doc, [correct]) == {"math_verify": 1.0}
    assert task.process_results(doc, [incorrect]) == {"math_verify": 0.0}
    assert task.process_results(doc, [malformed]) == {"math_verify": 0.0}
    assert task.process_results(doc, ["no answer at all"]) == {"math_verify": 0.0}
    assert task.process_results(doc, ["\\boxed{0.5} at first, then \\boxed{3}"]) == {"math_verify": 0.0}  # the last box
    # Repeats: one document's samples together (lm-eval hands them over as one list).
    graded = task.process_results(doc, [[incorrect, correct, malformed, correct, incorrect]])
    assert graded == pytest.approx({"math_verify": 0.0, "avg@5": 0.4, "pass@2": 0.7, "pass@4": 1.0, "pass@5": 1.0})
    # pass@k is the chance that k of the n samples, drawn without replacement, hold a correct one.
    from itertools import combinations

    for n in range(1, 7):
        for c in range(n + 1):
            grades = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                draws = list(combinations(grades, k))
                assert task.pass_at_k(n, c, k) == pytest.approx(sum(any(d) for d in draws) / len(draws))
    assert task.sample_ks(16) == [2, 4, 8, 16] and task.sample_ks(3) == [2, 3] and task.sample_ks(1) == []


def test_capitals_task_grades_as_the_real_model_example(monkeypatch):
    """The real-model example's harness task: a response is right when it names an accepted capital, as a word."""
    monkeypatch.chdir(REPO_ROOT)
    task = _task_module("opd_capitals")
    monkeypatch.syspath_prepend(str(REPO_ROOT / "examples" / "real_model"))
    from make_capitals_task import PHRASINGS, example

    doc = example("Côte d'Ivoire", ["Yamoussoukro", "Abidjan"], PHRASINGS[1])
    assert task.doc_to_text(doc) == doc["messages"][0]["content"]
    assert "Côte d'Ivoire" in task.doc_to_text(doc) and task.doc_to_target(doc).endswith("Yamoussoukro.")
    for response, right in [
        ("The capital of Côte d'Ivoire is Yamoussoukro.", True),
        ("abidjan", True),  # any accepted spelling, any case
        ("The capital is Paris.", False),
        ("Abidjanese food is famous.", False),  # a longer word is not the name
        ("", False),
    ]:
        assert task.process_results(doc, [response]) == {"names_capital": float(right)}, response


def test_vllm_backend_without_vllm_names_the_key(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed (it is not, here)
    status = main(
        ["eval", "--config", str(DEMO_CONFIG), "--harness", "lm-eval", "--tasks", "opd_math", "--backend", "vllm",
         f"logger.log_dir={tmp_path}"]
    )  # fmt: skip
    assert status == 2
    error = capsys.readouterr().err
    assert (
        "validation.harness.backend = vllm" in error
        and "needs vllm, which cannot be imported" in error
        and "backend: hf" in error
    )
    assert not (tmp_path / "harness_results.json").exists()
    # Where vLLM is importable, it loads directories itself: a preset only opd can build is refused.
    from types import ModuleType

    from opd.run.harness import evaluate_with_harness

    monkeypatch.setitem(sys.modules, "vllm", ModuleType("vllm"))
    with pytest.raises(
        ConfigError, match=r"backend = vllm loads model directories, not presets such as \['tiny:student'\]"
    ):
        evaluate_with_harness({"model": "tiny:student"}, ["opd_math"], HarnessConfig(backend="vllm"), load=None)
