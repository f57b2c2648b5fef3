"""Start-up cost: `dptrain --help` and usage errors answer without importing torch, and
`import dptrain` loads nothing heavy until a name is used."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

HEAVY = ("torch", "dp_accounting", "scipy", "sklearn", "matplotlib", "timm", "transformers")


def imported_modules(code: str, *args: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run ``code`` in a fresh interpreter; (the process, every top-level module it imported)."""
    run = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1"})
    # -X importtime lines: "import time: self | cumulative | <indent>module.name"
    names = {line.rsplit("|", 1)[1].strip().split(".")[0] for line in run.stderr.splitlines()
             if line.startswith("import time:") and line.count("|") == 2}
    return run, names


# What the `dptrain` console script runs.
CONSOLE_SCRIPT = "import sys; from dptrain.cli import main; sys.exit(main())"


@pytest.mark.parametrize("argv, status, output", [
    (["--help"], 0, "train"),
    (["train", "--help"], 0, "--epsilon"),
    (["plan", "--help"], 0, "--input-size"),
    (["bench", "--help"], 0, "--preset"),
    (["train", "--epsilon", "-1"], 2, "--epsilon: must be a finite number > 0, got -1"),
    (["plan", "--clipping-mode", "fastest"], 2, "invalid choice: 'fastest'"),
    (["epsilon", "--epsilon", "3"], 2, "here it is --target-epsilon"),
    (["train", "--target-epsilon", "3"], 2, "here the target is --epsilon"),
    (["train", "--model", "resnet18"], 1, "unknown model 'resnet18'; valid: cnn, mlp, torchvision:NAME or timm:NAME"),
    (["train", "--model", "hf:bert"], 1, "'hf:bert' is a text model"),
    (["plan", "--model", "timm"], 1, "unknown model 'timm'"),
])
def test_help_and_usage_errors_do_not_import_torch(argv, status, output):
    run, modules = imported_modules(CONSOLE_SCRIPT, *argv)
    assert run.returncode == status, run.stderr[-2000:]
    assert output in run.stdout + run.stderr
    assert not modules & set(HEAVY), sorted(modules & set(HEAVY))


def test_package_imports_its_public_names_on_first_use():
    code = (
        "import sys, dptrain\n"
        "assert 'torch' not in sys.modules, 'import dptrain loaded torch'\n"
        "assert set(dptrain.__all__) <= set(dir(dptrain))\n"
        "from dptrain import PrivacyEngine, CLIPPING_MODES, fix\n"
        "assert PrivacyEngine.__module__ == 'dptrain.engine' and 'bk-mixopt' in CLIPPING_MODES\n"
        "assert dptrain.nn.DPLSTM.__name__ == 'DPLSTM' and dptrain.testing.reference_clipped_gradient\n"
        "assert all(getattr(dptrain, name) is not None for name in dptrain.__all__)\n"
        "try:\n"
        "    dptrain.no_such_name\n"
        "except AttributeError as err:\n"
        "    assert 'no_such_name' in str(err)\n"
        "else:\n"
        "    raise AssertionError('no AttributeError')\n"
    )
    run, _ = imported_modules(code)
    assert run.returncode == 0, run.stderr[-3000:]


def test_accounting_imports_dp_accounting_when_an_accountant_runs():
    code = (
        "import sys, dptrain.accounting as accounting\n"
        "assert not {'torch', 'dp_accounting', 'scipy'} & set(sys.modules), 'eager import'\n"
        "assert accounting.ACCOUNTANTS\n"
        "epsilon = accounting.compute_epsilon(1.0, 0.01, 100, 1e-5, accountant='rdp')\n"
        "assert 'dp_accounting' in sys.modules and 0 < epsilon < 10\n"
        "import dp_accounting.rdp\n"
        "assert accounting.RDP_ORDERS == tuple(dp_accounting.rdp.rdp_privacy_accountant.DEFAULT_RDP_ORDERS)\n"
    )
    run, _ = imported_modules(code)
    assert run.returncode == 0, run.stderr[-3000:]


def test_cli_choices_are_the_library_ones():
    """The parser lists choices without importing torch; they must stay the library's own."""
    import torch

    from dptrain import cli
    from dptrain.core.clipping import CLIPPING_FNS
    from dptrain.core.planning import DECISION_RULES

    assert cli.CLIPPING_FNS == CLIPPING_FNS
    assert cli.DECISION_RULES == DECISION_RULES
    from dptrain.cli.options import NOISES
    from dptrain.correlated.resolve import NOISES as ENGINE_NOISES

    assert NOISES == ENGINE_NOISES
    assert all(issubclass(getattr(torch.optim, name), torch.optim.Optimizer) for name in cli.OPTIMIZERS.values())
