"""The ``opd`` command line: ``opd train --config FILE [key.sub=value ...]``.

User mistakes (config, data, incompatible models) end the run with one ``error:`` line
and exit status 2, before any model is loaded where possible; no traceback is shown
for them.
"""

from __future__ import annotations

import argparse
import sys

from opd.utils.errors import OpdError

EXIT_USER_ERROR = 2


def _add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="YAML config file")
    parser.add_argument(
        "overrides", nargs="*", metavar="key.sub=value", help="config overrides, e.g. training.learning_rate=1e-5"
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``opd`` command."""
    parser = argparse.ArgumentParser(prog="opd", description="On-policy knowledge distillation for LLMs.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = commands.add_parser("train", help="run on-policy distillation (student learns from teacher)")
    _add_config_arguments(train)
    return parser


def quiet_third_party_output() -> None:
    """Keeps the console to opd's own progress lines.

    transformers draws a progress bar for every shard it writes or loads (one per
    checkpoint), and torchdata warns about an internal call of its own on every start.
    """
    import warnings

    import transformers

    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message=".*set_vital.*")


def run_train(config_path: str, overrides: list[str]) -> None:
    """Loads and validates the config, builds every component and runs the training loop."""
    # Imported here so that `opd --help` and config errors do not pay for importing torch.
    from opd.algorithms.distillation import MasterConfig, distillation_train, setup
    from opd.utils.config import load_config
    from opd.utils.logger import setup_console_logging

    setup_console_logging()
    quiet_third_party_output()
    config = load_config(MasterConfig, config_path, overrides)
    distillation_train(*setup(config))


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``opd`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "train":
            run_train(args.config, args.overrides)
    except OpdError as error:
        print(f"opd: error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
