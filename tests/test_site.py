"""The course as a website (`make docs`): it builds, a broken link fails it, and Chromium shows it.

The site is built once for the module with the repository's own mkdocs.yml (`--strict`, as
`make docs` builds it), into a temporary folder, and opened from the disk (file://) in
Debian's headless Chromium: the front page, a notebook page with its stored pictures (the
timeline, an SVG; a matplotlib figure, a PNG) and the API reference made from the docstrings.
The reference solutions are not published: no exercise cell; the only .ipynb files in the site
are the student versions each notebook's page offers for download, with how to open them in
Colab, Kaggle or a JupyterHub.
A copy of the sources with two broken links (one in a guide, one in a notebook) must fail to
build and name both. The build runs with no network (`unshare -n` where this user may), which
proves it downloads nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from browserkit import CHROMIUM_FLAGS

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
PICTURES = "06_build_all_reduce"          # a timeline (SVG) and a matplotlib figure (PNG)
BUILD_DEADLINE = 240

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def _offline() -> list[str]:
    """`unshare -n` (a network namespace with only a loopback that is down) where it works."""
    if shutil.which("unshare") and subprocess.run(["unshare", "-n", "true"],
                                                  capture_output=True).returncode == 0:
        return ["unshare", "-n"]
    return []


def build(config: Path, site: Path, cwd: Path) -> subprocess.CompletedProcess:
    """`mkdocs build --strict` of config into site; mkdocs-jupyter's cache goes under cwd."""
    return subprocess.run([*_offline(), sys.executable, "-m", "mkdocs", "build", "--strict",
                           "-f", str(config), "-d", str(site)],
                          cwd=cwd, capture_output=True, text=True, timeout=BUILD_DEADLINE,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> tuple[Path, Path]:
    """The site, built as make docs builds it; and the folder holding the notebooks' cache."""
    work = tmp_path_factory.mktemp("site")
    result = build(ROOT / "mkdocs.yml", work / "site", cwd=work)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    return work / "site", work


def test_every_notebook_and_guide_has_a_page_and_no_solution_is_published(site):
    folder, _ = site
    missing = [p.name for p in NOTEBOOKS if not (folder / "notebooks" / f"{p.stem}.html").is_file()]
    missing += [p.name for p in sorted((ROOT / "docs").glob("*.md"))
                if not (folder / "docs" / f"{'index' if p.stem == 'README' else p.stem}.html").is_file()]
    assert not missing, f"no page in the site for: {missing}"
    assert (folder / "index.html").is_file() and (folder / "benchmarks" / "index.html").is_file()
    # The only notebooks in the site are the student versions offered for download.
    published = sorted(str(p.relative_to(folder)) for p in folder.rglob("*.ipynb"))
    assert published == [f"downloads/{p.name}" for p in NOTEBOOKS], published
    solutions = [p for p in published if "BEGIN SOLUTION" in (folder / p).read_text()]
    solutions += [f"notebooks/{p.name}" for p in (folder / "notebooks").glob("*.html")
                  if "BEGIN SOLUTION" in p.read_text()]
    assert not solutions, f"the reference solutions are published in: {solutions}"
    front = (folder / "index.html").read_text()
    assert 'href="notebooks/01_point_to_point.html"' in front, "README's links must lead to the pages"


def test_each_notebook_page_offers_its_student_version_and_says_where_to_open_it(site):
    from ddplab.course.release import release_notebook

    folder, _ = site
    for path in NOTEBOOKS:
        page = (folder / "notebooks" / f"{path.stem}.html").read_text()
        link = f'href="../downloads/{path.name}" download="{path.name}"'
        assert link in page, f"{path.name}: its page offers no download"
        box = page[page.index(link):page.index("</div>", page.index(link))]
        assert all(place in box for place in ("Colab", "Kaggle", "JupyterHub", "%pip")), box
        assert "not in Colab or Kaggle themselves" in box           # no claim of a run there
        offered = nbformat.read(folder / "downloads" / path.name, as_version=4)
        student = release_notebook(nbformat.read(path, as_version=4), path.name)
        assert [c.source for c in offered.cells] == [c.source for c in student.cells], path.name


def test_a_broken_link_fails_the_build(site, tmp_path):
    """The sources copied, two links broken: --strict refuses the site and names both."""
    _, cache = site
    copy = tmp_path / "src"
    copy.mkdir()
    for name in ("README.md", "benchmarks", "tools", "ddplab"):
        (copy / name).symlink_to(ROOT / name)
    shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", copy / "docs")
    shutil.copytree(ROOT / "notebooks", copy / "notebooks")
    students = copy / "docs" / "students.md"
    students.write_text(students.read_text() + "\nSee [the lost notebook](../notebooks/99_lost.ipynb).\n")
    setup = nbformat.read(copy / "notebooks" / "00_setup.ipynb", as_version=4)
    setup.cells.append(nbformat.v4.new_markdown_cell("Next: [notebook 98](98_gone.ipynb)."))
    nbformat.write(setup, copy / "notebooks" / "00_setup.ipynb")

    result = build(copy / "mkdocs.yml", tmp_path / "site", cwd=cache)
    output = result.stdout + result.stderr
    assert result.returncode != 0, f"a site with broken links was built:\n{output}"
    assert "99_lost.ipynb" in output and "98_gone.ipynb" in output, output


def test_chromium_shows_the_pages(site, chromium):
    from playwright.sync_api import sync_playwright

    folder, _ = site
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS,
                                             headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.set_default_timeout(30_000)

            page.goto((folder / "index.html").as_uri())
            assert "ddplab" in page.title()
            page.click('article a[href="notebooks/01_point_to_point.html"]')
            page.wait_for_url("**/notebooks/01_point_to_point.html")
            assert page.locator("article .ddplab-trace svg").count() >= 1

            page.goto((folder / "notebooks" / f"{PICTURES}.html").as_uri())
            svg = page.locator(".ddplab-trace svg").first
            box = svg.bounding_box()
            assert box and box["width"] > 100 and box["height"] > 50, f"the timeline is not drawn: {box}"
            images = page.locator('img[src^="data:image/png"]')
            assert images.count() >= 1, "the notebook's stored PNG is not on its page"
            widths = images.evaluate_all("imgs => imgs.map(i => i.complete ? i.naturalWidth : 0)")
            assert all(w > 0 for w in widths), f"a PNG did not load: naturalWidth {widths}"

            page.goto((folder / "docs" / "reference.html").as_uri())
            start = page.locator('[id="ddplab.start"]')
            assert start.count() == 1, "the API reference does not list ddplab.start"
            assert "world_size" in start.locator("xpath=..").inner_text()
        finally:
            browser.close()
