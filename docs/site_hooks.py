"""MkDocs hooks (``hooks:`` in mkdocs.yml): the package READMEs become site pages, and links from the
docs to files of the repository outside ``docs/`` are resolved rather than left dangling.

Each distribution's README is the front door of its package, so the site shows it as
``packages/<folder>.md`` (under "Packages" in the navigation). A relative link in any page is
resolved against the file's real place in the repository:

* a file inside ``docs/``: linked relative to the page's place in the site;
* a distribution's ``README.md``: linked to its site page;
* an image (``.png``, ``.svg``, ``.jpg``): copied into the site beside the page that shows it;
* any other file or folder of the repository (a test, a source file): its text stays, unlinked,
  since the site does not carry source files;
* a target that exists nowhere: left as written, so ``mkdocs build --strict`` reports it; except a
  bare word with neither ``/`` nor ``.`` (``ACT2FN[silu](gate)`` in a pasted table), which is code
  text rather than a link, and stays text.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
IMAGES = (".png", ".svg", ".jpg", ".jpeg", ".gif")
# [text](target "title") and ![alt](target); a target never holds spaces or parentheses here.
LINK = re.compile(r"(?P<bang>!?)\[(?P<text>[^\]\n]*)\]\((?P<target>[^)\s]+)(?P<title>\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~)", re.MULTILINE)

# site path (src_uri) -> the real file its Markdown comes from, for pages generated from READMEs
_SOURCES: dict[str, Path] = {}


def distribution_readmes() -> dict[str, Path]:
    """``packages/<folder>.md`` -> that distribution's README, for every distribution folder."""
    folders = [ROOT / "kernels", *sorted((ROOT / "packages").glob("*")), *sorted((ROOT / "integrations").glob("*"))]
    return {f"packages/{folder.name}.md": folder / "README.md" for folder in folders
            if (folder / "pyproject.toml").is_file() and (folder / "README.md").is_file()}


def on_files(files: Files, config: Any) -> Files:
    """Add a page per distribution README."""
    for src_uri, readme in distribution_readmes().items():
        _SOURCES[src_uri] = readme
        files.append(File.generated(config, src_uri, content=readme.read_text(encoding="utf-8")))
    return files


def _real_source(page: Any) -> Path:
    return _SOURCES.get(page.file.src_uri) or Path(page.file.abs_src_path)


def _site_target(path: Path, page_uri: str, files: Files, config: Any) -> str | None:
    """The link from ``page_uri`` to the repository file ``path``, or None when the site has no page for it."""
    readmes = {readme: uri for uri, readme in distribution_readmes().items()}
    if path.is_relative_to(DOCS):
        uri = path.relative_to(DOCS).as_posix()
    elif path in readmes:
        uri = readmes[path]
    elif path.suffix.lower() in IMAGES and path.is_file():
        uri = f"assets/repo/{path.relative_to(ROOT).as_posix()}"
        if files.get_file_from_path(uri) is None:
            files.append(File.generated(config, uri, abs_src_path=str(path)))
    else:
        return None
    return posixpath.relpath(uri, posixpath.dirname(page_uri) or ".")


def _rewrite(text: str, source: Path, page_uri: str, files: Files, config: Any) -> str:
    def replace(match: re.Match[str]) -> str:
        target = match["target"]
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith(("#", "/")):
            return match[0]
        raw, _, fragment = target.partition("#")
        path = (source.parent / raw).resolve()
        if not path.exists() or not path.is_relative_to(ROOT):
            if "/" not in raw and "." not in raw:  # code in a table cell, e.g. "ACT2FN[silu](gate)"
                return match[0].replace("](", "]\\(", 1)
            return match[0]  # strict mode names it
        link = _site_target(path, page_uri, files, config)
        if link is None:
            return match["text"]
        return f"{match['bang']}[{match['text']}]({link}{'#' + fragment if fragment else ''}{match['title'] or ''})"

    # Fenced code is left alone: a link there is an example, not a link.
    parts = FENCE.split(text)
    out, in_fence, fence = [], False, ""
    for part in parts:
        if part in ("```", "~~~"):
            if not in_fence or part == fence:
                in_fence, fence = not in_fence, part
            out.append(part)
        else:
            out.append(part if in_fence else LINK.sub(replace, part))
    return "".join(out)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """Resolve the page's relative links against its real place in the repository."""
    return _rewrite(markdown, _real_source(page), page.file.src_uri, files, config)
