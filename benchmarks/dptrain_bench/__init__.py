"""dptrain's benchmark harness (``dptrain bench``, ``python benchmarks/run.py``, ``python -m dptrain_bench``).

It lives in a checkout's ``benchmarks/``, not in the installed package: ``harness`` measures, ``options`` holds the
command's options (torch-free, so ``--help`` answers at once). See benchmarks/README.md.
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
    from .harness import main as run

    return run(argv)
