"""Counts the feature pairs opd's config validation accepts (issue 35's pair count).

Every non-default value of every axis of ``tests/feature_matrix.py`` alone, and every
pair of non-default values from two different axes, is validated on
``examples/configs/distillation_tiny.yaml`` (config validation only: nothing is loaded or
run). Prints the counts, the refused singles and a table of the refused pairs with the
first line of each refusal.

    python scripts/feature_pairs.py [--markdown] [--covering-array]

``--covering-array`` also prints the runs of the combination test
(``tests/functional/test_feature_pairs.py``): how many cover the accepted pairs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import feature_matrix as fm


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--covering-array", action="store_true", help="also print the combination test's runs")
    parser.add_argument("--width", type=int, default=160, help="cut each refusal's first line to this many characters")
    arguments = parser.parse_args(argv)

    singles = fm.non_default_settings()
    refused_singles = [(setting, fm.refusal(dict([setting]))) for setting in singles]
    refused_singles = [(setting, message) for setting, message in refused_singles if message is not None]
    pairs = fm.all_pairs()
    refused_pairs = [(pair, fm.refusal(dict(pair))) for pair in pairs]
    refused_pairs = [(pair, message) for pair, message in refused_pairs if message is not None]

    print(f"axes: {', '.join(f'{axis} ({len(values) - 1} non-default)' for axis, values in fm.AXES.items())}")
    print(f"singles accepted: {len(singles) - len(refused_singles)} / {len(singles)}")
    print(f"pairs accepted: {len(pairs) - len(refused_pairs)} / {len(pairs)}")
    print()
    print("refused singles:")
    for (axis, name), message in refused_singles:
        print(f"  {axis}={name}: {fm.first_line(message)[: arguments.width]}")
    print()
    print(f"refused pairs ({len(refused_pairs)}):")
    print("| pair | refusal (first line) |")
    print("|---|---|")
    for pair, message in refused_pairs:
        text = fm.first_line(message)[: arguments.width].replace("|", "\\|")
        print(f"| {fm.label(dict(pair))} | {text} |")

    if arguments.covering_array:
        print()
        for title, runs in fm.combination_runs().items():
            print(f"{title}: {len(runs)} runs")
            for run in runs:
                print(f"  {fm.label(run)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
