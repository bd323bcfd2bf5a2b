"""How long a command takes to read its config: plain merges and libyaml against OmegaConf's merge and PyYAML.

Before it imports a model, every ``opd train`` (and ``eval``, ``plan``, ``sft``, ``generate``) reads its config
twice: :func:`opd.utils.config_keys.check_config_keys` refuses a misspelt key before torch is imported, then
:func:`opd.utils.config.load_config` reads it again for pydantic. Each read parses the YAML files of the
``defaults`` chain and merges them and every command-line override into one tree.

opd merges plain dictionaries (:func:`opd.utils.config._merge`) and parses with libyaml where PyYAML has it. The
reference is the way before: each merge through OmegaConf (the whole tree copied into OmegaConf's nodes and back)
and PyYAML's pure-Python parser. The script checks that both ways give the same config before it times anything.

Cases: ``distillation_tiny.yaml`` with the 14 overrides of the run-lifecycle tests, and the spec case's
``distillation_math.yaml`` as written. Reported: the median and range of ``--repeats`` timed reads (key check
and load) of each way, after one untimed one, and their ratio. Run::

    python benchmarks/config_loading.py [--repeats 20]

(``--smoke``: 3 timed reads of each.)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

import yaml
from harness import REPO
from omegaconf import OmegaConf
from timing import median_and_range

import opd.utils.config as config_module
import opd.utils.strict_yaml as strict_yaml
from opd.distillation.config import MasterConfig
from opd.utils.config import load_config
from opd.utils.config_keys import check_config_keys

CONFIGS = REPO / "examples" / "configs"
LIFECYCLE_OVERRIDES = [
    "output_dir=/tmp/opd_config_loading",
    f"data.train_path={REPO / 'examples' / 'data' / 'tiny_arithmetic' / 'train.jsonl'}",
    f"data.val_path={REPO / 'examples' / 'data' / 'tiny_arithmetic' / 'val.jsonl'}",
    "data.max_train_examples=40",
    "training.batch_size=8",
    "training.num_epochs=5",
    "training.max_num_steps=12",
    "training.save_freq=3",
    "training.val_freq=0",
    "validation.val_at_start=false",
    "validation.val_at_end=false",
    "distillation.lambda=0.5",
    "distillation.generate_strategy.max_length=8",
    "validation.generate_strategy.max_length=8",
]
"""``tests/functional/test_run_lifecycle.py``'s overrides (its paths and output directory)."""
CASES = {
    "tiny_14_overrides": (CONFIGS / "distillation_tiny.yaml", LIFECYCLE_OVERRIDES),
    "spec_math": (CONFIGS / "distillation_math.yaml", []),
}


def _omegaconf_merge(base: dict[str, Any], incoming: dict[str, Any]) -> dict[str, Any]:
    merged = OmegaConf.merge(OmegaConf.create(base), OmegaConf.create(incoming))
    return dict(OmegaConf.to_container(merged, resolve=False))  # type: ignore[arg-type]


@contextlib.contextmanager
def the_way_before() -> Iterator[None]:
    """OmegaConf's merge and PyYAML's pure-Python parser in place of opd's, for the duration."""
    plain_merge, with_libyaml = config_module._merge, yaml.__with_libyaml__
    config_module._merge = _omegaconf_merge
    yaml.__with_libyaml__ = False
    importlib.reload(strict_yaml)  # the loader's base is chosen at import
    try:
        yield
    finally:
        config_module._merge, yaml.__with_libyaml__ = plain_merge, with_libyaml
        importlib.reload(strict_yaml)


def read(path, overrides) -> MasterConfig:
    """What a command does before it imports a model: the key check, then the full load."""
    check_config_keys("train", path, overrides)
    return load_config(MasterConfig, path, overrides)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20, help="timed reads of each way and case")
    parser.add_argument("--smoke", action="store_true", help="3 timed reads of each")
    args = parser.parse_args()
    if args.smoke:
        args.repeats = 3
    print(f"median [min-max] of {args.repeats} timed reads (key check and load) after one untimed, in ms")
    ratios = {}
    for case, (path, overrides) in CASES.items():
        with the_way_before():
            before = read(path, overrides)
            timed_before = median_and_range(lambda: read(path, overrides), args.repeats)  # noqa: B023
        now = read(path, overrides)
        if now != before:
            raise SystemExit(f"config_loading: the two ways read {case} differently")
        timed_now = median_and_range(lambda: read(path, overrides), args.repeats)  # noqa: B023
        for label, (median, low, high) in (("OmegaConf + PyYAML", timed_before), ("plain + libyaml", timed_now)):
            print(f"  {case:<18} {label:<19} {1000 * median:8.1f} [{1000 * low:.1f}-{1000 * high:.1f}]")
        ratios[case] = timed_now[0] / timed_before[0]
    print("config_loading " + " ".join(f"{case}={ratio:.3f}" for case, ratio in ratios.items()))


if __name__ == "__main__":
    main()
