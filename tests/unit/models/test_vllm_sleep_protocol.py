"""The order of vLLM sleep / wake / refit calls of the colocated engine (GPU behaviour, checked without a GPU).

vLLM's sleep mode exists on CUDA only, so these tests drive ``VllmGeneration``'s methods
against a recording stand-in for ``vllm.LLM``: after a rollout the engine sleeps (level 1,
weights kept on the host); a refit wakes only the weights before loading them; the next
rollout wakes only what is still asleep (the KV cache); a refit is one reload (opened, loaded,
closed) followed by one prefix-cache reset. Whether vLLM itself honours these
calls is for a GPU run to confirm.
"""

from __future__ import annotations

import re

import pytest

from opd.models.tiny import build_tiny_model
from opd.rollout.vllm_generation import VllmGeneration


class RecordingLLM:
    """Records the calls a ``vllm.LLM`` would receive."""

    def __init__(self, parameter_count: int) -> None:
        self.calls: list[tuple] = []
        self.parameter_count = parameter_count

    def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None) -> None:
        self.calls.append(("wake_up", tuple(tags) if tags is not None else None))

    def collective_rpc(self, method, args=()):
        if method.__name__ != "_load_worker_part":  # opening or closing the refit's one reload
            self.calls.append((method.__name__.strip("_"),))
            return [None]
        weights = list(args[0])  # consume the stream as the worker would
        self.calls.append(("load_part", len(weights)))
        return [len(weights)]

    def reset_prefix_cache(self) -> None:
        self.calls.append(("reset_prefix_cache",))


def engine_with(llm: RecordingLLM, sleep_enabled: bool) -> VllmGeneration:
    engine = VllmGeneration.__new__(VllmGeneration)  # no real engine: only the call protocol is under test
    engine.llm = llm
    engine.sleep_enabled = sleep_enabled
    engine.tied_embeddings = True
    engine.tensor_parallel_size = 1
    engine._asleep = set()
    engine._refit_open = False
    return engine


def test_sleep_after_rollout_wake_weights_for_refit_then_the_cache_for_the_next_rollout():
    model = build_tiny_model("student")
    count = sum(1 for _ in model.named_parameters())
    llm = RecordingLLM(count)
    engine = engine_with(llm, sleep_enabled=True)
    engine.prepare_for_generation()  # awake at start: nothing to wake
    engine.finish_generation()
    engine.refit_from_model(model)
    engine.prepare_for_generation()
    engine.finish_generation()
    engine.prepare_for_generation()  # a second validation pass without a refit: the host copy comes back
    assert llm.calls == [
        ("sleep", 1),
        ("wake_up", ("weights",)),
        ("begin_worker_reload",), ("load_part", count), ("finish_worker_reload",), ("reset_prefix_cache",),
        ("wake_up", ("kv_cache",)),
        ("sleep", 1),
        ("wake_up", ("kv_cache", "weights")),
    ]


def test_without_sleep_mode_the_engine_stays_resident():
    model = build_tiny_model("student")
    llm = RecordingLLM(sum(1 for _ in model.named_parameters()))
    engine = engine_with(llm, sleep_enabled=False)
    engine.prepare_for_generation()
    engine.finish_generation()
    engine.refit_from_model(model)
    assert [call[0] for call in llm.calls] == [
        "begin_worker_reload", "load_part", "finish_worker_reload", "reset_prefix_cache"
    ]


def test_a_refit_that_loses_tensors_is_an_error():
    model = build_tiny_model("student")
    llm = RecordingLLM(0)
    llm.collective_rpc = lambda method, args=(): [3]  # the worker saw 3 tensors
    engine = engine_with(llm, sleep_enabled=False)
    with pytest.raises(RuntimeError, match=re.escape("the engine took [3] tensors")):
        engine.refit_from_model(model)
