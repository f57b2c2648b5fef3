#!/usr/bin/env python
"""Run the dptrain benchmark suite; the same as ``dptrain bench``. See benchmarks/README.md.

    python benchmarks/run.py --list
    python benchmarks/run.py --scale cpu --configs gpt2-t64 vgg11-gn-32
"""
import sys
from pathlib import Path

try:
    from dptrain.benchmarking import main
except ImportError:  # run from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from dptrain.benchmarking import main

if __name__ == "__main__":
    sys.exit(main())
