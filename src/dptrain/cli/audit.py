"""``dptrain audit``: an empirical lower bound on epsilon from one training run (dptrain.audit)."""
from __future__ import annotations

import argparse


def run(args: argparse.Namespace) -> int:
    from ..audit import run_command  # torch and scipy: imported only when an audit runs

    options = {k: v for k, v in vars(args).items() if k not in ("command", "json")}
    return run_command(options, json_output=getattr(args, "json", False))
