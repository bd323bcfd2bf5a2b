"""End-to-end on-policy distillation speed and memory: opd vs TRL's ``DistillationTrainer`` and ``GKDTrainer``.

What is compared: one optimizer step of fully on-policy distillation (λ = 1) — the
student samples responses to a batch of prompts, the frozen teacher scores them, the
student takes one AdamW step on the generalized JSD (β = 0.5) between the two — run by
opd (``setup`` + ``distillation_train``), by TRL's stable ``trl.DistillationTrainer``
(**Distill**) and by its experimental ``trl.experimental.gkd.GKDTrainer`` (**GKD**), on
the same CPU, with the same models, tokenizer, prompts and settings. Two sizes:

* ``small``: a byte-level BPE tokenizer trained on the benchmark's prompts (≈2k tokens);
* ``qwen_vocab``: the real Qwen2/2.5 vocabulary size, 151,669 outputs. The tokenizer is
  the small one with unreachable filler entries appended to its BPE vocabulary (no merges
  produce them) until ``len(tokenizer) == 151,669``, so text tokenizes exactly as with the
  small tokenizer (checked), while the embedding, the LM head, every logit row, the
  sampler's softmax and the divergence have Qwen's width.

The models are opd's tiny presets (:mod:`opd.models.tiny`): teacher ``hidden 128 × 4
layers``, student ``hidden 64 × 2 layers``, randomly initialised, fp32, tied embeddings,
saved once as HF model directories that both frameworks load.

How the comparison is made fair:

* identical inputs: the same model directories, tokenizer and JSONL chat rows; every
  prompt renders to exactly ``--prompt-tokens`` tokens (prompts are picked by length), so
  both frameworks see the same shapes whatever order their shuffles give;
* identical work: λ = 1 (every step on-policy), ``max_new_tokens`` = opd's
  ``generate_strategy.max_length``, sampling at the same temperature with top-k off and
  top-p = 1 (TRL's fixed ``top_k=0, top_p=1.0`` = opd ``decoding_method=top_p, top_p=1``).
  The student is untrained, so its next-token distribution is
  nearly uniform and EOS is rare: responses almost always run to ``max_new_tokens``. The
  table shows each framework's mean response length so any difference is visible;
* identical objective: TRL computes ``generalized_jsd_loss(beta)`` with its default
  temperature 1 (``compute_loss`` does not pass ``args.temperature``, which only sets the
  sampling temperature), so opd runs ``loss_fn.type=jsd, loss_fn.beta=β,
  loss_fn.temperature=1``; both average over response tokens;
* identical optimisation: per-device batch = opd ``training.batch_size``, one forward /
  backward per step (no accumulation), the fused ``torch.optim.AdamW`` kernel with the
  same lr, betas, eps and weight decay 0 (TRL's default ``adamw_torch_fused``, opd's
  ``adam_implementation: auto``), constant learning rate without warm-up, max_grad_norm 1;
* TRL's defaults are kept otherwise (``bf16=False`` for fp32 like opd; no saving,
  evaluation or reporting), and each TRL trainer runs twice: as shipped, with
  ``gradient_checkpointing=True`` (both configs' default: activations are recomputed in
  the backward pass), and with ``gradient_checkpointing=False`` (**gc-off**), which does
  the same work as opd (no recomputation). With checkpointing on, ``GKDTrainer`` also
  generates without the KV cache, while ``DistillationTrainer`` turns checkpointing off
  around ``generate`` and keeps the cache;
* how ``DistillationConfig`` is mapped onto the same run (GKD's settings above apply to it
  unchanged where the two configs share a field: batch, steps, optimizer, lr, scheduler,
  clipping, precision, checkpointing, seed, logging every step):

  - data: the same JSONL rows. ``DistillationTrainer`` reads a conversational ``prompt``
    column, so each row's user turn becomes its ``prompt`` — what GKD's collator keeps as
    the prompt of the same row (it drops the assistant turn); both render it with the
    chat template and ``add_generation_prompt``, so the prompts are the same tokens;
  - λ: ``DistillationTrainer`` has no ``lmbda`` and no ``seq_kd``: every step samples its
    completions with the student itself, which is λ = 1 (GKD's ``lmbda=1.0``, opd's
    ``distillation.lambda: 1``);
  - β: ``beta=0.5``. Both TRL trainers define the divergence the same way — mixture
    ``m = (1 - β) p_student + β p_teacher``, loss ``β KL(p_teacher‖m) + (1 - β)
    KL(p_student‖m)``, 0 = forward KL, 1 = reverse KL — and so does opd's ``jsd`` loss;
    only the default differs (1.0 in ``DistillationConfig``), so it is set explicitly;
  - temperature: ``DistillationConfig.temperature`` is both the sampling temperature and
    the softmax temperature of the divergence, where GKD's only samples (its loss runs at
    1) and opd keeps the two apart (``generate_strategy.temperature`` and
    ``loss_fn.temperature``). So ``temperature=1.0`` sets the loss's temperature to 1,
    as in GKD and opd, and ``generation_kwargs={"temperature": <sampling>}`` overrides the
    sampling temperature alone (``generation_kwargs`` is applied over the trainer's own
    generation settings);
  - sampling: ``top_k=0`` and ``top_p=1.0`` (its defaults, spelled out, = GKD's fixed
    values), ``max_completion_length`` = GKD's ``max_new_tokens`` = opd's
    ``generate_strategy.max_length``; generation stops at the tokenizer's and the model's
    EOS ids (GKD: the model's; opd: both), here one and the same ``<|im_end|>``;
    ``use_vllm=False`` (no GPU here), so it samples with the student's own HF
    ``generate``, like GKD;
  - batching: ``shuffle_dataset=True`` (its default; GKD's loader shuffles too) with the
    same seed, and ``pad_to_multiple_of`` left at ``"auto"``, which pads nothing off
    Neuron: every prompt has the same length, so each step has GKD's shapes whatever rows
    it draws;
  - loss and reduction: ``DistillationTrainer`` has one loss path, the chunked
    ``ChunkedDivergenceFunction``: the student's and teacher's final hidden states are
    projected through their LM heads tile by tile (``TOKEN_CHUNK_SIZE`` 4096 positions ×
    ``VOCAB_CHUNK_SIZE`` 32,768 logits, module constants that no config field sets), so
    neither model's full logits exist, like opd's ``fused_lm_head`` loss and unlike GKD,
    which builds both models' full logits. Off Triton devices (this CPU) it projects every
    position of the completion block, padding included, and masks the padded ones
    afterwards. The loss is the sum over response tokens (to EOS) over their number, as in
    GKD and opd. There is no other loss or chunking option to set;
  - dropout: ``disable_dropout=True``, GKD's default (``DistillationConfig``'s is
    ``False``); the tiny models have no dropout, so it changes nothing here;
  - what cannot be matched: ``DistillationTrainer`` tokenizes the prompts inside the
    training step (``_prepare_inputs`` → ``_generate``), so its step time includes the chat
    template and tokenization, where GKD's collator runs in the data loader before
    ``on_step_begin``; with checkpointing on it still generates with the KV cache (see
    above), which ``GKDTrainer`` does not; and it runs the teacher's decoder only, its LM
    head being applied inside the chunked loss (so counted as training below), as in opd,
    where GKD's teacher forward includes the head;
* opd also runs twice: **opd** with its own defaults (notably ``loss_fn.fused_lm_head:
  true`` and ``generation.decode_loop: opd``), and **opd compiled** with the one option
  that is off by default, ``generation.compile_decode: true`` (``torch.compile`` of the
  one-token decode step). Validation and checkpoints are off in both.

What is measured, per size, in fresh processes that alternate Distill, Distill gc-off,
GKD, GKD gc-off, opd, opd compiled, … (``--rounds`` of each), each process running
``--warmup`` untimed and ``--steps`` timed steps:

* step time: the median over all timed steps of the framework's own step — TRL: a
  ``TrainerCallback`` from ``on_step_begin`` to ``on_step_end`` (generation, forward,
  backward, clipping, optimizer and scheduler step); opd: ``timing/step`` from
  ``metrics.jsonl`` (the same span). ``loop s`` is the median interval between the ends of
  consecutive steps, which also holds data loading and logging;
* per-phase times: opd's ``timing/generation``, ``timing/teacher``, ``timing/training``;
  for TRL the generation call (GKD: ``generate_on_policy_outputs``; Distill:
  ``_generate_single_turn``, i.e. padding, ``generate`` and the EOS mask) and the
  teacher's forward (GKD: the whole model; Distill: its decoder) are timed by
  wrappers/hooks and the rest of the step is "training";
* tokens/s: (prompt + response tokens of the step, padding excluded, response up to and
  including EOS) / step time, the median over steps, defined identically for both;
* peak RSS: the process's ``VmHWM`` at the end of the last timed step (imports, models,
  optimizer state and the steps included); ``Δ train`` is the peak during the steps minus
  the RSS just before the first one (the high-water mark is reset there);
* per run: a second table puts opd, Distill and GKD side by side with one figure per
  process — its median timed step and its peak RSS — as the median and range over the
  ``--rounds`` runs, and opd's (and opd compiled's) ratios to Distill's, each round's opd
  run over the same round's Distill run (runs of one round are neighbours in time), as
  the median and range over the rounds;
* compile seconds of ``compile_decode``, which the median step time leaves out: the
  compilation happens in the first steps (mostly the warm-up, and once more whenever a
  new shape appears, e.g. a single row left decoding). Per run, the one-time time is the
  sum of all its step times (warm-up and timed) minus the number of steps times its
  median step; the compile seconds are opd compiled's one-time time minus opd's, in the
  same round (so first-call costs common to both cancel), the median over rounds. The
  break-even point is the compile seconds over the per-step saving (opd's median step
  minus opd compiled's): the number of steps after which a run with ``compile_decode``
  has taken less time in all (none when compiling does not make a step faster).

Overhead report: another kind of process times, at the same shapes, the essential parts
of an opd step alone, without opd's driver — opd's decode loop (KV cache, same sampling,
the same stop ids, the compiled step as in the opd compiled runs; HF ``generate`` is
timed next to it for reference), the teacher's decoder forward to its final hidden
states (``inference_mode``), and the student's forward + opd's fused JSD loss + backward
+ clipping + AdamW step — and prints opd compiled's step time over their sum, next to
its own per-phase timings. Once, untimed, it also checks on one batch that opd's loss
equals GKD's ``generalized_jsd_loss`` and ``DistillationTrainer``'s chunked loss
(``_chunked_divergence_loss`` with the settings above; same weights, same tokens), i.e.
that all the runs optimise the same objective.

``--smoke`` runs one round of one warm-up and one timed step per framework at the 2k
vocabulary, with 4-token responses to batches of 2, and times the parts alone on eager
kernels (the opd runs compile the same loss kernels and decode step).

The last lines are machine-readable:
``e2e opd/trl_gc_off step_time small=<ratio> qwen_vocab=<ratio> peak_rss small=<ratio> qwen_vocab=<ratio>``
then the same with ``e2e opd/trl``, ``e2e opd_compiled/trl_gc_off`` and
``e2e opd_compiled/trl`` (``trl`` is GKD; ratios of the medians pooled over all runs), then
``e2e opd/distill_gc_off``, ``e2e opd/distill``, ``e2e opd_compiled/distill_gc_off`` and
``e2e opd_compiled/distill`` in the same form (the median over rounds of the per-round
ratios of the second table), then
``e2e compile_decode compile_s small=<s> qwen_vocab=<s> break_even_steps small=<n> qwen_vocab=<n>``.

Usage: ``python benchmarks/e2e_vs_trl.py [--steps 8] [--warmup 2] [--rounds 3]
[--batch-size 4] [--max-new-tokens 32] [--sizes small,qwen_vocab] [--smoke]``. Nothing is
downloaded. Run it on an otherwise idle machine: times assume the cores are free.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import random
import re
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import parse_arguments

QWEN_VOCAB = 151_669
"""Qwen2/2.5 vocabulary size used for the ``qwen_vocab`` model (its output layer width)."""
SMALL_VOCAB_TARGET = 2048
"""Upper bound of the BPE vocabulary trained for the ``small`` model."""
STUDENT_PRESET, TEACHER_PRESET = "student", "teacher"
"""opd tiny presets: student hidden 64 × 2 layers, teacher hidden 128 × 4 layers."""
JSD_BETA = 0.5
"""TRL's default β; opd's ``loss_fn.beta`` gets the same value."""
SAMPLING_TEMPERATURE = 0.9
"""TRL's default ``temperature`` (sampling only); opd's ``generate_strategy.temperature``."""
LEARNING_RATE = 1e-5
SEED = 42
NUM_PROMPTS = 64
SIZES = ("small", "qwen_vocab")
FRAMEWORKS = ("distill", "distill_nogc", "trl", "trl_nogc", "opd", "opd_compiled")
"""Alternated in this order: TRL's DistillationTrainer as shipped and with gradient checkpointing off, TRL's
GKDTrainer likewise (named ``trl`` so that its machine-readable lines keep their names), opd, opd with
compile_decode."""
OPD_RUNS = ("opd", "opd_compiled")
DISTILL_RUNS = ("distill", "distill_nogc")
GKD_RUNS = ("trl", "trl_nogc")
TRL_RUNS = DISTILL_RUNS + GKD_RUNS
LABELS = {
    "distill": "Distill",
    "distill_nogc": "Distill gc-off",
    "trl": "GKD",
    "trl_nogc": "GKD gc-off",
    "opd": "opd",
    "opd_compiled": "opd compiled",
}
MIB = 2**20


# --------------------------------------------------------------------------------------
# Process memory (Linux /proc).
# --------------------------------------------------------------------------------------


def _proc_status_bytes(key: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process, in bytes."""
    with open("/proc/self/status", encoding="ascii") as status:
        match = re.search(rf"^{key}:\s+(\d+) kB", status.read(), re.MULTILINE)
    return int(match.group(1)) * 1024 if match else 0


def _reset_peak_rss() -> bool:
    """Sets ``VmHWM`` back to the current RSS, so the next peak is the training steps' own.

    Returns:
        False if the kernel refused (then ``Δ train`` is reported as unknown).
    """
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


class _PeakTracker:
    """Whole-process peak RSS plus the peak of the training steps alone."""

    def __init__(self) -> None:
        self.setup_peak = 0
        self.baseline = 0
        self.reset_ok = False

    def start_training(self) -> None:
        """Called just before the first step: remembers the setup peak, resets the mark."""
        self.setup_peak = _proc_status_bytes("VmHWM")
        self.baseline = _proc_status_bytes("VmRSS")
        self.reset_ok = _reset_peak_rss()

    def finish(self) -> dict[str, float | None]:
        """Called at the end of the last timed step."""
        train_peak = _proc_status_bytes("VmHWM")
        return {
            "peak_rss_mib": max(self.setup_peak, train_peak) / MIB,
            "train_delta_mib": (train_peak - self.baseline) / MIB if self.reset_ok else None,
        }


# --------------------------------------------------------------------------------------
# Shared inputs: prompts, tokenizers, models (built once by the parent process).
# --------------------------------------------------------------------------------------

_SYLLABLES = (
    "ka",
    "lo",
    "mi",
    "ten",
    "ra",
    "su",
    "vo",
    "pe",
    "di",
    "ng",
    "ar",
    "bel",
    "cor",
    "dun",
    "el",
    "fa",
    "gor",
    "hin",
    "is",
    "jo",
    "ku",
    "lam",
    "mon",
    "nor",
    "ost",
    "pra",
    "qui",
    "ros",
    "sel",
    "tur",
)


def _pseudo_words(rng: random.Random, count: int) -> list[str]:
    """Distinct made-up words: enough distinct character pairs for a ≈2k BPE vocabulary."""
    words: set[str] = set()
    while len(words) < count:
        words.add("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))))
    return sorted(words)


def _make_texts(seed: int) -> tuple[list[str], list[str]]:
    """Candidate prompt sentences and answer sentences (deterministic)."""
    rng = random.Random(seed)
    words = _pseudo_words(rng, 1500)

    def sentence(low: int, high: int) -> str:
        return " ".join(rng.choice(words) for _ in range(rng.randint(low, high))).capitalize() + "."

    questions = [f"Question {i}: {sentence(4, 20)} What follows?" for i in range(4000)]
    answers = [sentence(5, 15) for _ in range(4000)]
    return questions, answers


def _padded_qwen_tokenizer(small: Any) -> Any:
    """The small tokenizer with filler BPE entries appended until it has ``QWEN_VOCAB`` tokens.

    The filler strings contain ``<|`` and ``|>``, which the Qwen pre-tokenizer regex always
    splits apart, and no merge produces them, so no text ever maps to a filler id: the
    tokenization of real text is the small tokenizer's, only the id space is Qwen-sized.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(small.backend_tokenizer.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    # Added (special) tokens live outside model.vocab but occupy ids too.
    used_ids = set(vocab.values()) | {token["id"] for token in spec["added_tokens"]}
    next_id = max(used_ids) + 1
    filler = 0
    while next_id < QWEN_VOCAB:
        vocab[f"<|fill_{filler}|>"] = next_id
        filler += 1
        next_id += 1
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)), eos_token=small.eos_token, pad_token=small.pad_token
    )
    tokenizer.chat_template = small.chat_template
    return tokenizer


def build_inputs(workdir: Path, prompt_tokens: int, sizes: list[str]) -> dict[str, Any]:
    """Builds the data, and the tokenizers and models of ``sizes``, under ``workdir``.

    Returns:
        Facts for the header: vocabulary sizes, parameter counts, prompt count.
    """
    import torch
    from transformers import AutoTokenizer

    from opd.models.tiny import build_model_for_tokenizer, train_bpe_tokenizer

    questions, answers = _make_texts(SEED)
    chats = [[{"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a in zip(questions, answers)]
    # Trained on whole ChatML conversations, as a real tokenizer has seen them: "user",
    # "assistant" and the newlines of the template become single tokens.
    small = train_bpe_tokenizer(
        (
            f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{a}<|im_end|>\n"
            for q, a in zip(questions, answers)
        ),
        SMALL_VOCAB_TARGET,
    )
    # Keep only prompts whose rendered chat prompt is exactly prompt_tokens long: both
    # frameworks then process the same shapes at every step, whatever their shuffles pick.
    rows = []
    for chat in chats:
        prompt = small.apply_chat_template(chat[:1], add_generation_prompt=True, tokenize=False)
        if len(small(prompt, add_special_tokens=False)["input_ids"]) == prompt_tokens:
            rows.append({"messages": chat})
        if len(rows) == NUM_PROMPTS:
            break
    if len(rows) < NUM_PROMPTS:
        raise SystemExit(f"only {len(rows)} prompts of exactly {prompt_tokens} tokens; choose another --prompt-tokens")
    data_path = workdir / "train.jsonl"
    data_path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")

    facts: dict[str, Any] = {"num_prompts": len(rows)}
    for size in sizes:
        tokenizer = small if size == "small" else _padded_qwen_tokenizer(small)
        for role, preset in (("student", STUDENT_PRESET), ("teacher", TEACHER_PRESET)):
            directory = workdir / size / role
            model = build_model_for_tokenizer(preset, tokenizer)
            model.save_pretrained(directory)
            tokenizer.save_pretrained(directory)
            facts[f"{size}_{role}_params"] = sum(p.numel() for p in model.parameters())
            del model
        # What both frameworks will load (AutoTokenizer may re-wrap it as a Qwen2Tokenizer).
        reloaded = AutoTokenizer.from_pretrained(workdir / size / "student")
        facts[f"{size}_vocab"] = len(reloaded)
        for row in rows[:8]:
            text = reloaded.apply_chat_template(row["messages"], tokenize=False)
            reference = small(text, add_special_tokens=False)["input_ids"]
            if reloaded(text, add_special_tokens=False)["input_ids"] != reference:
                raise SystemExit(f"{size}: the reloaded tokenizer tokenizes differently from the small one")
    if "qwen_vocab" in sizes and facts["qwen_vocab_vocab"] != QWEN_VOCAB:
        raise SystemExit(f"qwen_vocab tokenizer has {facts['qwen_vocab_vocab']} tokens, expected {QWEN_VOCAB}")
    torch.manual_seed(SEED)
    return facts


# --------------------------------------------------------------------------------------
# Workers: one run of one framework (or the parts) in its own process.
# --------------------------------------------------------------------------------------


def _read_rows(workdir: Path) -> list[dict[str, Any]]:
    with open(workdir / "train.jsonl", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


def _trl_step_timer(total_steps: int, phases: dict[str, float], step_tokens: list[dict[str, float]]) -> Any:
    """The ``TrainerCallback`` that measures a TRL run: each step ``on_step_begin`` → ``on_step_end``.

    Both TRL trainers are measured by this one callback, so their columns mean the same.

    Args:
        total_steps: warm-up and timed steps; the peak RSS is read at the end of the last.
        phases: the current step's generation and teacher seconds, added to by the trainer's
            wrappers and hooks; zeroed at the start of every step.
        step_tokens: token counts appended by the trainer once per step.

    Returns:
        The callback; after training, its ``records`` hold one entry per step and its
        ``result_memory`` the peak RSS figures.
    """
    from transformers import TrainerCallback

    peak = _PeakTracker()

    class StepTimer(TrainerCallback):
        """``on_step_begin`` → ``on_step_end``: the whole optimizer step."""

        def __init__(self) -> None:
            self.begin = 0.0
            self.last_end: float | None = None
            self.records: list[dict[str, float]] = []
            self.result_memory: dict[str, Any] = {}

        def on_train_begin(self, *_: Any, **__: Any) -> None:
            peak.start_training()

        def on_step_begin(self, *_: Any, **__: Any) -> None:
            phases["generation"] = phases["teacher"] = 0.0
            self.begin = time.perf_counter()

        def on_step_end(self, _args: Any, state: Any, *__: Any, **___: Any) -> None:
            end = time.perf_counter()
            step = end - self.begin
            self.records.append(
                {
                    "step": step,
                    "loop": end - self.last_end if self.last_end is not None else float("nan"),
                    "generation": phases["generation"],
                    "teacher": phases["teacher"],
                    "training": step - phases["generation"] - phases["teacher"],
                    **step_tokens[-1],
                }
            )
            self.last_end = end
            if state.global_step == total_steps:
                self.result_memory = peak.finish()

    return StepTimer()


def _time_teacher_forward(module: Any, phases: dict[str, float]) -> None:
    """Adds the seconds of every forward of ``module`` to ``phases["teacher"]``."""

    def pre_hook(*_: Any) -> None:
        phases["teacher_start"] = time.perf_counter()

    def post_hook(*_: Any) -> None:
        phases["teacher"] += time.perf_counter() - phases["teacher_start"]

    module.register_forward_pre_hook(pre_hook)
    module.register_forward_hook(post_hook)


def _trl_training_arguments(args: argparse.Namespace, run_name: str, gradient_checkpointing: bool) -> dict[str, Any]:
    """The ``TrainingArguments`` fields both TRL configs share, set alike (see the module docstring)."""
    return {
        "output_dir": str(Path(args.workdir) / f"{run_name}_out_{args.size}_{args.run_index}"),
        "per_device_train_batch_size": args.batch_size,
        "gradient_accumulation_steps": 1,
        "max_steps": args.warmup + args.steps,
        "learning_rate": LEARNING_RATE,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        "adam_beta1": 0.9,
        "adam_beta2": 0.999,
        "adam_epsilon": 1e-8,
        "max_grad_norm": 1.0,
        "optim": "adamw_torch_fused",  # TRL's default, spelled out: the kernel opd's auto picks on CPU
        "gradient_checkpointing": gradient_checkpointing,  # TRL's default True: recompute in backward
        "bf16": False,
        "fp16": False,
        "use_cpu": True,
        "report_to": "none",
        "save_strategy": "no",
        "eval_strategy": "no",
        "logging_steps": 1,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "seed": SEED,
    }


def _load_models(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """(tokenizer, student, teacher) of ``args.size``, fp32, as every TRL run loads them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(args.workdir) / args.size
    tokenizer = AutoTokenizer.from_pretrained(model_dir / "student")
    student = AutoModelForCausalLM.from_pretrained(model_dir / "student", dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(model_dir / "teacher", dtype=torch.float32)
    return tokenizer, student, teacher


def run_trl(args: argparse.Namespace, gradient_checkpointing: bool = True) -> dict[str, Any]:
    """One TRL ``GKDTrainer`` run; returns per-step timings, tokens and peak RSS.

    Args:
        args: the worker's arguments.
        gradient_checkpointing: TRL's default ``True`` (activations recomputed in the
            backward pass, KV cache off in generation), or ``False`` (equal work to opd).
    """
    import torch
    from datasets import Dataset
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    tokenizer, student, teacher = _load_models(args)
    dataset = Dataset.from_list(_read_rows(Path(args.workdir)))

    phases = {"generation": 0.0, "teacher": 0.0}
    step_tokens: list[dict[str, float]] = []

    class TimedGKDTrainer(GKDTrainer):
        """GKDTrainer plus measurement: the generation call is timed, tokens are counted."""

        @staticmethod
        def generate_on_policy_outputs(model, inputs, generation_config):  # type: ignore[override]
            start = time.perf_counter()
            outputs = GKDTrainer.generate_on_policy_outputs(model, inputs, generation_config)
            phases["generation"] += time.perf_counter() - start
            return outputs

        def training_step(self, model, inputs, num_items_in_batch=None):  # type: ignore[override]
            loss = super().training_step(model, inputs, num_items_in_batch)
            # GKD replaced the batch in place with prompt + sampled completion; the
            # attention mask marks exactly the prompt and response tokens (to EOS).
            prompt_width = inputs["prompts"].shape[1]
            mask = inputs["attention_mask"]
            step_tokens.append(
                {
                    "tokens": float(mask.sum()),
                    "response_length": float(mask[:, prompt_width:].sum()) / mask.shape[0],
                    "prompt_length": float(inputs["prompt_attention_mask"].sum()) / mask.shape[0],
                }
            )
            return loss

    config = GKDConfig(
        lmbda=1.0,
        beta=JSD_BETA,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        **_trl_training_arguments(args, "trl", gradient_checkpointing),
    )
    timer = _trl_step_timer(args.warmup + args.steps, phases, step_tokens)
    trainer = TimedGKDTrainer(
        model=student,
        teacher_model=teacher,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    _time_teacher_forward(trainer.teacher_model, phases)
    trainer.train()
    return {
        "records": timer.records[args.warmup :],
        "generation_use_cache": bool(trainer.generation_config.use_cache),
        "threads": torch.get_num_threads(),
        **timer.result_memory,
    }


def run_distill(args: argparse.Namespace, gradient_checkpointing: bool = True) -> dict[str, Any]:
    """One TRL ``DistillationTrainer`` run, measured as :func:`run_trl` measures ``GKDTrainer``.

    Args:
        args: the worker's arguments.
        gradient_checkpointing: ``DistillationConfig``'s default ``True`` (activations
            recomputed in the backward pass; the trainer lifts it around ``generate``, so the
            KV cache stays on), or ``False`` (equal work to opd).
    """
    import torch
    from datasets import Dataset
    from trl import DistillationConfig, DistillationTrainer

    tokenizer, student, teacher = _load_models(args)
    # The same rows as GKD's: the user turn is the prompt GKD's collator keeps from each row.
    dataset = Dataset.from_list([{"prompt": row["messages"][:1]} for row in _read_rows(Path(args.workdir))])

    phases = {"generation": 0.0, "teacher": 0.0}
    step_tokens: list[dict[str, float]] = []
    # Whether generate used the KV cache is observed, not read from the trainer's
    # GenerationConfig, which leaves use_cache unset (generate's default, True, then applies):
    # with the cache, every student forward after a generate's first feeds one token per row.
    decode_widths: list[int] = []
    generations_with_cache: list[bool] = []

    def record_decode_width(_module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        if kwargs.get("input_ids") is not None:
            decode_widths.append(kwargs["input_ids"].shape[1])

    class TimedDistillationTrainer(DistillationTrainer):
        """DistillationTrainer plus measurement: the generation call is timed, tokens are counted."""

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, has_tool_images=False):  # type: ignore[override]
            decode_widths.clear()
            hook = self.model.register_forward_pre_hook(record_decode_width, with_kwargs=True)
            start = time.perf_counter()
            completion_ids = super()._generate_single_turn(prompt_ids, images, multimodal_fields, has_tool_images)
            phases["generation"] += time.perf_counter() - start
            hook.remove()
            generations_with_cache.append(all(width == 1 for width in decode_widths[1:]))
            return completion_ids

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # type: ignore[override]
            # The generated batch: left-padded prompts and right-padded completions whose
            # mask ends at the first EOS, as GKD's attention mask does.
            prompt_mask, completion_mask = inputs["prompt_mask"], inputs["completion_mask"]
            rows = prompt_mask.shape[0]
            step_tokens.append(
                {
                    "tokens": float(prompt_mask.sum() + completion_mask.sum()),
                    "response_length": float(completion_mask.sum()) / rows,
                    "prompt_length": float(prompt_mask.sum()) / rows,
                }
            )
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    config = DistillationConfig(
        beta=JSD_BETA,
        # The loss's softmax temperature (1, as GKD's loss and opd's loss_fn.temperature);
        # generation_kwargs below overrides the sampling temperature alone.
        temperature=1.0,
        generation_kwargs={"temperature": args.temperature},
        top_k=0,
        top_p=1.0,
        max_completion_length=args.max_new_tokens,
        disable_dropout=True,  # GKDConfig's default
        use_vllm=False,
        **_trl_training_arguments(args, "distill", gradient_checkpointing),
    )
    timer = _trl_step_timer(args.warmup + args.steps, phases, step_tokens)
    trainer = TimedDistillationTrainer(
        model=student,
        teacher_model=teacher,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    # The mapping above relies on generation_kwargs overriding the shared temperature.
    if trainer.generation_config.temperature != args.temperature:
        raise SystemExit(
            f"DistillationTrainer samples at temperature {trainer.generation_config.temperature}, "
            f"not {args.temperature}"
        )
    # The loss runs the teacher's decoder alone (base_model), its head inside the chunked loss.
    _time_teacher_forward(trainer.teacher_model.base_model, phases)
    trainer.train()
    return {
        "records": timer.records[args.warmup :],
        "generation_use_cache": all(generations_with_cache),
        "threads": torch.get_num_threads(),
        **timer.result_memory,
    }


def opd_config_tree(args: argparse.Namespace, run_dir: Path, compile_decode: bool) -> dict[str, Any]:
    """The opd config equivalent to the TRL run (see the module docstring), with or without ``compile_decode``."""
    model_dir = Path(args.workdir) / args.size
    return {
        "output_dir": str(run_dir),
        "model": {
            "student_model_path": str(model_dir / "student"),
            "teacher_model_path": str(model_dir / "teacher"),
            "dtype": "float32",
            "device": "cpu",
        },
        "distillation": {
            "lambda": 1.0,
            "num_samples_per_prompt": 1,
            "generate_strategy": {
                "max_length": args.max_new_tokens,
                "temperature": args.temperature,
                "decoding_method": "top_p",
                "top_p": 1.0,
            },
        },
        # temperature 1: TRL's compute_loss uses temperature 1 in the loss.
        "loss_fn": {"type": "jsd", "beta": JSD_BETA, "temperature": 1.0, "reduction": "mean"},
        # Compiled in the first steps when on; see the module docstring.
        "generation": {"decode_loop": "opd", "compile_decode": compile_decode},
        "training": {
            "batch_size": args.batch_size,
            "micro_batch_size": None,
            "gradient_accumulation_steps": None,
            "learning_rate": LEARNING_RATE,
            "weight_decay": 0.0,
            "adam_beta1": 0.9,
            "adam_beta2": 0.999,
            "adam_epsilon": 1e-8,
            "max_grad_norm": 1.0,
            "warmup_steps": 0,
            "lr_scheduler": "constant_with_warmup",
            "num_epochs": 1000,
            "max_num_steps": args.warmup + args.steps,
            "val_freq": 0,
            "save_freq": 0,
            "seed": SEED,
        },
        "data": {
            "train_path": str(Path(args.workdir) / "train.jsonl"),
            "val_path": None,
            "max_prompt_length": None,
            "shuffle": True,
        },
        "validation": {"val_at_start": False, "val_at_end": False},
        "logger": {"log_dir": str(run_dir / "logs"), "jsonl": True, "console": False, "progress_bar": False},
        "checkpointing": {"enabled": False},
    }


def run_opd(args: argparse.Namespace, compile_decode: bool = False) -> dict[str, Any]:
    """One opd run; returns per-step timings (from metrics.jsonl), tokens and peak RSS.

    Args:
        args: the worker's arguments.
        compile_decode: ``generation.compile_decode`` (opd's default is off).
    """
    import torch

    from opd.distillation.config import MasterConfig
    from opd.distillation.setup import setup
    from opd.distillation.step import distillation_train
    from opd.utils.config import validate_config

    kind = "opd_compiled" if compile_decode else "opd"
    run_dir = Path(args.workdir) / f"{kind}_out_{args.size}_{args.run_index}"
    config = validate_config(MasterConfig, opd_config_tree(args, run_dir, compile_decode))
    parts = setup(config)
    logger = parts.logger
    total_steps = args.warmup + args.steps
    peak = _PeakTracker()
    step_ends: list[float] = []
    memory: dict[str, Any] = {}
    log_metrics = logger.log_metrics

    def timed_log_metrics(metrics: dict[str, Any], step: int, *rest: Any, **kwargs: Any) -> None:
        # The loop logs each step right after it: the end of a step, for the loop interval.
        if "timing/step" in metrics:
            step_ends.append(time.perf_counter())
            if step == total_steps:
                memory.update(peak.finish())
        log_metrics(metrics, step, *rest, **kwargs)

    logger.log_metrics = timed_log_metrics  # type: ignore[method-assign]
    peak.start_training()
    distillation_train(parts)

    steps = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [record for record in steps if "timing/step" in record]
    records = []
    for index, record in enumerate(steps):
        tokens = record["perf/tokens_per_s"] * record["timing/step"]  # = input_lengths.sum()
        records.append(
            {
                "step": record["timing/step"],
                "loop": step_ends[index] - step_ends[index - 1] if index else float("nan"),
                "generation": record["timing/generation"],
                "teacher": record["timing/teacher"],
                "training": record["timing/training"],
                "tokens": tokens,
                "response_length": record["train/mean_response_length"],
                "prompt_length": tokens / args.batch_size - record["train/mean_response_length"],
            }
        )
    return {
        "records": records[args.warmup :],
        "all_step_seconds": [record["step"] for record in records],  # warm-up included: the compile time
        "generation_use_cache": True,
        "threads": torch.get_num_threads(),
        **memory,
    }


def run_parts(args: argparse.Namespace) -> dict[str, Any]:
    """Times the essential parts of an opd step alone, at the benchmark's shapes.

    Generation: opd's decode loop with the compiled step (what the opd compiled runs use),
    stopping at the stop ids opd's generation uses, and HF ``generate`` on the same prompts
    for reference, both with the KV cache and the same sampling. Teacher: its decoder
    forward to the final hidden states under ``inference_mode`` (opd's fused loss applies
    the teacher's head inside the loss). Student: decoder forward, opd's fused
    JSD loss (both heads, the divergence; compiled kernels as opd's default), backward,
    clipping and a fused AdamW step.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opd.data.batched_data_dict import BatchedDataDict
    from opd.data.sequences import attention_mask_from_lengths, build_token_mask, encode_prompt, shift_token_mask
    from opd.losses.distillation_losses import JSDLossFn
    from opd.models.decoding import GenerateStrategyConfig
    from opd.models.lm_head import LMHeadInput, final_hidden_states, output_head_of
    from opd.rollout.decode_loop import compile_decode_step, decode
    from opd.rollout.stop_tokens import is_stop, stop_token_ids
    from opd.utils.compile_cache import resolve_compile_kernels

    torch.manual_seed(SEED)
    workdir = Path(args.workdir)
    model_dir = workdir / args.size
    tokenizer = AutoTokenizer.from_pretrained(model_dir / "student")
    student = AutoModelForCausalLM.from_pretrained(model_dir / "student", dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(model_dir / "teacher", dtype=torch.float32)
    teacher.eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(
        student.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.999), eps=1e-8, fused=True, weight_decay=0.0
    )
    # The loss exactly as opd's default config builds it (compiled kernels where a C++
    # compiler exists); the first calls (compilation) fall in the untimed warm-up steps.
    # --smoke runs both eagerly: compiling them cost this process a minute of CPU (2 cores,
    # inductor's cache empty), and the smoke's opd and opd compiled runs compile the same two.
    loss_fn = JSDLossFn(
        beta=JSD_BETA,
        temperature=1.0,
        vocab_size=len(tokenizer),
        fused_lm_head=True,
        compile_kernels=resolve_compile_kernels("auto", "cpu") and not args.smoke,
    )
    # Compiled in the warm-up steps, as in the opd compiled runs.
    step_forward = None if args.smoke else compile_decode_step(student)
    prompts = [encode_prompt(tokenizer, row["messages"][:1]) for row in _read_rows(workdir)]
    pad = tokenizer.pad_token_id
    # What opd's generation stops at: the tokenizer's EOS and the generation config's.
    stops = stop_token_ids(tokenizer, student)
    stop_ids = torch.tensor(stops, dtype=torch.long)
    strategy = GenerateStrategyConfig(
        max_length=args.max_new_tokens, temperature=args.temperature, decoding_method="top_p", top_p=1.0
    )
    times: dict[str, list[float]] = {"generation": [], "teacher": [], "student": []}
    hf_generate_times: list[float] = []
    response_lengths = []
    for step in range(args.warmup + args.steps):
        batch_prompts = prompts[(step * args.batch_size) % len(prompts) :][: args.batch_size]
        width = max(len(p) for p in batch_prompts)
        left = torch.tensor([[pad] * (width - len(p)) + p for p in batch_prompts])
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch_prompts])

        student.eval()
        start = time.perf_counter()
        with torch.inference_mode():
            new, _ = decode(
                student, left, attention, strategy, stops, pad, return_logprobs=False, step_forward=step_forward
            )
        generation = time.perf_counter() - start

        # Right-padded [prompt | response to its first stop token | pad], as opd trains on (untimed glue).
        new = new.clone()
        stopped = is_stop(new, stop_ids)
        lengths = torch.where(stopped.any(1), stopped.int().argmax(1) + 1, torch.full((new.shape[0],), new.shape[1]))
        prompt_lengths = torch.tensor([len(p) for p in batch_prompts])
        input_lengths = prompt_lengths + lengths
        ids = torch.full((len(batch_prompts), int(input_lengths.max())), pad, dtype=torch.long)
        for row, prompt in enumerate(batch_prompts):
            ids[row, : len(prompt)] = torch.tensor(prompt)
            ids[row, len(prompt) : int(input_lengths[row])] = new[row, : int(lengths[row])]
        batch = BatchedDataDict(
            input_ids=ids,
            input_lengths=input_lengths,
            prompt_lengths=prompt_lengths,
            token_mask=build_token_mask(input_lengths, prompt_lengths, ids.shape[1], True),
        )
        mask = attention_mask_from_lengths(input_lengths, ids.shape[1])
        response_lengths.append(float(lengths.float().mean()))

        start = time.perf_counter()
        with torch.inference_mode():
            teacher_hidden = final_hidden_states(teacher, ids, mask)
        teacher_seconds = time.perf_counter() - start
        teacher_hidden = teacher_hidden.clone()  # an ordinary tensor, usable in autograd (untimed)
        teacher_weight, teacher_bias = output_head_of(teacher)

        if step == 0:  # once, untimed: the two frameworks' objectives agree on this batch
            objective_check = _objective_check(student, teacher, batch, mask, loss_fn)

        student.train()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        weight, bias = output_head_of(student)
        valid_tokens = int(shift_token_mask(batch["token_mask"]).sum())
        loss, _ = loss_fn(
            LMHeadInput(final_hidden_states(student, ids, mask), weight, bias),
            batch,
            valid_tokens,
            batch.size,
            teacher_output=LMHeadInput(teacher_hidden, teacher_weight, teacher_bias),
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        optimizer.step()
        student_seconds = time.perf_counter() - start

        # HF generate for reference, after the step: each timed part then follows what
        # precedes it in an opd step (generation follows the previous optimizer step).
        student.eval()
        start = time.perf_counter()
        with torch.inference_mode():
            student.generate(
                input_ids=left,
                attention_mask=attention,
                max_new_tokens=args.max_new_tokens,
                do_sample=True,
                temperature=args.temperature,
                top_k=0,
                top_p=1.0,
                use_cache=True,
                pad_token_id=pad,
                eos_token_id=list(stops),
            )
        hf_generate_seconds = time.perf_counter() - start

        if step >= args.warmup:
            hf_generate_times.append(hf_generate_seconds)
            times["generation"].append(generation)
            times["teacher"].append(teacher_seconds)
            times["student"].append(student_seconds)
    return {
        "times": times,
        "hf_generate": hf_generate_times,
        "response_lengths": response_lengths[args.warmup :],
        **objective_check,
    }


def _objective_check(student: Any, teacher: Any, batch: Any, mask: Any, loss_fn: Any) -> dict[str, float]:
    """opd's loss, ``GKDTrainer.generalized_jsd_loss`` and ``DistillationTrainer``'s chunked loss on one batch.

    GKD's loss is called as its ``compute_loss`` calls it: full logits of both models,
    shifted by one, labels ``-100`` outside the response, temperature 1, batch-mean over
    the valid labels. ``DistillationTrainer``'s as its ``_compute_loss`` calls it: both
    decoders' final hidden states (``base_model``) without the last position, the two LM
    heads, the response positions as the mask, β and temperature 1 as the run maps them,
    mean over the masked positions. Equal values show that all runs optimise the same
    objective.
    """
    import torch
    from trl.experimental.gkd import GKDTrainer
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    from opd.data.sequences import shift_token_mask
    from opd.models.lm_head import LMHeadInput, final_hidden_states, output_head_of

    ids = batch["input_ids"]
    with torch.no_grad():
        weight, bias = output_head_of(student)
        teacher_weight, teacher_bias = output_head_of(teacher)
        opd_loss, _ = loss_fn(
            LMHeadInput(final_hidden_states(student, ids, mask), weight, bias),
            batch,
            int(shift_token_mask(batch["token_mask"]).sum()),
            batch.size,
            teacher_output=LMHeadInput(final_hidden_states(teacher, ids, mask), teacher_weight, teacher_bias),
        )
        labels = ids.masked_fill(batch["token_mask"] == 0, -100)
        trl_loss = GKDTrainer.generalized_jsd_loss(
            student(input_ids=ids, attention_mask=mask).logits[:, :-1],
            teacher(input_ids=ids, attention_mask=mask).logits[:, :-1],
            labels=labels[:, 1:],
            beta=JSD_BETA,
        )
        # Position t predicts token t + 1: its loss counts where token t + 1 is a response token.
        distill_loss, _, _ = _chunked_divergence_loss(
            student.base_model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1],
            teacher.base_model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1],
            weight,
            teacher_weight,
            batch["token_mask"][:, 1:],
            JSD_BETA,
            student_lm_head_bias=bias,
            teacher_lm_head_bias=teacher_bias,
            temperature=1.0,
        )
    return {"opd_loss": float(opd_loss), "trl_loss": float(trl_loss), "distill_loss": float(distill_loss)}


def run_trl_without_checkpointing(args: argparse.Namespace) -> dict[str, Any]:
    """TRL with ``gradient_checkpointing=False``: the same work as opd (KV cache on, no recompute)."""
    return run_trl(args, gradient_checkpointing=False)


def run_distill_without_checkpointing(args: argparse.Namespace) -> dict[str, Any]:
    """``DistillationTrainer`` with ``gradient_checkpointing=False``: the same work as opd (no recompute)."""
    return run_distill(args, gradient_checkpointing=False)


def run_opd_compiled(args: argparse.Namespace) -> dict[str, Any]:
    """opd with ``generation.compile_decode: true``."""
    return run_opd(args, compile_decode=True)


WORKERS = {
    "distill": run_distill,
    "distill_nogc": run_distill_without_checkpointing,
    "trl": run_trl,
    "trl_nogc": run_trl_without_checkpointing,
    "opd": run_opd,
    "opd_compiled": run_opd_compiled,
    "parts": run_parts,
}


# --------------------------------------------------------------------------------------
# Parent: build inputs, alternate runs, report.
# --------------------------------------------------------------------------------------


def _spawn(kind: str, size: str, run_index: int, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Runs one worker process and returns its JSON result (exits with its log on failure)."""
    out = workdir / f"result_{kind}_{size}_{run_index}.json"
    log_path = workdir / f"log_{kind}_{size}_{run_index}.txt"
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        kind,
        "--size",
        size,
        "--workdir",
        str(workdir),
        "--out",
        str(out),
        "--run-index",
        str(run_index),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--batch-size",
        str(args.batch_size),
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--temperature",
        str(args.temperature),
        *(["--smoke"] if args.smoke else []),
    ]
    start = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log_file:
        completed = subprocess.run(command, stdout=log_file, stderr=subprocess.STDOUT, check=False)
    seconds = time.perf_counter() - start
    if completed.returncode != 0:
        tail = log_path.read_text(encoding="utf-8", errors="replace")[-4000:]
        raise SystemExit(f"worker {kind}/{size} failed (exit {completed.returncode}):\n{tail}")
    result = json.loads(out.read_text(encoding="utf-8"))
    result["process_s"] = seconds
    print(f"  {kind:<12} {size:<10} run {run_index}: {seconds:5.1f} s", flush=True)
    return result


def _median(values: list[float]) -> float:
    finite = [value for value in values if value == value]
    return statistics.median(finite) if finite else float("nan")


def _summarise(results: list[dict[str, Any]]) -> dict[str, float]:
    """Pools the timed steps of all runs of one framework at one size."""
    records = [record for result in results for record in result["records"]]
    deltas = [result.get("train_delta_mib") for result in results]
    return {
        "step": _median([r["step"] for r in records]),
        "loop": _median([r["loop"] for r in records]),
        "generation": _median([r["generation"] for r in records]),
        "teacher": _median([r["teacher"] for r in records]),
        "training": _median([r["training"] for r in records]),
        "tokens_per_s": _median([r["tokens"] / r["step"] for r in records]),
        "tokens": statistics.mean(r["tokens"] for r in records),
        "prompt_length": statistics.mean(r["prompt_length"] for r in records),
        "response_length": statistics.mean(r["response_length"] for r in records),
        "peak_rss_mib": max(result["peak_rss_mib"] for result in results),
        "train_delta_mib": max(deltas) if all(d is not None for d in deltas) else float("nan"),
        "steps": len(records),
        "kv_cache": all(result["generation_use_cache"] for result in results),
        "threads": results[0]["threads"],
    }


def _one_time_seconds(result: dict[str, Any]) -> float:
    """What an opd run spent beyond its steady pace: Σ of all its step times − their number × its median timed step."""
    seconds = result["all_step_seconds"]
    return sum(seconds) - len(seconds) * _median([record["step"] for record in result["records"]])


def _compile_cost(runs: dict[str, list[dict[str, Any]]], summary: dict[str, dict[str, float]]) -> dict[str, Any]:
    """``compile_decode``'s compile seconds (median and per round) and the steps after which it pays off.

    Args:
        runs: one size's results per framework, rounds in order.
        summary: that size's summaries per framework.
    """
    per_round = [
        _one_time_seconds(compiled) - _one_time_seconds(eager)
        for eager, compiled in zip(runs["opd"], runs["opd_compiled"], strict=True)
    ]
    compile_s = statistics.median(per_round)
    saving = summary["opd"]["step"] - summary["opd_compiled"]["step"]
    return {
        "compile_s": compile_s,
        "per_round": per_round,
        "saving": saving,
        "break_even": compile_s / saving if saving > 0 else float("inf"),
    }


def _per_run_comparison(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """One size's figures per run, and opd's ratios to DistillationTrainer's per round.

    Args:
        runs: one size's results per framework, rounds in order.

    Returns:
        ``figures[framework][key]``: per run, its median timed step (``step``) and its peak
        RSS (``peak_rss_mib``); ``ratios[(opd_run, distill_run)][key]``: per round, the opd
        run's figure over the Distill run's of the same round.
    """
    figures = {
        framework: {
            "step": [_median([record["step"] for record in result["records"]]) for result in results],
            "peak_rss_mib": [result["peak_rss_mib"] for result in results],
        }
        for framework, results in runs.items()
    }
    ratios = {
        (opd_run, distill_run): {
            key: [opd / distill for opd, distill in zip(figures[opd_run][key], figures[distill_run][key], strict=True)]
            for key in ("step", "peak_rss_mib")
        }
        for opd_run in OPD_RUNS
        for distill_run in DISTILL_RUNS
    }
    return {"figures": figures, "ratios": ratios}


def _spread(values: list[float], digits: int) -> str:
    """``median [min–max]`` of one figure over runs."""
    return f"{_fmt(_median(values), digits)} [{_fmt(min(values), digits)}–{_fmt(max(values), digits)}]"


def _cpu_seconds() -> tuple[float, float]:
    """(CPU-seconds the whole machine has been busy, CPU-seconds of this process and its children)."""
    with open("/proc/stat", encoding="ascii") as stat:
        fields = [int(value) for value in stat.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal ...: busy = all but idle and iowait.
    busy = sum(fields[:8]) - fields[3] - fields[4]
    own = sum(
        getattr(resource.getrusage(who), attribute)
        for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
        for attribute in ("ru_utime", "ru_stime")
    )
    return busy / os.sysconf("SC_CLK_TCK"), own


def _machine_header(args: argparse.Namespace) -> list[str]:
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            match = re.search(r"^model name\s*:\s*(.+)$", cpuinfo.read(), re.MULTILINE)
        cpu = match.group(1).strip() if match else cpu
        with open("/proc/meminfo", encoding="utf-8") as meminfo:
            ram_gib = int(re.search(r"^MemTotal:\s+(\d+)", meminfo.read(), re.MULTILINE).group(1)) / 2**20
    except OSError:
        ram_gib = float("nan")
    versions = ", ".join(
        f"{name} {importlib.metadata.version(name)}" for name in ("torch", "transformers", "trl", "accelerate")
    )
    return [
        f"# machine: {cpu}; {os.cpu_count()} logical cores; {ram_gib:.1f} GiB RAM; Python {platform.python_version()}",
        f"# versions: {versions}",
        f"# command: {shlex.join(['python', *sys.argv])}",
    ]


def _fmt(value: float, digits: int = 3) -> str:
    return "nan" if value != value else f"{value:.{digits}f}"


def main(args: argparse.Namespace) -> None:
    sizes = [size.strip() for size in args.sizes.split(",") if size.strip()]
    unknown = set(sizes) - set(SIZES)
    if unknown:
        raise SystemExit(f"unknown --sizes {sorted(unknown)}; choose from {SIZES}")
    wall_start = time.perf_counter()
    # Other processes' CPU use during the run is measured: with tiny models every op is
    # short, and a competing process makes the worker threads wait on each other.
    machine_busy_start, own_start = _cpu_seconds()
    header = _machine_header(args)
    for line in header:
        print(line)
    with tempfile.TemporaryDirectory(prefix="opd_e2e_") as tmp:
        workdir = Path(tmp)
        facts = build_inputs(workdir, args.prompt_tokens, sizes)
        print(
            f"# setup: λ=1, JSD β={JSD_BETA} (loss temperature 1), sampling temperature {args.temperature} "
            f"top_k off top_p 1.0, max_new_tokens {args.max_new_tokens}, batch {args.batch_size}, "
            f"{args.prompt_tokens}-token prompts ({facts['num_prompts']}), AdamW lr {LEARNING_RATE} wd 0 constant, "
            f"max_grad_norm 1, fp32 CPU; {args.warmup} warm-up + {args.steps} timed steps per run, "
            f"{args.rounds} alternating runs per framework"
        )
        for size in sizes:
            print(
                f"# {size}: vocab {facts[f'{size}_vocab']:,}; student {facts[f'{size}_student_params'] / 1e6:.2f}M "
                f"params (hidden 64 × 2 layers), teacher {facts[f'{size}_teacher_params'] / 1e6:.2f}M "
                "(hidden 128 × 4 layers), tied embeddings"
            )
        print(
            "# qwen_vocab tokenizer = the small BPE tokenizer + unreachable filler entries up to 151,669 ids "
            "(same tokenization, Qwen-sized output layer)"
        )
        print(
            "# Distill = TRL's DistillationTrainer with its defaults (gradient_checkpointing=True: activations "
            "recomputed in backward; the KV cache stays on in generation), beta=0.5, loss temperature 1 and the "
            "sampling temperature through generation_kwargs, disable_dropout=True, no vLLM; GKD = TRL's "
            "experimental GKDTrainer with its defaults (gradient_checkpointing=True, which also turns the KV cache "
            "off in generation), lmbda=1; gc-off = the same with gradient_checkpointing=False (equal work to opd). "
            "All TRL runs: bf16=False (fp32 like opd), TRL's default fused AdamW. "
            "opd: its defaults; opd compiled: its defaults + generation.compile_decode=true"
        )
        print("runs:", flush=True)

        summaries: dict[str, dict[str, dict[str, float]]] = {}
        compile_costs: dict[str, dict[str, Any]] = {}
        comparisons: dict[str, dict[str, Any]] = {}
        parts: dict[str, dict[str, Any]] = {}
        for size in sizes:
            runs: dict[str, list[dict[str, Any]]] = {framework: [] for framework in FRAMEWORKS}
            for round_index in range(args.rounds):
                for framework in FRAMEWORKS:  # alternating: distill, distill_nogc, trl, ..., opd_compiled, distill, ...
                    runs[framework].append(_spawn(framework, size, round_index, args, workdir))
            summaries[size] = {framework: _summarise(runs[framework]) for framework in FRAMEWORKS}
            compile_costs[size] = _compile_cost(runs, summaries[size])
            comparisons[size] = _per_run_comparison(runs)
            if not args.skip_parts:
                parts[size] = _spawn("parts", size, 0, args, workdir)

    print()
    print("end-to-end (median over timed steps; times in seconds; RSS in MiB)")
    columns = (
        "size",
        "framework",
        "step s",
        "loop s",
        "gen s",
        "teacher s",
        "train s",
        "tokens/s",
        "tok/step",
        "resp len",
        "peak RSS",
        "Δ train",
    )
    widths = [10, 27] + [10] * (len(columns) - 2)

    def row(cells: list[str]) -> str:
        return "  ".join(f"{cell:>{width}}" for cell, width in zip(cells, widths))

    print(row(list(columns)))
    for size in sizes:
        for framework in FRAMEWORKS:
            summary = summaries[size][framework]
            cells = [
                size,
                LABELS[framework],
                _fmt(summary["step"]),
                _fmt(summary["loop"]),
                _fmt(summary["generation"]),
                _fmt(summary["teacher"]),
                _fmt(summary["training"]),
                _fmt(summary["tokens_per_s"], 0),
                _fmt(summary["tokens"], 1),
                _fmt(summary["response_length"], 1),
                _fmt(summary["peak_rss_mib"], 0),
                _fmt(summary["train_delta_mib"], 0),
            ]
            print(row(cells))
        ratio_keys = (
            "step",
            "loop",
            "generation",
            "teacher",
            "training",
            "tokens_per_s",
            "tokens",
            "response_length",
            "peak_rss_mib",
            "train_delta_mib",
        )
        for opd_run in OPD_RUNS:
            opd = summaries[size][opd_run]
            for framework in TRL_RUNS:
                other = summaries[size][framework]
                cells = [size, f"{LABELS[opd_run]}/{LABELS[framework]}"] + [
                    _fmt(opd[key] / other[key] if other[key] else float("nan"), 2) for key in ratio_keys
                ]
                print(row(cells))
    for size in sizes:
        described = "; ".join(
            f"{LABELS[framework]}: {summary['steps']} timed steps, prompt tokens/row {summary['prompt_length']:.1f}, "
            f"KV cache {'on' if summary['kv_cache'] else 'OFF'}, {summary['threads']} threads"
            for framework, summary in summaries[size].items()
        )
        print(f"# {size}: {described}")

    print()
    print(
        f"per run: opd, TRL DistillationTrainer and TRL GKDTrainer side by side (median [min–max] over {args.rounds} "
        "runs of each run's median timed step and its peak RSS; opd/Distill pairs each round's opd run with the "
        "same round's Distill run)"
    )
    run_widths = [10, 27, 22, 22]

    def run_row(cells: list[str]) -> str:
        return "  ".join(f"{cell:>{width}}" for cell, width in zip(cells, run_widths))

    print(run_row(["size", "framework", "step s", "peak RSS MiB"]))
    for size in sizes:
        figures, ratios = comparisons[size]["figures"], comparisons[size]["ratios"]
        for framework in (*OPD_RUNS, *DISTILL_RUNS, *GKD_RUNS):
            print(
                run_row(
                    [
                        size,
                        LABELS[framework],
                        _spread(figures[framework]["step"], 3),
                        _spread(figures[framework]["peak_rss_mib"], 0),
                    ]
                )
            )
        for (opd_run, distill_run), ratio_runs in ratios.items():
            print(
                run_row(
                    [
                        size,
                        f"{LABELS[opd_run]}/{LABELS[distill_run]}",
                        _spread(ratio_runs["step"], 2),
                        _spread(ratio_runs["peak_rss_mib"], 2),
                    ]
                )
            )

    print()
    print(
        "compile_decode: compile seconds outside the timed steps (opd compiled's one-time time minus opd's, "
        "median over rounds) and the steps after which compiling pays off"
    )
    for size in sizes:
        cost = compile_costs[size]
        rounds = ", ".join(f"{seconds:.1f}" for seconds in cost["per_round"])
        pays_off = (
            f"pays off after {cost['break_even']:.0f} steps"
            if cost["saving"] > 0
            else "never pays off (no step saving)"
        )
        print(
            f"  {size}: compile {cost['compile_s']:.1f} s (per round: {rounds}); step "
            f"{summaries[size]['opd_compiled']['step']:.3f} s compiled vs {summaries[size]['opd']['step']:.3f} s "
            f"without (saves {cost['saving']:.4f} s a step): {pays_off}"
        )

    if parts:
        print()
        print(
            "opd overhead: essential parts timed alone at the same shapes (median s) vs opd compiled's own phase "
            "timings"
        )
        for size in sizes:
            opd, part = summaries[size]["opd_compiled"], parts[size]["times"]
            opd_loss, trl_loss = parts[size]["opd_loss"], parts[size]["trl_loss"]
            distill_loss = parts[size]["distill_loss"]
            print(
                f"  {size}: objective check on one batch: opd loss {opd_loss:.6f}, GKD generalized_jsd_loss "
                f"{trl_loss:.6f} (relative difference {abs(opd_loss - trl_loss) / abs(trl_loss):.1e}), "
                f"DistillationTrainer chunked loss {distill_loss:.6f} "
                f"(relative difference {abs(opd_loss - distill_loss) / abs(distill_loss):.1e})"
            )
            alone = {key: _median(values) for key, values in part.items()}
            total = sum(alone.values())
            print(
                f"  {size}: generation {alone['generation']:.3f} (opd {opd['generation']:.3f}; HF generate alone "
                f"{_median(parts[size]['hf_generate']):.3f})  "
                f"teacher fwd {alone['teacher']:.3f} (opd {opd['teacher']:.3f})  "
                f"student fwd+loss+bwd+AdamW {alone['student']:.3f} (opd {opd['training']:.3f})  "
                f"sum {total:.3f}  opd step {opd['step']:.3f}  overhead {100 * (opd['step'] / total - 1):+.1f}%  "
                f"(parts resp len {statistics.mean(parts[size]['response_lengths']):.1f})"
            )

    print()
    machine_busy_end, own_end = _cpu_seconds()
    foreign = (machine_busy_end - machine_busy_start) - (own_end - own_start)
    wall = time.perf_counter() - wall_start
    print(
        f"# total wall time {wall:.0f} s; CPU used by other processes meanwhile {max(foreign, 0.0):.0f} CPU-s "
        f"({100 * max(foreign, 0.0) / (wall * (os.cpu_count() or 1)):.0f}% of the machine)"
        + ("; WARNING: the machine was not idle, timings are unreliable" if foreign > 0.05 * wall else "")
    )

    def ratio(size: str, key: str, opd_run: str, trl: str) -> str:
        if size not in summaries:
            return "nan"
        return f"{summaries[size][opd_run][key] / summaries[size][trl][key]:.3f}"

    # Each opd run against GKD with gradient checkpointing off (equal work), then against
    # GKD as shipped, which is what a user gets from GKDConfig's defaults.
    for opd_run in OPD_RUNS:
        for trl, name in (("trl_nogc", "trl_gc_off"), ("trl", "trl")):
            print(
                f"e2e {opd_run}/{name} step_time small={ratio('small', 'step', opd_run, trl)} "
                f"qwen_vocab={ratio('qwen_vocab', 'step', opd_run, trl)} "
                f"peak_rss small={ratio('small', 'peak_rss_mib', opd_run, trl)} "
                f"qwen_vocab={ratio('qwen_vocab', 'peak_rss_mib', opd_run, trl)}"
            )

    def round_ratio(size: str, key: str, opd_run: str, distill_run: str) -> str:
        if size not in comparisons:
            return "nan"
        return f"{_median(comparisons[size]['ratios'][(opd_run, distill_run)][key]):.3f}"

    # The same against DistillationTrainer, gc-off (equal work) then as shipped: the
    # medians of the per-round ratios of the per-run table.
    for opd_run in OPD_RUNS:
        for distill_run, name in (("distill_nogc", "distill_gc_off"), ("distill", "distill")):
            print(
                f"e2e {opd_run}/{name} step_time small={round_ratio('small', 'step', opd_run, distill_run)} "
                f"qwen_vocab={round_ratio('qwen_vocab', 'step', opd_run, distill_run)} "
                f"peak_rss small={round_ratio('small', 'peak_rss_mib', opd_run, distill_run)} "
                f"qwen_vocab={round_ratio('qwen_vocab', 'peak_rss_mib', opd_run, distill_run)}"
            )

    def cost(size: str, key: str, digits: int) -> str:
        return _fmt(compile_costs[size][key], digits) if size in compile_costs else "nan"

    print(
        f"e2e compile_decode compile_s small={cost('small', 'compile_s', 1)} "
        f"qwen_vocab={cost('qwen_vocab', 'compile_s', 1)} break_even_steps small={cost('small', 'break_even', 0)} "
        f"qwen_vocab={cost('qwen_vocab', 'break_even', 0)}"
    )


SMOKE = {"sizes": "small", "rounds": 1, "warmup": 1, "steps": 1, "batch_size": 2, "max_new_tokens": 4}
"""``--smoke``: one round of one warm-up and one timed step per framework at the 2k vocabulary."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=8, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of each run")
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs per framework and size")
    parser.add_argument("--batch-size", type=int, default=4, help="prompts per step (one sample each)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="response budget per prompt")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="exact length of every rendered prompt")
    parser.add_argument("--temperature", type=float, default=SAMPLING_TEMPERATURE, help="sampling temperature")
    parser.add_argument("--sizes", default=",".join(SIZES), help="comma-separated subset of " + ",".join(SIZES))
    parser.add_argument("--skip-parts", action="store_true", help="skip the overhead report")
    # Internal: a worker process.
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--size", choices=SIZES, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--run-index", type=int, default=0, help=argparse.SUPPRESS)
    return parse_arguments(parser, SMOKE, argv)


if __name__ == "__main__":
    arguments = parse_args()
    # Quiet, and no tokenizer thread pool competing with the timed steps.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if arguments.worker:
        # Workers run from the repository root's package without installation too.
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        worker_result = WORKERS[arguments.worker](arguments)
        Path(arguments.out).write_text(json.dumps(worker_result), encoding="utf-8")
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        main(arguments)
