"""Every relative link in the README and the docs resolves: the file exists, and a ``#anchor`` names a heading.

Checked: markdown links and images (``[t](x)``, ``![a](x)``, reference definitions ``[r]: x``) and HTML ``href``
and ``src`` attributes, outside fenced code blocks and inline code, in README.md and every .md under docs/ and
reports/ (the generated results). A link is resolved from the folder of the page holding it, as GitHub renders
it; external links (a URL scheme) are left alone. Anchors follow GitHub's heading slugs: the heading's text
without markup, lower case, punctuation other than ``-`` and ``_`` removed, spaces turned into ``-``, repeats
numbered ``-1``, ``-2``.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parents[2]

FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
LABEL = r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]"  # [text] or ![alt], one level of nested brackets
INLINE = re.compile(LABEL + r"\(\s*(<[^>]*>|[^\s()]*(?:\([^\s()]*\)[^\s()]*)*)(?:\s+[\"'(].*?)?\s*\)")
REFDEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)", re.M)
HTML_ATTR = re.compile(r"<(?:a|img)\b[^>]*?\b(?:href|src)\s*=\s*[\"']([^\"']*)[\"']", re.I)
ANCHOR_ATTR = re.compile(r"<a\b[^>]*?\b(?:name|id)\s*=\s*[\"']([^\"']+)[\"']", re.I)
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "reports").rglob("*.md"))]


def prose_lines(text: str) -> list[str]:
    """The page's lines with fenced code blocks blanked (line numbers kept)."""
    out, fence = [], None
    for line in text.splitlines():
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)[0] * 3
            out.append("")
        elif fence is not None:
            if line.strip().startswith(fence):
                fence = None
            out.append("")
        else:
            out.append(line)
    return out


def _plain(markup: str) -> str:
    """Rendered text of inline markdown outside code spans."""
    text = re.sub(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\([^)]*\)", r"\1", markup)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    return re.sub(r"(?<!\w)[*_]+|[*_]+(?!\w)|\*+", "", text)  # emphasis markers (an underscore inside a word stays)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's source text."""
    parts, pos = [], 0
    for m in CODE_SPAN.finditer(heading):  # code spans render their content verbatim
        parts += [_plain(heading[pos:m.start()]), m.group(2).strip()]
        pos = m.end()
    text = "".join([*parts, _plain(heading[pos:])])
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    """Every anchor a page has: its headings' slugs (repeats numbered) and explicit HTML anchors."""
    seen: dict[str, int] = {}
    found = set()
    for line in prose_lines(page.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
        found.update(a for a in ANCHOR_ATTR.findall(line))
    return frozenset(found)


def links(page: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link and image on a page, code left out."""
    lines = prose_lines(page.read_text(encoding="utf-8"))
    text = "\n".join(lines)
    masked = CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)  # code spans hold no links

    def line_of(pos: int) -> int:
        return masked.count("\n", 0, pos) + 1

    found = [(line_of(m.start()), m.group(1)) for m in INLINE.finditer(masked)]
    found += [(line_of(m.start()), m.group(1)) for m in REFDEF.finditer(masked)]
    found += [(line_of(m.start()), m.group(1)) for m in HTML_ATTR.finditer(masked)]
    return [(n, t[1:-1] if t.startswith("<") else t) for n, t in found]


def broken(page: Path, target: str, root: Path = REPO) -> str | None:
    """Why a link target does not resolve from ``page`` in the repository ``root``, or None when it does (or is
    external)."""
    if not target or SCHEME.match(target) or target.startswith("//"):
        return None if target else "empty link"
    path_part, _, anchor = target.partition("#")
    path_part = unquote(path_part.partition("?")[0])
    dest = page if not path_part else (root / path_part.lstrip("/") if path_part.startswith("/")
                                       else (page.parent / path_part))
    dest = Path(dest).resolve()
    if dest != root and root not in dest.parents:
        return "points outside the repository"
    if not dest.exists():
        return "no such file"
    if anchor and dest.suffix == ".md" and unquote(anchor).lower() not in anchors(dest):
        return f"no heading with the anchor #{anchor} in {dest.relative_to(root)}"
    return None


def test_slugs_follow_githubs_rules() -> None:
    assert slug("Why CF_max is 100") == "why-cf_max-is-100"
    assert slug("Run I: methods side by side, ResNet-18 on a settling curve") == \
        "run-i-methods-side-by-side-resnet-18-on-a-settling-curve"
    assert slug("PyTorch DDP (no Horovod)") == "pytorch-ddp-no-horovod"
    assert slug("The `AdaptiveCompression()` *defaults*") == "the-adaptivecompression-defaults"
    assert slug("[Linked](x.md) heading") == "linked-heading"
    assert slug("`__init__` and _emphasis_") == "__init__-and-emphasis"
    assert slug("Outputs (`--out`, default `results/bench/X`)") == "outputs---out-default-resultsbenchx"


def test_the_checker_finds_links_and_skips_code(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("[a](x.md) ![i](img/y.png \"title\") `[no](z.md)`\n```\n[no](w.md)\n```\n[r]: <v w.md>\n"
                    '<img src="s.png"> [ext](https://e.org/x) [here](#top)\n')
    assert [t for _, t in links(page)] == ["x.md", "img/y.png", "https://e.org/x", "#top", "v w.md", "s.png"]
    (tmp_path / "x.md").write_text("# Top part\n## Top part\n")
    assert broken(page, "x.md#top-part-1", tmp_path) is None and broken(page, "https://e.org/x", tmp_path) is None
    assert broken(page, "x.md#top", tmp_path) == "no heading with the anchor #top in x.md"
    assert broken(page, "img/y.png", tmp_path) == "no such file"
    assert broken(page, "../x.md", tmp_path) == "points outside the repository"


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page: Path) -> None:
    bad = []
    for line, target in links(page):
        why = broken(page, target)
        if why:
            bad.append(f"{page.relative_to(REPO)}:{line}: ({target}) {why}")
    assert not bad, "broken links:\n" + "\n".join(bad)


@pytest.mark.parametrize("report", ["reports/BENCHMARKS.md", "reports/benchmarks-x.md"])
def test_generated_reports_link_from_where_they_are_written(tmp_path: Path, monkeypatch, report: str) -> None:
    """benchmarks/run_all.py writes reports/BENCHMARKS.md and other reports under reports/: their links must
    resolve from where they are written."""
    from benchmarks import run_all

    monkeypatch.setattr(run_all, "REPO", tmp_path)
    (tmp_path / run_all.HISTORY).parent.mkdir(parents=True)
    (tmp_path / run_all.HISTORY).write_text("# History\n")
    machine = {"date": "today", "commit": "abc", "load": 0.0, "cores": 2, "kernel": "k", "python": "3",
               "torch": "t", "horovod": "h"}
    page = tmp_path / report
    page.parent.mkdir(parents=True, exist_ok=True)
    run_all.write_report(page, [], [{"argv": [], "machine": machine, "wall_s": 60.0, "sections": []}])
    found = links(page)
    assert found and all(broken(page, t, tmp_path) is None for _, t in found), found
