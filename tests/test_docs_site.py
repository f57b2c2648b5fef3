"""The documentation site: ``mkdocs build --strict`` passes (a broken link, a page outside the nav or a missing
docstring fails it), the API reference names every public name, every example has its tutorial, and a tutorial's
excerpts are its example's code.

The build needs the ``docs`` extra (``pip install -e '.[docs]'``; the ``test`` extra brings it too); without it
that test skips, saying so. The other tests read the files only.
"""
import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import dptrain

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
DOCS_EXTRA = ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python", "griffe")


def missing_docs_extra() -> list[str]:
    def found(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # a parent package is missing
            return False

    return [name for name in DOCS_EXTRA if not found(name)]


needs_docs_extra = pytest.mark.skipif(
    bool(missing_docs_extra()),
    reason=f"the docs extra is not installed (missing {', '.join(missing_docs_extra())}): pip install -e '.[docs]'")


@pytest.mark.slow
@needs_docs_extra
def test_site_builds_with_warnings_as_errors(tmp_path):
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    warnings = [line for line in result.stderr.splitlines() if "WARNING" in line or "ERROR" in line]
    assert result.returncode == 0 and not warnings, result.stderr[-6000:]
    api = (site / "api" / "dptrain" / "index.html").read_text()
    assert 'id="dptrain.engine.PrivacyEngine.backward"' in api  # generated from the docstrings
    tutorial = (site / "tutorials" / "timm-classification" / "index.html").read_text()
    assert "corner_squares" in tutorial  # the example's code, included whole
    assert (site / "_repo" / "benchmarks" / "results" / "correlated-noise.png").is_file()  # a plot outside docs/


def api_directives(page: str) -> list[str]:
    return re.findall(r"^:::\s+(\S+)", (DOCS / "api" / page).read_text(), flags=re.M)


def test_api_reference_names_every_public_name():
    documented = set(api_directives("dptrain.md"))
    exports = dptrain._EXPORTS
    missing = [name for name in dptrain.__all__
               if name != "nn" and not any(d.endswith(f".{name}") and d.startswith(f"dptrain.{exports[name]}")
                                           for d in documented)]
    assert not missing, f"docs/api/dptrain.md has no '::: ...' entry for {missing}"
    assert "dptrain.nn" in api_directives("nn.md")
    for page, module in [("data.md", "dptrain.data"), ("losses.md", "dptrain.losses"),
                         ("testing.md", "dptrain.testing"), ("integrations.md", "dptrain.integrations")]:
        assert module in api_directives(page), f"docs/api/{page} does not render {module}"
    integrations = set(api_directives("integrations.md"))
    for submodule in ("hf_trainer", "accelerate", "lightning", "loaders"):
        assert f"dptrain.integrations.{submodule}" in integrations


def tutorials() -> dict[Path, Path]:
    """{tutorial page: the example it includes whole}."""
    pages = {}
    for page in sorted((DOCS / "tutorials").glob("*.md")):
        included = re.findall(r'^--8<-- "(examples/[\w.]+)"$', page.read_text(), flags=re.M)
        if included:
            assert len(included) == 1, f"{page.name} includes {included}: one example per page"
            pages[page] = ROOT / included[0]
    return pages


def test_every_example_has_a_tutorial_in_the_nav():
    included = {example.name for example in tutorials().values()}
    examples = {path.name for path in (ROOT / "examples").glob("*.py")}
    assert examples == included, f"examples without a tutorial page: {sorted(examples - included)}"
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in tutorials():
        assert f"tutorials/{page.name}" in nav, f"{page.name} is not in mkdocs.yml's nav"
        assert f"({page.name})" in (DOCS / "tutorials" / "index.md").read_text()


def excerpt_in(excerpt: str, code: str) -> bool:
    """Whether ``excerpt`` is a run of consecutive lines of ``code`` (indentation as there, or dedented alike)."""
    lines = [line.rstrip() for line in textwrap.dedent(excerpt).strip("\n").splitlines()]
    source = [line.rstrip() for line in code.splitlines()]
    for start in range(len(source) - len(lines) + 1):
        window = source[start:start + len(lines)]
        if [line.rstrip() for line in textwrap.dedent("\n".join(window)).splitlines()] == lines:
            return True
    return False


def test_tutorial_excerpts_are_the_examples_code():
    """A tutorial shows its example's lines, not a paraphrase that could drift from the code that runs."""
    checked = 0
    for page, example in tutorials().items():
        code = example.read_text()
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S):
            if block.startswith("--8<--"):
                continue
            assert excerpt_in(block, code), f"{page.name}: this excerpt is not in {example.name}:\n{block}"
            checked += 1
    assert checked >= 2 * len(tutorials())


def test_excerpt_check_sees_a_changed_line():
    code = "def f(x):\n    y = x + 1\n    return y\n"
    assert excerpt_in("    y = x + 1\n    return y\n", code)
    assert excerpt_in("y = x + 1\nreturn y\n", code)  # dedented alike
    assert not excerpt_in("    y = x + 2\n    return y\n", code)
    assert not excerpt_in("def f(x):\n    return y\n", code)  # not consecutive


# ------------------------------------------------------------------ the hooks the strict build relies on
def load_hook(name: str):
    spec = importlib.util.spec_from_file_location(name, DOCS / "_hooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_docs_extra
def test_docstring_hook_names_what_lacks_a_docstring(tmp_path):
    import griffe

    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text('"""A package."""\n__all__ = ["Thing", "helper", "LIMIT"]\n'
                                         'from .impl import Thing, helper\nLIMIT = 3\n')
    (package / "impl.py").write_text(textwrap.dedent('''\
        """The implementation."""
        class Thing:
            """A thing."""
            size = 1
            def documented(self):
                """Does it."""
            def undocumented(self):
                pass
            def _private(self):
                pass
        def helper():
            pass
        def _hidden():
            pass
        '''))
    hook = load_hook("api_docstrings")
    loaded = griffe.load("pkg", search_paths=[str(tmp_path)], resolve_aliases=False)
    assert sorted(hook.missing_docstrings(loaded, "pkg")) == ["pkg.LIMIT", "pkg.impl.Thing.undocumented",
                                                              "pkg.impl.helper"]
    assert hook.missing_docstrings(loaded, "pkg.impl.Thing") == ["pkg.impl.Thing.undocumented"]


@needs_docs_extra
def test_repo_files_hook_maps_links_outside_docs():
    hook = load_hook("repo_files")
    docs, root = DOCS.resolve(), ROOT.resolve()
    assert hook._outside("correlated-noise.md", "../benchmarks/results/x.png", docs, root) == "benchmarks/results/x.png"
    assert hook._outside("tutorials/a.md", "../../examples/ddp_train.py", docs, root) == "examples/ddp_train.py"
    assert hook._outside("tutorials/a.md", "../engine.md", docs, root) is None  # inside docs/: mkdocs checks it
