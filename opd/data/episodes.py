"""Fixed multi-turn data: a recorded episode as token ids, with the loss on the assistant's turns alone.

With an environment, fixed-data steps (λ < 1) train on chat rows that go on after the first assistant turn (tool
calls, ``tool`` messages). Only assistant turns carry loss; tool results, later user messages and markup do not.

The ids are laid out as a rollout's (:mod:`opd.rollout.multi_turn`): each assistant turn through its end-of-turn
token, then the template's text up to the next assistant header, each piece tokenised on its own so a turn never
merges with its markup. Turns are cut from one rendering of the whole conversation, so a template that rewrites
earlier turns once later ones exist (dropping old reasoning, say) cannot be laid out; such a row is refused.
"""

from __future__ import annotations

from typing import Any

from opd.data.sequences import encode_text, render_chat
from opd.utils.errors import DataError


def split_at_first_assistant(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(prompt, episode)``: the messages before the first assistant turn, and the rest (empty without one)."""
    for index, message in enumerate(messages):
        if message.get("role") == "assistant":
            return list(messages[:index]), list(messages[index:])
    return list(messages), []


def encode_episode(
    tokenizer: Any, prompt_messages: list[dict], episode: list[dict], tools: list[dict] | None
) -> tuple[list[int], list[int]]:
    """The ids after the prompt, and a 0/1 mask over them that is 1 on the assistant's own tokens.

    A turn ends at the tokenizer's EOS; messages after the last assistant turn add nothing.

    Raises:
        DataError: if the episode has no assistant turn, or the template does not render the conversation so far
            as a prefix of the longer one.
    """
    if not any(message.get("role") == "assistant" for message in episode):
        raise DataError("a recorded episode needs at least one assistant turn after the prompt")
    eos = tokenizer.eos_token
    whole = render_chat(tokenizer, [*prompt_messages, *episode], add_generation_prompt=False, tools=tools)
    done = render_chat(tokenizer, prompt_messages, add_generation_prompt=True, tools=tools)
    ids: list[int] = []
    mask: list[int] = []
    for index, message in enumerate(episode):
        if message.get("role") != "assistant":
            continue
        header = render_chat(tokenizer, [*prompt_messages, *episode[:index]], add_generation_prompt=True, tools=tools)
        if not whole.startswith(header) or not header.startswith(done):
            raise DataError(
                f"the chat template renders the conversation before messages[{len(prompt_messages) + index}] "
                "differently once later turns exist (it rewrites earlier turns), so a recorded episode cannot be "
                "laid out as one growing sequence of ids"
            )
        turn = whole[len(header) :]
        end = turn.find(eos) if eos else -1
        turn = turn[: end + len(eos)] if end >= 0 else turn
        between = header[len(done) :]
        between_ids, turn_ids = encode_text(tokenizer, between) if between else [], encode_text(tokenizer, turn)
        ids += between_ids + turn_ids
        mask += [0] * len(between_ids) + [1] * len(turn_ids)
        done = header + turn
    return ids, mask
