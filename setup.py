"""Ship the course notebooks inside the package without a second committed copy.

``notebooks/`` is the one place the notebooks live. At build time (wheel, or
the wheel pip builds from the sdist) this copies them into
``ddplab/course/notebooks/`` in the build folder, where pyproject.toml's
package-data picks them up. A checkout (``pip install -e .``) reads
``notebooks/`` directly: see ``ddplab.hints.reference_dir``.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithNotebooks(build_py):
    def run(self):
        super().run()
        if self.editable_mode:
            return
        source = Path(__file__).resolve().parent / "notebooks"
        target = Path(self.build_lib) / "ddplab" / "course" / "notebooks"
        shutil.rmtree(target, ignore_errors=True)      # a notebook removed since the last build
        target.mkdir(parents=True)
        for notebook in sorted(source.glob("*.ipynb")):
            shutil.copy2(notebook, target / notebook.name)


setup(cmdclass={"build_py": BuildWithNotebooks})
