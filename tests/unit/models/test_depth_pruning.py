"""Depth pruning (:mod:`opd.models.depth_pruning`, ``opd prune``) against plain references.

* ``evenly_spaced_layers``: every (total, keep) pair up to 40 layers: first and last kept,
  the count exact, sorted and distinct, gaps differing by at most one.
* ``most_important_layers``: a layer stays when fewer than ``keep`` layers outrank it
  (a higher score, or an equal score and an earlier index), on random scores full of ties.
* ``block_importance``: a float64 reference that runs each calibration sequence alone
  (no padding at all) and reads every layer's input and output from the model's own
  ``hidden_states``, against the implementation on right-padded batches of unequal rows.
* ``prune_depth``: for Llama (tied and untied), Qwen2, Qwen3 and Gemma 3 (sliding and full
  attention mixed, a window shorter than the sequence), the pruned model's logits equal
  those of the original model run with only the kept layers in its ``layers`` list, bit
  for bit in float64 on right-padded batches; greedy ``generate`` with its KV cache equals
  greedy decoding without a cache.
* ``opd prune`` through :func:`opd.cli.main`: the written directory loads with plain
  transformers, the record says what was kept and why, and bad options end in exit
  status 2 with their cause named.

Models are tiny, random and built here from transformers' config classes; nothing is
downloaded.
"""

from __future__ import annotations

import copy
import itertools
import json
import random
import re
from pathlib import Path

import pytest
import torch
from opd_test_helpers import write_llama_gguf
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma3TextConfig,
    LlamaConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)

import opd.models.loading
from opd.cli import EXIT_USER_ERROR
from opd.cli import main as opd_main
from opd.models.depth_pruning import (
    PRUNING_RECORD,
    block_importance,
    evenly_spaced_layers,
    most_important_layers,
    prune_depth,
    pruned_config,
)
from opd.models.tiny import build_tiny_tokenizer, train_bpe_tokenizer
from opd.utils.errors import ConfigError

VOCAB = 97
SLIDING, FULL = "sliding_attention", "full_attention"
# Gemma 3's pattern (local layers, then a global one) on six layers. The kept layers
# [1, 2, 5] are (sliding, full, full); the first three entries would be (sliding, sliding,
# full), so a config that cut the list instead of selecting from it would show.
GEMMA_LAYER_TYPES = [SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL]
KEEP = [1, 2, 5]  # the first layer dropped, and indices past the pruned depth (a stale layer_idx fails)
WINDOW = 4  # Gemma's sliding window: shorter than the sequences, so sliding and full attention differ


def family_config(family: str, **overrides):
    """A six-layer config of ``family`` (or as ``overrides`` say): four heads of 8 dimensions, two KV heads."""
    shape: dict = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.2,  # peaked logits, so that a misplaced weight shows
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    shape.update(overrides)
    if family == "llama-tied":
        return LlamaConfig(**shape, tie_word_embeddings=True)
    if family == "llama-untied":
        return LlamaConfig(**shape, tie_word_embeddings=False)
    if family == "qwen2":
        return Qwen2Config(**shape, tie_word_embeddings=True)
    if family == "qwen3":
        return Qwen3Config(**shape, head_dim=8, tie_word_embeddings=False)
    assert family == "gemma3"
    return Gemma3TextConfig(
        **shape, head_dim=8, query_pre_attn_scalar=8, sliding_window=WINDOW, layer_types=GEMMA_LAYER_TYPES
    )


def build_model(config, seed: int = 0, dtype: torch.dtype = torch.float64) -> PreTrainedModel:
    """A random model built the way ``prune_depth`` builds its result (``from_config`` in ``dtype``).

    Built in its final dtype rather than converted afterwards: buffers made at init (Gemma's
    embedding scale) then hold the same values in both, so the logits can be compared bit for bit.
    """
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    with torch.no_grad():  # norms (and biases) away from their initial values, so that a norm copied wrongly shows
        for parameter in model.parameters():
            if parameter.ndim == 1:
                parameter.add_(0.1 * torch.randn_like(parameter))
    return model


@pytest.fixture(scope="module", params=["llama-tied", "llama-untied", "qwen2", "qwen3", "gemma3"])
def family_model(request) -> PreTrainedModel:
    return build_model(family_config(request.param))


def right_padded(lengths: list[int], seed: int, total: int = 12) -> dict[str, torch.Tensor]:
    """Random token ids (never the pad id 0) in rows of ``lengths`` real tokens, padded on the right."""
    ids = torch.randint(2, VOCAB, (len(lengths), total), generator=torch.Generator().manual_seed(seed))
    mask = (torch.arange(total)[None, :] < torch.tensor(lengths)[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask}


def logits_of(model: PreTrainedModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch, use_cache=False).logits


def with_only_layers(model: PreTrainedModel, keep: list[int], layer_types: list[str] | None = None) -> PreTrainedModel:
    """The reference: a copy of ``model`` whose ``layers`` list holds only the kept layers.

    The decoder chooses each layer's mask (and Gemma's rotary table) by
    ``config.layer_types[i]`` for the layer at position ``i``, so the copy's config lists
    the kept layers' own kinds (or ``layer_types`` when given, to show that a wrong list
    is seen). The layer modules themselves are the original ones.
    """
    reference = copy.deepcopy(model)
    reference.model.layers = torch.nn.ModuleList(reference.model.layers[index] for index in keep)
    reference.config.num_hidden_layers = len(keep)
    if getattr(model.config, "layer_types", None) is not None:
        reference.config.layer_types = layer_types or [model.config.layer_types[index] for index in keep]
    return reference


# --- which layers ----------------------------------------------------------------------------


def test_evenly_spaced_layers_for_every_depth_up_to_40():
    for total in range(1, 41):
        for keep in range(1, total + 1):
            chosen = evenly_spaced_layers(total, keep)
            assert len(chosen) == keep and chosen == sorted(set(chosen)), (total, keep, chosen)
            assert all(0 <= index < total for index in chosen)
            assert chosen[0] == 0
            if keep >= 2:
                assert chosen[-1] == total - 1, (total, keep, chosen)
                gaps = [after - before for before, after in itertools.pairwise(chosen)]
                assert max(gaps) - min(gaps) <= 1, (total, keep, chosen)  # evenly spaced, up to rounding
        assert evenly_spaced_layers(total, total) == list(range(total))
    assert evenly_spaced_layers(12, 4) == [0, 4, 7, 11]


@pytest.mark.parametrize("total, keep", [(4, 0), (4, 5), (4, -1), (0, 1)])
def test_a_layer_count_out_of_range_names_layers(total, keep):
    with pytest.raises(ConfigError, match="--layers"):
        evenly_spaced_layers(total, keep)
    with pytest.raises(ConfigError, match="--layers"):
        most_important_layers([0.5] * total, keep)


def test_most_important_layers_against_a_plain_ranking():
    assert most_important_layers([0.1, 0.5, 0.5, 0.2], 1) == [1]
    assert most_important_layers([0.1, 0.5, 0.5, 0.2], 3) == [1, 2, 3]
    assert most_important_layers([0.3, 0.3, 0.3], 2) == [0, 1]  # a tie: the earlier layers stay
    rng = random.Random(0)
    for _ in range(300):
        scores = [rng.choice([0.0, 0.1, 0.2, 0.3]) for _ in range(rng.randint(1, 12))]  # many ties
        for keep in range(1, len(scores) + 1):
            # Layer i stays when fewer than `keep` layers outrank it: a higher score, or the same and earlier.
            expected = [
                i
                for i, score in enumerate(scores)
                if sum(other > score or (other == score and j < i) for j, other in enumerate(scores)) < keep
            ]
            assert most_important_layers(scores, keep) == expected, (scores, keep)


# --- block importance ------------------------------------------------------------------------


def reference_importance(model: PreTrainedModel, sequences: list[torch.Tensor]) -> list[float]:
    """``1 − cos(x_in, x_out)`` of every layer, in float64, averaged over the tokens of ``sequences``.

    Each sequence runs alone (no padding to leave out). In transformers 5 ``hidden_states``
    is the embedding output, then each layer's output, except that the last entry is the
    final norm's output. With the final norm replaced by an identity, entries ``i`` and
    ``i + 1`` are exactly layer ``i``'s input and output, for every layer.
    """
    reference = copy.deepcopy(model)
    reference.model.norm = torch.nn.Identity()
    depth = reference.config.num_hidden_layers
    sums = [0.0] * depth
    tokens = 0
    for sequence in sequences:
        with torch.no_grad():
            states = reference(input_ids=sequence[None], use_cache=False, output_hidden_states=True).hidden_states
        assert len(states) == depth + 1
        for index in range(depth):
            before, after = states[index][0].double(), states[index + 1][0].double()
            cosine = (before * after).sum(-1) / (before.norm(dim=-1) * after.norm(dim=-1))
            sums[index] += float((1 - cosine).sum())
        tokens += len(sequence)
    return [total / tokens for total in sums]


@pytest.mark.parametrize("family", ["llama-untied", "gemma3"])
def test_block_importance_equals_a_float64_reference_without_padding(family):
    model = build_model(family_config(family))
    batches = [right_padded([12, 7, 3], seed=1), right_padded([5, 9], seed=2)]
    sequences = [
        row[: int(mask.sum())] for batch in batches for row, mask in zip(batch["input_ids"], batch["attention_mask"])
    ]
    importance = block_importance(model, batches)
    expected = reference_importance(model, sequences)
    # Both read float64 hidden states that differ only by rounding (a padded batch against
    # one row alone: same sums, other kernel shapes) and compute the cosine by different
    # formulas: a few units of 1e-16 on importances of 1e-2 to 1, so 1e-12 relative is wide.
    assert min(expected) > 1e-3
    torch.testing.assert_close(torch.tensor(importance), torch.tensor(expected), rtol=1e-12, atol=0)
    # The padding would have counted: the same batches with the pads taken as tokens differ.
    counted = block_importance(
        model, [{**batch, "attention_mask": torch.ones_like(batch["input_ids"])} for batch in batches]
    )
    assert max(abs(a - b) for a, b in zip(counted, expected)) > 1e-3


def test_calibration_without_tokens_is_refused():
    model = build_model(family_config("llama-tied"))
    batch = right_padded([3], seed=0)
    with pytest.raises(ConfigError, match="no tokens"):
        block_importance(model, [{**batch, "attention_mask": torch.zeros_like(batch["attention_mask"])}])


# --- the pruned model ------------------------------------------------------------------------


def test_pruned_logits_equal_the_original_with_only_the_kept_layers(family_model, tmp_path):
    model = family_model
    pruned = prune_depth(model, KEEP)
    assert pruned.dtype == torch.float64 and pruned.config.num_hidden_layers == len(KEEP)
    assert len(pruned.model.layers) == len(KEEP)
    assert [layer.self_attn.layer_idx for layer in pruned.model.layers] == list(range(len(KEEP)))
    types = getattr(model.config, "layer_types", None)
    if types is not None:
        assert pruned.config.layer_types == [types[index] for index in KEEP]
    tied = model.config.tie_word_embeddings
    assert (pruned.get_output_embeddings().weight is pruned.get_input_embeddings().weight) == tied
    assert torch.equal(pruned.get_output_embeddings().weight, model.get_output_embeddings().weight)

    batch = right_padded([12, 9, 5], seed=3)
    real = batch["attention_mask"].bool()
    got = logits_of(pruned, batch)
    # The same layer modules and weights, the same kernels on the same shapes in one process:
    # the same bits, so no tolerance.
    torch.testing.assert_close(got[real], logits_of(with_only_layers(model, KEEP), batch)[real], rtol=0, atol=0)
    if family_model.config.model_type == "gemma3_text":  # the comparison sees each layer's attention kind
        wrong = logits_of(with_only_layers(model, KEEP, layer_types=GEMMA_LAYER_TYPES[: len(KEEP)]), batch)
        assert (got[real] - wrong[real]).abs().max() > 1e-3

    # Written and read back with plain transformers (the per-layer config included), it is the same model.
    pruned.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    assert getattr(reloaded.config, "layer_types", None) == getattr(pruned.config, "layer_types", None)
    torch.testing.assert_close(logits_of(reloaded, batch)[real], got[real], rtol=0, atol=0)


def test_greedy_generation_with_the_kv_cache_equals_decoding_without_one(family_model):
    pruned = prune_depth(family_model, KEEP)
    pruned.generation_config.eos_token_id = None  # run the full length
    pruned.generation_config.pad_token_id = 0
    prompt = right_padded([7, 7], seed=4, total=7)["input_ids"]  # longer than Gemma's window, as is the decoding
    new_tokens = 9
    with torch.no_grad():
        generated = pruned.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens, do_sample=False
        )
        # Each layer writes its KV cache slot by its own layer_idx: a stale index (the
        # original 5 of 3 layers) or a shared one would give other tokens, or no run at all.
        expected = prompt
        for _ in range(new_tokens):
            following = pruned(input_ids=expected, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            expected = torch.cat([expected, following], dim=1)
    assert torch.equal(generated, expected)


def test_pruned_config_selects_per_layer_lists_only():
    config = LlamaConfig(num_hidden_layers=3, hidden_size=16, num_attention_heads=2, eos_token_id=[5, 6, 7])
    config.layer_types = [SLIDING, FULL, SLIDING]
    pruned = pruned_config(config, [0, 1])
    assert pruned.num_hidden_layers == 2 and pruned.layer_types == [SLIDING, FULL]
    # Three end tokens of a three-layer model are not one per layer.
    assert pruned.eos_token_id == [5, 6, 7]
    assert config.num_hidden_layers == 3 and config.layer_types == [SLIDING, FULL, SLIDING]  # not changed


@pytest.mark.parametrize("keep", [[], [0, 0], [0, 6], [-1, 2]])
def test_prune_depth_refuses_bad_layer_lists(keep):
    with pytest.raises(ConfigError, match="distinct indices below 6"):
        prune_depth(build_model(family_config("llama-tied")), keep)


# --- opd prune -------------------------------------------------------------------------------

CHATS = [
    [{"role": "user", "content": "What is 12 + 30?"}, {"role": "assistant", "content": "12 + 30 = 42."}],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}],
    [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "How many legs has a spider?"},
        {"role": "assistant", "content": "Eight legs; insects have six."},
    ],
    [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}],
    [{"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "1, 2, 3, 4, 5."}],
]
WEAK_LAYERS = (0, 2)  # their outputs scaled down: they change the residual stream least


@pytest.fixture(scope="module")
def source_dir(tmp_path_factory) -> Path:
    """A four-layer Qwen2 and the tiny ChatML tokenizer in a model directory (float32).

    Layers 0 and 2 add a hundredth of what they would: block importance drops them, so
    ``--method importance`` (keeping 1 and 3) and ``even`` (0 and 3) choose differently.
    """
    tokenizer = build_tiny_tokenizer()
    config = family_config(
        "qwen2",
        vocab_size=len(tokenizer),
        num_hidden_layers=4,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = build_model(config, dtype=torch.float32)
    with torch.no_grad():
        for index in WEAK_LAYERS:
            model.model.layers[index].self_attn.o_proj.weight.mul_(0.01)
            model.model.layers[index].mlp.down_proj.weight.mul_(0.01)
    directory = tmp_path_factory.mktemp("source") / "model"
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def calibration_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "calibration.jsonl"
    path.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in CHATS))
    return path


def prune(*arguments) -> int:
    return opd_main(["prune", *map(str, arguments)])


def load_source(source_dir: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(source_dir, dtype=torch.float32).eval()


def assert_is_pruned_source(output: Path, source: PreTrainedModel, keep: list[int]) -> None:
    """``output`` loads with plain transformers and computes what ``prune_depth(source, keep)`` does."""
    written = AutoModelForCausalLM.from_pretrained(output).eval()
    assert written.config.num_hidden_layers == len(keep)
    batch = right_padded([10, 6], seed=5, total=10)
    real = batch["attention_mask"].bool()
    # Both float32, the weights stored exactly: the same bits.
    torch.testing.assert_close(
        logits_of(written, batch)[real], logits_of(prune_depth(source, keep), batch)[real], rtol=0, atol=0
    )


def test_opd_prune_even_writes_a_plain_model_directory(source_dir, tmp_path, capsys):
    output = tmp_path / "student"
    assert prune(source_dir, output, "--layers", 2) == 0
    assert "2 of 4 layers (even): 0,3" in capsys.readouterr().out
    assert_is_pruned_source(output, load_source(source_dir), [0, 3])
    tokenizer = AutoTokenizer.from_pretrained(output)
    assert tokenizer.chat_template == build_tiny_tokenizer().chat_template
    assert tokenizer.apply_chat_template(CHATS[0], tokenize=False).startswith("<|im_start|>user\n")
    record = json.loads((output / PRUNING_RECORD).read_text())
    assert record["source"] == str(source_dir) and record["source_layers"] == 4
    assert record["kept_layers"] == [0, 3] and record["method"] == "even" and record["importance"] is None
    assert not list(tmp_path.glob(".tmp_*"))  # the staging directory became the output


def test_opd_prune_by_importance_keeps_the_layers_block_importance_ranks_first(source_dir, calibration_file, tmp_path):
    output = tmp_path / "student"
    code = prune(source_dir, output, "--layers", 2, "--method", "importance", "--calibration", calibration_file)
    assert code == 0
    record = json.loads((output / PRUNING_RECORD).read_text())
    # The reference: every chat rendered by its template and measured alone (no padding).
    source = load_source(source_dir)
    tokenizer = AutoTokenizer.from_pretrained(source_dir)
    batches = []
    for chat in CHATS:
        ids = tokenizer(
            tokenizer.apply_chat_template(chat, tokenize=False), add_special_tokens=False, return_tensors="pt"
        )
        batches.append({"input_ids": ids["input_ids"], "attention_mask": ids["attention_mask"]})
    expected = block_importance(source, batches)
    # float32 hidden states of padded batches against single rows: rounding of a few 1e-7
    # relative through four layers moves 1 − cos by well under 1e-5.
    torch.testing.assert_close(torch.tensor(record["importance"]), torch.tensor(expected), rtol=1e-4, atol=1e-5)
    assert record["kept_layers"] == most_important_layers(expected, 2) == [1, 3]
    assert record["method"] == "importance" and record["calibration"] == str(calibration_file)
    assert record["calibration_examples"] == len(CHATS)
    assert_is_pruned_source(output, source, [1, 3])


def test_opd_prune_keeps_the_given_layers(source_dir, tmp_path):
    output = tmp_path / "student"
    assert prune(source_dir, output, "--keep", "0,2") == 0
    record = json.loads((output / PRUNING_RECORD).read_text())
    assert record["kept_layers"] == [0, 2] and record["method"] == "given"
    assert_is_pruned_source(output, load_source(source_dir), [0, 2])


def test_opd_prune_a_gguf_file(tmp_path):
    tokenizer = train_bpe_tokenizer([f"<|im_start|>user\n{chat[0]['content']}<|im_end|>\n" for chat in CHATS] * 4, 320)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        rms_norm_eps=2.0**-17,  # GGUF stores it as float32: a value float32 holds exactly comes back unchanged
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.2,
    )
    model = build_model(config, dtype=torch.float32)
    gguf_file = write_llama_gguf(tmp_path / "model.gguf", model, tokenizer)
    output = tmp_path / "student"
    assert prune(gguf_file, output, "--layers", 3) == 0
    record = json.loads((output / PRUNING_RECORD).read_text())
    assert record["source"] == str(gguf_file) and record["kept_layers"] == [0, 2, 3]
    # F32 in the file holds every weight exactly (tests/unit/models/test_gguf_source.py), so
    # the student equals the original pruned directly, bit for bit.
    assert_is_pruned_source(output, model, [0, 2, 3])
    assert AutoTokenizer.from_pretrained(output).chat_template == tokenizer.chat_template


def test_opd_prune_a_base_model_without_a_chat_template(source_dir, tmp_path, capsys):
    """A base model's tokenizer may have no template: an even cut needs none, calibration chats do."""
    import shutil

    base = tmp_path / "base"
    shutil.copytree(source_dir, base)
    for name in ("chat_template.jinja",):
        (base / name).unlink(missing_ok=True)
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    assert AutoTokenizer.from_pretrained(base).chat_template is None
    assert prune(base, tmp_path / "even", "--layers", 2) == 0
    assert_is_pruned_source(tmp_path / "even", load_source(source_dir), [0, 3])
    calibration = tmp_path / "chats.jsonl"
    calibration.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in CHATS))
    assert prune(base, tmp_path / "importance", "--layers", 2, "--method", "importance", "--calibration", calibration) == 2
    assert "has no chat template" in capsys.readouterr().err


@pytest.fixture
def no_model_load(monkeypatch):
    """Fails the test if ``opd prune`` loads the model or its tokenizer."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the error was found")

    monkeypatch.setattr(opd.models.loading, "load_causal_lm", refuse)
    monkeypatch.setattr(opd.models.loading, "load_tokenizer", refuse)


@pytest.mark.parametrize(
    "options, cause",
    [
        (["--layers", "2", "--keep", "0,1"], "either --layers"),
        ([], "either --layers"),
        (["--keep", "1,x"], "--keep takes comma-separated layer indices, got '1,x'"),
        (["--layers", "2", "--method", "importance"], "--method importance .* --calibration"),
    ],
)
def test_bad_options_are_refused_before_the_model_loads(source_dir, tmp_path, capsys, no_model_load, options, cause):
    assert prune(source_dir, tmp_path / "student", *options) == EXIT_USER_ERROR
    assert re.search(cause, capsys.readouterr().err)
    assert not (tmp_path / "student").exists()


@pytest.mark.parametrize(
    "options, cause",
    [
        (["--layers", "0"], "--layers must be between 1 and the model's 4 layers, got 0"),
        (["--layers", "5"], "--layers must be between 1 and the model's 4 layers, got 5"),
        (["--keep", "0,0"], r"distinct indices below 4, got \[0, 0\]"),
        (["--keep", "0,4"], r"distinct indices below 4, got \[0, 4\]"),
    ],
)
def test_layer_choices_the_model_cannot_take_are_refused(source_dir, tmp_path, capsys, options, cause):
    assert prune(source_dir, tmp_path / "student", *options) == EXIT_USER_ERROR
    assert re.search(cause, capsys.readouterr().err)
    assert not (tmp_path / "student").exists() and not list(tmp_path.glob(".tmp_*"))


def test_a_malformed_calibration_line_is_named_before_the_model_loads(source_dir, tmp_path, capsys, no_model_load):
    data = tmp_path / "calibration.jsonl"
    data.write_text(json.dumps({"messages": CHATS[0]}) + "\n{not json\n")
    code = prune(source_dir, tmp_path / "student", "--layers", "2", "--method", "importance", "--calibration", data)
    assert code == EXIT_USER_ERROR
    error = capsys.readouterr().err
    assert str(data) in error and "line 2" in error


def test_an_existing_output_is_refused_before_the_model_loads(source_dir, tmp_path, capsys, no_model_load):
    output = tmp_path / "student"
    output.mkdir()
    (output / "mine.txt").write_text("keep me")
    assert prune(source_dir, output, "--layers", "2") == EXIT_USER_ERROR
    assert f"{output} exists already" in capsys.readouterr().err
    assert [path.name for path in output.iterdir()] == ["mine.txt"]


def test_opd_prune_writes_the_dtype_asked_for(source_dir, tmp_path):
    output = tmp_path / "student"
    assert prune(source_dir, output, "--keep", "3", "--dtype", "bfloat16") == 0
    written = AutoModelForCausalLM.from_pretrained(output, dtype="auto")
    source = load_source(source_dir)
    assert written.dtype == torch.bfloat16 and written.config.num_hidden_layers == 1
    # Rounding to bfloat16 is the only change: the kept layer is the source's layer 3.
    assert torch.equal(
        written.model.layers[0].mlp.down_proj.weight, source.model.layers[3].mlp.down_proj.weight.to(torch.bfloat16)
    )
