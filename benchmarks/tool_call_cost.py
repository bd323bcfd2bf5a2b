"""What running a tool call costs, on a thread and in a worker process.

The built-in calculator (``1234 * 567``) through :func:`opd.rollout.tools.sandbox.run_tool`, side by side:

* **warm**: the median (with its range) of ``--calls`` calls, after one untimed call, on a thread of this process
  and in a warm worker process (pickling, the pipe's round trip, and the check for processes the call left);
* **first in a process**: a call with no worker yet (the ``forkserver`` and the worker start), and the first call
  after the worker was killed (a new worker).

Run::

    OMP_NUM_THREADS=1 python benchmarks/tool_call_cost.py [--calls 500]

(``--smoke``: 20 calls.) The last line is machine-readable:
``tool_call_cost thread_ms=<median> process_ms=<median> ratio=<process/thread>``.
"""

from __future__ import annotations

import argparse
import time

from harness import parse_arguments
from timing import median_and_range

from opd.rollout.tools.calculator import calculator_tool
from opd.rollout.tools.sandbox import SandboxLimits, run_tool
from opd.rollout.tools.workers import WORKERS

ARGUMENTS = {"expression": "1234 * 567"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=500, help="warm calls timed per isolation")
    arguments = parse_arguments(parser, {"calls": 20}, argv)
    tool = calculator_tool()
    WORKERS.stop_all()
    first = {}
    for label in ("first", "after a kill"):
        start = time.perf_counter()
        assert run_tool(tool, tool.name, ARGUMENTS, SandboxLimits(isolation="process")).ok
        first[label] = time.perf_counter() - start
        WORKERS.stop_all()
    warm = {
        isolation: median_and_range(
            lambda isolation=isolation: run_tool(tool, tool.name, ARGUMENTS, SandboxLimits(isolation=isolation)),
            arguments.calls,
        )
        for isolation in ("thread", "process")
    }
    WORKERS.stop_all()
    print(f"| isolation | warm call, median ms (range) over {arguments.calls} |")
    print("|---|---|")
    for isolation, (median, low, high) in warm.items():
        print(f"| {isolation} | {median * 1e3:.3f} ({low * 1e3:.3f}-{high * 1e3:.3f}) |")
    print(
        f"first call in a process: {first['first']:.3f} s; first after the worker was killed: "
        f"{first['after a kill']:.3f} s"
    )
    thread_ms, process_ms = warm["thread"][0] * 1e3, warm["process"][0] * 1e3
    print(f"tool_call_cost thread_ms={thread_ms:.4f} process_ms={process_ms:.4f} ratio={process_ms / thread_ms:.2f}")


if __name__ == "__main__":
    main()
