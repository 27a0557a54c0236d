"""The wheel carries the prebuilt JupyterLab extension ``alpa-lab``: installing it needs no node.

``make wheel`` builds the extension into alpa_lab/labextension/ and then the wheel, whose data
files put it into ``share/jupyter/labextensions/alpa-lab/`` (with ``install.json``) of the
environment it is installed into (pyproject.toml's data-files, checked by setup.py).

These tests build from a copy of the checkout (the extension built by ``make labextension``,
which ``make test-slow`` runs first) and install into fresh venvs in tmp. The dev venv is an
editable install whose Jupyter has the extension linked by ``jupyter-builder develop``, so the
fresh venvs do not extend it: they have only the wheel in their own site-packages, plus a .pth
line putting the dev venv's site-packages after it for the dependencies (a plain path: its .pth
files, the editable finder among them, are not run). Every command runs with only the fresh
venv's bin/ on PATH (no node), no JUPYTER_PATH, and tmp Jupyter data and config dirs, and the
extension must be found in the fresh venv's ``sys.prefix/share/jupyter/labextensions``.
Building needs setuptools from the package index (pip's build isolation), as ``make wheel`` does.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
EXTENSION = "alpa-lab"
BUILT = REPO / "alpa_lab" / "labextension"
SHARE = f"share/jupyter/labextensions/{EXTENSION}"
HINT = "build it with `make labextension` (`make test-slow` does)"
# what a copy of the checkout leaves out: VCS, venvs, node's and the builds' outputs, caches
SKIP = {".git", ".venv", "node_modules", ".yarn", "build", "dist", "__pycache__", ".pytest_cache", ".ruff_cache", ".ipynb_checkpoints"}


def _run(cmd: list, env: dict, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)


def _out(proc: subprocess.CompletedProcess) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)


def _copy_checkout(dest: Path, with_extension: bool) -> Path:
    def ignore(folder: str, names: list[str]) -> set[str]:
        skip = {n for n in names if n in SKIP or n.endswith(".egg-info")}
        if not with_extension and Path(folder).resolve() == BUILT.parent:
            skip.add("labextension")
        return skip

    shutil.copytree(REPO, dest, ignore=ignore)
    assert (dest / "alpa_lab" / "labextension").exists() == with_extension
    return dest


def _env(bin_dir: Path, tmp: Path) -> dict:
    """The environment of every command: only ``bin_dir`` on PATH (no node), no JUPYTER_PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JUPYTER") and k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PATH=str(bin_dir), JUPYTER_DATA_DIR=str(tmp / "jupyter-data"), JUPYTER_CONFIG_DIR=str(tmp / "jupyter-config"))
    assert shutil.which("node", path=env["PATH"]) is None
    return env


def _fresh_venv(path: Path) -> Path:
    """A venv without alpa_lab; the dev venv's site-packages (a plain path) serves its dependencies."""
    proc = subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, _out(proc)
    python = path / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], capture_output=True, text=True)
    site = Path(purelib.stdout.strip())
    assert site.is_dir() and site.resolve().is_relative_to(path.resolve()), purelib
    (site / "_alpa_lab_test_dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return python


def _pip(*args, python: Path, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    """The dev venv's pip, installing into ``python``'s environment (pip --python)."""
    return _run([sys.executable, "-m", "pip", "--python", python, *args], env, cwd)


def _build_wheel(source: Path, out: Path, env: dict) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", out, source], env, source)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A copy of the checkout with the built extension."""
    if not (BUILT / "package.json").is_file():
        pytest.fail(f"the JupyterLab extension is not built in {BUILT}: {HINT}")
    return _copy_checkout(tmp_path_factory.mktemp("wheel") / "src", with_extension=True)


def test_wheel_carries_the_prebuilt_extension_and_installs_without_node(source, tmp_path):
    venv = tmp_path / "venv"
    env = _env(venv / "bin", tmp_path)
    built = _build_wheel(source, tmp_path / "dist", env)
    assert built.returncode == 0, _out(built)
    (wheel,) = (tmp_path / "dist").glob("alpa_lab-*.whl")

    # The wheel: the extension as data files (template layout), not a second copy in the package.
    names = zipfile.ZipFile(wheel).namelist()
    data = sorted(n.split(f".data/data/{SHARE}/", 1)[1] for n in names if f".data/data/{SHARE}/" in n)
    copied = source / "alpa_lab" / "labextension"
    load = json.loads((copied / "package.json").read_text())["jupyterlab"]["_build"]["load"]
    assert {"package.json", "install.json", load} <= set(data), names
    assert sorted(str(p.relative_to(copied)) for p in copied.rglob("*") if p.is_file()) == sorted(set(data) - {"install.json"})
    assert not [n for n in names if n.startswith("alpa_lab/labextension/")], names

    python = _fresh_venv(venv)
    installed = _pip("install", "--no-deps", "--no-index", "--ignore-installed", wheel, python=python, env=env, cwd=tmp_path)
    assert installed.returncode == 0, _out(installed)

    prefix = Path(_run([python, "-c", "import sys; print(sys.prefix)"], env, tmp_path).stdout.strip())
    assert prefix.resolve() == venv.resolve()
    ours = prefix / SHARE
    assert not ours.is_symlink() and (ours / "package.json").is_file() and (ours / load).is_file()
    assert json.loads((ours / "install.json").read_text())["packageName"] == "alpa_lab"
    where = _run([python, "-c", "import importlib.util as u; print(u.find_spec('alpa_lab').origin)"], env, tmp_path)
    assert Path(where.stdout.strip()).resolve().is_relative_to(venv.resolve()), _out(where)  # the wheel's, not the editable checkout

    # `jupyter labextension list` (the jupyter-labextension entry point) in the fresh venv.
    listed = _run([python, "-m", "jupyterlab.labextensions", "list"], env, tmp_path, timeout=120)
    text = _out(listed)
    assert listed.returncode == 0, text
    section, found = None, []
    for line in text.splitlines():
        words = line.split()
        if line.startswith(os.sep):
            section = Path(line.strip())
        elif words[:1] == [EXTENSION]:
            found.append((section, words))
    assert len(found) == 1, text
    (section, words) = found[0]
    assert section is not None and section.resolve() == (prefix / "share" / "jupyter" / "labextensions").resolve(), text
    assert "enabled" in words and "OK" in words, text
    assert "(python, alpa_lab)" in " ".join(words), text  # install.json: the package that brought it

    # the installation check a user runs next finds it too (its other checks run in tests/test_installation_check.py)
    checked = _run([python, "-m", "alpa_lab.test_install", "--skip", "shard,ray"], env, tmp_path, timeout=300)
    assert checked.returncode == 0 and "ok    jupyterlab:" in checked.stdout, _out(checked)


def test_editable_install_leaves_the_extension_to_jupyter_builder(source, tmp_path):
    """`pip install -e .` (what make does) installs no copy: `make labextension` links the built one."""
    venv = tmp_path / "venv"
    env = _env(venv / "bin", tmp_path)
    python = _fresh_venv(venv)
    installed = _pip("install", "--no-deps", "-e", source, python=python, env=env, cwd=tmp_path)
    assert installed.returncode == 0, _out(installed)
    assert not (venv / "share" / "jupyter" / "labextensions").exists(), _out(installed)


def test_wheel_without_the_built_extension_fails_with_a_hint_and_editable_install_works(tmp_path):
    source = _copy_checkout(tmp_path / "src", with_extension=False)
    venv = tmp_path / "venv"
    env = _env(venv / "bin", tmp_path)
    built = _build_wheel(source, tmp_path / "dist", env)
    text = _out(built)
    assert built.returncode != 0 and "make labextension" in text and "alpa_lab/labextension/package.json" in text, text
    assert not list((tmp_path / "dist").glob("*.whl"))

    python = _fresh_venv(venv)
    installed = _pip("install", "--no-deps", "-e", source, python=python, env=env, cwd=tmp_path)
    assert installed.returncode == 0, _out(installed)
    assert not (venv / "share" / "jupyter" / "labextensions").exists()
