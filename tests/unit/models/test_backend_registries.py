"""The registries that replace string dispatch: teacher backends, wire protocols, signal codecs, decoding methods.

Each registry must cover exactly the values its config key accepts, and the code that
used to compare strings must go through it: a backend, codec or method substituted in the
registry changes what the validator, the wire or the samplers do.
"""

from __future__ import annotations

import typing

import pytest
import torch
from opd_test_helpers import REPO_ROOT

from opd.distillation.config import MasterConfig
from opd.distillation.setup import setup
from opd.distributed.config import TeacherPoolConfig
from opd.distributed.pool_engines import POOL_ENGINES
from opd.models.decoding import DECODING_METHODS, DecodingMethod, GenerateStrategyConfig, SamplingFilter
from opd.models.interfaces import FullVocabRequest, TokenLogprobsRequest, TopKRequest
from opd.rollout.engines import ENGINES, GenerationConfig
from opd.rollout.hf_generation import sampling_kwargs
from opd.rollout.sampling import next_tokens, warp_logits
from opd.rollout.vllm_generation import sampling_params_kwargs
from opd.teachers import backends
from opd.teachers.backends import TEACHER_BACKENDS, LocalBackend, RemoteTeacherConfig, TeacherSourceConfig
from opd.teachers.config import TeacherConfig, TeacherMemberConfig
from opd.teachers.local_teacher import LocalTeacher
from opd.teachers.served import wire
from opd.teachers.served.remote_teacher import PROTOCOLS, RemoteTeacher, protocol_refusal
from opd.utils.config import load_config
from opd.utils.errors import ConfigError

TINY_CONFIG = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
TRAIN_DATA = REPO_ROOT / "examples" / "data" / "tiny_arithmetic" / "train.jsonl"


def _choices(model: type, field: str) -> set[str]:
    return set(typing.get_args(model.model_fields[field].annotation))


def test_every_registry_covers_exactly_the_values_its_key_accepts():
    for model in (TeacherSourceConfig, TeacherConfig, TeacherMemberConfig):
        assert _choices(model, "backend") == set(TEACHER_BACKENDS)
    assert _choices(RemoteTeacherConfig, "protocol") == set(PROTOCOLS) | {"auto"}
    assert _choices(GenerateStrategyConfig, "decoding_method") == set(DECODING_METHODS)
    assert _choices(GenerationConfig, "backend") == set(ENGINES)
    assert _choices(TeacherPoolConfig, "engine") == set(POOL_ENGINES)
    assert set(typing.get_args(wire.Signal)) == set(wire.CODECS) == set(wire.SIGNALS)


class _RecordingLoader:
    """A TeacherLoader that records what it was asked for instead of loading or connecting."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def load(self, path):
        self.calls.append(("load", path))
        return torch.nn.Linear(2, 2)

    def connect(self, remote, model_path):
        self.calls.append(("connect", remote.url, model_path))
        return "client"


def test_a_teacher_config_builds_its_teacher_through_its_backend():
    loader = _RecordingLoader()
    local = TeacherConfig().build(loader, "tiny:teacher")
    assert isinstance(local, LocalTeacher) and backends.model_in_process(local) is local.model
    served = TeacherMemberConfig(name="m", backend="remote", remote={"url": "http://x"})
    assert served.build(loader, "tiny:teacher") == "client"
    assert loader.calls == [("load", "tiny:teacher"), ("connect", "http://x", "tiny:teacher")]
    assert served.served and not TeacherConfig().served
    assert backends.model_in_process(None) is None


def _tiny(overrides, tmp_path):
    common = [f"output_dir={tmp_path}", f"data.train_path={TRAIN_DATA}"]
    return load_config(MasterConfig, TINY_CONFIG, [*common, *overrides])


def test_the_validator_asks_the_backend_what_it_cannot_serve(tmp_path, monkeypatch):
    _tiny([], tmp_path)  # accepted with the real local backend

    class Refusing(LocalBackend):
        def unsupported_reason(self, request):
            return "this backend sends no signal at all"

    monkeypatch.setitem(TEACHER_BACKENDS, "local", Refusing())
    with pytest.raises(ConfigError, match=r"teacher.backend = local cannot serve loss_fn.type = .*sends no signal"):
        _tiny([], tmp_path)


def test_the_validator_asks_the_backend_what_its_settings_lack(tmp_path, monkeypatch):
    class NeedsSomething(LocalBackend):
        def problem(self, source, model_path, key):
            return f"{key}.backend = local needs something (model {model_path})"

    monkeypatch.setitem(TEACHER_BACKENDS, "local", NeedsSomething())
    with pytest.raises(ConfigError, match=r"teacher.backend = local needs something \(model tiny:teacher\)"):
        _tiny([], tmp_path)


def test_setup_builds_the_teacher_through_its_backend(tmp_path, monkeypatch):
    built = []

    class Recording(LocalBackend):
        def build(self, loader, source, model_path):
            built.append(model_path)
            return super().build(loader, source, model_path)

    monkeypatch.setitem(TEACHER_BACKENDS, "local", Recording())
    parts = setup(_tiny(["data.val_path=null"], tmp_path))
    try:
        assert built == ["tiny:teacher"]
        assert isinstance(parts.teacher_policy, LocalTeacher)
    finally:
        parts.close()


def test_each_wire_protocol_states_its_own_limit():
    assert "vLLM's JSON does not carry" in protocol_refusal("openai", FullVocabRequest())
    assert protocol_refusal("opd", FullVocabRequest()) is None
    assert protocol_refusal("auto", FullVocabRequest()) is None  # auto takes opd's where the server offers it
    for request in (TopKRequest(k=4), TokenLogprobsRequest()):
        assert protocol_refusal("openai", request) is None
    # Before connecting, a client speaks the configured protocol (auto: the one every server speaks).
    for setting, expected in (("opd", "opd"), ("openai", "openai"), ("auto", "openai")):
        client = RemoteTeacher("http://127.0.0.1:1", protocol=setting)
        try:
            assert client.protocol == expected
        finally:
            client.close()


class _EntropyCodec(wire.SignalCodec):
    """A signal that is not opd's: the entropy of each position, to show a new codec is one class."""

    name = "entropy"  # type: ignore[assignment]

    def expected(self, rows, k, hidden):
        return {"entropy": ((rows,), torch.float32)}

    def check_values(self, tensors, vocab_size):
        if bool((tensors["entropy"] < 0).any()):
            raise wire.WireError("a negative entropy")

    def answerer(self, scorer, body, sequences, first_positions, read_k):
        return lambda rows: {"entropy": rows.float().abs().sum(dim=-1)}


def test_a_signal_codec_in_the_registry_is_encoded_checked_and_decoded(monkeypatch):
    monkeypatch.setitem(wire.CODECS, "entropy", _EntropyCodec())
    sequences, firsts = [[1, 2, 3], [4, 5]], [0, 1]
    rows = torch.randn(wire.scored_rows([3, 2], firsts), 4)
    values = wire.CODECS["entropy"].answerer(None, {}, sequences, firsts, int)(rows)
    body = wire.build_answer(sequences, firsts, "entropy", values)
    decoded = wire.decode(body, sequences, firsts, "entropy")  # type: ignore[arg-type]
    assert torch.equal(decoded["entropy"], rows.abs().sum(dim=-1))
    bad = wire.build_answer(sequences, firsts, "entropy", {"entropy": -values["entropy"]})
    with pytest.raises(wire.WireError, match="a negative entropy"):
        wire.decode(bad, sequences, firsts, "entropy")  # type: ignore[arg-type]


STRATEGIES = {
    "greedy": GenerateStrategyConfig(decoding_method="greedy", temperature=0.7),
    "top_k": GenerateStrategyConfig(decoding_method="top_k", top_k=3, temperature=0.7),
    "top_p": GenerateStrategyConfig(decoding_method="top_p", top_p=0.6, temperature=0.7),
}


def test_the_engines_get_the_same_sampling_settings_as_before():
    # The mappings the string comparisons made, written out: the registry must not change them.
    common_hf = {"repetition_penalty": 1.0, "num_beams": 1}
    assert sampling_kwargs(STRATEGIES["greedy"]) == {
        **common_hf, "do_sample": False, "temperature": None, "top_k": None, "top_p": None}
    assert sampling_kwargs(STRATEGIES["top_k"]) == {
        **common_hf, "do_sample": True, "temperature": 0.7, "top_k": 3, "top_p": 1.0}
    assert sampling_kwargs(STRATEGIES["top_p"]) == {
        **common_hf, "do_sample": True, "temperature": 0.7, "top_k": 0, "top_p": 0.6}
    vllm = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0}
    assert sampling_params_kwargs(STRATEGIES["greedy"]) == {**vllm, "temperature": 0.0, "top_k": -1, "top_p": 1.0}
    assert sampling_params_kwargs(STRATEGIES["top_k"]) == {**vllm, "temperature": 0.7, "top_k": 3, "top_p": 1.0}
    assert sampling_params_kwargs(STRATEGIES["top_p"]) == {**vllm, "temperature": 0.7, "top_k": -1, "top_p": 0.6}
    assert [name for name, strategy in STRATEGIES.items() if strategy.is_greedy] == ["greedy"]


def test_a_method_says_what_it_cuts_and_each_engine_spells_it():
    filters = {name: strategy.sampling_filter for name, strategy in STRATEGIES.items()}
    assert filters == {"greedy": SamplingFilter(), "top_k": SamplingFilter(top_k=3), "top_p": SamplingFilter(top_p=0.6)}
    assert [name for name, kept in filters.items() if kept.leaves_out_tokens] == ["top_k", "top_p"]
    assert [kept.describe() for kept in filters.values()] == ["every token kept", "top_k = 3", "top_p = 0.6"]
    assert not GenerateStrategyConfig(decoding_method="top_p", top_p=1.0).sampling_filter.leaves_out_tokens


def test_the_sampler_filters_with_the_method_the_registry_holds(monkeypatch):
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0]])

    class OnlyTheFirst(DecodingMethod):
        name = "top_k"

        def keep(self, logits, strategy):
            return torch.full_like(logits, float("-inf")).index_fill(-1, torch.tensor([0]), 0.0)

        def filter(self, strategy):
            return SamplingFilter()

    assert set(torch.isfinite(warp_logits(logits, STRATEGIES["top_k"]))[0].nonzero().flatten().tolist()) == {2, 3, 4}
    monkeypatch.setitem(DECODING_METHODS, "top_k", OnlyTheFirst())
    assert next_tokens(logits, STRATEGIES["top_k"], return_logprobs=False)[0].tolist() == [0]


def test_a_pool_engine_states_its_own_limits_and_placement():
    hf = TeacherPoolConfig(placement="pool", workers=4, shards_per_replica=2)
    assert hf.pool_engine.name == "hf" and hf.devices_per_worker == 1
    assert hf.engine_problem(FullVocabRequest(), colocated=True) is None
    assert hf.pool_engine.planned_placement(hf).dry_run_shards == 2
    vllm = TeacherPoolConfig(placement="pool", engine="vllm", vllm={"tensor_parallel_size": 2, "max_logprobs": 8})
    assert vllm.devices_per_worker == 2
    assert vllm.pool_engine.planned_placement(vllm).dry_run_shards is None  # vLLM sizes its own memory
    assert "set cluster.placement = split" in vllm.engine_problem(TokenLogprobsRequest(), colocated=True)
    assert "raise max_logprobs" in vllm.engine_problem(TopKRequest(16), colocated=False)
    assert "not the final hidden states" in vllm.engine_problem(FullVocabRequest(), colocated=False)
    assert vllm.engine_problem(TopKRequest(8), colocated=False) is None
    sharded = TeacherPoolConfig(placement="pool", engine="vllm", workers=2, shards_per_replica=2)
    assert "not FSDP2 shards" in sharded.engine_problem(None, colocated=False)
    assert "placement = pool" in TeacherPoolConfig(engine="vllm").engine_problem(None, colocated=False)
    # Colocated in the trainer workers, the teacher is HF's whatever the pool engine: no pool, no devices of its own.
    assert TeacherPoolConfig(engine="vllm", vllm={"tensor_parallel_size": 2}).devices_per_worker == 1
