"""The in-process teacher's shared-prompt forward (``teacher.share_prompt_forward``).

Rows that begin with the same prompt share one pass over it; every answer the teacher
gives (logits, hidden states, top-k with rest mass, token log-probs) must equal the
one-pass answer at every real position (float32, rtol 1e-5 of each tensor's scale): prompts of unequal length
in one batch, rows in any order, a row whose prompt differs, an empty response, and
multi-turn trajectories (one prompt, episodes of different turns and observations).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from opd.data.sequences import pack_padding_free, pack_sequences
from opd.models.decoding import GenerateStrategyConfig
from opd.models.interfaces import FullVocabRequest, TokenLogprobsRequest, TopKRequest
from opd.models.tiny import build_tiny_model, build_tiny_tokenizer
from opd.rollout.environments.base import Environment, Episode, StepResult, StudentTurn
from opd.rollout.environments.turn_template import TurnTemplate
from opd.rollout.hf_generation import HFGeneration
from opd.rollout.multi_turn import multi_turn_rollout
from opd.teachers.local_teacher import LocalTeacher
from opd.teachers.shared_prompt import prompt_groups, sharing_problem


@pytest.fixture(scope="module")
def model():
    return build_tiny_model("teacher").eval()


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _single_turn_batch(tokenizer):
    """Three prompts of different lengths, their samples interleaved, plus a row alone with its prompt."""
    long_prompt = _ids(
        tokenizer, "<|im_start|>user\nWhat is 347 + 589? Show your work.<|im_end|>\n<|im_start|>assistant\n"
    )
    short_prompt = _ids(tokenizer, "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")
    lone_prompt = _ids(tokenizer, "<|im_start|>user\n9 * 9?<|im_end|>\n<|im_start|>assistant\n")
    rows = [
        (long_prompt, "7+9=16 write 6 carry 1. So 936.<|im_end|>"),
        (short_prompt, "4<|im_end|>"),
        (long_prompt, "936<|im_end|>"),
        (lone_prompt, "81, since nine nines are eighty-one.<|im_end|>"),
        (short_prompt, "The answer is 4, of course.<|im_end|>"),
        (long_prompt, ""),  # an empty response (cut at once)
    ]
    sequences = [prompt + _ids(tokenizer, response) for prompt, response in rows]
    return pack_sequences(sequences, [len(prompt) for prompt, _ in rows], tokenizer.pad_token_id)


def _multi_turn_batch(tokenizer):
    """One task's episodes: the same prompt, then turns and tool observations of different counts and lengths."""
    prompt = _ids(
        tokenizer, "<|im_start|>user\nWhat is 1234 * 567? Use the calculator.<|im_end|>\n<|im_start|>assistant\n"
    )
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1234 * 567"}}\n</tool_call><|im_end|>\n'
    observation = "<|im_start|>user\n<tool_response>\n699678\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    episodes = [
        call + observation + "The product is \\boxed{699678}.<|im_end|>",
        call + observation + call + observation + "\\boxed{699678}<|im_end|>",
        "I think it is \\boxed{700000}.<|im_end|>",  # no tool call: one turn
        call + "<|im_start|>user\n<tool_response>\nError: calculator did not finish\n</tool_response><|im_end|>\n",
    ]
    sequences = [prompt + _ids(tokenizer, episode) for episode in episodes]
    return pack_sequences(sequences, [len(prompt)] * len(episodes), tokenizer.pad_token_id)


def _answers(teacher: LocalTeacher, batch) -> dict[str, torch.Tensor]:
    hidden = teacher.score(batch, FullVocabRequest(prefer_hidden_states=True))
    top = teacher.score(batch, TopKRequest(k=5, temperature=1.0, vocab_size=None))
    return {
        "logits": teacher.score(batch, FullVocabRequest(prefer_hidden_states=False)),
        "hidden_states": hidden.hidden_states,
        "topk_logprobs": top.logprobs,
        "topk_ids": top.ids,
        "topk_rest": top.rest_logprobs,
        "token_logprobs": teacher.score(batch, TokenLogprobsRequest(None)),
    }


def _count_embedded_tokens(model) -> list[int]:
    """A list that records how many token positions each decoder pass embeds."""
    counts: list[int] = []
    model.get_input_embeddings().register_forward_hook(lambda module, inputs, output: counts.append(inputs[0].numel()))
    return counts


@pytest.mark.parametrize("batch_of", [_single_turn_batch, _multi_turn_batch], ids=["single-turn", "multi-turn"])
def test_shared_prompt_forward_equals_one_pass(model, tokenizer, batch_of):
    batch = batch_of(tokenizer)
    groups = prompt_groups(batch)
    assert groups is not None and len(groups.prompts) < batch["input_ids"].shape[0]
    one_pass = _answers(LocalTeacher(model, share_prompt_forward=False), batch)
    shared = _answers(LocalTeacher(model, share_prompt_forward=True), batch)
    real = torch.arange(batch["input_ids"].shape[1])[None, :] < batch["input_lengths"][:, None]
    for name, expected in one_pass.items():
        got = shared[name]
        assert got.shape == expected.shape, name
        if name == "topk_ids":  # ties aside, the same tokens in the same order
            assert torch.equal(got[real], expected[real]), name
        else:
            # rtol 1e-5, and an atol of 1e-5 of the tensor's scale: entries near zero differ by rounding only.
            scale = float(expected[real].abs().max())
            torch.testing.assert_close(got[real], expected[real], rtol=1e-5, atol=1e-5 * scale, msg=name)


def test_shared_prompt_forward_runs_each_prompt_once(model, tokenizer):
    batch = _single_turn_batch(tokenizer)
    groups = prompt_groups(batch)
    assert groups is not None and groups.group_of_row == [0, 1, 0, 2, 1, 0]
    counts = _count_embedded_tokens(model)
    LocalTeacher(model).score(batch, TokenLogprobsRequest(None))
    prompts, responses = counts  # two decoder passes: the distinct prompts, then every row's response
    widest_prompt = max(len(prompt) for prompt in groups.prompts)
    assert prompts == 3 * widest_prompt
    assert responses == 6 * max(length - prompt for length, prompt in zip(groups.input_lengths, groups.prompt_lengths))


def test_one_pass_where_sharing_saves_nothing(tokenizer):
    batch = _single_turn_batch(tokenizer)
    assert prompt_groups(batch.select_indices([0, 1, 3])) is None  # every prompt differs
    assert prompt_groups(pack_padding_free(batch)) is None  # packed rows
    without_prompts = {key: value for key, value in batch.items() if key != "prompt_lengths"}
    assert prompt_groups(type(batch)(without_prompts)) is None


def test_models_that_do_not_attend_to_the_whole_context_score_in_one_pass(model):
    from transformers import Qwen2Config

    windowed = Qwen2Config(num_hidden_layers=2, use_sliding_window=True, sliding_window=8, max_window_layers=0)
    assert "sliding_attention" in sharing_problem(SimpleNamespace(config=windowed))
    assert sharing_problem(model) is None
    assert not LocalTeacher(
        SimpleNamespace(config=windowed, eval=lambda: None, requires_grad_=lambda _: None)
    ).share_prompt_forward


class _AlwaysAnswer(Environment):
    """A simulated user who answers every turn (its length decides the reply) until the last one."""

    class _Episode(Episode):
        def step(self, turn: StudentTurn, last_turn: bool = False) -> StepResult:
            if last_turn:
                return StepResult(done=True, reward=0.0)
            return StepResult([{"role": "user", "content": "go on" + "!" * (len(turn.text) % 5)}])

    def start(self, row):
        return self._Episode()


def test_sampled_multi_turn_episodes_of_one_prompt_score_as_one_pass(model, tokenizer):
    """Real multi-turn rollouts (3 sampled episodes for each of 2 prompts), scored shared and in one pass."""
    torch.manual_seed(0)
    student = build_tiny_model("student")
    engine = HFGeneration(student, tokenizer)
    engine.prepare_for_generation()
    rows = [
        {"messages": [{"role": "user", "content": "Add 2 and 3."}]},
        {"messages": [{"role": "user", "content": "Count to four, slowly, please."}]},
    ]
    strategy = GenerateStrategyConfig(max_length=5, decoding_method="top_p", temperature=1.0, top_p=1.0)
    rollout = multi_turn_rollout(
        engine,
        _AlwaysAnswer(),
        TurnTemplate(tokenizer),
        rows,
        [row["messages"] for row in rows],
        strategy,
        max_turns=3,
        pad_token_id=tokenizer.pad_token_id,
        num_samples=3,
    )
    engine.finish_generation()
    batch = rollout.batch
    assert all(record.turns >= 2 for record in rollout.episodes)  # observations between turns
    groups = prompt_groups(batch)
    assert groups is not None and groups.group_of_row == [0, 0, 0, 1, 1, 1]
    assert len({tuple(row.tolist()) for row in batch["input_ids"]}) == 6  # the episodes differ
    real = torch.arange(batch["input_ids"].shape[1])[None, :] < batch["input_lengths"][:, None]
    request = TokenLogprobsRequest(None)
    expected = LocalTeacher(model, share_prompt_forward=False).score(batch, request)[real]
    got = LocalTeacher(model).score(batch, request)[real]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def test_the_switch_reaches_the_cluster_teachers(tmp_path):
    """``share_prompt_forward`` goes to each cluster teacher by role: a pool's worker builds its teacher with it."""
    from opd_test_helpers import REPO_ROOT, short_run_overrides

    from opd.distillation.config import MasterConfig
    from opd.distillation.setup import _cluster_prompt_sharing, _cluster_teacher_paths
    from opd.distributed.teacher_pool import TeacherWorker
    from opd.utils.config import load_config

    tiny = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
    one = load_config(MasterConfig, tiny, [*short_run_overrides(tmp_path), "teacher.share_prompt_forward=false"])
    assert _cluster_prompt_sharing(one, _cluster_teacher_paths(one)) == (False,)
    members = (
        "teachers.members=[{name: add, model_path: 'tiny:teacher', share_prompt_forward: false}, "
        "{name: sub, model_path: 'tiny:student-b'}]"
    )
    two_overrides = ["teachers.mode=route", "teachers.route_key=task", "model.teacher_model_path=null", members]
    two = load_config(MasterConfig, tiny, [*short_run_overrides(tmp_path), *two_overrides])
    paths = _cluster_teacher_paths(two)
    assert list(paths) == ["teacher add", "teacher sub"]
    assert _cluster_prompt_sharing(two, paths) == (False, True)
    for share in (False, True):
        worker = TeacherWorker(0, "tiny:teacher", one.model, threads=1, share_prompt_forward=share)
        assert worker.teacher.share_prompt_forward is share
