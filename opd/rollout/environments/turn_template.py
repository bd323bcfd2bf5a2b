"""How the chat template joins turns: the prompt with the tools, and each observation's tokens.

An observation's text is what the template writes after the student's turn: the turn's end, the environment's
messages and the next assistant header. For Qwen's template, after a turn ending in ``<|im_end|>``::

    \\n<|im_start|>user\\n<tool_response>\\n...\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n

:meth:`TurnTemplate.observation_ids` renders the conversation with a placeholder as the student's last turn and
takes what follows it, less the stop token the student already generated (a different stop token leaves the
template's turn end in the observation, where it carries no loss), so any chat template works. How a template
re-renders *earlier* turns (Qwen3-style templates drop their ``<think>`` reasoning) does not change the trajectory,
whose ids are the generated ones; only a trainer that re-renders the conversation sees it.
"""

from __future__ import annotations

import re
from typing import Any

from opd.data.sequences import encode_prompt, encode_text, render_chat
from opd.utils.errors import DataError

PLACEHOLDER = "\u2063OPD-STUDENT-TURN\u2063"
"""Stands for the student's last turn while the template renders what follows it."""


class TurnTemplate:
    """Renders a conversation's prompt and observations with a tokenizer's chat template and ``tools`` schemas."""

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]] | None = None) -> None:
        self.tokenizer = tokenizer
        self.tools = tools or None
        self._special_texts: set[str] | None = None

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The episode's prompt: ``messages`` rendered with the tools and the assistant header."""
        return encode_prompt(self.tokenizer, messages, self.tools)

    def _text_after_placeholder(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str | None:
        """What the template writes after the last :data:`PLACEHOLDER` turn; None if it does not write it as given."""
        text = render_chat(self.tokenizer, messages, add_generation_prompt, self.tools)
        at = text.rfind(PLACEHOLDER)
        return text[at + len(PLACEHOLDER) :] if at >= 0 else None

    def turn_end_ids(self) -> list[int]:
        """The special token with which the template ends an assistant turn (``<|im_end|>`` for ChatML).

        It is the first token written after a rendered turn's content; empty when that is not a special token.
        """
        messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": PLACEHOLDER}]
        after = self._text_after_placeholder(messages, add_generation_prompt=False)
        ids = encode_text(self.tokenizer, after) if after else []
        special = set(self.tokenizer.all_special_ids) | {
            token_id for token_id, token in getattr(self.tokenizer, "added_tokens_decoder", {}).items() if token.special
        }
        return ids[:1] if ids and ids[0] in special else []

    def observation_text(self, history: list[dict[str, Any]], turn_end: str, observation: list[dict[str, Any]]) -> str:
        """The template's text between the student's last turn and its next turn.

        Args:
            history: the conversation before the student's last turn (earlier turns as ``assistant`` messages).
            turn_end: the text of the stop token the student's turn ended with ("" if none).

        Raises:
            DataError: the template does not write the assistant's content as given.
        """
        messages = [*history, {"role": "assistant", "content": PLACEHOLDER}, *observation]
        after = self._text_after_placeholder(messages, add_generation_prompt=True)
        if after is None:
            raise DataError(
                "the chat template does not write an assistant turn's content as given, so the text "
                "between turns cannot be found; multi-turn rollouts need a template that does"
            )
        return after.removeprefix(turn_end)

    def observation_ids(
        self, history: list[dict[str, Any]], turn_end: str, observation: list[dict[str, Any]]
    ) -> list[int]:
        """:meth:`observation_text` tokenised: the template's own special tokens as such, but a message's text that
        spells one (a tool's output writing ``<|im_end|><|im_start|>assistant``) as ordinary tokens, so that it
        cannot open a turn. Without such text, the whole observation is tokenised once.

        (Added tokens that are not special, such as Qwen's ``<tool_call>``, stay single tokens in a message's text,
        as they would anywhere in the student's own text.)
        """
        texts = [message.get("content") for message in observation]
        if not any(isinstance(text, str) and self._spells_a_special_token(text) for text in texts):
            return encode_text(self.tokenizer, self.observation_text(history, turn_end, observation))
        marked = [
            {**message, "content": _content_marker(index)} if isinstance(text, str) else message
            for index, (message, text) in enumerate(zip(observation, texts, strict=True))
        ]
        ids: list[int] = []
        for index, piece in enumerate(_CONTENT_MARKER.split(self.observation_text(history, turn_end, marked))):
            if index % 2 == 0:  # the template's text around the messages
                ids += encode_text(self.tokenizer, piece) if piece else []
            else:
                content = texts[int(piece)]
                assert isinstance(content, str)
                ids += self.tokenizer(content, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        return ids

    def _spells_a_special_token(self, text: str) -> bool:
        if self._special_texts is None:
            decoder = getattr(self.tokenizer, "added_tokens_decoder", {})
            self._special_texts = {*self.tokenizer.all_special_tokens} | {
                token.content for token in decoder.values() if token.special
            }
        return any(special in text for special in self._special_texts)


_CONTENT_MARKER = re.compile("\u2063OPD-CONTENT-(\\d+)\u2063")
"""Stands for one observation message's text while the template renders around it (its index captured)."""


def _content_marker(index: int) -> str:
    return f"\u2063OPD-CONTENT-{index}\u2063"
