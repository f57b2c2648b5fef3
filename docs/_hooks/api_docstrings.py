"""mkdocs hook: everything the API reference renders has a docstring.

mkdocstrings leaves out an object without a docstring, silently. This hook reads the ``::: identifier`` lines of
the pages under ``docs/api/``, loads the package with griffe (statically, as mkdocstrings does) and logs a warning,
which ``mkdocs build --strict`` turns into a failure, for each public module, class, function or method that
has no docstring, and for each module attribute listed in its module's ``__all__`` without one. Instance and
class attributes are described in their class's docstring and are not required to have their own.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path

import griffe

log = logging.getLogger("mkdocs.hooks.api_docstrings")

DIRECTIVE = re.compile(r"^:::\s+(\S+)", flags=re.M)


def on_pre_build(config) -> None:
    docs = Path(config["docs_dir"])
    identifiers = [i for page in sorted((docs / "api").glob("*.md")) for i in DIRECTIVE.findall(page.read_text())]
    if not identifiers:
        log.warning("docs/api/ has no '::: identifier' line: the API reference would be empty")
        return
    src = Path(config["config_file_path"]).parent / "src"
    packages: dict[str, griffe.Object] = {}
    for identifier in identifiers:
        top = identifier.split(".")[0]
        if top not in packages:
            packages[top] = griffe.load(top, search_paths=[str(src)], resolve_aliases=False)
        for path in missing_docstrings(packages[top], identifier):
            log.warning(f"{path} has no docstring (rendered by '::: {identifier}' in docs/api/): write one")


def missing_docstrings(package: griffe.Object, identifier: str) -> list[str]:
    """The objects under ``identifier`` that the API reference renders and that lack a docstring."""
    relative = identifier.split(".", 1)[1] if "." in identifier else ""
    root = package[relative] if relative else package
    missing: list[str] = []
    walk(resolved(root), missing, top=True)
    return missing


def resolved(obj):
    return obj.final_target if obj.is_alias else obj


def walk(obj, missing: list[str], top: bool) -> None:
    if not obj.docstring:
        missing.append(obj.path)
    if not (obj.is_class or (obj.is_module and top)):
        return  # a submodule is documented where a page names it
    for member in obj.members.values():
        if member.name.startswith("_"):
            continue
        if obj.is_module:
            if not member.is_public or (member.is_alias and member.name not in (obj.exports or ())):
                continue  # an imported name is documented where it is defined, unless the module exports it
            try:
                member = resolved(member)
            except griffe.AliasResolutionError:
                continue  # defined outside the package (torch, transformers)
            if member.is_module:
                continue
        elif member.is_alias:
            continue
        if member.is_attribute:
            if obj.is_module and member.name in (obj.exports or ()) and not member.docstring:
                missing.append(member.path)
            continue
        walk(member, missing, top=False)
