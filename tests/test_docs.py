"""The front page and the guides: README.md stays a front page, and every relative link resolves.

README.md, docs/*.md and benchmarks/README.md link each other by relative paths and
`#anchors`; a file moved or a heading renamed breaks a link silently, so each link here
must name a file that exists and, for a Markdown file, an anchor one of its headings makes
(as GitHub makes them).
"""

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans, where links can be."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(path: Path) -> set[str]:
    """The anchors GitHub makes for a Markdown file's headings."""
    made: dict[str, int] = {}
    for line in re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S).splitlines():
        heading = re.match(r"^#{1,6} +(.*?) *#*$", line)
        if not heading:
            continue
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1))   # a link's text only
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        n = made.get(slug, 0)
        made[slug] = n + 1
        if n:
            made[f"{slug}-{n}"] = 1
    return set(made)


def links(path: Path) -> list[str]:
    return [t for t in LINK.findall(_prose(path.read_text()))
            if not re.match(r"[a-z]+:", t)]          # http:, https:, mailto: are not checked here


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    broken = []
    for target in links(path):
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists():
            broken.append(f"{target}: no file {resolved}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading of {resolved.name} makes #{anchor}")
    assert not broken, f"{path.relative_to(ROOT)}: broken links:\n" + "\n".join(broken)


def test_the_checker_sees_links_and_anchors():
    """The checker itself: it finds a link in prose, not in code, and makes GitHub's anchors."""
    assert "docs/api.md" in links(ROOT / "README.md")
    assert "debugging-one-rank-ddplabbreakpoint" in anchors(ROOT / "docs" / "debugging.md")
    assert "set---kernelmanagertransportipc-on-a-class-server" in anchors(ROOT / "docs" / "class-server.md")


def test_readme_is_a_front_page():
    text = (ROOT / "README.md").read_text()
    lines = text.count("\n")
    assert lines <= 300, f"README.md has {lines} lines; the front page keeps to 300: move the rest into docs/"
    assert "make lab" in text and "make test" in text


def test_every_guide_is_in_the_index():
    index = set(links(ROOT / "docs" / "README.md"))
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md"))
               if p.name != "README.md" and p.name not in index]
    assert not missing, f"docs/README.md does not list: {missing}"
    assert "../benchmarks/README.md" in index


@pytest.mark.parametrize("page", ["README.md", "docs/students.md"])
def test_every_notebook_is_linked(page):
    linked = {Path(t.partition("#")[0]).name for t in links(ROOT / page)}
    missing = [p.name for p in sorted((ROOT / "notebooks").glob("*.ipynb")) if p.name not in linked]
    assert not missing, f"{page} does not link: {missing}"


def test_notebook_00s_course_map_is_the_readmes():
    """The map a student sees first, in notebook 00, is README's, row for row (links made relative)."""
    import nbformat

    rows = re.compile(r"^\| \[\d\d\w? · .*$", re.M)
    readme = [row.replace("](notebooks/", "](") for row in rows.findall((ROOT / "README.md").read_text())]
    setup = nbformat.read(ROOT / "notebooks" / "00_setup.ipynb", as_version=4)
    course_map = next(c.source for c in setup.cells if c.source.startswith("## Where the course goes"))
    assert rows.findall(course_map) == readme
    assert len(readme) == len(list((ROOT / "notebooks").glob("*.ipynb")))


GUIDE = re.compile(r'((?:docs/[\w-]+|benchmarks/README)\.md)(?:, \\?"([^"\\]+?)\\?")?')
STALE = re.compile(r"""README['’]s [A-Z]|README, \\?"|README\.md \("""
                   r"|see the README|see README|the README (?:says|shows)")


def _sources():
    """The code, tools, tests and notebooks: the files whose text points readers at a guide."""
    yield from sorted((ROOT / "ddplab").rglob("*.py"))
    for folder, pattern in (("tools", "*"), ("benchmarks", "*.py"), ("tests", "*.py"),
                            ("notebooks", "*.ipynb")):
        yield from sorted(p for p in (ROOT / folder).glob(pattern)
                          if p.is_file() and p.name != "test_docs.py")


def _text(source: Path) -> str:
    return re.sub(r"\s+", " ", source.read_text(errors="replace"))      # a name wrapped across lines


def _titles(path: Path) -> list[str]:
    return [re.sub(r"[`*]", "", line.lstrip("#").strip()).lower()
            for line in re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S).splitlines()
            if line.startswith("#")]


def test_every_guide_the_code_names_exists():
    """Text that says `docs/x.md, "Section"` names a file, and a heading of it, that exist."""
    wrong = []
    for source in _sources():
        for page, section in GUIDE.findall(_text(source)):
            where = f"{source.relative_to(ROOT)}: {page}"
            if not (ROOT / page).exists():
                wrong.append(f"{where}: no such file")
            elif section and not any(h.startswith(section.lower()) for h in _titles(ROOT / page)):
                wrong.append(f'{where}: no heading starts with "{section}"')
    assert not wrong, "\n".join(wrong)


def test_nothing_points_at_a_readme_section_any_more():
    """The README is a front page: the sections the code used to cite live in docs/ now."""
    found = [f"{source.relative_to(ROOT)}: {m.group(0)}"
             for source in _sources() for m in STALE.finditer(_text(source))]
    assert not found, "point these at the guide in docs/ instead:\n" + "\n".join(found)


def test_the_api_page_documents_every_teaching_module():
    """docs/reference.md lists modules by hand: each one ddplab/__init__ names must be there."""
    sys.path.insert(0, str(ROOT / "tools"))
    from check_layout import listed_teaching_modules

    page = (ROOT / "docs" / "reference.md").read_text()
    missing = [m for m in listed_teaching_modules(ROOT / "ddplab" / "__init__.py")
               if f"::: ddplab.{m}\n" not in page]
    assert missing == [], f"add `::: ddplab.<name>` to docs/reference.md for {missing}"
