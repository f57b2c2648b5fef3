"""``dptrain bench``: runs the benchmark harness of a checkout (benchmarks/dptrain_bench), which is not installed
with the package."""
from __future__ import annotations

import sys
from pathlib import Path


def find_benchmarks() -> Path | None:
    """A checkout's ``benchmarks/`` folder (the harness is not installed with the package): the one next to this
    package's ``src/``, else the current directory's."""
    for root in (Path(__file__).resolve().parents[3], Path.cwd()):
        if (root / "benchmarks" / "dptrain_bench" / "__init__.py").is_file():
            return root / "benchmarks"
    return None


def run(argv: list[str]) -> int:
    """``dptrain bench``: hand the arguments whole to the harness of a checkout (its own options: --help)."""
    folder = find_benchmarks()
    if folder is None:
        print("dptrain bench: error: the benchmark harness is not installed with the package; run it from a clone "
              "of dptrain's repository: `dptrain bench` or `python benchmarks/run.py`", file=sys.stderr)
        return 1
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    from dptrain_bench import main as bench_main

    return bench_main(argv)
