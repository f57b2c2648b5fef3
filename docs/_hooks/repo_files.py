"""mkdocs hook: a docs page may show a file of the repository outside docs/ (a plot under benchmarks/results/).

Pages link such files relatively (``../benchmarks/results/correlated-noise.png``), which works where the
repository is read as files (GitHub, an editor). For the site, this hook copies each linked file under
``_repo/`` and points the link there. A link to a missing file, or to a Markdown page outside docs/ (which would
not be rendered), is a warning, so ``mkdocs build --strict`` fails on it.
"""
from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

log = logging.getLogger("mkdocs.hooks.repo_files")

LINK = re.compile(r"(\]\()(\.\./[^)\s#]+)")
MOUNT = "_repo"


def _outside(page_uri: str, link: str, docs: Path, root: Path) -> str | None:
    """The repository path a page's link names, if it leaves docs/ (else None)."""
    target = (docs / posixpath.dirname(page_uri) / link).resolve()
    if docs in target.parents:
        return None
    return target.relative_to(root).as_posix() if root in target.parents else None


def on_files(files, config):
    docs = Path(config["docs_dir"]).resolve()
    root = Path(config["config_file_path"]).resolve().parent
    mounted = set()
    for file in list(files.documentation_pages()):
        for _, link in LINK.findall(Path(file.abs_src_path).read_text(encoding="utf-8")):
            path = _outside(file.src_uri, link, docs, root)
            if path is None or path in mounted:
                continue
            if path.endswith(".md"):
                log.warning(f"{file.src_uri} links {link}, a Markdown file outside docs/ that the site does not "
                            f"render: link a page of docs/ instead, or write the path as code")
            elif not (root / path).is_file():
                log.warning(f"{file.src_uri} links {link}, which does not exist")
            else:
                files.append(File.generated(config, f"{MOUNT}/{path}", abs_src_path=str(root / path)))
                mounted.add(path)
    return files


def on_page_markdown(markdown, page, config, files):
    docs = Path(config["docs_dir"]).resolve()
    root = Path(config["config_file_path"]).resolve().parent

    def mounted(match):
        path = _outside(page.file.src_uri, match.group(2), docs, root)
        if path is None or path.endswith(".md") or not (root / path).is_file():
            return match.group(0)  # left for mkdocs' own link check to report
        return match.group(1) + posixpath.relpath(f"{MOUNT}/{path}", posixpath.dirname(page.file.src_uri) or ".")

    return LINK.sub(mounted, markdown)
