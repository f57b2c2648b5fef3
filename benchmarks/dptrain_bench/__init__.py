"""dptrain's benchmark harness (``dptrain bench``, ``python benchmarks/run.py``, ``python -m dptrain_bench``).

It lives in a checkout's ``benchmarks/``, not in the installed package. Its modules:

- ``options``: the command's options (torch-free, so ``--help`` answers at once); ``cli``: the command itself;
- ``zoo``: the models and their batches; ``arms``: the ways of training them that are compared;
- ``memory``: peak-memory probes and the largest-batch search; ``workers``: the measurements, each in a fresh process;
- ``harness``: a run over configurations and arms; ``presets``: fixed plans within a time budget;
- ``environment``: hardware, versions and commit; ``reports``: ratios, targets, JSON, CSV, Markdown and PNG;
- ``gpu_table`` (``python -m dptrain_bench.gpu_table``, ``benchmarks/gpu_table.sh``): issue 43's GPU table in one
  device call, with ``gpu_table_rows`` (its rows and jobs), ``gpu_table_measure`` (one job, in its own process) and
  ``gpu_table_report`` (its figures, ratios and Markdown).

See benchmarks/README.md.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark command; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] != ["--worker"] and {"-h", "--help"} & set(argv):
        from .options import parser

        parser().parse_args(argv)  # prints the help and exits, without importing torch
    from .cli import main as run

    return run(argv)
