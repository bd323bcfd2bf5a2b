"""Aligning two tokenizations of one text by byte offsets (a teacher with another tokenizer).

Each token stands for an exact byte string, so two tokenizations of one text are two ways of cutting one byte
string. Between two common cut points lies an aligned *group* of student and teacher tokens with the same bytes; at
its start both models have read the same text, so their next-token distributions can be compared there. Working on
bytes, not decoded text, is linear, exact for any UTF-8, and free of incremental-decoding drift.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate
from typing import Any

import torch


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's table, inverted: the printable character that stands for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    characters = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            characters.append(256 + extra)
            extra += 1
    return {chr(character): byte for byte, character in zip(printable, characters, strict=True)}


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and "ByteLevel" in repr(decoder)


def _is_sentencepiece_style(tokenizer: Any) -> bool:
    """Words marked with ``▁`` (Metaspace) and bytes as ``<0xNN>`` tokens (Llama 2, Mistral, Gemma)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    described = repr(getattr(backend, "decoder", None)) + repr(getattr(backend, "pre_tokenizer", None))
    return "Metaspace" in described or "ByteFallback" in described or "▁" in described


def token_bytes(tokenizer: Any) -> list[bytes]:
    """The bytes each id ``0 .. len(tokenizer) - 1`` stands for (added tokens: their literal UTF-8 content).

    Supports byte-level BPE (GPT-2's byte table) and SentencePiece-style (``▁`` = space, ``<0xNN>`` = a byte);
    raises ``ValueError`` naming the token whose bytes cannot be found.
    """
    table = _unicode_to_byte()
    byte_level = _is_byte_level(tokenizer)
    sentencepiece = not byte_level and _is_sentencepiece_style(tokenizer)
    added = {index: token.content for index, token in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    name = getattr(tokenizer, "name_or_path", "?")
    pieces: list[bytes] = []
    for index, token in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
        if index in added:
            pieces.append(added[index].encode("utf-8"))
        elif token is None:
            raise ValueError(f"tokenizer {name}: id {index} has no token")
        elif byte_level:
            try:
                pieces.append(bytes(table[character] for character in token))
            except KeyError:
                raise ValueError(f"tokenizer {name}: token {token!r} (id {index}) is not byte-level") from None
        elif len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            pieces.append(bytes([int(token[3:5], 16)]))
        elif sentencepiece:
            pieces.append(token.replace("▁", " ").encode("utf-8"))
        else:
            raise ValueError(
                f"tokenizer {name}: cannot tell the bytes of token {token!r} "
                f"(id {index}): only byte-level BPE and SentencePiece-style (▁, <0xNN>) tokenizers are supported"
            )
    return pieces


def special_counterparts(student_tokenizer: Any, teacher_tokenizer: Any) -> dict[int, int]:
    """Each student special token's teacher counterpart, ``{student id: teacher id}``: the same content.

    The two EOS tokens are also paired when neither has a counterpart of its own: both end the response, so the
    student learns where to stop from the teacher's probability of stopping there.
    """
    cache = getattr(student_tokenizer, "_opd_special_counterparts", None)
    if cache is not None and cache[0] is teacher_tokenizer:
        return cache[1]
    teacher_by_content = {
        token.content: index for index, token in getattr(teacher_tokenizer, "added_tokens_decoder", {}).items()
    }
    pairs = {
        index: teacher_by_content[token.content]
        for index, token in getattr(student_tokenizer, "added_tokens_decoder", {}).items()
        if token.content in teacher_by_content
    }
    student_eos, teacher_eos = student_tokenizer.eos_token_id, teacher_tokenizer.eos_token_id
    if (
        isinstance(student_eos, int)
        and isinstance(teacher_eos, int)
        and student_eos in getattr(student_tokenizer, "added_tokens_decoder", {})
        and teacher_eos in getattr(teacher_tokenizer, "added_tokens_decoder", {})
        and student_eos not in pairs
        and teacher_eos not in pairs.values()
    ):
        pairs[student_eos] = teacher_eos
    student_tokenizer._opd_special_counterparts = (teacher_tokenizer, pairs)  # computed once per pair
    return pairs


def shared_vocabulary(student_tokenizer: Any, teacher_tokenizer: Any) -> torch.Tensor:
    """``[V_student]`` int64: the teacher id with the same bytes (and specialness) as each student id, or −1."""
    student_special = set(getattr(student_tokenizer, "added_tokens_decoder", {}))
    teacher_special = set(getattr(teacher_tokenizer, "added_tokens_decoder", {}))
    teacher_index = {
        (piece, index in teacher_special): index for index, piece in enumerate(token_bytes(teacher_tokenizer))
    }
    mapping = [
        teacher_index.get((piece, index in student_special), -1)
        for index, piece in enumerate(token_bytes(student_tokenizer))
    ]
    return torch.tensor(mapping, dtype=torch.long)


@dataclass(frozen=True)
class PrefixClasses:
    """The events both models' next-token distributions can be compared on: classes of token strings.

    A token's probability means "the text goes on with these bytes and not with a longer token of *this*
    vocabulary", so one string is a different event in two vocabularies. A *root* is a string that is a token in
    both; its class on each side is the sum over tokens whose longest root prefix it is. Both models put the same
    continuations in the same class, so the classes compare exactly. Equal vocabularies give one token per class
    (ordinary top-k); special tokens stand alone, paired by :func:`special_counterparts`.

    Attributes:
        student_roots: ``[V_student]`` int64, each student id's class (its root's student id), or the id itself
            when it has no root prefix (a class the teacher never lists, so its mass stays in the rest).
        teacher_to_student: ``[V_teacher]`` int64, each teacher id's class, or −1 without a root prefix.
        roots: how many classes both sides can name.
    """

    student_roots: torch.Tensor
    teacher_to_student: torch.Tensor
    roots: int

    @property
    def classified_fraction(self) -> float:
        """The share of student ids that fall in a class the teacher can name."""
        own = torch.arange(self.student_roots.numel())
        named = torch.zeros_like(own, dtype=torch.bool)
        named[self.teacher_to_student[self.teacher_to_student >= 0]] = True
        return float(named[self.student_roots].float().mean()) if own.numel() else 0.0


def prefix_classes(student_tokenizer: Any, teacher_tokenizer: Any) -> PrefixClasses:
    """The :class:`PrefixClasses` of two tokenizers (computed once per pair of tokenizer objects)."""
    cache = getattr(student_tokenizer, "_opd_prefix_classes", None)
    if cache is not None and cache[0] is teacher_tokenizer and cache[1].student_roots.numel() == len(student_tokenizer):
        return cache[1]
    student_pieces, teacher_pieces = _cached_pieces(student_tokenizer), _cached_pieces(teacher_tokenizer)
    student_special = set(getattr(student_tokenizer, "added_tokens_decoder", {}))
    teacher_special = set(getattr(teacher_tokenizer, "added_tokens_decoder", {}))
    teacher_strings = {piece for index, piece in enumerate(teacher_pieces) if index not in teacher_special and piece}
    root_ids: dict[bytes, int] = {}  # each root string's student id (the lowest, if several spell it)
    for index, piece in enumerate(student_pieces):
        if index not in student_special and piece in teacher_strings:
            root_ids.setdefault(piece, index)

    def root_of(piece: bytes, missing: int) -> int:
        """The student id of ``piece``'s longest root prefix, or ``missing``."""
        return next((root_ids[piece[:end]] for end in range(len(piece), 0, -1) if piece[:end] in root_ids), missing)

    student_roots = [
        index if index in student_special else root_of(piece, index) for index, piece in enumerate(student_pieces)
    ]
    student_special_by_teacher = {
        teacher: student for student, teacher in special_counterparts(student_tokenizer, teacher_tokenizer).items()
    }
    teacher_to_student = [
        student_special_by_teacher.get(index, -1) if index in teacher_special else root_of(piece, -1)
        for index, piece in enumerate(teacher_pieces)
    ]
    classes = PrefixClasses(
        torch.tensor(student_roots, dtype=torch.long),
        torch.tensor(teacher_to_student, dtype=torch.long),
        len(root_ids) + len(student_special_by_teacher),
    )
    student_tokenizer._opd_prefix_classes = (teacher_tokenizer, classes)
    return classes


def pool_logits_by_class(logits: torch.Tensor, student_roots: torch.Tensor) -> torch.Tensor:
    """``[..., V]`` logits with each class's mass on its root id (logsumexp there, −inf on other members).

    The normaliser is unchanged, so ``log_softmax`` gives each class's log-probability at its root and the gradient
    reaches members in proportion to their share. Ids beyond ``student_roots`` (``[V_tokenizer]``) stand alone.
    Returns float32 (float64 for float64 input).
    """
    compute_dtype = torch.promote_types(logits.dtype, torch.float32)
    values = logits.to(compute_dtype)
    vocab = values.shape[-1]
    roots = student_roots.to(values.device)
    if roots.numel() < vocab:
        roots = torch.cat([roots, torch.arange(roots.numel(), vocab, device=roots.device)])
    index = roots[:vocab].expand_as(values)
    # The logsumexp of each class, shifted by the class's largest logit (a constant: its gradient is not needed).
    top = torch.full_like(values, -math.inf).scatter_reduce(-1, index, values.detach(), "amax")
    shift = top.gather(-1, index)
    shift = shift.masked_fill(~torch.isfinite(shift), 0.0)
    sums = torch.zeros_like(values).scatter_add(-1, index, (values - shift).exp())
    pooled = sums.clamp_min(torch.finfo(compute_dtype).tiny).log() + top.masked_fill(~torch.isfinite(top), 0.0)
    return pooled.masked_fill(sums == 0, -math.inf)


@dataclass(frozen=True)
class AlignedGroup:
    """Student tokens ``[student_start, student_end)`` and teacher tokens ``[teacher_start, teacher_end)``
    covering the same bytes, between two common boundaries."""

    student_start: int
    student_end: int
    teacher_start: int
    teacher_end: int

    @property
    def one_to_one(self) -> bool:
        """One token on each side."""
        return self.student_end - self.student_start == 1 and self.teacher_end - self.teacher_start == 1


def align_tokens(student_pieces: list[bytes], teacher_pieces: list[bytes]) -> list[AlignedGroup]:
    """The groups of two tokenizations of one byte string, cut at their common boundaries (linear time).

    A zero-byte token belongs to the group that ends where it does. Raises ``ValueError`` (naming the first
    differing offset) if the byte strings differ.
    """
    student_text, teacher_text = b"".join(student_pieces), b"".join(teacher_pieces)
    if student_text != teacher_text:
        offset = next(
            (i for i, (a, b) in enumerate(zip(student_text, teacher_text, strict=False)) if a != b),
            min(len(student_text), len(teacher_text)),
        )
        raise ValueError(f"the two tokenizations differ at byte {offset}; they must cover the same bytes")
    student_ends = list(accumulate(len(piece) for piece in student_pieces))
    teacher_ends = list(accumulate(len(piece) for piece in teacher_pieces))
    common = sorted(set(student_ends) & set(teacher_ends))
    groups: list[AlignedGroup] = []
    i = j = 0
    for boundary in common:
        next_i, next_j = i, j
        while next_i < len(student_ends) and student_ends[next_i] <= boundary:
            next_i += 1
        while next_j < len(teacher_ends) and teacher_ends[next_j] <= boundary:
            next_j += 1
        groups.append(AlignedGroup(i, next_i, j, next_j))
        i, j = next_i, next_j
    return groups


def _valid_utf8_length(data: bytes) -> int:
    """The length of the longest prefix of ``data`` that is valid UTF-8."""
    try:
        data.decode("utf-8")
        return len(data)
    except UnicodeDecodeError as error:
        return error.start


def teacher_tokens_for_response(
    student_response_ids: list[int], student_tokenizer: Any, teacher_tokenizer: Any
) -> tuple[list[int], list[AlignedGroup]]:
    """``(teacher ids, groups)`` for the student's response ids (no prompt, no padding); groups in response indices.

    The response is cut at its special tokens; each text run is tokenized by the teacher on its own, and each special
    token becomes its :func:`special_counterparts` entry, a group of its own (none without a counterpart). Alignment
    stops, leaving the rest without teacher signal, at invalid UTF-8 (after the last whole token before it) or at a
    run the teacher's tokenizer does not return byte for byte (normalisation).
    Tokenizing runs alone could miss a merge across the prompt boundary; chat templates end prompts with a newline.
    """
    student_pieces, teacher_pieces = _cached_pieces(student_tokenizer), _cached_pieces(teacher_tokenizer)
    student_special = set(getattr(student_tokenizer, "added_tokens_decoder", {}))
    counterparts = special_counterparts(student_tokenizer, teacher_tokenizer)
    teacher_ids: list[int] = []
    groups: list[AlignedGroup] = []
    run_start = 0
    for position in range(len(student_response_ids) + 1):
        at_end = position == len(student_response_ids)
        if not at_end and student_response_ids[position] not in student_special:
            continue
        run = [student_pieces[token] for token in student_response_ids[run_start:position]]
        run_ids, run_groups, whole = _align_run(run, run_start, len(teacher_ids), teacher_tokenizer, teacher_pieces)
        teacher_ids += run_ids
        groups += run_groups
        if not whole:  # what follows was read after other text by the two models: not comparable
            break
        if not at_end and student_response_ids[position] in counterparts:
            groups.append(AlignedGroup(position, position + 1, len(teacher_ids), len(teacher_ids) + 1))
            teacher_ids.append(counterparts[student_response_ids[position]])
        run_start = position + 1
    return teacher_ids, groups


def _align_run(
    pieces: list[bytes], start: int, offset: int, teacher_tokenizer: Any, teacher_pieces: list[bytes]
) -> tuple[list[int], list[AlignedGroup], bool]:
    """Tokenizes a text run (the student's token ``pieces``) for the teacher: its ids, groups and whether all aligned.

    The groups count student tokens from ``start`` and teacher tokens from ``offset``.
    """
    # Keep whole student tokens within the valid UTF-8 prefix (repeat: cutting a token can cut a character).
    count = len(pieces)
    while True:
        valid = _valid_utf8_length(b"".join(pieces[:count]))
        ends = list(accumulate(len(piece) for piece in pieces[:count]))
        kept = sum(1 for offset in ends if offset <= valid)
        if kept == count:
            break
        count = kept
    text = b"".join(pieces[:count]).decode("utf-8")
    if not text:
        return [], [], count == len(pieces)
    # Special-token text the student spelled in plain bytes stays text for the teacher too.
    run_teacher = teacher_tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    try:
        run_groups = align_tokens(pieces[:count], [teacher_pieces[token] for token in run_teacher])
    except ValueError:
        return [], [], False  # the teacher's tokenizer changed the text (normalisation): nothing aligns
    shifted = [
        AlignedGroup(start + g.student_start, start + g.student_end, offset + g.teacher_start, offset + g.teacher_end)
        for g in run_groups
    ]
    return run_teacher, shifted, count == len(pieces)


def _cached_pieces(tokenizer: Any) -> list[bytes]:
    """:func:`token_bytes`, computed once per tokenizer object (kept on the object)."""
    pieces = getattr(tokenizer, "_opd_token_bytes", None)
    if pieces is None or len(pieces) != len(tokenizer):
        pieces = token_bytes(tokenizer)
        tokenizer._opd_token_bytes = pieces
    return pieces
