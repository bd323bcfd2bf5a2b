"""A teacher with another tokenizer: it scores the student's response text under its own tokenization.

Token-level distillation needs one vocabulary; a teacher of another family (Llama for a Qwen student) tokenizes the
same text differently. :class:`CrossTokenizerTeacher` wraps such a teacher (in process or served):

1. **Its own rows**: the teacher's rendering of the prompt (``teacher_prompt_ids``) followed by the student's
   response *text*, re-tokenized by the teacher (:func:`opd.data.token_alignment.teacher_tokens_for_response`).
2. **Alignment by bytes**: both tokenizations of the response are cut into groups at the byte offsets where both
   have a token boundary; at a group's start both models have read the same text.
3. **Classes both vocabularies can name**: there the teacher's top k (at the loss temperature) are gathered into the
   classes of :class:`~opd.data.token_alignment.PrefixClasses`, each token under its root (the longest string that
   prefixes it and is a token in both vocabularies). A class is one event for both models, so its teacher mass is
   compared with the student's mass over all its tokens (:func:`~opd.data.token_alignment.pool_logits_by_class`).
   Single shared strings would be wrong where the vocabularies extend a string differently (the teacher's ``" "``
   may start a word the student writes as one token). Classes are sent heaviest first, as their root's student id;
   listed tokens without a root join the teacher's rest. The top-k loss is then the exact KL over the listed
   classes plus one rest class, up to class members outside the teacher's top k (counted in its rest).
4. **Other positions** (inside a multi-token group) get no teacher token: all mass in the rest on both sides, so
   they add nothing to the loss.
5. **Multi-turn rows** (with ``episode_layout``): only the student's turns are re-tokenized; each observation
   between them is rendered by the teacher's own chat template (its tool-result markup and assistant header, see
   :class:`~opd.rollout.environments.turn_template.TurnTemplate`), so the teacher reads the episode as it would
   write it. Observations get no teacher token: they carry no loss.

With identical tokenizers this is the teacher's own top k and the ordinary top-k loss. What the cross-tokenizer loss
gives up is described in the guide (section 15).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from opd.data.batched_data_dict import BatchedDataDict
from opd.data.sequences import pack_rows, unpack_padding_free
from opd.data.token_alignment import AlignedGroup, PrefixClasses, prefix_classes, teacher_tokens_for_response
from opd.kernels.topk_rest import rest_logprobs_from_topk
from opd.models.interfaces import (
    TeacherInterface,
    TeacherRequest,
    TeacherSignal,
    TopKLogprobs,
    TopKRequest,
)
from opd.rollout.environments.turn_template import TurnTemplate
from opd.teachers.several_teachers import map_single


class CrossTokenizerTeacher(TeacherInterface):
    """Wraps a ``teacher`` whose tokenizer differs from the student's (see the module docstring)."""

    def __init__(self, teacher: TeacherInterface, student_tokenizer: Any, teacher_tokenizer: Any) -> None:
        self.teacher = teacher
        self.student_tokenizer = student_tokenizer
        self.teacher_tokenizer = teacher_tokenizer
        self.classes: PrefixClasses = prefix_classes(student_tokenizer, teacher_tokenizer)
        pad = teacher_tokenizer.pad_token_id
        self.teacher_pad_id = pad if pad is not None else teacher_tokenizer.eos_token_id

    @classmethod
    def unsupported_reason(cls, request: TeacherRequest) -> str | None:
        """Only top-k answers can be mapped onto the student's vocabulary."""
        if not isinstance(request, TopKRequest):
            return (
                "a teacher with another tokenizer sends its top-k over the token strings both vocabularies "
                "share; use loss_fn.type = topk"
            )
        return None

    def refusal(self, request: TeacherRequest) -> str | None:
        """This wrapper's reason, else the wrapped teacher's for the request it is sent."""
        reason = self.unsupported_reason(request)
        if reason is not None or not isinstance(request, TopKRequest):
            return reason
        return self.teacher.refusal(self._teacher_request(request))

    def _teacher_request(self, request: TopKRequest) -> TopKRequest:
        return TopKRequest(request.k, request.temperature, len(self.teacher_tokenizer))

    def score(self, data: BatchedDataDict, request: TeacherRequest) -> TeacherSignal:
        """The teacher's top k at the student's group starts, in student ids (empty slots −1).

        A packed micro-batch is scored as its rows and the answer packed like them. Raises ValueError for a request
        other than top-k, or rows without ``teacher_prompt_ids``.
        """
        if not isinstance(request, TopKRequest):
            raise ValueError(self.unsupported_reason(request))
        if "sequence_lengths" in data:
            # Re-tokenising needs each sequence on its own: score the rows, then pack the answer like them.
            lengths = [int(length) for length in data["sequence_lengths"][0]]
            answer = self.score(unpack_padding_free(data, self.student_tokenizer.pad_token_id), request)
            assert isinstance(answer, TopKLogprobs) and answer.rest_logprobs is not None
            return map_single(answer, functools.partial(pack_rows, lengths=lengths))
        if "teacher_prompt_ids" not in data:
            raise ValueError("a teacher with another tokenizer needs data['teacher_prompt_ids'] (its own prompts)")
        rows, groups_per_row = self._teacher_rows(data)
        batch = _right_padded(rows, [len(prompt) for prompt in data["teacher_prompt_ids"]], self.teacher_pad_id)
        answer = self.teacher.score(batch.to(data["input_ids"].device), self._teacher_request(request))
        if isinstance(answer, tuple):
            return self._to_student(data, answer, groups_per_row, request.k)
        raise TypeError(f"the teacher answered a top-k request with {type(answer).__name__}")

    def _teacher_rows(self, data: BatchedDataDict) -> tuple[list[list[int]], list[list[tuple[int, int]]]]:
        """Each row's ``[teacher prompt | re-tokenized response]`` and its group starts ``(student j, teacher j')``."""
        rows, starts = [], []
        layouts = data.get("episode_layout")
        for row, teacher_prompt in enumerate(data["teacher_prompt_ids"]):
            prompt_length, length = int(data["prompt_lengths"][row]), int(data["input_lengths"][row])
            response = data["input_ids"][row, prompt_length:length].tolist()
            if layouts is None:
                teacher_response, groups = teacher_tokens_for_response(
                    response, self.student_tokenizer, self.teacher_tokenizer
                )
            else:
                teacher_response, groups = self._episode_tokens(response, layouts[row])
            rows.append(list(teacher_prompt) + list(teacher_response))
            starts.append([(group.student_start, group.teacher_start) for group in groups])
        return rows, starts

    def _episode_tokens(self, response: list[int], layout: dict[str, Any]) -> tuple[list[int], list[AlignedGroup]]:
        """A multi-turn response for the teacher: each student turn re-tokenized, each observation rendered by the
        teacher's chat template; groups (in response indices) on the turns only. ``layout``: the row's
        :data:`~opd.rollout.multi_turn.EpisodeLayout`."""
        template = TurnTemplate(self.teacher_tokenizer, layout["tools"])
        turn_end = template.turn_end_ids()
        history = list(layout["prompt_messages"])
        ids: list[int] = []
        groups: list[AlignedGroup] = []
        for index, (start, end) in enumerate(layout["turns"]):
            turn_ids, turn_groups = teacher_tokens_for_response(
                response[start:end], self.student_tokenizer, self.teacher_tokenizer
            )
            groups += [
                AlignedGroup(
                    start + group.student_start, start + group.student_end,
                    len(ids) + group.teacher_start, len(ids) + group.teacher_end,
                )
                for group in turn_groups
            ]  # fmt: skip
            ids += turn_ids
            if index >= len(layout["observations"]):  # the last turn: nothing answered it
                break
            # The student's stop token became the teacher's end of turn where they correspond; else the teacher's
            # template writes its own after the turn.
            ended = bool(turn_end) and turn_ids[-1:] == turn_end
            observation = layout["observations"][index]
            turn_end_text = self.teacher_tokenizer.decode(turn_end) if ended else ""
            ids += template.observation_ids(history, turn_end_text, observation)
            history += [{"role": "assistant", "content": layout["contents"][index]}, *observation]
        return ids, groups

    def _to_student(
        self,
        data: BatchedDataDict,
        answer: tuple[torch.Tensor, torch.Tensor],
        groups_per_row: list[list[tuple[int, int]]],
        k: int,
    ) -> TopKLogprobs:
        """Moves the teacher's top k to the student's group starts and maps its ids (see the module docstring)."""
        teacher_logprobs, teacher_ids = answer[0], answer[1]
        teacher_rest = answer.rest_logprobs if isinstance(answer, TopKLogprobs) else None
        width = data["input_ids"].shape[1]
        slots = teacher_ids.shape[-1]
        device = teacher_ids.device
        logprobs = torch.zeros((len(groups_per_row), width, slots), dtype=torch.float32, device=device)
        ids = torch.full((len(groups_per_row), width, slots), -1, dtype=torch.long, device=device)
        rest = torch.zeros((len(groups_per_row), width), dtype=torch.float32, device=device)  # log 1: all mass
        mapping = self.classes.teacher_to_student.to(device)
        for row, starts in enumerate(groups_per_row):
            prompt_length = int(data["prompt_lengths"][row])
            teacher_prompt_length = len(data["teacher_prompt_ids"][row])
            if not starts:
                continue
            student_positions = torch.tensor([prompt_length + j - 1 for j, _ in starts], device=device)
            teacher_positions = torch.tensor([teacher_prompt_length + j - 1 for _, j in starts], device=device)
            values = teacher_logprobs[row, teacher_positions].float()
            if teacher_rest is None:  # log(1 − Σ_k P) in float64, for a teacher that sent no rest mass
                own_rest = rest_logprobs_from_topk(values.double()).float()
            else:
                own_rest = teacher_rest[row, teacher_positions].float()
            class_logprobs, class_ids, unsent = _by_class(values, mapping[teacher_ids[row, teacher_positions]])
            # The mass of listed tokens in no class sent joins the rest (summed in log space, never 1 - Σ).
            rest[row, student_positions] = torch.logaddexp(own_rest, unsent)
            logprobs[row, student_positions] = class_logprobs
            ids[row, student_positions] = class_ids
        return TopKLogprobs(logprobs, ids, rest)

    @property
    def student_classes(self) -> torch.Tensor:
        """The class (root student id) of each student id: the loss pools the student's logits by it."""
        return self.classes.student_roots

    def close(self) -> None:
        """Closes the wrapped teacher."""
        self.teacher.close()


def _by_class(values: torch.Tensor, classes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The teacher's listed tokens gathered by class: ``(log-probs, class ids, log-mass not sent)``.

    ``values``, ``classes``: ``[P, k]`` log-probs and classes (root student ids, −1 for none). Classes come by mass,
    each at its first member's slot (empty slots: id −1, log-prob 0); the ``[P]`` unsent mass is −inf if there is none.
    """
    slots = values.shape[-1]
    same = (classes.unsqueeze(-1) == classes.unsqueeze(-2)) & (classes >= 0).unsqueeze(-1)
    class_mass = torch.logsumexp(values.unsqueeze(-2).masked_fill(~same, -math.inf), dim=-1)
    earlier = torch.ones(slots, slots, dtype=torch.bool, device=values.device).tril(-1)
    first = (classes >= 0) & ~(same & earlier).any(dim=-1)
    order = class_mass.masked_fill(~first, -math.inf).argsort(dim=-1, descending=True, stable=True)
    sent = first.gather(-1, order)
    class_ids = classes.gather(-1, order).masked_fill(~sent, -1)
    class_logprobs = class_mass.gather(-1, order).masked_fill(~sent, 0.0)
    unsent = torch.logsumexp(values.masked_fill(classes >= 0, -math.inf), dim=-1)
    return class_logprobs, class_ids, unsent


def _right_padded(rows: list[list[int]], prompt_lengths: list[int], pad_id: int) -> BatchedDataDict:
    width = max((len(row) for row in rows), default=0)
    input_ids = torch.full((len(rows), max(width, 1)), pad_id, dtype=torch.long)
    token_mask = torch.zeros_like(input_ids, dtype=torch.float32)
    for index, (row, prompt_length) in enumerate(zip(rows, prompt_lengths, strict=True)):
        input_ids[index, : len(row)] = torch.tensor(row, dtype=torch.long)
        token_mask[index, prompt_length : len(row)] = 1.0
    return BatchedDataDict(
        input_ids=input_ids,
        input_lengths=torch.tensor([len(row) for row in rows], dtype=torch.long),
        prompt_lengths=torch.tensor(prompt_lengths, dtype=torch.long),
        token_mask=token_mask,
    )
