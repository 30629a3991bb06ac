"""mkdocs hooks for `make docs`: the site is laid out as the repository is.

The pages live where they are committed: README.md, the front page (index.html);
docs/*.md (the guides), notebooks/*.ipynb (the course, with the outputs stored in
them) and benchmarks/README.md. mkdocs reads one folder (`docs_dir`), so these hooks
hand it the others as files with the repository root as their source folder. Every
relative link then means in the site what it means on GitHub (`../notebooks/06_x.ipynb`
from docs/students.md, `docs/api.md` from README.md), with no second copy of anything
to keep in step and nothing to stage before a build.

mkdocs checks the links of Markdown pages (a broken one is a warning, an error under
`--strict`). A notebook page is HTML made by mkdocs-jupyter, which mkdocs does not
check, so `on_post_page` checks its relative links here, in the same way, and points
a link to another notebook at that notebook's page.

Each notebook's page offers the student version (solutions stubbed, made by `ddplab
release`'s own function) as a download, `downloads/NN_x.ipynb`, and says how to open
it in Colab, Kaggle or a JupyterHub (`on_post_page` and `on_post_build`): its set-up
cell installs ddplab with `%pip` where it is missing. The reference notebooks, with
their solutions, are never copied into the site.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.hooks.ddplab_site")

COURSE = "The course"     # the nav section on_config fills
# The pages outside docs_dir, as patterns relative to the repository root.
OUTSIDE = ["README.md", "notebooks/*.ipynb", "benchmarks/README.md"]
SITE_FILES: dict[str, File] = {}
HREF = re.compile(r'(href|src)="([^"#:?]+)(#[^"]*)?"')
DOWNLOADS = "downloads"   # the site's folder of student notebooks
# Put after a notebook page's title: {href} is its student version, {name} that file's name.
RUN_IT = """
<div class="admonition tip ddplab-run-it">
<p class="admonition-title">Run this notebook yourself</p>
<p><a href="{href}" download="{name}">Download {name}</a>, the student version (exercises to fill in;
this page shows the reference's outputs, its solutions left out), then open it:</p>
<ul>
<li><b>Colab</b>: File &rsaquo; Upload notebook, and choose the file.</li>
<li><b>Kaggle</b>: File &rsaquo; Import Notebook, and choose the file.</li>
<li><b>A JupyterHub</b> or your own JupyterLab: the file browser's Upload button.</li>
</ul>
<p>Its first cell installs ddplab with <code>%pip</code> where it is missing, from the package index or
from a ddplab wheel uploaded beside the notebook (your course's, or <code>pip wheel --no-deps .</code> in
a clone), and says so in one line. That path is tested in a fresh Python environment holding only the
wheel (<code>tests/test_wheel.py</code>), not in Colab or Kaggle themselves. With a clone,
<code>make lab</code> does it all: <a href="{readme}">the front page</a>.</p>
</div>
"""
TITLE_END = re.compile(r"</h1>")


def _root(config) -> Path:
    return Path(config.config_file_path).resolve().parent


# Before mkdocs-jupyter's on_files, so that it turns the notebooks added here into pages.
@event_priority(100)
def on_files(files: Files, config) -> Files:
    """Each guide keeps its docs/ folder in the site; the pages outside docs/ join them."""
    root = _root(config)
    docs_dir = Path(config.docs_dir).resolve()
    moved = docs_dir.relative_to(root).as_posix()
    out = []
    for file in files:
        if file.abs_src_path and docs_dir in Path(file.abs_src_path).resolve().parents:
            out.append(File(f"{moved}/{file.src_uri}", str(root), config.site_dir,
                            config.use_directory_urls))
        else:
            out.append(file)                # the theme's own files
    for pattern in OUTSIDE:
        for path in sorted(root.glob(pattern)):
            out.append(File(path.relative_to(root).as_posix(), str(root), config.site_dir,
                            config.use_directory_urls))
    return Files(out)


def on_post_page(output: str, page, config) -> str:
    """A notebook page: each relative link must name a page of the site; a notebook's, its page.
    After its title, how to download and run the student version (``RUN_IT``)."""
    if not page.file.src_uri.endswith(".ipynb"):
        return output
    pages = SITE_FILES
    here = posixpath.dirname(page.file.src_uri)

    def point(match: re.Match) -> str:
        attr, target, anchor = match.group(1), match.group(2), match.group(3) or ""
        if not target.endswith((".md", ".ipynb")):
            return match.group(0)
        wanted = posixpath.normpath(posixpath.join(here, target))
        file = pages.get(wanted)
        if file is None:
            log.warning("Doc file '%s' contains a link '%s', but the target '%s' is not found "
                        "among documentation files.", page.file.src_uri, target, wanted)
            return match.group(0)
        return f'{attr}="{file.url_relative_to(page.file)}{anchor}"'

    # after the check: the download link names a file of the site, not a page
    return _offer_download(HREF.sub(point, output), page)


def _offer_download(output: str, page) -> str:
    name = posixpath.basename(page.file.src_uri)
    here = posixpath.dirname(page.file.dest_uri)
    box = RUN_IT.format(href=posixpath.relpath(f"{DOWNLOADS}/{name}", here), name=name,
                        readme=posixpath.relpath(SITE_FILES["README.md"].dest_uri, here))
    with_box, found = TITLE_END.subn(lambda m: m.group(0) + box, output, count=1)
    if not found:
        log.warning("Notebook page '%s' has no title (# heading): no download offered.", page.file.src_uri)
    return with_box


def on_post_build(config) -> None:
    """The student version of every notebook of the course into the site's downloads/."""
    import nbformat

    from ddplab.course.release import release_notebook

    folder = Path(config.site_dir) / DOWNLOADS
    folder.mkdir(parents=True, exist_ok=True)
    for path in sorted((_root(config) / "notebooks").glob("*.ipynb")):
        student = release_notebook(nbformat.read(path, as_version=4), path.name)
        nbformat.write(student, folder / path.name)


def on_nav(nav, config, files: Files):
    """Keep the site's files, by source path, for on_post_page (mkdocs does not hand them to it)."""
    SITE_FILES.clear()
    SITE_FILES.update({f.src_uri: f for f in files})
    return nav


def on_config(config):
    """The course section of the nav: every notebook, in file order."""
    root = _root(config)
    for entry in config.nav:
        if isinstance(entry, dict) and COURSE in entry:
            entry[COURSE] = [p.relative_to(root).as_posix() for p in sorted(root.glob("notebooks/*.ipynb"))]
    return config
