"""Every public import path works: each name the documentation gives (the API reference's ``:::`` entries, the
imports of the docs' and the README's code, every `dptrain.x.y` they name), each public package's ``__all__``, and
the paths modules had before the package was grouped by concern (``dptrain._MOVED``), which import the very module
that stands at the new path."""
from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import dptrain

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
PUBLIC_PACKAGES = ("dptrain", "dptrain.data", "dptrain.accounting", "dptrain.correlated", "dptrain.layers",
                   "dptrain.nn", "dptrain.models", "dptrain.testing", "dptrain.audit")


def documented_names() -> dict[str, str]:
    """{dotted path: the page that names it first}."""
    names: dict[str, str] = {}
    for page in PAGES:
        text = page.read_text()
        where = str(page.relative_to(ROOT))
        for path in re.findall(r"^:::\s+(\S+)", text, flags=re.M):
            names.setdefault(path, where)
        for block in re.findall(r"```python\n(.*?)```", text, flags=re.S):
            try:
                tree = ast.parse(block)
            except SyntaxError:  # (an excerpt: a fragment of a larger piece of code)
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "dptrain":
                    names.update({f"{node.module}.{a.name}": where for a in node.names if a.name != "*"})
                elif isinstance(node, ast.Import):
                    names.update({a.name: where for a in node.names if a.name.split(".")[0] == "dptrain"})
        for path in re.findall(r"`(dptrain(?:\.[A-Za-z_]\w*)+)", text):
            names.setdefault(path, where)
    return names


def resolve(path: str):
    """The object at a dotted path: the longest prefix that imports as a module, then attributes."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[i:]:
            obj = getattr(obj, attribute)
        return obj
    raise ModuleNotFoundError(path)


DOCUMENTED = documented_names()


def test_the_documentation_names_public_names():
    assert len(DOCUMENTED) > 50 and "dptrain.engine.PrivacyEngine" in DOCUMENTED


@pytest.mark.parametrize("path", sorted(DOCUMENTED))
def test_every_documented_name_imports(path):
    try:
        resolve(path)
    except (ImportError, AttributeError) as err:
        pytest.fail(f"{path} (named in {DOCUMENTED[path]}) does not import: {err!r}")


@pytest.mark.parametrize("package", PUBLIC_PACKAGES)
def test_every_exported_name_imports(package):
    module = importlib.import_module(package)
    missing = [name for name in module.__all__ if getattr(module, name, None) is None]
    assert not missing, f"{package}.__all__ names what it does not have: {missing}"


@pytest.mark.parametrize("old", sorted(dptrain._MOVED))
def test_a_moved_module_keeps_its_old_path(old):
    new = importlib.import_module(f"dptrain.{dptrain._MOVED[old]}")
    assert importlib.import_module(f"dptrain.{old}") is new
    assert getattr(dptrain, old) is new
    assert sys.modules[f"dptrain.{old}"] is new
    assert new.__name__ == f"dptrain.{dptrain._MOVED[old]}"  # (the module itself is not renamed)


def test_old_paths_in_the_forms_users_wrote_them():
    namespace: dict = {}
    exec("from dptrain.pipeline import StepSums\n"
         "from dptrain.step import PrivateStep\n"
         "from dptrain import checks, neighbours\n"
         "import dptrain.ledger as ledger\n"
         "from dptrain.models import SmallCNN, build_image_model, parse_spec\n", namespace)
    from dptrain.core.pipeline import StepSums
    from dptrain.privacy import ledger

    assert namespace["StepSums"] is StepSums and namespace["ledger"] is ledger
    assert namespace["checks"].positive_int("steps", 3) == 3
    assert namespace["neighbours"].neighbour_test is dptrain.testing.neighbour_test


def test_old_paths_load_nothing_heavy():
    """``import dptrain.checks`` (the argument checks, which the command line reads) stays torch-free."""
    code = ("import sys, dptrain.checks, dptrain.model_specs, dptrain.algorithms\n"
            "assert 'torch' not in sys.modules, 'an old path loaded torch'\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
