"""A student's JupyterLab: no instructor tools, no news pop-up, set in the workspace itself.

``ddplab notebooks DIR`` (the student versions) writes, beside the notebooks, a
Jupyter configuration folder, ``DIR/.jupyter``; ``make lab`` puts it first on
Jupyter's search path for its own server (``JUPYTER_CONFIG_PATH``, which Jupyter
reads before the user's ``~/.jupyter`` and the environment's settings):

- ``labconfig/page_config.json`` disables JupyterLab plugins: nbgrader's (its
  "Nbgrader" menu, the "Validate" button on every notebook, the "Create
  Assignment" panel: instructors' tools, present wherever the instructor
  profile is installed, as in ``make test``'s environment), and JupyterLab's
  announcements (the "get notified about official Jupyter news?" pop-up over
  every page, and the fetching of news and updates from the internet);
- ``jupyter_server_config.d/ddplab-student.json`` leaves nbgrader's server
  extensions unloaded, so the server answers none of their pages either.

Nothing outside DIR changes: a server started without the variable (``make
lab-reference``, an instructor's) shows everything as before, and the user's own
settings still apply. A JupyterHub gives students the same by setting
``JUPYTER_CONFIG_PATH`` in the spawner's environment. Hidden files are not listed
by Jupyter's file browser, so students do not see the folder.

The files are ddplab's, not the student's work: each run writes them again.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["CONFIG_FOLDER", "DISABLED_PLUGINS", "write_lab_settings"]

#: The Jupyter configuration folder inside a workspace (``make lab``'s JUPYTER_CONFIG_PATH).
CONFIG_FOLDER = ".jupyter"

#: JupyterLab plugins a student's JupyterLab leaves out: a package name disables all its plugins.
DISABLED_PLUGINS = ("@jupyter/nbgrader", "@jupyterlab/apputils-extension:announcements")

# nbgrader's server extensions, as its own jupyter_server_config.d/nbgrader.json enables them.
NBGRADER_SERVER_EXTENSIONS = ("nbgrader.server_extensions.formgrader",
                              "nbgrader.server_extensions.validate_assignment",
                              "nbgrader.server_extensions.assignment_list",
                              "nbgrader.server_extensions.course_list")


def write_lab_settings(workspace: str | Path) -> Path:
    """Write the student's JupyterLab settings into ``workspace``; return their folder.

    A conf.d file rather than ``jupyter_server_config.json``: Jupyter merges
    ``jpserver_extensions`` key by key across conf.d files, so the extensions
    the user's own settings enable stay enabled (a ``jupyter_server_config.json``
    here would replace their whole ``jpserver_extensions`` dictionary).
    """
    folder = Path(workspace) / CONFIG_FOLDER
    page = {"disabledExtensions": {name: True for name in DISABLED_PLUGINS}}
    server = {"ServerApp": {"jpserver_extensions": {name: False for name in NBGRADER_SERVER_EXTENSIONS}}}
    for relative, content in (("labconfig/page_config.json", page),
                              ("jupyter_server_config.d/ddplab-student.json", server)):
        path = folder / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(content, indent=2) + "\n")
    return folder
