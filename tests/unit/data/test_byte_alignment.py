"""Byte-span alignment of two tokenizations (opd/data/token_alignment.py), on two tokenizers built here.

The demo's tokenizer and one trained on other text with a smaller vocabulary cut the same
text differently. Checked: each token's bytes round-trip any UTF-8 text; shared strings
map to equal bytes (and a tokenizer maps onto itself); groups are exactly the spans
between common byte boundaries (against a brute-force reference on random texts with
multi-byte characters, whitespace runs and special tokens at the edges); a response cut
inside a character, one ending in ``<|im_end|>``, an empty one; mismatched bytes name the
offset.
"""

from __future__ import annotations

import random

import pytest
import torch
from opd_test_helpers import REPO_ROOT
from transformers import AutoTokenizer

from opd.data.token_alignment import align_tokens, shared_vocabulary, teacher_tokens_for_response, token_bytes
from opd.models.tiny import train_bpe_tokenizer

ALPHABET = list("abcdefgh 0123456789+-=.\n\t") + ["é", "中", "文", "🙂", "  ", "carry", "write", "Ü"]


@pytest.fixture(scope="module")
def pair():
    demo = AutoTokenizer.from_pretrained(REPO_ROOT / "examples" / "demo" / "models" / "teacher")
    other = train_bpe_tokenizer([f"{a} - {b} = {a - b} borrow é中文🙂 carry" for a in range(100, 600, 7) for b in (3, 45)],
                                vocab_size=300)
    return demo, other


def random_texts(count=200, seed=0):
    rng = random.Random(seed)
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 30))) for _ in range(count)]


def test_token_bytes_round_trip_any_text(pair):
    for tokenizer in pair:
        pieces = token_bytes(tokenizer)
        assert len(pieces) == len(tokenizer)
        for text in random_texts():
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            assert b"".join(pieces[i] for i in ids) == text.encode()
        assert pieces[tokenizer.convert_tokens_to_ids("<|im_end|>")] == b"<|im_end|>"


def test_shared_strings_have_equal_bytes_and_a_tokenizer_maps_onto_itself(pair):
    demo, other = pair
    mapping = shared_vocabulary(demo, other)
    demo_pieces, other_pieces = token_bytes(demo), token_bytes(other)
    mapped = (mapping >= 0).nonzero().squeeze(-1).tolist()
    assert 0 < len(mapped) < len(demo)
    assert all(demo_pieces[i] == other_pieces[int(mapping[i])] for i in mapped)
    specials_demo, specials_other = set(demo.added_tokens_decoder), set(other.added_tokens_decoder)
    assert all((i in specials_demo) == (int(mapping[i]) in specials_other) for i in mapped)
    assert torch.equal(shared_vocabulary(demo, demo), torch.arange(len(demo)))


def brute_force_groups(a: list[bytes], b: list[bytes]):
    """Boundaries as sets of offsets: a group ends at every offset both tokenizations end a token at."""
    def ends(pieces):
        out, total = [], 0
        for piece in pieces:
            total += len(piece)
            out.append(total)
        return out
    return sorted(set(ends(a)) & set(ends(b)))


def test_groups_are_the_spans_between_common_boundaries(pair):
    demo, other = pair
    pieces = token_bytes(demo), token_bytes(other)
    multi = 0
    for text in random_texts(300, seed=1):
        ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for tokenizer in pair]
        a = [pieces[0][i] for i in ids[0]]
        b = [pieces[1][i] for i in ids[1]]
        groups = align_tokens(a, b)
        if not text:
            assert groups == []
            continue
        # Contiguous, covering every token once, equal bytes on both sides.
        assert [g.student_start for g in groups] == [0] + [g.student_end for g in groups[:-1]]
        assert [g.teacher_start for g in groups] == [0] + [g.teacher_end for g in groups[:-1]]
        assert (groups[-1].student_end, groups[-1].teacher_end) == (len(a), len(b))
        ends = []
        for g in groups:
            assert b"".join(a[g.student_start:g.student_end]) == b"".join(b[g.teacher_start:g.teacher_end])
            ends.append(len(b"".join(a[:g.student_end])))
            multi += not g.one_to_one
        assert ends == brute_force_groups(a, b)  # minimal: a group ends at every common boundary
    assert multi > 50  # the two tokenizers really disagree


def test_identical_tokenizations_are_one_to_one():
    pieces = [b"ab", b"c", "中".encode(), b" "]
    groups = align_tokens(pieces, pieces)
    assert all(g.one_to_one for g in groups) and len(groups) == 4


def test_different_bytes_name_the_offset():
    with pytest.raises(ValueError, match="differ at byte 2"):
        align_tokens([b"ab", b"c"], [b"a", b"bd"])


def test_a_response_ending_in_im_end_maps_it_to_the_teachers_own(pair):
    demo, other = pair
    ids = demo("7+9=16 carry 1 中文", add_special_tokens=False)["input_ids"] + [demo.eos_token_id]
    teacher_ids, groups = teacher_tokens_for_response(ids, demo, other)
    assert teacher_ids[-1] == other.convert_tokens_to_ids("<|im_end|>")
    assert groups[-1].one_to_one and groups[-1].student_start == len(ids) - 1
    assert groups[-1].student_end == len(ids) and sum(g.student_end - g.student_start for g in groups) == len(ids)


def test_a_response_cut_inside_a_character_aligns_up_to_it(pair):
    demo, other = pair
    pieces = token_bytes(demo)
    ids = demo("ab 中文", add_special_tokens=False)["input_ids"]
    # Drop the last byte-token: the response now ends inside 文 (three bytes, one token each here).
    assert any(len(pieces[i]) == 1 and pieces[i][0] >= 0x80 for i in ids)
    cut = ids[:-1]
    teacher_ids, groups = teacher_tokens_for_response(cut, demo, other)
    covered = sum(g.student_end - g.student_start for g in groups)
    assert b"".join(pieces[i] for i in cut[:covered]).decode() == "ab 中"
    assert other.decode(teacher_ids) == "ab 中"


def test_an_empty_response_has_no_groups(pair):
    assert teacher_tokens_for_response([], *pair) == ([], [])
