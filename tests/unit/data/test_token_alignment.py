"""Tokenizer-level checks of cross-tokenizer alignment (opd/data/token_alignment.py), on tokenizers built here.

Three byte-level BPE tokenizers are trained in this file on different text, so they cut
the same string differently: a Qwen-style student (Qwen's split regex, 300 tokens), a
GPT-2-style teacher (GPT-2's split regex, 600 tokens), both with ChatML special tokens,
and a Llama-3-style teacher with the same merges as the GPT-2 one but other special
tokens (no ``<|im_end|>``). The byte tokenizer of the tiny models (every byte one token)
is a fourth student that can cut a response anywhere, even inside a character.

Checked, each against something computed independently of the module: token bytes
round-trip any UTF-8 text; the shared vocabulary pairs equal bytes only, special with
special only, and misses nothing; groups equal a brute-force cut at common byte
boundaries (random byte strings cut at random, zero-byte tokens included, and random
texts with multi-byte characters, whitespace runs and special tokens at the edges);
identical tokenizers align one to one onto themselves; a response cut inside a
character, one ending in ``<|im_end|>`` (with and without a teacher that has it), an
empty one; two different byte strings name the offset where they part.
"""

from __future__ import annotations

import functools
import itertools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from opd.data.token_alignment import (
    AlignedGroup,
    align_tokens,
    pool_logits_by_class,
    prefix_classes,
    shared_vocabulary,
    special_counterparts,
    teacher_tokens_for_response,
    token_bytes,
)
from opd.models.tiny import SPECIAL_TOKENS, build_tiny_tokenizer, train_bpe_tokenizer

# Bounded and reproducible: the same examples on every run, and no .hypothesis folder in the checkout.
BOUNDED = settings(max_examples=80, deadline=None, derandomize=True, database=None)

IM_END = "<|im_end|>"
IM_START = "<|im_start|>"
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]

# Pieces of response text: words each tokenizer was trained on, characters of 2, 3 and 4
# UTF-8 bytes, whitespace runs, digits and punctuation.
TEXT_PIECES = [
    *("ka", "tori", "nesu", "mo", "the", "quick", "brown", "an"),
    *("é", "ü", "naïve", "café", "中", "文", "中文", "字", "🙂", "🙃", "à"),
    *(" ", "  ", "   ", "\n", "\n\n", "\t", " \n ", "\r\n"),
    *("0", "7", "123", "2048", "+", "=", ".", ",", "!", "x*y"),
]
SPECIAL_PIECES = [IM_START, IM_END, "<|endoftext|>"]


def _corpus(seed: int, syllables: list[str], extra: list[str]) -> list[str]:
    """Deterministic pseudo-sentences from made-up words: enough distinct pairs to fill the vocabulary."""
    rng = random.Random(seed)
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(300)]
    return [
        " ".join(rng.choice(words + extra) for _ in range(12)) + rng.choice([".", "!\n", ",\t", "  "])
        for _ in range(2000)
    ]


def _train_gpt2_style(texts: list[str], vocab_size: int, special_tokens: list[str]) -> PreTrainedTokenizerFast:
    """Byte-level BPE with GPT-2's own split regex (digits in runs, unlike Qwen's single digits)."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=special_tokens[-1], name_or_path="gpt2-style")


@functools.cache
def student() -> PreTrainedTokenizerFast:
    texts = _corpus(0, ["ka", "to", "ri", "ne", "su", "mo", "é", "ü", "中", "文"], ["123", "4+5=9", "🙂", "café"])
    return train_bpe_tokenizer(texts, vocab_size=300)


def _teacher_corpus() -> list[str]:
    syllables = ["th", "e", "an", "qu", "ick", "br", "ow", "n", "字", "🙃", "à"]
    return _corpus(1, syllables, ["2048", "x*y", "中文", "naïve"])


@functools.cache
def teacher() -> PreTrainedTokenizerFast:
    return _train_gpt2_style(_teacher_corpus(), 600, SPECIAL_TOKENS)


@functools.cache
def llama_teacher() -> PreTrainedTokenizerFast:
    """The teacher's merges with Llama 3's special tokens: it has no ``<|im_end|>``."""
    return _train_gpt2_style(_teacher_corpus(), 600, LLAMA_SPECIALS)


@functools.cache
def byte_student() -> PreTrainedTokenizerFast:
    return build_tiny_tokenizer()


@functools.cache
def pieces_of(name: str) -> list[bytes]:
    return token_bytes(TOKENIZERS[name]())


TOKENIZERS = {"student": student, "teacher": teacher, "llama_teacher": llama_teacher, "byte_student": byte_student}


def encode(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids


texts = st.lists(st.sampled_from(TEXT_PIECES), max_size=16).map("".join)
texts_with_specials = st.lists(st.sampled_from(TEXT_PIECES + SPECIAL_PIECES), max_size=16).map("".join)
# Any Unicode text at all (no surrogates: they are not encodable), to check nothing relies on the pieces above.
any_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=24)


# ---------------------------------------------------------------------------------------------------------------------
# A reference that knows nothing of the module: cut the byte string offset by offset.


def reference_groups(student_pieces: list[bytes], teacher_pieces: list[bytes]) -> list[AlignedGroup]:
    """Brute force: a group ends at every byte offset where both tokenizations end a token.

    A token belongs to the first group that ends at or after its own end, so a zero-byte
    token joins the group that ends where it sits (the one before it when that offset is
    a common boundary). A token with no such group (zero-byte tokens facing no tokens at
    all) is in no group.
    """

    def ends(pieces: list[bytes]) -> list[int]:
        return [len(b"".join(pieces[: index + 1])) for index in range(len(pieces))]

    student_ends, teacher_ends = ends(student_pieces), ends(teacher_pieces)
    total = len(b"".join(student_pieces))
    common = [offset for offset in range(total + 1) if offset in student_ends and offset in teacher_ends]

    def group_of(end: int) -> int | None:
        return next((number for number, boundary in enumerate(common) if boundary >= end), None)

    groups = []
    for number in range(len(common)):
        student_members = [index for index, end in enumerate(student_ends) if group_of(end) == number]
        teacher_members = [index for index, end in enumerate(teacher_ends) if group_of(end) == number]
        groups.append(
            AlignedGroup(student_members[0], student_members[-1] + 1, teacher_members[0], teacher_members[-1] + 1)
        )
    return groups


def check_groups(student_pieces: list[bytes], teacher_pieces: list[bytes], groups: list[AlignedGroup]) -> None:
    """Groups are contiguous, in order, and cover the same bytes on both sides."""
    previous_student = previous_teacher = 0
    for group in groups:
        assert (group.student_start, group.teacher_start) == (previous_student, previous_teacher)
        assert group.student_end > group.student_start and group.teacher_end > group.teacher_start
        student_bytes = b"".join(student_pieces[group.student_start : group.student_end])
        assert student_bytes == b"".join(teacher_pieces[group.teacher_start : group.teacher_end])
        previous_student, previous_teacher = group.student_end, group.teacher_end


# ---------------------------------------------------------------------------------------------------------------------
# token_bytes


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@BOUNDED
@given(text=st.one_of(texts_with_specials, any_text))
def test_token_bytes_round_trip_any_text(name, text):
    tokenizer, pieces = TOKENIZERS[name](), pieces_of(name)
    assert len(pieces) == len(tokenizer)
    assert b"".join(pieces[index] for index in encode(tokenizer, text)) == text.encode("utf-8")


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_special_tokens_are_their_literal_content(name):
    tokenizer, pieces = TOKENIZERS[name](), pieces_of(name)
    specials = LLAMA_SPECIALS if name == "llama_teacher" else SPECIAL_TOKENS
    for content in specials:
        assert pieces[tokenizer.convert_tokens_to_ids(content)] == content.encode("utf-8")
    # A byte-level token is not its printable spelling: "Ġ" is one space byte, not the two bytes of U+0120.
    assert pieces[tokenizer.convert_tokens_to_ids("Ġ")] == b" "


def _sentencepiece_style() -> PreTrainedTokenizerFast:
    """A Llama-2-style tokenizer: ``▁`` for a space, ``<0xNN>`` byte tokens for what is not in the vocabulary."""
    vocab = {"<unk>": 0, **{f"<0x{byte:02X}>": 1 + byte for byte in range(256)}}
    for token in ["▁", "a", "b", "c", "▁a", "ab", "▁ab", "é"]:
        vocab[token] = len(vocab)
    merges = [("▁", "a"), ("a", "b"), ("▁a", "b")]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", name_or_path="sentencepiece-style")


def test_token_bytes_of_a_sentencepiece_style_tokenizer():
    tokenizer = _sentencepiece_style()
    pieces = token_bytes(tokenizer)
    assert pieces[tokenizer.convert_tokens_to_ids("<0xE4>")] == b"\xe4"
    assert pieces[tokenizer.convert_tokens_to_ids("▁ab")] == b" ab"
    for text in ["ab a b", "a abc 中文 🙂", "é è", "cab  ba"]:
        ids = encode(tokenizer, text)
        assert b"".join(pieces[index] for index in ids) == text.encode("utf-8")
    # And it aligns with a byte-level tokenizer of the same text.
    text = "ab 中é 🙂 cab"
    groups = align_tokens([pieces[index] for index in encode(tokenizer, text)], byte_pieces(text))
    assert groups == reference_groups([pieces[index] for index in encode(tokenizer, text)], byte_pieces(text))


def test_token_bytes_names_the_tokenizer_when_a_token_is_not_byte_level():
    backend = Tokenizer(models.BPE(vocab=byte_level_vocab("☃"), merges=[]))  # ☃ is no byte in GPT-2's table
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, name_or_path="snowman-tokenizer")
    with pytest.raises(ValueError, match=r"snowman-tokenizer.*☃"):
        token_bytes(tokenizer)


def byte_level_vocab(*extra: str) -> dict[str, int]:
    """GPT-2's 256 byte symbols, then ``extra`` tokens (ids in that order)."""
    return {symbol: index for index, symbol in enumerate([*sorted(pre_tokenizers.ByteLevel.alphabet()), *extra])}


def byte_pieces(text: str) -> list[bytes]:
    return [bytes([byte]) for byte in text.encode("utf-8")]


# ---------------------------------------------------------------------------------------------------------------------
# shared_vocabulary


@pytest.mark.parametrize(("student_name", "teacher_name"), [("student", "teacher"), ("byte_student", "llama_teacher")])
def test_shared_vocabulary_pairs_equal_bytes_special_with_special_and_misses_nothing(student_name, teacher_name):
    student_tokenizer, teacher_tokenizer = TOKENIZERS[student_name](), TOKENIZERS[teacher_name]()
    student_pieces, teacher_pieces = pieces_of(student_name), pieces_of(teacher_name)
    mapping = shared_vocabulary(student_tokenizer, teacher_tokenizer)
    assert mapping.dtype == torch.long and mapping.shape == (len(student_tokenizer),)
    student_special = set(student_tokenizer.added_tokens_decoder)
    teacher_special = set(teacher_tokenizer.added_tokens_decoder)
    # Independently: the teacher's (bytes, is special) -> id, and what each student id should get.
    teacher_index = {(piece, index in teacher_special): index for index, piece in enumerate(teacher_pieces)}
    for index, piece in enumerate(student_pieces):
        expected = teacher_index.get((piece, index in student_special), -1)
        assert int(mapping[index]) == expected, (index, piece)
        if expected >= 0:
            assert teacher_pieces[expected] == piece
    coverage = float((mapping >= 0).float().mean())
    assert 0.0 < coverage < 1.0  # the two vocabularies share some strings, not all


def test_a_tokenizer_maps_onto_itself():
    for name in ["student", "teacher", "byte_student"]:
        tokenizer = TOKENIZERS[name]()
        assert torch.equal(shared_vocabulary(tokenizer, tokenizer), torch.arange(len(tokenizer)))


def test_special_tokens_map_to_special_tokens_only():
    # The ChatML stop token exists in both ChatML tokenizers, and in neither Llama-style one.
    student_tokenizer, teacher_tokenizer = student(), teacher()
    mapping = shared_vocabulary(student_tokenizer, teacher_tokenizer)
    for content in SPECIAL_TOKENS:
        student_id = student_tokenizer.convert_tokens_to_ids(content)
        assert int(mapping[student_id]) == teacher_tokenizer.convert_tokens_to_ids(content)
    im_end = student_tokenizer.convert_tokens_to_ids(IM_END)
    assert int(shared_vocabulary(student_tokenizer, llama_teacher())[im_end]) == -1
    # A tokenizer whose vocabulary spells "<|im_end|>" as an ordinary token: it is not the stop token.
    backend = Tokenizer(models.BPE(vocab=byte_level_vocab(IM_END), merges=[]))
    backend.decoder = decoders.ByteLevel()
    plain = PreTrainedTokenizerFast(tokenizer_object=backend, name_or_path="plain-im-end")
    plain_id = plain.convert_tokens_to_ids(IM_END)
    assert token_bytes(plain)[plain_id] == token_bytes(student_tokenizer)[im_end]  # the same bytes...
    assert int(shared_vocabulary(student_tokenizer, plain)[im_end]) == -1  # ...but special never maps to normal
    assert int(shared_vocabulary(plain, student_tokenizer)[plain_id]) == -1  # ...nor normal to special


# ---------------------------------------------------------------------------------------------------------------------
# prefix_classes and pool_logits_by_class


def reference_roots(pieces: list[bytes], special: set[int], roots: dict[bytes, int]) -> list[int]:
    """Brute force: each normal token's longest prefix among the root strings (every prefix length tried)."""
    found = []
    for index, piece in enumerate(pieces):
        prefixes = [piece[:end] for end in range(1, len(piece) + 1) if piece[:end] in roots]
        found.append(-1 if index in special or not prefixes else roots[max(prefixes, key=len)])
    return found


@pytest.mark.parametrize(("student_name", "teacher_name"), [("student", "teacher"), ("teacher", "student")])
def test_prefix_classes_put_each_token_under_its_longest_prefix_that_both_vocabularies_have(student_name, teacher_name):
    student_tokenizer, teacher_tokenizer = TOKENIZERS[student_name](), TOKENIZERS[teacher_name]()
    student_pieces, teacher_pieces = pieces_of(student_name), pieces_of(teacher_name)
    student_special = set(student_tokenizer.added_tokens_decoder)
    teacher_special = set(teacher_tokenizer.added_tokens_decoder)
    teacher_strings = {p for i, p in enumerate(teacher_pieces) if i not in teacher_special}
    roots = {}
    for index, piece in enumerate(student_pieces):
        if index not in student_special and piece in teacher_strings and piece not in roots:
            roots[piece] = index
    classes = prefix_classes(student_tokenizer, teacher_tokenizer)
    expected_student = reference_roots(student_pieces, student_special, roots)
    for index, root in enumerate(expected_student):
        assert int(classes.student_roots[index]) == (index if root < 0 else root), (index, student_pieces[index])
    expected_teacher = reference_roots(teacher_pieces, teacher_special, roots)
    for index in teacher_special:  # a special token stands for the student's of the same content, if any
        content = teacher_tokenizer.added_tokens_decoder[index].content
        student_id = student_tokenizer.convert_tokens_to_ids(content)
        expected_teacher[index] = student_id if student_id in student_special else -1
    assert classes.teacher_to_student.tolist() == expected_teacher
    # Not vacuous: classes of several tokens exist on both sides, and roots that stand alone.
    sizes = torch.bincount(classes.student_roots, minlength=len(student_pieces))
    assert (sizes > 1).any() and (sizes == 1).any()
    assert len(set(expected_teacher)) < len([t for t in expected_teacher if t >= 0])
    assert prefix_classes(student_tokenizer, teacher_tokenizer) is classes  # computed once per pair


def test_prefix_classes_of_equal_tokenizers_are_the_tokens_themselves():
    for name in ["student", "teacher", "byte_student"]:
        tokenizer = TOKENIZERS[name]()
        classes = prefix_classes(tokenizer, tokenizer)
        assert torch.equal(classes.student_roots, torch.arange(len(tokenizer)))
        assert torch.equal(classes.teacher_to_student, torch.arange(len(tokenizer)))
        assert classes.roots == len(tokenizer) and classes.classified_fraction == 1.0


def test_a_word_the_teacher_spells_in_pieces_is_compared_as_the_class_of_its_first_piece():
    # The student writes " carry" as one token; the teacher has no such token and starts it with " ".
    student_backend = Tokenizer(models.BPE(vocab=byte_level_vocab("Ġc", "Ġca", "Ġcar", "Ġcarr", "Ġcarry"), merges=[
        ("Ġ", "c"), ("Ġc", "a"), ("Ġca", "r"), ("Ġcar", "r"), ("Ġcarr", "y")]))
    teacher_backend = Tokenizer(models.BPE(vocab=byte_level_vocab("ar"), merges=[("a", "r")]))
    for backend in (student_backend, teacher_backend):
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
    student_tokenizer = PreTrainedTokenizerFast(tokenizer_object=student_backend, name_or_path="carry-student")
    teacher_tokenizer = PreTrainedTokenizerFast(tokenizer_object=teacher_backend, name_or_path="pieces-teacher")
    classes = prefix_classes(student_tokenizer, teacher_tokenizer)

    def student_class(token: str) -> int:
        return int(classes.student_roots[student_tokenizer.convert_tokens_to_ids(token)])

    def teacher_class(token: str) -> int:
        return int(classes.teacher_to_student[teacher_tokenizer.convert_tokens_to_ids(token)])

    space, a = student_tokenizer.convert_tokens_to_ids("Ġ"), student_tokenizer.convert_tokens_to_ids("a")
    # " " on the teacher's side also stands for the start of " carry": the student's whole word joins that class.
    assert {student_class(t) for t in ("Ġ", "Ġc", "Ġca", "Ġcar", "Ġcarr", "Ġcarry")} == {space}
    assert teacher_class("Ġ") == space
    # "a" on the student's side also stands for the start of "ar": the teacher's "ar" joins the class of "a".
    assert teacher_class("a") == teacher_class("ar") == student_class("a") == a
    c, seven = student_tokenizer.convert_tokens_to_ids("c"), student_tokenizer.convert_tokens_to_ids("7")
    assert student_class("c") == teacher_class("c") == c and student_class("7") == teacher_class("7") == seven


def reference_pool(logits: torch.Tensor, roots: list[int]) -> torch.Tensor:
    """Float64, by hand: each class's log-sum-exp at its root, −inf at the other members."""
    pooled = torch.full_like(logits, float("-inf"))
    for root in set(roots):
        members = [index for index, r in enumerate(roots) if r == root]
        pooled[..., root] = torch.logsumexp(logits[..., members], dim=-1)
    return pooled


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pooled_logits_give_each_class_its_members_mass_and_gradient(dtype):
    generator = torch.Generator().manual_seed(0)
    vocab = 40
    roots = [index if index % 7 == 0 or index > 34 else (index // 7) * 7 for index in range(35)]  # 35..39: unlisted
    logits = (torch.randn(3, 5, vocab, generator=generator, dtype=torch.float64) * 4).requires_grad_()
    logits_in = logits.detach().to(dtype).requires_grad_()
    logits_in.data[0, 0, 8] = float("-inf")  # a member that can never be chosen
    logits_in.data[1, 2, 14:21] = float("-inf")  # a whole class that can never be chosen
    pooled = pool_logits_by_class(logits_in, torch.tensor(roots))
    padded = roots + list(range(35, vocab))  # ids past the tokenizer (a padded head) stand alone
    expected = reference_pool(logits_in.detach().double(), padded)
    # Rounding: a float32 logsumexp of at most 7 terms is within a few units of the last place of its value.
    tolerance = 8 * torch.finfo(dtype).eps * expected.abs().clamp_min(1)
    finite = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(pooled), finite)
    assert ((pooled.double() - expected)[finite].abs() <= tolerance[finite]).all()
    # log_softmax of the pooled logits is each class's log-probability; the gradient follows the members' shares.
    weights = torch.randn(3, 5, vocab, generator=generator, dtype=torch.float64)
    got = torch.autograd.grad((torch.log_softmax(pooled, -1).exp().double() * weights).sum(), logits_in)[0]
    reference_logits = logits_in.detach().double().requires_grad_()
    reference = (torch.log_softmax(reference_pool(reference_logits, padded), -1).exp() * weights).sum()
    # A class whose members are all -inf has no gradient (torch's logsumexp gives NaN there, not 0).
    want = torch.autograd.grad(reference, reference_logits)[0].nan_to_num(nan=0.0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, atol=64 * torch.finfo(dtype).eps * weights.abs().max(), rtol=0)


# ---------------------------------------------------------------------------------------------------------------------
# align_tokens


@st.composite
def two_cuttings(draw):
    """One byte string cut in two independent ways; repeated cut offsets make zero-byte tokens."""
    data = draw(st.one_of(any_text.map(lambda text: text.encode("utf-8")), st.binary(max_size=24)))

    def cutting() -> list[bytes]:
        cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=len(data) + 3)))
        offsets = [0, *cuts, len(data)]
        return [data[start:end] for start, end in itertools.pairwise(offsets) if end > start or draw(st.booleans())]

    return cutting(), cutting()


@BOUNDED
@given(two_cuttings())
def test_groups_equal_the_brute_force_cut_of_random_byte_strings(cuttings):
    student_pieces, teacher_pieces = cuttings
    groups = align_tokens(student_pieces, teacher_pieces)
    assert groups == reference_groups(student_pieces, teacher_pieces)
    check_groups(student_pieces, teacher_pieces, groups)


@pytest.mark.parametrize(("student_name", "teacher_name"), [("student", "teacher"), ("byte_student", "teacher")])
@BOUNDED
@given(text=st.one_of(texts_with_specials, any_text))
def test_groups_equal_the_brute_force_cut_of_two_real_tokenizations(student_name, teacher_name, text):
    student_pieces = [pieces_of(student_name)[index] for index in encode(TOKENIZERS[student_name](), text)]
    teacher_pieces = [pieces_of(teacher_name)[index] for index in encode(TOKENIZERS[teacher_name](), text)]
    groups = align_tokens(student_pieces, teacher_pieces)
    assert groups == reference_groups(student_pieces, teacher_pieces)
    check_groups(student_pieces, teacher_pieces, groups)
    if groups:  # real tokens have bytes: every token is in exactly one group
        assert (groups[-1].student_end, groups[-1].teacher_end) == (len(student_pieces), len(teacher_pieces))


def test_multi_byte_characters_split_differently_form_one_group():
    text = "ka 中文🙂 naïve"
    student_pieces = [pieces_of("student")[index] for index in encode(student(), text)]
    teacher_pieces = [pieces_of("teacher")[index] for index in encode(teacher(), text)]
    assert student_pieces != teacher_pieces  # the two tokenizers disagree on this text
    groups = align_tokens(byte_pieces(text), teacher_pieces)
    # The byte student spells 中 and 文 (3 bytes each) and 🙂 (4) byte by byte; the teacher has " 中文" as one token.
    chinese = next(g for g in groups if b"\xe4\xb8\xad" in b"".join(teacher_pieces[g.teacher_start : g.teacher_end]))
    assert (chinese.student_end - chinese.student_start, chinese.teacher_end - chinese.teacher_start) == (7, 1)
    assert not chinese.one_to_one
    assert groups == reference_groups(byte_pieces(text), teacher_pieces)


def test_special_tokens_and_whitespace_at_the_edges_are_groups_of_their_own():
    text = f"{IM_START}  \n\nka tori\t \n{IM_END}\n"
    student_pieces = [pieces_of("student")[index] for index in encode(student(), text)]
    teacher_pieces = [pieces_of("teacher")[index] for index in encode(teacher(), text)]
    groups = align_tokens(student_pieces, teacher_pieces)
    assert groups == reference_groups(student_pieces, teacher_pieces)
    first, last_special = groups[0], groups[-2]
    assert first.one_to_one and student_pieces[first.student_start] == IM_START.encode()
    assert last_special.one_to_one and student_pieces[last_special.student_start] == IM_END.encode()
    assert b"".join(student_pieces[groups[-1].student_start : groups[-1].student_end]) == b"\n"


def test_identical_tokenizations_are_one_to_one():
    pieces = [b"ab", b"c", "中".encode(), b" ", b"<|im_end|>"]
    groups = align_tokens(pieces, pieces)
    assert groups == [AlignedGroup(index, index + 1, index, index + 1) for index in range(len(pieces))]
    assert all(group.one_to_one for group in groups)


def test_zero_byte_tokens_join_the_group_that_ends_where_they_sit():
    # After a common boundary: the group before it. Before the first boundary: the first group.
    assert align_tokens([b"ab", b"", b"cd"], [b"ab", b"cd"]) == [AlignedGroup(0, 2, 0, 1), AlignedGroup(2, 3, 1, 2)]
    assert align_tokens([b"", b"ab"], [b"a", b"b"]) == [AlignedGroup(0, 2, 0, 2)]
    assert align_tokens([], []) == []
    assert align_tokens([b""], []) == []  # nothing to face: in no group


@pytest.mark.parametrize(
    ("student_pieces", "teacher_pieces", "offset"),
    [
        ([b"ab", b"c"], [b"a", b"bd"], 2),
        ([b"ab", b"c"], [b"ab"], 2),  # one is a prefix of the other: they part where the shorter ends
        ([b"x"], [b"y"], 0),
        ("中".encode(), "丫".encode(), 2),  # U+4E2D and U+4E2B: the same first two bytes
    ],
)
def test_different_bytes_name_the_offset(student_pieces, teacher_pieces, offset):
    if isinstance(student_pieces, bytes):
        student_pieces, teacher_pieces = [student_pieces], [teacher_pieces]
    with pytest.raises(ValueError, match=rf"\bbyte {offset}\b"):
        align_tokens(student_pieces, teacher_pieces)


# ---------------------------------------------------------------------------------------------------------------------
# teacher_tokens_for_response


def test_identical_tokenizers_align_every_token_onto_itself():
    tokenizer = student()
    mapping = shared_vocabulary(tokenizer, tokenizer)
    for text in ["ka tori 中文 🙂", f"{IM_START}assistant\n  7+9=16\n", ""]:
        ids = [*encode(tokenizer, text), tokenizer.convert_tokens_to_ids(IM_END)]
        teacher_ids, groups = teacher_tokens_for_response(ids, tokenizer, tokenizer)
        assert teacher_ids == ids
        assert groups == [AlignedGroup(index, index + 1, index, index + 1) for index in range(len(ids))]
        assert mapping[ids].tolist() == teacher_ids


@pytest.mark.parametrize("student_name", ["student", "byte_student"])
@BOUNDED
@given(text=texts)
def test_a_response_is_retokenized_on_its_own_and_aligned(student_name, text):
    student_tokenizer, teacher_tokenizer = TOKENIZERS[student_name](), teacher()
    ids = encode(student_tokenizer, text)
    teacher_ids, groups = teacher_tokens_for_response(ids, student_tokenizer, teacher_tokenizer)
    # The response alone, not as it would be cut after the teacher's prompt (documented choice).
    assert teacher_ids == encode(teacher_tokenizer, text)
    student_pieces = [pieces_of(student_name)[index] for index in ids]
    teacher_pieces = [pieces_of("teacher")[index] for index in teacher_ids]
    assert groups == reference_groups(student_pieces, teacher_pieces)


def test_a_response_ending_in_im_end_maps_it_to_the_teachers_own():
    student_tokenizer, teacher_tokenizer = student(), teacher()
    text = "ka tori 中文 the quick  \n"
    ids = [*encode(student_tokenizer, text), student_tokenizer.convert_tokens_to_ids(IM_END)]
    teacher_ids, groups = teacher_tokens_for_response(ids, student_tokenizer, teacher_tokenizer)
    assert teacher_ids == [*encode(teacher_tokenizer, text), teacher_tokenizer.convert_tokens_to_ids(IM_END)]
    assert groups[-1] == AlignedGroup(len(ids) - 1, len(ids), len(teacher_ids) - 1, len(teacher_ids))
    check_groups([pieces_of("student")[i] for i in ids], [pieces_of("teacher")[i] for i in teacher_ids], groups)
    assert groups[-2].student_end == len(ids) - 1  # the text before it is covered to its last token
    # Only <|im_end|>: one group.
    only = [student_tokenizer.convert_tokens_to_ids(IM_END)]
    assert teacher_tokens_for_response(only, student_tokenizer, teacher_tokenizer) == (
        [teacher_tokenizer.convert_tokens_to_ids(IM_END)],
        [AlignedGroup(0, 1, 0, 1)],
    )


def test_a_stop_token_the_teacher_lacks_stands_for_the_teachers_own_end_of_sequence():
    # Both end the response: one event for the two models, so the student learns where to stop.
    student_tokenizer, teacher_tokenizer = student(), llama_teacher()
    text = "ka tori 中文"
    im_end, eot = student_tokenizer.convert_tokens_to_ids(IM_END), teacher_tokenizer.convert_tokens_to_ids("<|eot_id|>")
    assert student_tokenizer.eos_token_id == im_end and teacher_tokenizer.eos_token_id == eot
    ids = [*encode(student_tokenizer, text), im_end]
    teacher_ids, groups = teacher_tokens_for_response(ids, student_tokenizer, teacher_tokenizer)
    assert teacher_ids == [*encode(teacher_tokenizer, text), eot]
    assert groups[-1] == AlignedGroup(len(ids) - 1, len(ids), len(teacher_ids) - 1, len(teacher_ids))
    assert special_counterparts(student_tokenizer, teacher_tokenizer) == {im_end: eot}  # no other special pairs
    classes = prefix_classes(student_tokenizer, teacher_tokenizer)
    assert int(classes.teacher_to_student[eot]) == im_end and int(classes.student_roots[im_end]) == im_end
    # A teacher with no end-of-sequence token: the stop token is left unaligned.
    no_eos = PreTrainedTokenizerFast(tokenizer_object=teacher_tokenizer.backend_tokenizer, name_or_path="no-eos")
    assert no_eos.eos_token_id is None
    teacher_ids, groups = teacher_tokens_for_response(ids, student_tokenizer, no_eos)
    assert teacher_ids == encode(no_eos, text)
    assert groups[-1].student_end == len(ids) - 1 and groups[-1].teacher_end == len(teacher_ids)
    check_groups([pieces_of("student")[i] for i in ids], [pieces_of("llama_teacher")[i] for i in teacher_ids], groups)


def test_special_tokens_inside_a_response_are_groups_of_their_own():
    student_tokenizer, teacher_tokenizer = student(), teacher()
    text = f"{IM_START}ka{IM_END}\n  tori{IM_START}"
    ids = encode(student_tokenizer, text)
    teacher_ids, groups = teacher_tokens_for_response(ids, student_tokenizer, teacher_tokenizer)
    assert teacher_ids == encode(teacher_tokenizer, text)
    student_pieces = [pieces_of("student")[i] for i in ids]
    teacher_pieces = [pieces_of("teacher")[i] for i in teacher_ids]
    assert groups == reference_groups(student_pieces, teacher_pieces)
    specials = [g for g in groups if student_pieces[g.student_start].startswith(b"<|")]
    assert len(specials) == 3 and all(g.one_to_one for g in specials)
    assert [teacher_tokenizer.convert_ids_to_tokens(teacher_ids[g.teacher_start]) for g in specials] == [
        IM_START,
        IM_END,
        IM_START,
    ]


def test_a_response_cut_inside_a_character_aligns_up_to_it():
    student_tokenizer, teacher_tokenizer = byte_student(), teacher()
    ids = encode(student_tokenizer, "ab 中文")
    cut = ids[:-1]  # the length limit stopped it after two of the three bytes of 文
    teacher_ids, groups = teacher_tokens_for_response(cut, student_tokenizer, teacher_tokenizer)
    assert teacher_ids == encode(teacher_tokenizer, "ab 中")
    assert groups[-1].student_end == len(cut) - 2  # the two bytes of half a 文 are in no group
    check_groups([pieces_of("byte_student")[i] for i in cut], [pieces_of("teacher")[i] for i in teacher_ids], groups)


def test_a_cut_token_that_also_ends_a_character_leaves_that_character_out_too():
    # A student whose merges cross character boundaries: "中" is b"\xe4\xb8" + b"\xad" and the next token is
    # b"\xad\xe6\x96" (the end of 中, then two bytes of 文). Cut there, the second token holds an incomplete 文;
    # without it, the first holds an incomplete 中: both go, and "ab " is what aligns.
    byte_symbols = byte_student().convert_ids_to_tokens(encode(byte_student(), "中文"))  # one symbol per byte
    head, straddling = "".join(byte_symbols[:2]), "".join(byte_symbols[2:5])
    backend = Tokenizer(models.BPE(vocab=byte_level_vocab(head, straddling), merges=[]))
    backend.decoder = decoders.ByteLevel()
    crossing = PreTrainedTokenizerFast(tokenizer_object=backend, name_or_path="crossing")
    pieces = token_bytes(crossing)
    ab = byte_student().convert_ids_to_tokens(encode(byte_student(), "ab "))
    response = crossing.convert_tokens_to_ids([*ab, head, straddling])
    assert b"".join(pieces[i] for i in response) == "ab 中".encode() + "文".encode()[:2]
    teacher_ids, groups = teacher_tokens_for_response(response, crossing, teacher())
    assert teacher_ids == encode(teacher(), "ab ")
    assert groups[-1].student_end == 3


def _longest_valid_prefix(pieces: list[bytes]) -> int:
    """The most leading tokens whose bytes together are valid UTF-8 (by trying every count)."""
    for count in range(len(pieces), -1, -1):
        try:
            b"".join(pieces[:count]).decode("utf-8")
            return count
        except UnicodeDecodeError:
            continue
    return 0


@pytest.mark.parametrize("student_name", ["student", "byte_student"])
@BOUNDED
@given(text=texts, data=st.data())
def test_a_response_cut_anywhere_aligns_its_longest_valid_prefix(student_name, text, data):
    student_tokenizer, teacher_tokenizer = TOKENIZERS[student_name](), teacher()
    ids = encode(student_tokenizer, text)
    cut = ids[: data.draw(st.integers(0, len(ids)))]
    student_pieces = [pieces_of(student_name)[index] for index in cut]
    kept = _longest_valid_prefix(student_pieces)
    teacher_ids, groups = teacher_tokens_for_response(cut, student_tokenizer, teacher_tokenizer)
    assert teacher_ids == encode(teacher_tokenizer, b"".join(student_pieces[:kept]).decode("utf-8"))
    assert groups == reference_groups(student_pieces[:kept], [pieces_of("teacher")[i] for i in teacher_ids])


def test_an_invalid_byte_inside_a_response_ends_the_alignment_there():
    student_tokenizer, teacher_tokenizer = byte_student(), teacher()
    ids = encode(student_tokenizer, "ka tori")
    lone = next(i for i, piece in enumerate(pieces_of("byte_student")) if piece == b"\x80")  # a stray continuation
    response = [*ids[:2], lone, *ids[2:]]
    teacher_ids, groups = teacher_tokens_for_response(response, student_tokenizer, teacher_tokenizer)
    assert teacher_ids == encode(teacher_tokenizer, "ka")
    assert groups[-1].student_end == 2


def test_an_empty_response_has_no_groups():
    assert teacher_tokens_for_response([], student(), teacher()) == ([], [])


def test_a_teacher_that_changes_the_text_aligns_nothing():
    # A teacher that adds a space before the first word gives back other bytes: no group, no error.
    backend = Tokenizer(models.BPE(vocab=byte_level_vocab(), merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    backend.decoder = decoders.ByteLevel()
    prefixing = PreTrainedTokenizerFast(tokenizer_object=backend, name_or_path="prefix-space")
    assert teacher_tokens_for_response(encode(student(), "ka tori"), student(), prefixing) == ([], [])


def test_special_token_text_spelled_by_the_student_stays_text_for_the_teacher():
    student_tokenizer, teacher_tokenizer = byte_student(), teacher()
    ids = student_tokenizer("a <|im_end|> b", add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert all(len(pieces_of("byte_student")[i]) == 1 for i in ids)  # the student wrote it byte by byte
    teacher_ids, _ = teacher_tokens_for_response(ids, student_tokenizer, teacher_tokenizer)
    assert teacher_tokenizer.convert_tokens_to_ids(IM_END) not in teacher_ids


def test_a_wordpiece_tokenizer_is_refused_with_its_name():
    vocab = {"[UNK]": 0, "ab": 1, "##cd": 2}
    backend = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    backend.decoder = decoders.WordPiece()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", name_or_path="wordpiece-style")
    with pytest.raises(ValueError, match=r"wordpiece-style: cannot tell the bytes of token 'ab'"):
        token_bytes(tokenizer)
