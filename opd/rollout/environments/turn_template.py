"""How the chat template joins turns: the prompt with the tools, and each observation's tokens.

A multi-turn trajectory is built from ids that are never re-tokenised: the prompt, then
each student turn as generated, then each observation tokenised once. The observation's
text is what the chat template itself writes after the student's turn: the end of the
assistant turn, the environment's messages in the template's markup, and the header of
the next assistant turn. For Qwen's template, after a turn ending in ``<|im_end|>``::

    \\n<|im_start|>user\\n<tool_response>\\n...\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n

:meth:`TurnTemplate.observation_ids` finds that text by rendering the conversation so far
with a placeholder as the student's last turn, followed by the observation, and taking
everything after the placeholder. The part the student already generated (its stop
token, e.g. ``<|im_end|>``) is removed from the front; if the student stopped with
another token, the template's own turn end stays in the observation (it carries no loss).
Only the template decides the markup, so the same code serves any chat template.

What the template does to *earlier* turns when the whole conversation is rendered again
(Qwen3-style templates drop the ``<think>`` reasoning of turns before the last user query,
and write an empty ``<think></think>`` block before a final answer that had none) does not
change the trajectory: its ids are the generated ones. A trainer that re-renders the
conversation (fixed multi-turn data) sees those differences; the tests detect and pin them.
"""

from __future__ import annotations

from typing import Any

from opd.data.sequences import encode_text
from opd.utils.errors import DataError

PLACEHOLDER = "\u2063OPD-STUDENT-TURN\u2063"
"""Stands for the student's last turn while the template renders what follows it."""


class TurnTemplate:
    """Renders a multi-turn conversation's prompt and observations with a tokenizer's chat template.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        tools: the tools' schemas for the template's ``tools`` (None: no tools section).
    """

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]] | None = None) -> None:
        self.tokenizer = tokenizer
        self.tools = tools or None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        """The template's text for ``messages`` (with the tools, if any)."""
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The episode's prompt: ``messages`` rendered with the tools and the assistant header."""
        return encode_text(self.tokenizer, self.render(messages, add_generation_prompt=True))

    def turn_end_ids(self) -> list[int]:
        """The special token(s) with which the template ends an assistant turn (``<|im_end|>`` for ChatML).

        Found by rendering a finished assistant turn and reading the first token the
        template writes after its content; empty where that is not a special token (a
        template that ends turns with plain text: only the engine's stop tokens end a turn).
        """
        messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": PLACEHOLDER}]
        text = self.render(messages, add_generation_prompt=False)
        at = text.rfind(PLACEHOLDER)
        after = text[at + len(PLACEHOLDER) :] if at >= 0 else ""
        ids = encode_text(self.tokenizer, after) if after else []
        special = set(self.tokenizer.all_special_ids) | {
            token_id for token_id, token in getattr(self.tokenizer, "added_tokens_decoder", {}).items() if token.special
        }
        return ids[:1] if ids and ids[0] in special else []

    def observation_text(self, history: list[dict[str, Any]], turn_end: str, observation: list[dict[str, Any]]) -> str:
        """The template's text between the student's last turn and its next turn.

        Args:
            history: the conversation before the student's last turn (prompt messages,
                earlier turns as ``assistant`` messages, earlier observations).
            turn_end: the text of the stop token the student's turn ended with ("" if none).
            observation: the environment's messages.

        Raises:
            DataError: the template does not write the assistant's content as given (it
                cannot be used for multi-turn rollouts).
        """
        messages = [*history, {"role": "assistant", "content": PLACEHOLDER}, *observation]
        text = self.render(messages, add_generation_prompt=True)
        at = text.rfind(PLACEHOLDER)
        if at < 0:
            raise DataError(
                "the chat template does not write an assistant turn's content as given, so the text "
                "between turns cannot be found; multi-turn rollouts need a template that does"
            )
        after = text[at + len(PLACEHOLDER) :]
        if turn_end and after.startswith(turn_end):
            after = after[len(turn_end) :]
        return after

    def observation_ids(
        self, history: list[dict[str, Any]], turn_end: str, observation: list[dict[str, Any]]
    ) -> list[int]:
        """:meth:`observation_text`, tokenised once (the template placed every special token)."""
        return encode_text(self.tokenizer, self.observation_text(history, turn_end, observation))
