"""README.md and docs/*.md hold together: every relative link reaches a file (and, for a markdown
file, a heading its anchor names), and README stays a front page (quick start, launch, a feature
table, links) whose details live in docs/, so it does not grow back into the 88 KB it once was."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.documented_commands import REPO_ROOT, documented_files

README_MAX_BYTES = 25_000
README_MAX_LINE = 300
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`[^`]*`")
# [text](target) and ![alt](target); the target stops at whitespace (an optional "title" follows).
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def _prose(path: Path) -> str:
    """The file's text with fenced blocks blanked (line numbers kept): links in code are not links."""
    lines, fence = path.read_text().splitlines(), ""
    for i, line in enumerate(lines):
        opener = FENCE.match(line)
        if fence:
            fence = "" if opener and opener.group(1) == fence else fence
            lines[i] = ""
        elif opener:
            fence, lines[i] = opener.group(1), ""
    return "\n".join(lines)


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a file's headings: lower case, punctuation dropped, spaces as
    hyphens, a repeated heading numbered -1, -2, ..."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in _prose(path).splitlines():
        heading = HEADING.match(line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every link of the file's prose, inline code spans left out."""
    text = INLINE_CODE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), _prose(path))
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in LINK.finditer(text)]


def broken_links(path: Path) -> list[str]:
    problems = []
    for line, target in links(path):
        if re.match(r"[a-zA-Z][\w+.-]*:", target):  # https:, mailto: ...: not ours to check offline
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        where = f"{path.relative_to(REPO_ROOT)}:{line}: {target}"
        if not dest.exists():
            problems.append(f"{where}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where}: {dest.name} has no heading with this anchor")
    return problems


@pytest.mark.parametrize("path", documented_files(), ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_relative_links_reach_a_file_and_heading(path):
    assert not broken_links(path), "\n".join(broken_links(path))


def test_readme_stays_a_front_page():
    readme = REPO_ROOT / "README.md"
    size = len(readme.read_bytes())
    assert size < README_MAX_BYTES, f"README.md is {size} bytes (limit {README_MAX_BYTES}): move details into docs/"
    long = [f"README.md:{i}: {len(line)} characters" for i, line in enumerate(readme.read_text().splitlines(), 1)
            if len(line) > README_MAX_LINE]
    assert not long, f"lines over {README_MAX_LINE} characters (shorten the cell, move details into docs/):\n" + \
        "\n".join(long)


def test_the_checker_finds_a_missing_file_and_a_missing_anchor(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO_ROOT", tmp_path)  # paths named relative to it
    (tmp_path / "other.md").write_text("# Other\n\n## Two words, `code`\n\n## Two words, `code`\n")
    doc = tmp_path / "doc.md"
    doc.write_text("# Doc\n\n[a](other.md#two-words-code-1) [b](other.md#nowhere) [c](gone.md)\n"
                   "[d](#doc) [e](https://example.com/x) `[f](in-code.md)`\n\n```\n[g](in-fence.md)\n```\n")
    assert broken_links(doc) == ["doc.md:3: other.md#nowhere: other.md has no heading with this anchor",
                                 "doc.md:3: gone.md: no such file"]
