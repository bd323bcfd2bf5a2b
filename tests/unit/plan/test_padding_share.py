"""``opd plan``'s padding share (:mod:`opd.plan.padding`), against shares worked out by hand.

Each test writes a small JSONL whose rows have known token lengths: the tiny tokenizer maps each byte to one
token, and a chat template that writes only the messages' contents makes a prompt of ``k`` bytes ``k`` tokens and
a reference response of ``m`` bytes ``m`` tokens (no EOS). The expected shares below are plain arithmetic over
those lengths, each micro-batch costing its rows × its longest row.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from opd_test_helpers import REPO_ROOT

from opd.distillation.config import MasterConfig
from opd.plan.dry_run import RankMemory
from opd.plan.memory_plan import MemoryPlan, render_plan
from opd.plan.padding import PaddingShare, UnknownPadding, estimate_padding
from opd.utils.config import load_config

TINY_CONFIG = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
CONTENTS_ONLY = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
"""A chat template that adds no tokens of its own: a row's length is its prompt's bytes plus its response's."""
BUDGET = 32  # distillation.generate_strategy.max_length of the tiny config


def write_rows(path: Path, rows: list[tuple[int, int | None]]) -> Path:
    """A chat JSONL of (prompt bytes, reference response bytes or None for no reference) rows."""
    with path.open("w") as file:
        for prompt, response in rows:
            messages = [{"role": "user", "content": "p" * prompt}]
            if response is not None:
                messages.append({"role": "assistant", "content": "r" * response})
            file.write(json.dumps({"messages": messages}) + "\n")
    return path


def config_for(data: Path | str, *overrides: str) -> MasterConfig:
    """The tiny config on ``data``, in file order (no shuffle), with the contents-only chat template."""
    config = load_config(
        MasterConfig,
        TINY_CONFIG,
        [
            f"data.train_path={data}",
            "data.val_path=null",
            "data.shuffle=false",
            "distillation.num_samples_per_prompt=1",
            *overrides,
        ],
    )
    return config.model_copy(update={"data": config.data.model_copy(update={"chat_template": CONTENTS_ONLY})})


def estimated(config: MasterConfig, ranks: int = 1) -> PaddingShare:
    estimate = estimate_padding(config, ranks)
    assert isinstance(estimate, PaddingShare), estimate.describe()
    return estimate


# Eight rows of 2, 11, 3, 10, 4, 9, 5 and 8 tokens (a 1-token reference each), in that order.
EIGHT = [(length - 1, 1) for length in (2, 11, 3, 10, 4, 9, 5, 8)]
EIGHT_REAL = 2 + 11 + 3 + 10 + 4 + 9 + 5 + 8  # 52


def test_two_steps_of_four_rows_in_micro_batches_of_two(tmp_path):
    # Step 1: 10, 2, 9, 3 tokens; step 2: four rows of 4; a ninth row makes no whole step and is not read.
    rows = [(6, 4), (1, 1), (5, 4), (2, 1), (2, 2), (3, 1), (1, 3), (2, 2), (50, 1)]
    config = config_for(
        write_rows(tmp_path / "train.jsonl", rows), "training.batch_size=4", "training.micro_batch_size=2"
    )
    estimate = estimated(config)
    real = (10 + 2 + 9 + 3) + 4 * 4
    # Sorted: [10, 9] [3, 2] pad to 2 × 10 + 2 × 3; unsorted: [10, 2] [9, 3] pad to 2 × 10 + 2 × 9.
    assert estimate.sorted_share == pytest.approx(1 - real / (2 * 10 + 2 * 3 + 4 * 4))
    assert estimate.unsorted_share == pytest.approx(1 - real / (2 * 10 + 2 * 9 + 4 * 4))
    assert (estimate.rows, estimate.reference_rows) == (8, 8)
    assert estimate.describe() == (
        f"padding: {1 - 40 / 42:.1%} of a step's tokens (sorted micro-batches of 2; {1 - 40 / 54:.1%} unsorted; "
        f"sequence_packing: true removes it), from 8 rows of {tmp_path / 'train.jsonl'} with their reference "
        f"responses (capped at the {BUDGET}-token response budget)"
    )


def test_rows_are_dealt_over_the_ranks_by_tokens_before_each_rank_cuts_its_own(tmp_path):
    config = config_for(
        write_rows(tmp_path / "train.jsonl", EIGHT), "training.batch_size=8", "training.micro_batch_size=2"
    )
    one_rank = estimated(config, ranks=1)
    # One rank: [11, 10] [9, 8] [5, 4] [3, 2] sorted; [2, 11] [3, 10] [4, 9] [5, 8] unsorted.
    assert one_rank.sorted_share == pytest.approx(1 - EIGHT_REAL / (22 + 18 + 10 + 6))
    assert one_rank.unsorted_share == pytest.approx(1 - EIGHT_REAL / (22 + 20 + 18 + 16))
    # Two ranks, longest first to the rank with fewer tokens (ties to rank 0): 11 → r0, 10 → r1, 9 → r1, 8 → r0,
    # 5 → r0 (19 each), 4 → r1, 3 → r1 (full), 2 → r0. In file order rank 0 holds 2, 11, 5, 8 and rank 1 3, 10, 4, 9.
    two_ranks = estimated(config, ranks=2)
    assert two_ranks.sorted_share == pytest.approx(1 - EIGHT_REAL / ((22 + 10) + (20 + 8)))
    assert two_ranks.unsorted_share == pytest.approx(1 - EIGHT_REAL / ((22 + 16) + (20 + 18)))
    assert "sorted micro-batches of 2 on each of 2 ranks" in two_ranks.describe()


def test_a_token_budget_cuts_sorted_rows_only(tmp_path):
    overrides = ("training.batch_size=8", "training.micro_batch_size=null", "training.micro_batch_tokens=20")
    estimate = estimated(config_for(write_rows(tmp_path / "train.jsonl", EIGHT), *overrides))
    # Longest first, filled while rows × the first row's length ≤ 20: [11] [10, 9] [8, 5] [4, 3, 2].
    assert estimate.sorted_share == pytest.approx(1 - EIGHT_REAL / (11 + 2 * 10 + 2 * 8 + 3 * 4))
    assert estimate.unsorted_share is None
    assert "(sorted micro-batches of ≤ 20 padded tokens; sequence_packing" in estimate.describe()


def test_each_prompts_samples_are_rows_of_its_length(tmp_path):
    rows = [(9, 1), (1, 1)]
    overrides = ("training.batch_size=2", "distillation.num_samples_per_prompt=2", "training.micro_batch_size=3")
    estimate = estimated(config_for(write_rows(tmp_path / "train.jsonl", rows), *overrides))
    # Rows 10, 10, 2, 2: sorted [10, 10, 2] [2] (the remainder last pads less than first: 32 < 40); unsorted alike.
    assert estimate.sorted_share == pytest.approx(1 - 24 / (3 * 10 + 2))
    assert estimate.unsorted_share == pytest.approx(1 - 24 / (3 * 10 + 2))


def test_a_row_without_a_reference_counts_the_budget_and_a_longer_reference_is_capped(tmp_path):
    rows = [(3, None), (5, BUDGET + 8)]
    config = config_for(
        write_rows(tmp_path / "train.jsonl", rows), "training.batch_size=2", "training.micro_batch_size=2"
    )
    estimate = estimated(config)
    # 3 + 32 and 5 + 32 tokens, in one micro-batch.
    assert estimate.sorted_share == pytest.approx(1 - (35 + 37) / (2 * 37))
    assert estimate.reference_rows == 1
    assert estimate.describe().endswith(
        f"with reference responses for 1 of them (capped at the {BUDGET}-token response budget) and the "
        f"{BUDGET}-token response budget for the rest"
    )
    no_reference = [(3, None), (5, None)]
    only_budget = estimated(config_for(write_rows(tmp_path / "budget.jsonl", no_reference), "training.batch_size=2"))
    assert only_budget.describe().endswith(
        f"with responses of the {BUDGET}-token response budget (the rows have no reference responses)"
    )


def test_sorted_micro_batches_pad_no_more_than_unsorted_ones(tmp_path):
    draw = random.Random(0)
    rows = [(draw.randint(1, 60), draw.randint(1, 30)) for _ in range(96)]
    data = write_rows(tmp_path / "train.jsonl", rows)
    for micro_batch_size, ranks in ((2, 1), (3, 1), (4, 2), (5, 3)):
        config = config_for(data, "training.batch_size=12", f"training.micro_batch_size={micro_batch_size}")
        estimate = estimated(config, ranks)
        assert estimate.unsorted_share is not None
        assert 0 < estimate.sorted_share <= estimate.unsorted_share, (micro_batch_size, ranks)


def test_sequence_packing_leaves_no_padding_and_reports_the_unpacked_share(tmp_path):
    rows = [(6, 4), (1, 1), (5, 4), (2, 1)]
    overrides = ("training.batch_size=4", "training.micro_batch_size=2", "training.sequence_packing=true")
    estimate = estimated(config_for(write_rows(tmp_path / "train.jsonl", rows), *overrides))
    assert estimate.configured_share == 0.0
    assert estimate.sorted_share == pytest.approx(1 - 24 / 26)
    assert estimate.describe().startswith(
        "padding: none: sequence_packing: true packs each micro-batch into one row (unpacked, "
        f"{1 - 24 / 26:.1%} of a step's tokens with sorted micro-batches of 2; {1 - 24 / 38:.1%} unsorted)"
    )
    assert estimate.as_dict()["configured_share"] == 0.0


def test_data_that_cannot_be_read_here_makes_the_share_unknown(tmp_path):
    missing = estimate_padding(config_for(tmp_path / "absent.jsonl"), 1)
    assert isinstance(missing, UnknownPadding) and missing.configured_share is None
    assert missing.describe() == (
        f"padding: unknown (data.train_path {tmp_path / 'absent.jsonl'} is no file or directory here (a hub dataset, "
        "or data on another machine); opd plan reads local data only); sequence_packing: true removes it"
    )
    hub = estimate_padding(config_for("someone/some-dataset"), 1)
    assert hub.describe().startswith("padding: unknown (data.train_path someone/some-dataset is no file")
    malformed = tmp_path / "malformed.jsonl"
    malformed.write_text('{"messages": [\n')
    unreadable = estimate_padding(config_for(malformed), 1)
    assert unreadable.describe().startswith(f"padding: unknown (data file {malformed}, line 1: invalid JSON")
    packed = estimate_padding(config_for(tmp_path / "absent.jsonl", "training.sequence_packing=true"), 1)
    assert packed.configured_share == 0.0
    assert packed.describe().startswith("padding: none: sequence_packing: true packs each micro-batch into one row")


def test_a_tokenizer_neither_local_nor_cached_makes_the_share_unknown_without_a_download(tmp_path):
    data = write_rows(tmp_path / "train.jsonl", [(4, 4)] * 8)
    estimate = estimate_padding(config_for(data, "model.tokenizer_path=nobody-here/no-such-tokenizer"), 1)
    assert estimate.describe().startswith(
        "padding: unknown (the tokenizer nobody-here/no-such-tokenizer is neither local nor in the Hugging Face cache"
    )


def test_fewer_rows_than_a_step_make_the_share_unknown(tmp_path):
    estimate = estimate_padding(config_for(write_rows(tmp_path / "train.jsonl", [(4, 4)] * 3)), 1)
    assert estimate.describe().startswith("padding: unknown (3 usable rows, fewer than one step's 8 prompts)")


def tiny_plan(padding: PaddingShare | UnknownPadding) -> MemoryPlan:
    """A plan of the tiny config without a dry run (as ``test_plan_headroom`` builds one): one rank's made-up peak."""
    rank = RankMemory(0, 2**20, {}, 2**10, 2**10, 2**11, 2**19, 0)
    return MemoryPlan(
        world_size=1,
        student="tiny:student",
        teacher="tiny:teacher",
        teacher_placement="colocated, whole",
        micro_batch_size=2,
        prompt_tokens=128,
        response_tokens=BUDGET,
        vocab_size=259,
        activation_checkpointing=False,
        student_parameters_total=2**10,
        teacher_parameters_total=0,
        ranks={"off": [rank]},
        ranks_equal=True,
        teacher_whole_bytes=0,
        loss_chunk_rows=16,
        loss_chunk_bytes=0,
        kv_bytes_per_token=256,
        shard_ranks=1,
        padding=padding,
    )


def test_the_plan_prints_the_line_and_writes_it_to_its_json(tmp_path):
    config = config_for(
        write_rows(tmp_path / "train.jsonl", EIGHT), "training.batch_size=8", "training.micro_batch_size=2"
    )
    padding = estimate_padding(config, 1)
    plan = tiny_plan(padding)
    assert padding.describe() in render_plan(plan).splitlines()
    written = json.loads(json.dumps(plan.as_dict()))["padding"]
    assert written["configured_share"] == pytest.approx(1 - EIGHT_REAL / (22 + 18 + 10 + 6))
    assert written["unsorted_share"] == pytest.approx(1 - EIGHT_REAL / (22 + 20 + 18 + 16))
    assert written["line"] == padding.describe()
    unknown = tiny_plan(estimate_padding(config_for(tmp_path / "absent.jsonl"), 1))
    assert any(line.startswith("padding: unknown (") for line in render_plan(unknown).splitlines())
    assert json.loads(json.dumps(unknown.as_dict()))["padding"]["configured_share"] is None
