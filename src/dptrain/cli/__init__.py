"""The ``dptrain`` command: ``train`` (private training), ``plan`` (per-layer decisions), ``epsilon``, ``audit``
and ``bench``, one module each; ``options`` is the parser, ``output`` the one-line messages they share.

``main(argv)`` returns the exit status, so everything here can be run in-process by tests.
An invalid value ends the command with one line on stderr and a non-zero status, never a
traceback; an exception that is not a user error (a bug) still shows its traceback.

torch and the parts of the library built on it are imported inside the functions that use
them: ``dptrain --help`` and a usage error answer at once, without loading torch.

The top floor: it may import every part of dptrain but ``testing`` and ``integrations``; nothing imports it.
"""
from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Sequence
from importlib import import_module

from .datasets import DATASETS
from .options import CLIPPING_FNS, DECISION_RULES, OPTIMIZERS, TRAIN_DEFAULTS, build_parser
from .output import CLIError, one_line, one_line_warning
from .plan import plan_report

__all__ = ["CLIError", "CLIPPING_FNS", "DATASETS", "DECISION_RULES", "OPTIMIZERS", "TRAIN_DEFAULTS", "build_parser",
           "main", "plan_report"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``dptrain`` command; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        from .bench import run as bench

        return bench(argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, or a usage error already printed on one line
        return exit_.code if isinstance(exit_.code, int) else 1
    if args.command is None:
        parser.print_help()
        return 2
    # dp_accounting logs (through absl) every RDP order it skips; that is noise on a terminal.
    absl_logger = logging.getLogger("absl")
    absl_level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.showwarning = one_line_warning(args.command)
        try:
            return import_module(f"{__name__}.{args.command}").run(args)
        except (CLIError, ValueError) as err:  # ValueError: the library's validation of a user value
            print(f"dptrain {args.command}: error: {one_line(err)}", file=sys.stderr)
            return 1
        except BrokenPipeError:  # the reader closed the pipe (`dptrain plan --json | head`): not our error
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
            return 141
        finally:
            absl_logger.setLevel(absl_level)  # main() may run in-process: leave the caller's logging as it was
