"""Fixed multi-turn data: a recorded episode as token ids, with the loss on the assistant's turns alone.

With an environment (multi-turn rollouts), a step that draws fixed data (λ < 1) trains on
recorded episodes: chat rows whose conversation goes on after the first assistant turn,
with ``tool`` messages and assistant turns that call tools (written in the template's own
format, or as ``tool_calls`` that the template renders). The student learns every
assistant turn, and nothing else: tool results, later user messages and the template's
markup between turns carry no loss, as in an on-policy multi-turn rollout.

The ids are laid out as a rollout's are (:mod:`opd.rollout.multi_turn`): the prompt
(the messages before the first assistant turn, rendered with the tools), then each
assistant turn up to and including the end-of-turn token, then the template's text up
to the next assistant header, and so on; each piece is tokenised on its own, so a
student turn never merges with the markup around it. The pieces come from the chat
template itself: the whole conversation is rendered once, and each assistant turn starts
where the conversation before it, rendered with the assistant header, ends (so a turn is
written as the template writes the finished conversation: Qwen3-style templates give the
last turn an empty ``<think>`` block, which is then part of it). A template that renders
an earlier turn differently once later turns exist (one that drops the reasoning of
turns before the last user message, say) cannot give the ids of a single growing
conversation; such a row is refused, naming it.
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

    Each assistant turn's tokens run through its end-of-turn token (the tokenizer's EOS,
    which the student generates to end a turn); what the template writes after it
    belongs to the next piece. Messages after the last assistant turn add nothing.

    Raises:
        DataError: the episode has no assistant turn, or the template does not render the
            conversation so far as a prefix of the longer one.
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
