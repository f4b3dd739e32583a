"""MkDocs hook: the figures that live outside docs/ (``benchmarks/results/*.png``) render in the site.

The pages link them by their path in the repository (``../../benchmarks/results/x.png`` from
``docs/results/``), so the same link works on GitHub. At build time each linked file is added to the site
as if it were ``docs/benchmarks/results/x.png`` (copied from the repository, nothing committed twice), and
the page's link loses the one ``../`` that leaves docs/.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File, Files

# A link from a page to a file under benchmarks/ of the repository: one "../" per folder of the page, and
# one more to leave docs/.
LINK = re.compile(r"\]\(((?:\.\./)+)(benchmarks/[^)\s]+\.(?:png|svg|jpg))\)")


def _depth(src_uri: str) -> int:
    return src_uri.count("/")


def on_files(files: Files, config) -> Files:
    docs = Path(config["docs_dir"]).resolve()
    repo = docs.parent
    wanted: set[str] = set()
    for page in docs.rglob("*.md"):
        depth = len(page.relative_to(docs).parts) - 1
        for ups, target in LINK.findall(page.read_text(encoding="utf-8")):
            if ups.count("../") == depth + 1:
                wanted.add(target)
    for target in sorted(wanted):
        if not (repo / target).is_file():
            continue  # the link stays unresolved, and --strict names it
        if files.get_file_from_path(target) is None:
            files.append(File(target, src_dir=str(repo), dest_dir=config["site_dir"],
                              use_directory_urls=config["use_directory_urls"]))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    depth = _depth(page.file.src_uri)

    def local(match: re.Match[str]) -> str:
        ups, target = match.groups()
        if ups.count("../") != depth + 1:
            return match.group(0)
        return f"]({'../' * depth}{target})"

    return LINK.sub(local, markdown)
