"""Where a multi-turn rollout ends a turn and an episode: the template's end of turn, and ``max_episode_tokens``.

The student's turns come from a scripted engine over the tiny byte-level tokenizer (whose
chat template ends an assistant turn with ``<|im_end|>``), so the trajectories are known;
the tool environment, its calculator and the math verifier are real. The engine does what
a real one does with ``strategy.max_length``: it cuts a response there and flags it
truncated, and it stops only at the stop ids it was given.
"""

from __future__ import annotations

import pytest
from opd_scripted_engine import ScriptedGeneration

from opd.models.decoding import GenerateStrategyConfig
from opd.models.tiny import build_tiny_tokenizer
from opd.rollout.environments.config import EnvironmentConfig
from opd.rollout.environments.tool_environment import ToolEnvironment
from opd.rollout.environments.turn_template import TurnTemplate
from opd.rollout.multi_turn import multi_turn_rollout
from opd.rollout.tools.calculator import calculator_tool
from opd.rollout.tools.registry import ToolRegistry

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
ANSWER = "\\boxed{42}"
ROW = {"messages": [{"role": "user", "content": "What is 6 * 7?"}], "ground_truth": "42"}
IM_END = "<|im_end|>"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def _rollout(tokenizer, engine, max_turns=3, max_episode_tokens=None, max_length=400):
    environment = ToolEnvironment(ToolRegistry([calculator_tool()]))
    return multi_turn_rollout(
        engine,
        environment,
        TurnTemplate(tokenizer, environment.tool_schemas()),
        [ROW],
        [ROW["messages"]],
        GenerateStrategyConfig(max_length=max_length),
        max_turns,
        tokenizer.pad_token_id,
        max_episode_tokens=max_episode_tokens,
    )


def _ids(batch, key="input_ids"):
    return batch[key][0, : int(batch["input_lengths"][0])].tolist()


def test_the_template_turn_end_is_found(tokenizer):
    assert TurnTemplate(tokenizer).turn_end_ids() == [tokenizer.convert_tokens_to_ids(IM_END)]


def test_a_turn_ends_at_the_templates_end_of_turn_where_the_engine_runs_past_it(tokenizer):
    """An engine that does not stop at ``<|im_end|>`` runs on into the next turn's markup; the
    rollout ends the turn at ``<|im_end|>``, so the call runs and the student answers in a second turn."""
    run_on = "\n<|im_start|>user\nthe student writes the user's turn"
    engine = ScriptedGeneration(tokenizer, [CALL + IM_END + run_on, ANSWER + IM_END + run_on])
    rollout = _rollout(tokenizer, engine)
    (record,) = rollout.episodes
    assert (record.turns, record.tool_calls, record.successful_calls, record.reward) == (2, 1, 1, 1.0)
    batch = rollout.batch
    text = tokenizer.decode(_ids(batch))
    assert "the student writes" not in text and not bool(batch["truncated"][0])
    assert text.endswith(ANSWER + IM_END)
    # The sampler's log-probs were cut with the turn: each turn's last kept log-prob is its <|im_end|>'s.
    start = int(batch["prompt_lengths"][0])
    turn_length = len(tokenizer(CALL + IM_END, add_special_tokens=False)["input_ids"])
    assert _ids(batch, "generation_logprobs")[start + turn_length - 1] == -(turn_length - 1)
    assert _ids(batch, "token_mask")[start + turn_length] == 0.0  # the observation follows at once


def test_the_episode_never_exceeds_max_episode_tokens_and_a_cut_turn_ends_it(tokenizer):
    reference = _rollout(tokenizer, ScriptedGeneration(tokenizer, [CALL + IM_END, ANSWER + IM_END]))
    full = len(_ids(reference.batch))
    assert reference.metrics()["env/truncated_share"] == 0.0
    cap = full - 3  # the answer's last three tokens do not fit
    engine = ScriptedGeneration(tokenizer, [CALL + IM_END, ANSWER + IM_END])
    rollout = _rollout(tokenizer, engine, max_episode_tokens=cap)
    (record,) = rollout.episodes
    assert len(_ids(rollout.batch)) == cap
    assert _ids(rollout.batch) == _ids(reference.batch)[:cap]
    assert record.capped and record.truncated and record.turns == 2 and record.reward == 0.0
    assert rollout.metrics()["env/truncated_share"] == 1.0
    # Each turn was asked for no more tokens than were left.
    prompt = int(reference.batch["prompt_lengths"][0])
    second_turn_room = cap - (full - len(tokenizer(ANSWER + IM_END, add_special_tokens=False)["input_ids"]))
    assert engine.budgets == [cap - prompt, second_turn_room]


def test_an_observation_that_does_not_fit_ends_the_episode_without_it(tokenizer):
    reference = _rollout(tokenizer, ScriptedGeneration(tokenizer, [CALL + IM_END, ANSWER + IM_END]))
    prompt = int(reference.batch["prompt_lengths"][0])
    first_turn = len(tokenizer(CALL + IM_END, add_special_tokens=False)["input_ids"])
    engine = ScriptedGeneration(tokenizer, [CALL + IM_END, ANSWER + IM_END])
    rollout = _rollout(tokenizer, engine, max_episode_tokens=prompt + first_turn + 5)
    (record,) = rollout.episodes
    assert _ids(rollout.batch) == _ids(reference.batch)[: prompt + first_turn]  # ends at the first turn's <|im_end|>
    assert record.capped and not record.truncated and record.turns == 1
    assert record.reward == 0.0  # graded on the turn it stopped after (a call, no answer), not left ungraded
    assert rollout.metrics()["env/truncated_share"] == 1.0


def test_a_prompt_that_leaves_no_room_is_refused_by_name(tokenizer):
    with pytest.raises(ValueError, match=r"environment\.max_episode_tokens"):
        _rollout(tokenizer, ScriptedGeneration(tokenizer, [ANSWER + IM_END]), max_episode_tokens=10)


def test_max_episode_tokens_is_a_config_key():
    assert EnvironmentConfig().max_episode_tokens is None
    assert EnvironmentConfig(max_episode_tokens=4096).max_episode_tokens == 4096
    with pytest.raises(ValueError):
        EnvironmentConfig(max_episode_tokens=1)
