"""GGUF files as model sources (:mod:`opd.models.gguf_source` and its wiring), on tiny files written here.

Each file is a tiny random Llama and a byte-level BPE tokenizer trained on a few lines,
written with gguf's own writer as llama.cpp writes them (``write_llama_gguf`` in
``tests/opd_test_helpers.py``): llama.cpp's tensor names and q/k row order, the metadata
transformers reads, the tokenizer and its chat template. Nothing is downloaded, and the
real GGUF model some environments install is not used.

* F32 storage holds the weights bit for bit, so the loaded model's logits must equal the
  original's exactly (same weights, same config, same kernels in one process), from the
  file and from the directory holding it, and after ``save_pretrained`` or ``opd export``.
* Q8_0 storage: every loaded weight lies within Q8_0's own rounding bound of the original,
  and the logits equal those of the original model rebuilt from gguf's dequantisation of
  the same bytes.
* Files opd cannot use end in one ``ConfigError`` naming the file and the cause.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import gguf  # the test extra installs it (as opd[gguf] does): this file never skips
import numpy as np
import pytest
import torch
from opd_test_helpers import permute_for_llama_cpp, write_llama_gguf
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from opd.cli import main as opd_main
from opd.models.config import ModelLoadingConfig
from opd.models.gguf_source import check_gguf_source, gguf_source
from opd.models.loading import load_causal_lm, load_output_layer, load_tokenizer
from opd.models.model_shapes import model_config, tokenizer_size
from opd.models.tiny import train_bpe_tokenizer
from opd.utils.errors import ConfigError

CPU = torch.device("cpu")
Q8_0 = gguf.GGMLQuantizationType.Q8_0

# The tokenizer's training text, and what both tokenizers must encode alike: ChatML turns,
# special tokens inside the text, digits, runs of spaces and newlines, and non-ASCII bytes.
TEXTS = [
    "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n12 + 30 = 42.<|im_end|>\n",
    "The quick brown fox jumps over the lazy dog. Ünïcödé: 日本語, emoji 🙂.",
    "  leading spaces,\n\n\ttabs and 1234567 digits; it's done",
]
CHAT = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "What is 7 + 35? 日本語 🙂"},
    {"role": "assistant", "content": "7 + 35 = 42.\n\n  Done"},
]


@pytest.fixture(scope="module")
def original() -> tuple[LlamaForCausalLM, object]:
    """A tiny random Llama (tied embeddings, grouped-query attention) and its trained BPE tokenizer."""
    tokenizer = train_bpe_tokenizer(TEXTS * 4, vocab_size=320)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        # GGUF stores both as float32: values float32 holds exactly come back unchanged, so the
        # config (and the logits) can be compared exactly (1e-5 would return as 9.99999974e-06).
        rms_norm_eps=2.0**-17,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.2,  # peaked logits, so that a misplaced weight shows
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, so that a norm read wrongly (or offset) shows too
        for parameter in model.parameters():
            if parameter.ndim == 1:
                parameter.copy_(1 + 0.1 * torch.randn_like(parameter))
    return model, tokenizer


@pytest.fixture(scope="module")
def f32_file(original, tmp_path_factory) -> Path:
    """The model in F32, alone in its directory (so that the directory is a GGUF source too)."""
    model, tokenizer = original
    return write_llama_gguf(tmp_path_factory.mktemp("f32") / "model.gguf", model, tokenizer)


@pytest.fixture(scope="module")
def q8_file(original, tmp_path_factory) -> Path:
    """The model with every 2-D weight in Q8_0 (norms stay F32, as llama.cpp keeps them)."""
    model, tokenizer = original
    return write_llama_gguf(tmp_path_factory.mktemp("q8") / "model.gguf", model, tokenizer, tensor_type=Q8_0)


@pytest.fixture(scope="module")
def input_ids(original) -> torch.Tensor:
    vocab_size = original[0].config.vocab_size
    return torch.randint(0, vocab_size, (2, 19), generator=torch.Generator().manual_seed(1))


def logits_of(model, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def test_the_file_holds_llama_cpps_names_and_q_k_row_order(original, f32_file):
    """What the round trip below reverses: the names and the q/k permutation are llama.cpp's."""
    model, _ = original
    reader = gguf.GGUFReader(str(f32_file))
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    assert {"token_embd.weight", "blk.1.attn_q.weight", "blk.1.ffn_down.weight", "output_norm.weight"} <= set(tensors)
    assert "output.weight" not in tensors  # tied embeddings: llama.cpp writes no separate head
    assert reader.fields["general.architecture"].contents() == "llama"
    stored = np.asarray(tensors["blk.0.attn_k.weight"].data)
    hf_layout = model.model.layers[0].self_attn.k_proj.weight.detach().numpy()
    assert not np.array_equal(stored, hf_layout)
    assert np.array_equal(stored, permute_for_llama_cpp(hf_layout, model.config.num_key_value_heads))


@pytest.mark.parametrize(
    ("as_directory", "dtype"), [(False, torch.float32), (True, torch.float64)], ids=["file-fp32", "directory-fp64"]
)
def test_f32_round_trip_gives_the_same_logits(original, f32_file, input_ids, as_directory, dtype):
    model, _ = original
    path = str(f32_file.parent if as_directory else f32_file)
    loaded = load_causal_lm(path, dtype, CPU, ModelLoadingConfig())
    assert type(loaded) is LlamaForCausalLM
    assert not hasattr(loaded.config, "quantization_config")  # a plain model, not GGUF-quantised
    for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads"):
        assert getattr(loaded.config, key) == getattr(model.config, key), key
    assert loaded.config.num_key_value_heads == model.config.num_key_value_heads
    assert loaded.config.rms_norm_eps == model.config.rms_norm_eps
    assert loaded.config.rope_parameters["rope_theta"] == model.config.rope_parameters["rope_theta"]
    assert loaded.config.tie_word_embeddings
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert all(parameter.dtype == dtype for parameter in loaded.parameters())
    # F32 storage keeps every weight bit for bit, and the model computes in one process with
    # the same kernels: the logits are equal, not merely close.
    reference = model if dtype == torch.float32 else LlamaForCausalLM(model.config).to(dtype).eval()
    if reference is not model:
        reference.load_state_dict(model.state_dict())
    assert torch.equal(logits_of(loaded, input_ids), logits_of(reference, input_ids))


def test_the_tokenizer_and_chat_template_come_back(original, f32_file):
    _, tokenizer = original
    for path in (str(f32_file), str(f32_file.parent)):
        loaded = load_tokenizer(path)
        assert len(loaded) == len(tokenizer)
        assert loaded.chat_template == tokenizer.chat_template
        assert (loaded.eos_token, loaded.eos_token_id) == (tokenizer.eos_token, tokenizer.eos_token_id)
        assert loaded.pad_token_id == tokenizer.pad_token_id
        for text in TEXTS:
            assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"], text
        for prompt in (True, False):
            assert loaded.apply_chat_template(CHAT, add_generation_prompt=prompt, tokenize=True) == (
                tokenizer.apply_chat_template(CHAT, add_generation_prompt=prompt, tokenize=True)
            )


def test_the_loaded_model_saves_as_a_plain_directory(original, f32_file, input_ids, tmp_path):
    model, _ = original
    load_causal_lm(str(f32_file), torch.float32, CPU, ModelLoadingConfig()).save_pretrained(str(tmp_path))
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    assert (tmp_path / "model.safetensors").is_file()
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert torch.equal(logits_of(reloaded, input_ids), logits_of(model, input_ids))


def test_the_output_layer_of_a_gguf_teacher_is_its_tied_embedding(original, f32_file):
    model, _ = original
    layer = load_output_layer(str(f32_file), torch.float32, CPU)
    assert torch.equal(layer.weight, model.model.embed_tokens.weight)
    assert layer.bias is None


def q8_0_bound(weights: torch.Tensor) -> torch.Tensor:
    """The largest error Q8_0 can make on each element of ``weights`` (rows of blocks of 32).

    Q8_0 stores a block as d = max|x| / 127, rounded to float16 (d16), and q = round(x / d)
    in [-127, 127]; it reads back q · d16. So |x - q·d16| ≤ |x - q·d| + |q|·|d - d16|
    ≤ d/2 + 127·|d - d16|, plus the float32 rounding of x · (1/d) before it is rounded to
    an integer (a few units of 2^-24 relative, times |q| ≤ 127: under 127 · 2^-22 · d).
    q · d16 itself is exact in float32 (8 by 11 significant bits).
    """
    blocks = weights.double().reshape(weights.shape[0], -1, 32)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    d16 = d.to(torch.float16).double()
    bound = d * (0.5 + 127 * 2.0**-22) + 127 * (d - d16).abs()
    return bound.expand_as(blocks).reshape(weights.shape)


def test_q8_0_weights_are_dequantised_within_q8_0s_error(original, q8_file, input_ids):
    model, _ = original
    loaded = load_causal_lm(str(q8_file), torch.float32, CPU, ModelLoadingConfig())
    reference = LlamaForCausalLM(model.config).eval()
    rebuilt = {}
    for name, weights in model.state_dict().items():
        if weights.ndim != 2:
            rebuilt[name] = weights  # norms are stored in F32
            continue
        # The permutation of q and k moves whole rows and a Q8_0 block lies within a row, so
        # quantising the permuted rows and un-permuting equals quantising the rows as they are.
        rebuilt[name] = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(weights.numpy(), Q8_0), Q8_0))
        error = (loaded.state_dict()[name].double() - weights.double()).abs()
        assert bool((error <= q8_0_bound(weights)).all()), name
        assert error.max() > 0, f"{name} was not quantised"
    reference.load_state_dict(rebuilt)
    # The same dequantised values in the same model: equal logits.
    assert torch.equal(logits_of(loaded, input_ids), logits_of(reference, input_ids))
    assert not torch.equal(logits_of(loaded, input_ids), logits_of(model, input_ids))


def test_opd_export_writes_a_plain_model_directory(original, f32_file, input_ids, tmp_path, capsys):
    model, tokenizer = original
    output = tmp_path / "exported"
    assert opd_main(["export", str(f32_file), str(output)]) == 0
    assert not any(path.suffix == ".gguf" for path in output.iterdir())
    exported = AutoModelForCausalLM.from_pretrained(str(output)).eval()  # plain transformers, no gguf_file
    assert exported.dtype == torch.float32
    assert torch.equal(logits_of(exported, input_ids), logits_of(model, input_ids))
    exported_tokenizer = AutoTokenizer.from_pretrained(str(output))
    assert exported_tokenizer.chat_template == tokenizer.chat_template
    assert exported_tokenizer.eos_token == tokenizer.eos_token
    assert exported_tokenizer.apply_chat_template(CHAT, tokenize=True) == tokenizer.apply_chat_template(
        CHAT, tokenize=True
    )

    capsys.readouterr()
    assert opd_main(["export", str(f32_file), str(output)]) == 2
    assert "exists already" in capsys.readouterr().err

    # --dtype: the dequantised weights written in bfloat16, each the original's rounding.
    assert opd_main(["export", str(f32_file.parent), str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    halved = AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"), dtype="auto")
    assert halved.dtype == torch.bfloat16
    for name, weights in model.state_dict().items():
        assert torch.equal(halved.state_dict()[name], weights.to(torch.bfloat16)), name


def test_model_shapes_read_the_config_and_tokenizer_from_the_file(original, f32_file):
    model, tokenizer = original
    for path in (str(f32_file), str(f32_file.parent)):
        config = model_config(path)
        assert (config.num_hidden_layers, config.hidden_size) == (2, 64)
        assert config.vocab_size == model.config.vocab_size
        assert not hasattr(config, "quantization_config")
        assert tokenizer_size(path) == len(tokenizer)


# --- files opd cannot use: one ConfigError naming the file and the cause -------------------------


def refusal(path: Path) -> str:
    with pytest.raises(ConfigError) as caught:
        load_causal_lm(str(path), torch.float32, CPU, ModelLoadingConfig())
    message = str(caught.value)
    assert str(path) in message
    return message


def test_a_file_named_gguf_that_is_not_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 a zip archive, renamed")
    assert "named .gguf but is not a GGUF file" in refusal(path)
    with pytest.raises(ConfigError, match=r"named \.gguf but is not a GGUF file"):
        load_tokenizer(str(path))


def test_a_file_that_is_not_a_model(tmp_path, capsys):
    path = tmp_path / "pytorch_model.bin"
    path.write_bytes(b"\x80\x02 a pickle")
    assert "is a file, not a model" in refusal(path)
    capsys.readouterr()
    assert opd_main(["export", str(path), str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert str(path) in error and "is a file, not a model" in error
    assert not (tmp_path / "out").exists()


def test_a_directory_with_two_gguf_files(original, f32_file, tmp_path):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(f32_file.read_bytes())
    with pytest.raises(ConfigError) as caught:
        load_causal_lm(str(tmp_path), torch.float32, CPU, ModelLoadingConfig())
    message = str(caught.value)
    assert str(tmp_path) in message and "several GGUF files (a.gguf, b.gguf)" in message


def test_an_architecture_transformers_cannot_read(original, tmp_path, capsys):
    model, tokenizer = original
    path = write_llama_gguf(tmp_path / "encoder.gguf", model, tokenizer, architecture="bert")
    assert "holds a 'bert' model" in refusal(path)
    capsys.readouterr()
    assert opd_main(["export", str(path), str(tmp_path / "out")]) == 2
    assert "holds a 'bert' model" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("architecture", ["qwen3moe", "qwen2moe", "gpt-oss", "qwen35"])
def test_architectures_llama_cpp_spells_its_own_way_are_accepted(tmp_path, architecture):
    """llama.cpp writes ``qwen3moe`` where transformers says ``qwen3_moe`` (and renames it on reading)."""
    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert check_gguf_source(gguf_source(str(path))) == architecture


def a_type_gguf_cannot_dequantise(row_width: int):
    """A quantisation type gguf knows the block layout of but cannot dequantise (Q8_1 in gguf 0.19)."""
    plain = {"F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64"}
    for qtype in gguf.GGMLQuantizationType:
        sizes = gguf.GGML_QUANT_SIZES.get(qtype)
        if qtype.name not in plain and qtype not in gguf.quants._type_traits and sizes and row_width % sizes[0] == 0:
            return qtype
    pytest.skip("the installed gguf dequantises every quantisation type it knows")


def test_a_tensor_in_a_type_gguf_cannot_dequantise(original, tmp_path):
    model, tokenizer = original
    qtype = a_type_gguf_cannot_dequantise(model.config.intermediate_size)
    path = write_llama_gguf(tmp_path / "model.gguf", model, tokenizer, tensor_types={"blk.1.ffn_down.weight": qtype})
    message = refusal(path)
    assert f"stores tensor 'blk.1.ffn_down.weight' as {qtype.name}" in message
    assert "cannot dequantise" in message


@pytest.mark.parametrize("package", ["gguf", "accelerate"])
def test_the_missing_extra_says_how_to_install_it(f32_file, monkeypatch, package):
    monkeypatch.setitem(sys.modules, package, None)  # `import gguf` now fails as if it were not installed
    message = refusal(f32_file)
    assert f"needs the {package} package" in message and "pip install 'opd[gguf]'" in message
    with pytest.raises(ConfigError, match=r"pip install 'opd\[gguf\]'"):
        model_config(str(f32_file))


def test_a_tokenizer_without_a_chat_template_needs_the_runs_template(tmp_path):
    """A base model's tokenizer (Gemma 3 270M's GGUF has none) is refused alone, and usable with data.chat_template."""
    from opd.data.config import DataConfig
    from opd.run.run_setup import load_run_tokenizer

    tokenizer = train_bpe_tokenizer(["hello there", "general kenobi"] * 8, vocab_size=300)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="has no chat template; set data.chat_template"):
        load_tokenizer(str(tmp_path))
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    data = DataConfig(train_path="unused.jsonl", chat_template=template)
    loaded = load_run_tokenizer(str(tmp_path), False, data)
    messages = [{"role": "user", "content": "hello"}]
    assert loaded.apply_chat_template(messages, tokenize=False) == "<user>hello"
