"""A scripted generation engine for multi-turn rollout tests: the student's turns are given as text."""

from __future__ import annotations

from opd.models.interfaces import GenerationInterface
from opd.rollout.rollout_batch import build_rollout_batch


class ScriptedGeneration(GenerationInterface):
    """Writes turn ``i`` of every episode from ``turns[i]`` (text with its special tokens), as an engine would.

    A response is cut at ``strategy.max_length`` tokens (then flagged truncated) and at the
    first of ``stop_ids``; ``<|im_end|>`` is not a stop id unless listed, as for a base
    model whose EOS is another token. Log-probs are the token's position in the turn, negated.
    """

    def __init__(self, tokenizer, turns: list[str], stop_ids: tuple[int, ...] = ()) -> None:
        self.tokenizer, self.turns, self.stop_ids = tokenizer, turns, stop_ids
        self.budgets: list[int] = []

    def prepare_for_generation(self) -> None:
        """Nothing to switch on: the script is the engine."""

    def finish_generation(self) -> None:
        """Nothing to release."""

    def generate(self, prompts, strategy, num_samples=1, return_logprobs=True):
        self.budgets.append(strategy.max_length)
        responses, truncated = [], []
        for prompt in prompts:
            turn = self.turns[self.tokenizer.decode(prompt).count("<|im_start|>assistant") - 1]
            ids = self.tokenizer(turn, add_special_tokens=False)["input_ids"]
            stop = next((at + 1 for at, token in enumerate(ids) if token in self.stop_ids), None)
            ids = ids[:stop] if stop is not None else ids
            responses.append(ids[: strategy.max_length])
            truncated.append(stop is None or len(ids) > strategy.max_length)
        logprobs = [[-float(at) for at in range(len(ids))] for ids in responses] if return_logprobs else None
        return build_rollout_batch(prompts, responses, logprobs, truncated, self.tokenizer.pad_token_id)
