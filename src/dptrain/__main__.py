"""``python -m dptrain``: the ``dptrain`` command (``dptrain.cli.main``, the console script's entry point)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
