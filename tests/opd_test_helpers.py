"""Helpers shared by several test modules."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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

    def __init__(
        self,
        name: str,
        command: list[str],
        workdir: Path,
        env: dict[str, str],
        timeout: float,
        own_process_group: bool = False,
    ) -> None:
        self.name = name
        self.timeout = timeout
        # A server that starts worker processes of its own (vLLM's engine core) is given
        # its own process group, so stopping it stops them too.
        self.own_process_group = own_process_group
        workdir.mkdir(parents=True, exist_ok=True)
        self.stdout_path = workdir / f"{name}.stdout"
        self.stderr_path = workdir / f"{name}.stderr"
        with open(self.stdout_path, "w") as stdout, open(self.stderr_path, "w") as stderr:
            self.popen = subprocess.Popen(
                command, cwd=REPO_ROOT, stdout=stdout, stderr=stderr, env=env, start_new_session=own_process_group
            )

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

    from opd.losses.distillation_losses import TopKKLLossFn
    from opd.losses.sampled_token import SampledTokenLossFn

    if loss == "topk":
        loss_fn = TopKKLLossFn(kl_type=kl_type, k=k, vocab_size=vocab)
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
    """The teacher server's app on uvicorn, on 127.0.0.1, in a background thread.

    ``port`` 0 takes a free port; another (a stopped server's) starts it again where clients look for it.
    """

    def __init__(self, service, port: int = 0, **options) -> None:
        from opd.teachers.served.server import build_app, listening_socket, uvicorn_server

        self.service = service
        sock = listening_socket("127.0.0.1", port)
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


def first_turn_calls_the_tool(generation, tokenizer, call: str | Callable[[str], str]) -> None:
    """Makes ``generation``'s first turn of every episode the text ``call`` (a tool call), in place; ``call`` may
    be a function of the prompt's text (a call to the tool that prompt lists).

    A tiny random student never writes a tool call on its own. Wrapped this way, the
    engine still generates every later turn (those whose prompt holds a tool response)
    itself, so a multi-turn rollout has a call, the environment's answer, and a real
    second turn. The forced turn's sampler log-probs are a fixed -0.25 per token.
    """
    from opd.rollout.rollout_batch import build_rollout_batch

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
                text = call(tokenizer.decode(prompt)) if callable(call) else call
                responses.append(tokenizer(text, add_special_tokens=False)["input_ids"] + [end])
                logprobs.append([-0.25] * len(responses[-1]))
        truncated = [response[-1] != end for response in responses]
        sampled = logprobs if return_logprobs else None
        return build_rollout_batch(prompts, responses, sampled, truncated, tokenizer.pad_token_id)

    generation.generate = generate


def permute_for_llama_cpp(weights, heads: int):
    """A q or k projection of ``heads`` heads in the row order llama.cpp stores it (``convert_hf_to_gguf.py``).

    llama.cpp's rotary embedding pairs neighbouring rows of a head, Hugging Face's the two
    halves of a head; its converter reorders each head's rows, and transformers' GGUF loader
    reverses that (``LlamaTensorProcessor``).
    """
    rows = weights.shape[0]
    return weights.reshape(heads, 2, rows // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def write_llama_gguf(path: Path, model, tokenizer, tensor_type=None, tensor_types=None, architecture: str = "llama"):
    """Writes a Hugging Face Llama and its byte-level BPE tokenizer as llama.cpp writes them: a GGUF file.

    The metadata is what transformers reads back (``transformers/integrations/ggml.py``'s
    ``llama`` keys, the ``tokenizer.ggml.*`` keys and the chat template); tensors take
    llama.cpp's names (gguf's own name map: ``token_embd.weight``, ``blk.N.attn_q.weight``,
    ..., ``output_norm.weight``; no ``output.weight`` when the embeddings are tied), with q
    and k permuted as llama.cpp stores them.

    Args:
        model: a ``LlamaForCausalLM`` (float32 weights).
        tokenizer: a fast byte-level BPE tokenizer whose text is split as Qwen2's is (the
            ``qwen2`` pre-tokenizer; :func:`opd.models.tiny.train_bpe_tokenizer` makes one).
        tensor_type: the ``gguf.GGMLQuantizationType`` of every 2-D weight (None: F32); norms stay F32.
        tensor_types: a type for single tensors by GGUF name, over ``tensor_type``. A type gguf
            cannot quantise to is written as zero bytes of the type's size (for files it must refuse).
        architecture: ``general.architecture`` and the prefix of the model's keys.

    Returns:
        ``path``.
    """
    import json

    import gguf
    import numpy as np

    config = model.config
    writer = gguf.GGUFWriter(str(path), architecture)
    for key, value in {
        "block_count": config.num_hidden_layers,
        "context_length": config.max_position_embeddings,
        "embedding_length": config.hidden_size,
        "feed_forward_length": config.intermediate_size,
        "attention.head_count": config.num_attention_heads,
        "attention.head_count_kv": config.num_key_value_heads,
        "rope.dimension_count": config.hidden_size // config.num_attention_heads,
        "vocab_size": config.vocab_size,
    }.items():
        writer.add_uint32(f"{architecture}.{key}", value)
    writer.add_float32(f"{architecture}.rope.freq_base", config.rope_parameters["rope_theta"])
    writer.add_float32(f"{architecture}.attention.layer_norm_rms_epsilon", config.rms_norm_eps)

    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)
    assert [vocab[token] for token in tokens] == list(range(len(tokens))), "token ids must be 0..n-1"
    # Every special added token (<|im_start|> too, not only EOS and padding) is a control token
    # (type 3), as llama.cpp marks them; the others are normal (type 1).
    control = {index for index, token in tokenizer.added_tokens_decoder.items() if token.special}
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", "qwen2")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", [3 if index in control else 1 for index in range(len(tokens))])
    writer.add_array(
        "tokenizer.ggml.merges", [merge if isinstance(merge, str) else " ".join(merge) for merge in merges]
    )
    writer.add_uint32("tokenizer.ggml.eos_token_id", tokenizer.eos_token_id)
    writer.add_uint32("tokenizer.ggml.padding_token_id", tokenizer.pad_token_id)
    writer.add_bool("tokenizer.ggml.add_bos_token", False)
    writer.add_string("tokenizer.chat_template", tokenizer.chat_template)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # llama.cpp writes no output.weight for tied embeddings; transformers ties them again
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        weights = tensor.detach().float().numpy()
        if name.endswith(".attn_q.weight"):
            weights = permute_for_llama_cpp(weights, config.num_attention_heads)
        elif name.endswith(".attn_k.weight"):
            weights = permute_for_llama_cpp(weights, config.num_key_value_heads)
        qtype = (tensor_types or {}).get(name, tensor_type if weights.ndim == 2 else None)
        if qtype is None or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, np.ascontiguousarray(weights))
        elif qtype in gguf.quants._type_traits or qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, gguf.quants.quantize(weights, qtype), raw_dtype=qtype)
        else:
            block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
            raw = np.zeros((weights.shape[0], weights.shape[1] // block_size * type_size), dtype=np.uint8)
            writer.add_tensor(name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_wrong_half_arithmetic_rows(path: Path, count: int = 16) -> Path:
    """3-digit additions in math-cl form whose ground truth is off by one on every odd row.

    A model that answers every row right scores exactly 0.5: the harness tests compare two
    graders (or two backends) on a score that is neither 0 nor 1.
    """
    rng = random.Random(7)
    with open(path, "w", encoding="utf-8") as handle:
        for index in range(count):
            a, b = rng.randint(100, 999), rng.randint(100, 999)
            truth = a + b + (index % 2)
            handle.write(json.dumps({"problem": f"What is {a} + {b}?", "ground_truth_answer": str(truth)}) + "\n")
    return path


def load_script(path: Path, register: bool = False) -> Any:
    """The module of a script that is not in a package (an example's or a benchmark's), imported from its file.

    ``register`` also puts it in ``sys.modules`` under its file name (for a script whose
    dataclasses or pickling look their module up there).
    """
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules.setdefault(path.stem, module)
    spec.loader.exec_module(module)
    return module
