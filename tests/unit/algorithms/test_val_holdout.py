"""A validation set carved out of the training data (``data.val_holdout``), and the overlap report.

* the held-out rows depend on ``val_holdout_seed`` and the row count only; training and
  validation are disjoint and together are the whole source;
* the size and source limits give clear errors; ``val_path`` and ``val_holdout`` together
  are refused;
* a run set up with a holdout validates on exactly those rows and trains on the rest;
* separate validation data that repeats training prompts is reported with the count.
"""

from __future__ import annotations

import json
import logging

import pytest
from opd_test_helpers import REPO_ROOT

from opd.data.config import DataConfig
from opd.distillation.config import MasterConfig
from opd.distillation.setup import setup
from opd.models.tiny import build_tiny_tokenizer
from opd.run.run_setup import holdout_rows, load_examples, report_overlap
from opd.utils.config import load_config
from opd.utils.errors import ConfigError

TRAIN = REPO_ROOT / "examples" / "data" / "tiny_arithmetic" / "train.jsonl"
VAL = REPO_ROOT / "examples" / "data" / "tiny_arithmetic" / "val.jsonl"
TINY_CONFIG = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def prompts_of(examples) -> list[tuple[int, ...]]:
    return [tuple(example["prompt_ids"]) for example in examples]


def test_holdout_rows_are_a_seeded_sample():
    first = holdout_rows(100, 10, seed=0, source="s")
    assert len(first) == 10 and all(0 <= index < 100 for index in first)
    assert holdout_rows(100, 10, seed=0, source="s") == first
    assert holdout_rows(100, 10, seed=1, source="s") != first
    with pytest.raises(ConfigError, match=r"val_holdout = 100 would hold out every one of the 100 rows of 's'"):
        holdout_rows(100, 100, seed=0, source="s")


def test_train_and_holdout_are_disjoint_and_cover_the_source(tokenizer):
    data = DataConfig(train_path=str(TRAIN), val_holdout=32, max_prompt_length=None)
    train = load_examples(data, tokenizer, "train")
    val = load_examples(data, tokenizer, "val")
    everything = load_examples(DataConfig(train_path=str(TRAIN), max_prompt_length=None), tokenizer, "train")
    assert len(val) == 32 and len(train) == len(everything) - 32
    # As multisets of (prompt, response): the split neither loses nor duplicates a row.
    key = lambda example: (tuple(example["prompt_ids"]), tuple(example["response_ids"] or ()))  # noqa: E731
    assert sorted(map(key, train + val)) == sorted(map(key, everything))
    held = holdout_rows(len(everything), 32, 0, str(TRAIN))
    assert sorted(map(key, val)) == sorted(key(everything[index]) for index in held)
    # The training seed plays no part; the holdout seed does.
    other = load_examples(DataConfig(train_path=str(TRAIN), val_holdout=32, val_holdout_seed=5), tokenizer, "val")
    assert sorted(map(key, other)) != sorted(map(key, val))
    # The per-split limits cut each side after the holdout.
    limited = DataConfig(train_path=str(TRAIN), val_holdout=32, max_train_examples=10, max_val_examples=4)
    assert len(load_examples(limited, tokenizer, "train")) == 10
    assert prompts_of(load_examples(limited, tokenizer, "val")) == prompts_of(val)[:4]


def test_val_path_and_holdout_together_are_refused():
    with pytest.raises(ConfigError, match=r"data.val_holdout = 8 .* data.val_path = .*set one of them to null"):
        load_config(MasterConfig, TINY_CONFIG, ["data.val_holdout=8"])


def test_overlap_is_reported_with_its_count(tokenizer, tmp_path, caplog):
    data = DataConfig(train_path=str(TRAIN), val_path=str(tmp_path / "val.jsonl"))
    rows = [json.loads(line) for line in TRAIN.read_text().splitlines()[:5]]
    rows += [json.loads(line) for line in VAL.read_text().splitlines()[:3]]
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    train = load_examples(data, tokenizer, "train")
    val = load_examples(data, tokenizer, "val")
    expected = sum(prompt in set(prompts_of(train)) for prompt in prompts_of(val))
    assert expected >= 5
    with caplog.at_level(logging.WARNING, logger="opd"):
        assert report_overlap(train, val, data) == expected
    assert any(f"{expected} of the 8 validation prompts also appear" in r.getMessage() for r in caplog.records)
    held = DataConfig(train_path=str(TRAIN), val_holdout=16)
    assert report_overlap(load_examples(held, tokenizer, "train"), load_examples(held, tokenizer, "val"), held) == sum(
        prompt in set(prompts_of(load_examples(held, tokenizer, "train")))
        for prompt in prompts_of(load_examples(held, tokenizer, "val"))
    )


def test_a_run_validates_on_the_holdout_and_trains_on_the_rest(tmp_path):
    config = load_config(
        MasterConfig,
        TINY_CONFIG,
        [f"output_dir={tmp_path / 'run'}", f"data.train_path={TRAIN}", "data.val_path=null", "data.val_holdout=24",
         "training.max_num_steps=1", "logger.console=false"],
    )
    components = setup(config)
    try:
        val_prompts = {tuple(row) for batch in components.val_dataloader for row in _prompt_rows(batch)}
        train_prompts = {tuple(row) for batch in components.dataloader for row in _prompt_rows(batch)}
        assert len(val_prompts) <= 24 and len(val_prompts) > 0
        held = set(prompts_of(load_examples(config.data, components.tokenizer, "val")))
        assert val_prompts == held
        # Only a prompt the source itself repeats can be on both sides.
        source = prompts_of(load_examples(DataConfig(train_path=str(TRAIN)), components.tokenizer, "train"))
        repeated = {prompt for prompt in source if source.count(prompt) > 1}
        assert val_prompts & train_prompts <= repeated
    finally:
        components.close()


def _prompt_rows(batch):
    return [example["prompt_ids"] for example in batch]
