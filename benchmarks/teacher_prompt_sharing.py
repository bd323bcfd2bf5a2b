"""The in-process teacher's forward with and without the shared-prompt pass (``teacher.share_prompt_forward``).

A micro-batch of ``--prompts`` prompts, each with ``samples`` responses (the rows of
``num_samples_per_prompt``), is scored by :class:`~opd.teachers.local_teacher.LocalTeacher`
twice: in one pass over the right-padded rows (``share_prompt_forward: false``), and with
each distinct prompt run once and the responses on top of its cache (the default). The
request is the fused loss's (final hidden states): the teacher's forward alone, which is
what sharing changes. Prompt and response lengths vary by ±25 % between prompts and rows
around ``prompt`` and ``--response``, as rollouts do.

Reported, per (prompt length, samples): the median seconds of ``--repeats`` timed calls
after one untimed call, with their range, for each way, the ratio of the medians (one pass
/ shared: above 1, sharing is faster), and the largest difference of the hidden states
between the two (float rounding only). Run::

    OMP_NUM_THREADS=1 python benchmarks/teacher_prompt_sharing.py [--model tiny:demo-teacher]
        [--prompt-lengths 64 300] [--samples 1 4 8] [--response 128] [--prompts 2] [--repeats 5]

(``--smoke``: the tiny teacher, prompts of 16 tokens, 2 samples, responses of 8, 1 repeat.)
"""

from __future__ import annotations

import argparse

import torch
from harness import parse_arguments
from timing import median_and_range

from opd.data.sequences import pack_sequences
from opd.models.interfaces import FullVocabRequest
from opd.models.tiny import build_tiny_model
from opd.teachers.local_teacher import LocalTeacher

SMOKE = {"model": "tiny:teacher", "prompt_lengths": [16], "samples": [2], "response": 8, "repeats": 1}


def batch_of(prompt_length: int, samples: int, response: int, prompts: int, vocab: int, seed: int):
    """``prompts × samples`` right-padded rows: random prompts, each row its own random response."""
    generator = torch.Generator().manual_seed(seed)

    def length_around(center: int) -> int:
        return max(1, int(center * (0.75 + 0.5 * torch.rand((), generator=generator).item())))

    sequences, prompt_lengths = [], []
    for _ in range(prompts):
        prompt = torch.randint(3, vocab, (length_around(prompt_length),), generator=generator).tolist()
        for _ in range(samples):
            tail = torch.randint(3, vocab, (length_around(response),), generator=generator).tolist()
            sequences.append(prompt + tail)
            prompt_lengths.append(len(prompt))
    return pack_sequences(sequences, prompt_lengths, pad_token_id=0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny:demo-teacher", help="tiny:<preset> (built here, nothing read)")
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[64, 300])
    parser.add_argument("--samples", type=int, nargs="+", default=[1, 4, 8], help="responses per prompt")
    parser.add_argument("--response", type=int, default=128, help="response tokens (around)")
    parser.add_argument("--prompts", type=int, default=2, help="distinct prompts per micro-batch")
    parser.add_argument("--repeats", type=int, default=5)
    arguments = parse_arguments(parser, SMOKE, argv)
    if not arguments.model.startswith("tiny:"):
        raise SystemExit(f"--model must be tiny:<preset>, got {arguments.model}")
    torch.manual_seed(0)
    model = build_tiny_model(arguments.model.removeprefix("tiny:")).eval()
    one_pass = LocalTeacher(model, share_prompt_forward=False)
    shared = LocalTeacher(model, share_prompt_forward=True)
    request = FullVocabRequest(prefer_hidden_states=True)
    print(
        f"model {arguments.model}, {arguments.prompts} prompts per micro-batch, responses ~{arguments.response} "
        f"tokens, median of {arguments.repeats} (range), torch threads {torch.get_num_threads()}"
    )
    print("| prompt | samples | rows | one pass (s) | shared (s) | one pass / shared | max |Δ hidden| |")
    print("|---:|---:|---:|---|---|---:|---:|")
    for prompt_length in arguments.prompt_lengths:
        for samples in arguments.samples:
            batch = batch_of(prompt_length, samples, arguments.response, arguments.prompts, model.config.vocab_size, 7)
            real = torch.arange(batch["input_ids"].shape[1])[None, :] < batch["input_lengths"][:, None]
            expected = one_pass.score(batch, request).hidden_states[real]
            difference = float((shared.score(batch, request).hidden_states[real] - expected).abs().max())
            base = median_and_range(lambda batch=batch: one_pass.score(batch, request), arguments.repeats)
            fast = median_and_range(lambda batch=batch: shared.score(batch, request), arguments.repeats)
            print(
                f"| {prompt_length} | {samples} | {batch['input_ids'].shape[0]} "
                f"| {base[0]:.4f} ({base[1]:.4f}–{base[2]:.4f}) | {fast[0]:.4f} ({fast[1]:.4f}–{fast[2]:.4f}) "
                f"| {base[0] / fast[0]:.2f} | {difference:.1e} |"
            )


if __name__ == "__main__":
    main()
