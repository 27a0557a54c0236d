"""Build hooks for the prebuilt JupyterLab extension; the project's metadata is in pyproject.toml.

A wheel carries the extension that `make labextension` builds into alpa_lab/labextension/ as
data files under share/jupyter/labextensions/alpa-lab/ (pyproject.toml's data-files, the layout
of the official extension template), so installing the wheel needs no node. Building a wheel
without the built extension fails. Editable installs (`pip install -e .`, used by `make`) leave
the extension out: `make labextension` links it into the venv with `jupyter-builder develop`.
"""

import json
from pathlib import Path

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.editable_wheel import editable_wheel
from setuptools.errors import FileError

SHARE = "share/jupyter/labextensions/alpa-lab"
BUILT = Path("alpa_lab/labextension")
INSTALL_JSON = Path("labextension/install.json")
HINT = "build it first with `make labextension` (or `make wheel`, which builds it and then the wheel; needs node >= 20)"


def _ours(dest: str) -> bool:
    return dest == SHARE or dest.startswith(SHARE + "/")


class BdistWheel(bdist_wheel):
    def run(self):
        shipped = {Path(f) for dest, files in self.distribution.data_files or [] if _ours(dest) for f in files}
        missing = [p for p in (BUILT / "package.json", INSTALL_JSON) if p not in shipped or not p.is_file()]
        if not missing:
            load = json.loads((BUILT / "package.json").read_text()).get("jupyterlab", {}).get("_build", {}).get("load")
            if not load or BUILT / load not in shipped:
                missing.append(BUILT / (load or "static/remoteEntry.*.js"))
        if missing:
            raise FileError(f"a wheel must carry the prebuilt JupyterLab extension (missing: {', '.join(map(str, missing))}): {HINT}")
        super().run()


class EditableWheel(editable_wheel):
    def run(self):
        dist = self.distribution
        dist.data_files = [(dest, files) for dest, files in dist.data_files or [] if not _ours(dest)]
        super().run()


setup(cmdclass={"bdist_wheel": BdistWheel, "editable_wheel": EditableWheel})
