"""What every subcommand shares: the user-error type and one-line messages on stderr."""
from __future__ import annotations

import sys


class CLIError(Exception):
    """A user error: printed as one line, exit status 1."""


def one_line(err: BaseException) -> str:
    """An error message on one line (the engine's validation lists its problems as ``- ...`` lines)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    rest = [line.lstrip("- ") for line in lines[1:]]  # validate() lists problems as "- ..." lines
    return " ".join([lines[0], "; ".join(rest)]) if rest else lines[0]


def one_line_warning(command: str):
    """A ``warnings.showwarning`` that prints ``dptrain COMMAND: warning: ...`` on one line."""

    def show(message, category, filename, lineno, file=None, line=None):
        print(f"dptrain {command}: warning: {one_line(Exception(str(message)))}", file=sys.stderr)

    return show


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"
