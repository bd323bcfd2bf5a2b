"""Helpers shared by several test modules."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY_TRAIN_DATA = REPO_ROOT / "examples" / "data" / "tiny_arithmetic" / "train.jsonl"


def json_from_a_process_of_its_own(arguments: list[str], timeout_s: float = 600) -> dict:
    """Runs ``python ARGUMENTS`` from the checkout and returns the JSON object its output ends with.

    For a dry run (``opd plan`` and the dry-run scripts): it registers a stand-in
    accelerator for its whole process, so it runs in one of its own.
    """
    import json
    import sys

    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, *arguments],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=environment,
        cwd=REPO_ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    text = done.stdout.strip()
    try:
        return json.loads(text)
    except json.JSONDecodeError:  # output before the answer: the answer is its last line
        return json.loads(text.splitlines()[-1])


def short_run_overrides(tmp_path: Path, run_name: str = "run") -> list[str]:
    """Config overrides every short test run shares: its own output dir, the tiny training
    file, no validation data or validation passes, and a quiet console."""
    return [
        f"output_dir={tmp_path / run_name}",
        f"data.train_path={TINY_TRAIN_DATA}",
        "data.val_path=null",
        "validation.val_at_start=false",
        "validation.val_at_end=false",
        "logger.console=false",
    ]


class BackgroundProcess:
    """A started process whose stdout/stderr go to files (no pipe can fill up and block it).

    Args:
        name: label used in file names and assertion messages.
        command: the full command line.
        workdir: where ``<name>.stdout`` / ``<name>.stderr`` are written.
        env: the process environment.
        timeout: default seconds for :meth:`wait` and :meth:`wait_until`.
    """

    def __init__(self, name: str, command: list[str], workdir: Path, env: dict[str, str], timeout: float,
                 own_process_group: bool = False) -> None:
        self.name = name
        self.timeout = timeout
        # A server that starts worker processes of its own (vLLM's engine core) is given
        # its own process group, so stopping it stops them too.
        self.own_process_group = own_process_group
        workdir.mkdir(parents=True, exist_ok=True)
        self.stdout_path = workdir / f"{name}.stdout"
        self.stderr_path = workdir / f"{name}.stderr"
        with open(self.stdout_path, "w") as stdout, open(self.stderr_path, "w") as stderr:
            self.popen = subprocess.Popen(command, cwd=REPO_ROOT, stdout=stdout, stderr=stderr, env=env,
                                          start_new_session=own_process_group)

    @property
    def stdout(self) -> str:
        return self.stdout_path.read_text()

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def output(self) -> str:
        """The tail of both streams, for assertion messages."""
        return f"--- {self.name} stdout:\n{self.stdout[-3000:]}\n--- {self.name} stderr:\n{self.stderr[-3000:]}"

    def wait(self, timeout: float | None = None) -> int:
        """Waits for the exit status; kills the process and fails after ``timeout``."""
        timeout = self.timeout if timeout is None else timeout
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop_if_running()
            raise AssertionError(f"{self.name} did not finish within {timeout} s\n{self.output()}") from None

    def wait_until(self, condition: Callable[[], bool], what: str, timeout: float | None = None) -> None:
        """Polls ``condition()`` every 10 ms; fails if the process ends first or time runs out."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while not condition():
            if self.popen.poll() is not None:
                raise AssertionError(
                    f"{self.name} exited (status {self.popen.returncode}) before {what}\n{self.output()}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: no {what} within {timeout} s\n{self.output()}")
            time.sleep(0.01)

    def send(self, sig: int) -> None:
        self.popen.send_signal(sig)

    def stop_if_running(self) -> None:
        if self.own_process_group:
            with contextlib.suppress(ProcessLookupError):  # the group may be gone already
                os.killpg(self.popen.pid, signal.SIGKILL)  # the process and every child it started
            self.popen.wait()
            return
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()


def served_and_in_process_losses(loss: str, kl_type: str, batch, student, remote, local, k: int, vocab: int):
    """One loss computed twice on the same student logits: from the served and the in-process teacher.

    Args:
        loss: ``topk`` (top-k KL of direction ``kl_type``) or ``sampled_token`` (random
            sampler log-probs are added to ``batch`` for it).
        batch: right-padded rows with ``token_mask``.
        student: the model whose logits enter both losses.
        remote, local: the served and the in-process teacher.

    Returns:
        ``(served_loss, in_process_loss)``.
    """
    import torch

    from opd.algorithms.loss_functions import DistillationLossFn, SampledTokenLossFn

    if loss == "topk":
        loss_fn = DistillationLossFn(kl_type=kl_type, teacher_signal="topk", teacher_topk=k, vocab_size=vocab)
    else:
        batch["generation_logprobs"] = -torch.rand(batch["input_ids"].shape)
        loss_fn = SampledTokenLossFn(vocab_size=vocab)
    logits = student(input_ids=batch["input_ids"]).logits.detach()
    valid = int(batch["token_mask"][:, 1:].sum())
    request = loss_fn.teacher_request
    served, _ = loss_fn(logits, batch, valid, batch.size, teacher_output=remote.score(batch, request))
    in_process, _ = loss_fn(logits, batch, valid, batch.size, teacher_output=local.score(batch, request))
    return served, in_process


class RunningServer:
    """The teacher server's app on uvicorn, on a free port of 127.0.0.1, in a background thread."""

    def __init__(self, service, **options) -> None:
        from opd.models.teacher.server import build_app, listening_socket, uvicorn_server

        self.service = service
        sock = listening_socket("127.0.0.1", 0)
        self.port = sock.getsockname()[1]
        self.server = uvicorn_server(build_app(service, **options))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def first_turn_calls_the_tool(generation, tokenizer, call: str) -> None:
    """Makes ``generation``'s first turn of every episode the text ``call`` (a tool call), in place.

    A tiny random student never writes a tool call on its own. Wrapped this way, the
    engine still generates every later turn (those whose prompt holds a tool response)
    itself, so a multi-turn rollout has a call, the environment's answer, and a real
    second turn. The forced turn's sampler log-probs are a fixed -0.25 per token.
    """
    from opd.models.generation.rollout_batch import build_rollout_batch

    real_generate = generation.generate
    end = tokenizer.eos_token_id

    def generate(prompts, strategy, num_samples=1, return_logprobs=True):
        later = real_generate(prompts, strategy, num_samples, return_logprobs)
        responses, logprobs = [], []
        for row, prompt in enumerate(prompts):
            start, stop = int(later["prompt_lengths"][row]), int(later["input_lengths"][row])
            if "<tool_response>" in tokenizer.decode(prompt):  # a later turn: the real engine writes it
                responses.append(later["input_ids"][row, start:stop].tolist())
                if return_logprobs:
                    logprobs.append(later["generation_logprobs"][row, start:stop].tolist())
            else:
                responses.append(tokenizer(call, add_special_tokens=False)["input_ids"] + [end])
                logprobs.append([-0.25] * len(responses[-1]))
        truncated = [response[-1] != end for response in responses]
        sampled = logprobs if return_logprobs else None
        return build_rollout_batch(prompts, responses, sampled, truncated, tokenizer.pad_token_id)

    generation.generate = generate
