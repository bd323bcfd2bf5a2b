"""A teacher with another tokenizer on tool-using trajectories (multi-turn rollouts).

The student (the tiny byte-level tokenizer, ChatML with ``<tool_response>`` in a user turn) plays an episode with
the real calculator: a call, the tool's answer, a final turn. The teacher has other merges and its own chat
template, which writes a tool's result in a ``tool_result`` turn of its own and lists the tools differently. The
rows the wrapped teacher is asked to score must be the teacher template's own rendering of the whole conversation
(its prompt, the student's turns, each observation in its markup, its assistant headers), token for token; and the
teacher's answer must sit only on the student's tokens: every observation position (and the prompt) gets no
teacher token, so only the student's tokens carry loss. A packed micro-batch gets the same answer, packed.
"""

from __future__ import annotations

import pytest
import torch
from opd_scripted_engine import ScriptedGeneration

from opd.data.batched_data_dict import BatchedDataDict
from opd.data.sequences import encode_prompt, pack_padding_free, render_chat
from opd.models.decoding import GenerateStrategyConfig
from opd.models.interfaces import TopKRequest
from opd.models.tiny import build_model_for_tokenizer, build_tiny_tokenizer, train_bpe_tokenizer
from opd.rollout.environments.tool_environment import ToolEnvironment
from opd.rollout.environments.turn_template import TurnTemplate
from opd.rollout.multi_turn import multi_turn_rollout
from opd.rollout.tools.calculator import calculator_tool
from opd.rollout.tools.registry import ToolRegistry
from opd.teachers.cross_tokenizer import CrossTokenizerTeacher
from opd.teachers.local_teacher import LocalTeacher

TEACHER_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools you may call:{% for tool in tools %} {{ tool['function']['name'] }}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}<|im_start|>tool_result\n{{ message['content'] }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
TURNS = [CALL + "<|im_end|>", "It is \\boxed{42}.<|im_end|>"]
ROW = {"messages": [{"role": "user", "content": "What is 6 * 7? Use the calculator."}], "ground_truth": "42"}
K = 6


@pytest.fixture(scope="module")
def tokenizers():
    student = build_tiny_tokenizer()
    texts = [
        f"<|im_start|>user\nWhat is {a} * {b}?<|im_end|>\n<|im_start|>assistant\n{CALL}<|im_end|>\n"
        f"<|im_start|>tool_result\n{a * b}<|im_end|>\n"
        for a in range(2, 60)
        for b in (3, 7)
    ]
    teacher = train_bpe_tokenizer(texts, vocab_size=400)
    teacher.chat_template = TEACHER_TEMPLATE
    return student, teacher


@pytest.fixture(scope="module")
def episode_batch(tokenizers):
    student, teacher = tokenizers
    environment = ToolEnvironment(ToolRegistry([calculator_tool()]))
    tools = environment.tool_schemas()
    rollout = multi_turn_rollout(
        ScriptedGeneration(student, TURNS, stop_ids=(student.eos_token_id,)),
        environment,
        TurnTemplate(student, tools),
        [ROW],
        [ROW["messages"]],
        GenerateStrategyConfig(max_length=200),
        max_turns=3,
        pad_token_id=student.pad_token_id,
    )
    batch = rollout.batch
    batch["teacher_prompt_ids"] = [encode_prompt(teacher, ROW["messages"], tools)]
    return batch, tools


class RecordingTeacher(LocalTeacher):
    """The teacher model, keeping the rows it was asked to score."""

    def __init__(self, model) -> None:
        super().__init__(model)
        self.rows: list[list[int]] = []

    def score(self, data, request):
        self.rows += [data["input_ids"][row, : int(data["input_lengths"][row])].tolist() for row in range(data.size)]
        return super().score(data, request)


def test_the_teacher_reads_the_episode_in_its_own_template(tokenizers, episode_batch):
    student, teacher_tokenizer = tokenizers
    batch, tools = episode_batch
    inner = RecordingTeacher(build_model_for_tokenizer("teacher", teacher_tokenizer))
    CrossTokenizerTeacher(inner, student, teacher_tokenizer).score(batch, TopKRequest(K))
    conversation = [
        *ROW["messages"],
        {"role": "assistant", "content": CALL},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "It is \\boxed{42}."},
    ]
    # The teacher's own rendering, ending where the student's last turn ended (its stop token included).
    expected = render_chat(teacher_tokenizer, conversation, add_generation_prompt=False, tools=tools).removesuffix("\n")
    (row,) = inner.rows
    assert teacher_tokenizer.decode(row) == expected
    assert "<tool_response>" in student.decode(batch["input_ids"][0]), "the student's own markup differs"
    assert row == teacher_tokenizer(expected, add_special_tokens=False)["input_ids"]


def test_only_the_students_tokens_get_a_teacher_token(tokenizers, episode_batch):
    student, teacher_tokenizer = tokenizers
    batch, _ = episode_batch
    teacher = CrossTokenizerTeacher(
        LocalTeacher(build_model_for_tokenizer("teacher", teacher_tokenizer)), student, teacher_tokenizer
    )
    answer = teacher.score(batch, TopKRequest(K))
    mask = batch["token_mask"][0]
    length = int(batch["input_lengths"][0])
    # The answer at position t predicts token t + 1; it carries a teacher token only where t + 1 is the student's.
    has_teacher = (answer.ids[0] >= 0).any(dim=-1)
    predicted_is_student = torch.zeros_like(has_teacher)
    predicted_is_student[: length - 1] = mask[1:length] == 1
    assert has_teacher.any()
    assert not (has_teacher & ~predicted_is_student).any(), "a teacher token where no student token is predicted"
    observation_positions = (~predicted_is_student).nonzero().flatten()
    assert torch.all(answer.rest_logprobs[0, observation_positions] == 0), "all mass in the rest: no loss there"
    # Each turn's first token (the group start after an observation's assistant header) gets the teacher's token.
    turn_starts = [t for t in range(1, length) if mask[t] == 1 and mask[t - 1] == 0]
    assert len(turn_starts) == 2 and all(bool(has_teacher[t - 1]) for t in turn_starts)

    packed = pack_padding_free(BatchedDataDict({**batch, "input_ids": batch["input_ids"]}))
    packed_answer = teacher.score(packed, TopKRequest(K))
    assert torch.equal(packed_answer.ids[0, :length], answer.ids[0, :length])
    assert torch.allclose(packed_answer.logprobs[0, :length], answer.logprobs[0, :length])
