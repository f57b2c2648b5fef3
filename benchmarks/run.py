#!/usr/bin/env python
"""Run the dptrain benchmark suite; the same as ``dptrain bench``. See benchmarks/README.md.

    python benchmarks/run.py --list
    python benchmarks/run.py --scale cpu --configs gpt2-t64 vgg11-gn-32
"""
import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the harness, benchmarks/dptrain_bench
if importlib.util.find_spec("dptrain") is None:  # run from a checkout without installing the package
    sys.path.insert(1, str(HERE.parent / "src"))

from dptrain_bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
