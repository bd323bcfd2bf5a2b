"""Convert a math-cl dataset (``problem``, ``ground_truth_answer``) to chat-format JSONL, once.

For an offline cluster, or to inspect the prompts training will see::

    python -m opd.data.convert_math_cl --input pe-nlp/math-cl --output math_cl.jsonl \\
        --prompt-file examples/prompts/math_think_answer.txt

Reads any format :func:`opd.data.datasets.load_chat_dataset` reads; converts with
:func:`opd.data.converters.math_cl_to_chat`.
"""

import argparse
import json
import sys
from pathlib import Path

from opd.data.datasets import load_chat_dataset
from opd.utils.errors import DataError, OpdError


def _build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m opd.data.convert_math_cl",
        description="Convert a math-cl dataset (problem, ground_truth_answer) to chat-format JSONL.",
    )
    parser.add_argument(
        "--input",
        required=True,
        help="a .jsonl/.json/.parquet file, a save_to_disk directory, or a Hugging Face hub dataset name",
    )
    parser.add_argument(
        "--split", default="train", help="split to read from a saved DatasetDict or hub dataset (default: train)"
    )
    parser.add_argument("--output", required=True, help="chat-format .jsonl file to write")
    parser.add_argument("--prompt-file", required=True, help="prompt template containing {prompt}")
    parser.add_argument("--max-examples", type=int, default=None, help="convert only the first N rows")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: 0 on success, 2 (a line on stderr) if the input, prompt file or output is unusable."""
    args = _build_arg_parser().parse_args(argv)
    try:
        # Load and convert everything before opening the output, so a bad row
        # never leaves a half-written file behind.
        examples = load_chat_dataset(
            args.input,
            split=args.split,
            data_format="math_cl",
            prompt_file=args.prompt_file,
            max_examples=args.max_examples,
        )
        output = Path(args.output)
        try:
            output.parent.mkdir(parents=True, exist_ok=True)
            with output.open("w", encoding="utf-8") as f:
                for example in examples:
                    f.write(json.dumps(example, ensure_ascii=False) + "\n")
        except OSError as err:
            raise DataError(f"could not write output file {output}: {err}") from None
    except OpdError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    print(f"wrote {len(examples)} examples to {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
