"""The package's layout holds (docs/architecture.md, "The map"): every module at most 500 lines, no import cycle
between modules, and each part of ``src/dptrain/`` imports only the parts its floor allows.

Imports are read from the source (every ``import`` statement, inside functions too), nothing is run.
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "dptrain"
MAX_LINES = 500

# What each part of src/dptrain/ may import besides _checks (docs/architecture.md's table; its package docstring
# says the same). A part is a top-level module or package.
MAY_IMPORT = {
    "_checks": set(),
    "nn": set(),
    "data": set(),
    "accounting": set(),
    "losses": set(),
    "layers": set(),
    "rows": {"layers"},
    "correlated": {"accounting"},
    "privacy": {"accounting", "data"},
    "models": {"layers", "nn"},
    "core": {"rows", "layers", "privacy", "correlated", "accounting", "losses"},
    "engine": {"core", "rows", "layers", "privacy", "correlated", "accounting", "losses", "models", "data", "nn"},
}
BELOW_ENGINE = MAY_IMPORT["engine"] | {"engine"}
MAY_IMPORT.update({
    "testing": BELOW_ENGINE,
    "integrations": BELOW_ENGINE,
    "audit": BELOW_ENGINE,
    "cli": BELOW_ENGINE | {"audit"},
})


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str) -> set[str]:
    """The modules of dptrain that module ``name`` imports (a name imported from a package: the package itself,
    unless the name is one of its modules)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: imports(name) for name in MODULES}


def part(name: str) -> str:
    """A module's part; the package's own modules (``__init__``, and ``__main__``: ``python -m dptrain``, the
    ``dptrain`` command) are ``__init__``, which may import every part."""
    top = name.split(".")[1] if "." in name else "__init__"
    return "__init__" if top == "__main__" else top


def test_no_module_is_over_500_lines():
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them along a seam): {long}"


def test_no_import_cycle():
    """Tarjan's strongly connected components of the import graph: each must be one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not cycles, f"modules that import each other in a loop: {cycles}"


def test_each_part_imports_only_what_its_floor_allows():
    parts = {part(name) for name in MODULES} - {"__init__"}
    assert parts == set(MAY_IMPORT), f"parts without a row in MAY_IMPORT (or rows without a part): " \
                                     f"{sorted(parts ^ set(MAY_IMPORT))}"
    wrong = defaultdict(set)
    for name, targets in GRAPH.items():
        if part(name) == "__init__":
            continue  # the public names, imported on first use from wherever they stand
        for target in targets:
            if part(target) not in MAY_IMPORT[part(name)] | {part(name), "_checks"}:
                wrong[part(name)].add(f"{name} -> {target}")
    assert not wrong, f"imports that run against the layout (docs/architecture.md): {dict(wrong)}"


def test_the_top_level_reads_as_a_table_of_contents():
    # __main__.py is no concern of its own: `python -m dptrain`, the dptrain command
    entries = sorted(p.name for p in PACKAGE.iterdir() if not p.name.startswith((".", "__pycache__", "__main__")))
    assert len(entries) <= 17, f"{len(entries)} entries at the top of src/dptrain/: group them by concern ({entries})"
