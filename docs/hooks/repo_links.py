"""MkDocs hook: links from the docs to files elsewhere in the repository, checked like any other link.

The pages link such files relatively (``../benchmarks/results/mirrored.md``), so the links also work where the markdown
is read as it is (GitHub, an editor). MkDocs only knows the files under ``docs/``, so this hook publishes every
repository file a page links to under ``repo/`` in the site and points the link there; MkDocs then validates the link
as usual. A link to a file that does not exist is a warning, which fails ``mkdocs build --strict``. Markdown files
published this way become pages whose own relative links are followed the same way. README.md's relative links are
checked too, since the README is not part of the site.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files, InclusionLevel
from mkdocs.structure.pages import Page

log = logging.getLogger("mkdocs.hooks.repo_links")

REPO = Path(__file__).resolve().parents[2]
PREFIX = "repo"
# Fenced blocks and inline code are skipped; outside them, the target of every inline link or image.
_PATTERN = re.compile(
    r"(?P<code>^(?P<fence>`{3,}|~{3,})[^\n]*\n.*?^(?P=fence)|`[^`\n]*`)|(?P<open>\]\()(?P<url>[^)\s#]*)",
    re.MULTILINE | re.DOTALL,
)


def _is_relative(url: str) -> bool:
    return bool(url) and not url.startswith(("/", "#")) and ":" not in url.split("/", 1)[0]


def _links(text: str) -> list[str]:
    return [m["url"] for m in _PATTERN.finditer(text) if m["open"] and _is_relative(m["url"])]


def _virtual(real: Path, docs_dir: Path) -> str | None:
    """Where a repository file lives in the site's source tree, or None for a file outside the repository."""
    if real.is_relative_to(docs_dir):
        return real.relative_to(docs_dir).as_posix()
    if real.is_relative_to(REPO):
        return f"{PREFIX}/{real.relative_to(REPO).as_posix()}"
    return None


def _resolve(source: Path, url: str) -> Path:
    return Path(posixpath.normpath((source.parent / url).as_posix()))


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Publish every repository file outside docs/ that a page links to, following published pages' links too."""
    docs_dir = Path(config.docs_dir).resolve()
    queue = [Path(f.abs_src_path) for f in files.documentation_pages() if f.abs_src_path]
    published: set[Path] = set()
    while queue:
        source = queue.pop()
        for url in _links(source.read_text(encoding="utf-8")):
            real = _resolve(source, url)
            if real.is_relative_to(docs_dir) or real in published:
                continue  # MkDocs checks links inside docs/ itself
            where = _virtual(real, docs_dir)
            if where is None or not real.is_file():
                log.warning("%s links to '%s', which is not a file in the repository", source.relative_to(REPO), url)
                continue
            published.add(real)
            files.append(File.generated(config, where, abs_src_path=str(real), inclusion=InclusionLevel.NOT_IN_NAV))
            if real.suffix == ".md":
                queue.append(real)
    readme = REPO / "README.md"
    for url in _links(readme.read_text(encoding="utf-8")):
        if not _resolve(readme, url).exists():
            log.warning("README.md links to '%s', which does not exist", url)
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Point each relative link at the target's place in the site (a published repository file or a docs page)."""
    docs_dir = Path(config.docs_dir).resolve()
    if not page.file.abs_src_path:
        return markdown
    source = Path(page.file.abs_src_path)
    here = posixpath.dirname(page.file.src_uri)

    def rewrite(match: re.Match[str]) -> str:
        if not match["open"] or not _is_relative(match["url"]):
            return match[0]
        where = _virtual(_resolve(source, match["url"]), docs_dir)
        if where is None:
            return match[0]
        return match["open"] + posixpath.relpath(where, here or ".")

    return _PATTERN.sub(rewrite, markdown)
