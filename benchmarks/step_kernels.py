"""The kernels behind opd's step time, each against the alternative it replaced.

One table, one process, on the machine it runs on (run it idle: 2 cores are easily
disturbed). Rows, at the two vocabularies of ``e2e_vs_trl.py`` (2,048 and Qwen's
151,669), 4 rows × 32-token prompts × 32 new tokens for generation:

* **draw**: one next token for 4 rows from a softmax: ``torch.multinomial`` (what
  ``generate`` uses) vs opd's inverse-CDF draw
  (:func:`opd.rollout.sampling.sample_from_probs`);
* **decode**: 32 sampled tokens with the KV cache: ``model.generate`` vs opd's decode
  loop (:func:`opd.rollout.decode_loop.decode`), the opd student preset; then
  opd's loop eager vs with its one-token step compiled (``generation.compile_decode``),
  the first compiled call (compilation) reported separately;
* **AdamW**: one step over the student's parameters: per-tensor loop, ``foreach``, fused
  (``training.adam_implementation``);
* **fused loss**: forward + backward of opd's fused JSD loss (β = 0.5) over 128 response
  positions, metrics included: eager vs compiled kernels (``loss_fn.compile_kernels``);
  the first compiled call (compilation) is reported separately.

Each cell is the median of ``--repeats`` timed calls after one untimed call. The ratio
column is opd's choice over the alternative (lower is better).

Usage: ``python benchmarks/step_kernels.py [--repeats 7] [--vocabularies 2048,151669] [--smoke]``
(about 2 minutes, most of it compiling; ``--smoke``: one timed call per cell at a
512-entry vocabulary).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import parse_arguments
from timing import median_seconds

from opd.losses.distillation_losses import DistillationLossFn, JSDLossFn
from opd.models.decoding import GenerateStrategyConfig
from opd.models.lm_head import LMHeadInput
from opd.models.tiny import build_model_for_tokenizer, build_tiny_tokenizer
from opd.rollout.decode_loop import compile_decode_step, decode
from opd.rollout.sampling import sample_from_probs

VOCABULARIES = (2048, 151_669)
ROWS, PROMPT_TOKENS, NEW_TOKENS, LOSS_POSITIONS = 4, 32, 32, 128


def student_with_vocabulary(vocab: int) -> torch.nn.Module:
    model = build_model_for_tokenizer("student", build_tiny_tokenizer())
    model.resize_token_embeddings(vocab, mean_resizing=False)
    return model.eval()


def draw_rows(vocab: int, repeats: int) -> list[tuple[str, str, float, float]]:
    probs = torch.softmax(torch.randn(ROWS, vocab) * 3, dim=-1)
    multinomial = median_seconds(lambda: torch.multinomial(probs, 1), repeats * 20)
    inverse_cdf = median_seconds(lambda: sample_from_probs(probs), repeats * 20)
    return [("draw (4 rows)", "multinomial → inverse CDF", multinomial, inverse_cdf)]


def decode_rows(vocab: int, repeats: int) -> list[tuple[str, str, float, float]]:
    model = student_with_vocabulary(vocab)
    prompts = torch.randint(10, 200, (ROWS, PROMPT_TOKENS))
    mask = torch.ones_like(prompts)
    strategy = GenerateStrategyConfig(max_length=NEW_TOKENS, temperature=0.9, decoding_method="top_p", top_p=1.0)
    no_stop: tuple[int, ...] = ()  # every row runs the full budget in both loops

    def with_generate() -> None:
        with torch.inference_mode():
            model.generate(
                input_ids=prompts,
                attention_mask=mask,
                max_new_tokens=NEW_TOKENS,
                do_sample=True,
                temperature=0.9,
                top_k=0,
                top_p=1.0,
                use_cache=True,
                pad_token_id=0,
                eos_token_id=model.config.vocab_size + 1,
            )

    def with_opd(step_forward: Callable[..., object] | None = None) -> None:
        with torch.inference_mode():
            decode(model, prompts, mask, strategy, no_stop, 0, return_logprobs=False, step_forward=step_forward)

    step_forward = compile_decode_step(model)
    start = time.perf_counter()
    with_opd(step_forward)  # compiles (or loads inductor's cached kernels)
    first_call = time.perf_counter() - start
    eager_loop = median_seconds(with_opd, repeats)
    return [
        ("decode 32 tokens", "generate → opd loop", median_seconds(with_generate, repeats), eager_loop),
        (
            "decode 32 tokens",
            "opd loop → compiled step",
            eager_loop,
            median_seconds(lambda: with_opd(step_forward), repeats),
        ),
        ("  first compiled call", "(compilation)", float("nan"), first_call),
    ]


def adam_rows(vocab: int, repeats: int) -> list[tuple[str, str, float, float]]:
    params = list(student_with_vocabulary(vocab).parameters())
    for param in params:
        param.grad = torch.randn_like(param)
    seconds = {}
    for name, kwargs in (("loop", {"foreach": False}), ("foreach", {"foreach": True}), ("fused", {"fused": True})):
        optimizer = torch.optim.AdamW(params, lr=1e-5, **kwargs)
        seconds[name] = median_seconds(optimizer.step, repeats * 5)
    return [
        ("AdamW step", "loop → fused", seconds["loop"], seconds["fused"]),
        ("AdamW step", "foreach → fused", seconds["foreach"], seconds["fused"]),
    ]


def loss_rows(vocab: int, repeats: int) -> list[tuple[str, str, float, float]]:
    generator = torch.Generator().manual_seed(0)
    rows_per_sequence = LOSS_POSITIONS // ROWS + 1
    student_states = torch.randn(ROWS, rows_per_sequence, 64, generator=generator)
    student_weight = torch.randn(vocab, 64, generator=generator) * 0.05
    teacher_states = torch.randn(ROWS, rows_per_sequence, 128, generator=generator)
    teacher_weight = torch.randn(vocab, 128, generator=generator) * 0.05
    token_mask = torch.ones(ROWS, rows_per_sequence)
    token_mask[:, 0] = 0
    data = {"token_mask": token_mask}
    valid = int(token_mask[:, 1:].sum())

    def step_with(loss_fn: DistillationLossFn) -> Callable[[], None]:
        def step() -> None:
            states = student_states.clone().requires_grad_()
            weight = student_weight.clone().requires_grad_()
            loss, _ = loss_fn(
                LMHeadInput(states, weight, None),
                data,
                valid,
                ROWS,
                teacher_output=LMHeadInput(teacher_states, teacher_weight, None),
            )
            loss.backward()

        return step

    eager = JSDLossFn(beta=0.5, fused_lm_head=True, compile_kernels=False)
    compiled = JSDLossFn(beta=0.5, fused_lm_head=True, compile_kernels=True)
    compiled_step = step_with(compiled)
    start = time.perf_counter()
    compiled_step()  # compiles (or loads inductor's cached kernels)
    first_call = time.perf_counter() - start
    return [
        (
            "fused JSD loss fwd+bwd",
            "eager → compiled",
            median_seconds(step_with(eager), repeats),
            median_seconds(compiled_step, repeats),
        ),
        ("  first compiled call", "(compilation)", float("nan"), first_call),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per cell (draw/AdamW use more)")
    parser.add_argument(
        "--vocabularies",
        default=",".join(str(vocab) for vocab in VOCABULARIES),
        type=lambda text: [int(vocab) for vocab in text.split(",") if vocab.strip()],
        help="comma-separated vocabulary sizes",
    )
    args = parse_arguments(parser, {"repeats": 1, "vocabularies": [512]})
    torch.manual_seed(0)
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads; command: python {' '.join(sys.argv)}")
    header = f"{'vocab':>8}  {'kernel':<24}  {'alternative → opd':<26}  {'before ms':>10}  {'opd ms':>10}  {'ratio':>6}"
    print(header)
    for vocab in args.vocabularies:
        for rows in (draw_rows, decode_rows, adam_rows, loss_rows):
            for kernel, change, before, after in rows(vocab, args.repeats):
                ratio = after / before if before == before else float("nan")
                before_text = f"{before * 1e3:10.3f}" if before == before else f"{'–':>10}"
                print(
                    f"{vocab:>8}  {kernel:<24}  {change:<26}  {before_text}  {after * 1e3:10.3f}  {ratio:6.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
