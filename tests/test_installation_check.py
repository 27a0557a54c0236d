"""``python -m alpa_lab.test_install``: the installation check a new user runs first (Alpa's ``alpa.test_install``).

Run for real: the check module in a fresh Python (its own simulated devices, its own local Ray on 127.0.0.1,
stopped by the check), and JupyterLab's own ``labextension list``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from alpa_lab import test_install


def test_the_installation_check_passes_where_alpa_lab_is_installed():
    """All three checks (one mesh, a pipeline on Ray, the JupyterLab extension) pass in this checkout's venv, which
    ``make test`` built the extension into; each says ok in one line and the exit status is 0."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "XLA_FLAGS")}
    raylets_before = _raylets()
    out = subprocess.run([sys.executable, "-m", "alpa_lab.test_install"], capture_output=True, text=True, timeout=540, env=env)
    lines = out.stdout.splitlines()
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert lines[0].startswith("alpa_lab ") and "8 cpu devices" in lines[0], lines
    for name in test_install.CHECKS:
        assert any(line.strip().startswith(f"ok    {name}:") for line in lines), (name, lines)
    assert lines[-1] == "alpa_lab is installed and works here."
    assert _raylets() <= raylets_before  # the check stopped the Ray it started


def _raylets() -> int:
    out = subprocess.run(["pgrep", "-f", "raylet"], capture_output=True, text=True)
    return len(out.stdout.split())


def test_an_extension_jupyterlab_does_not_have_is_reported_with_what_to_do():
    ok, said = test_install.labextension_status("alpa-lab-not-installed")
    assert not ok
    assert "does not list the alpa-lab-not-installed extension" in said and "wheel" in said


def test_checks_can_be_left_out_and_an_unknown_one_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        test_install.main(["--skip", "ray,gpu"])
    assert e.value.code == 2
    assert "unknown check(s) gpu: the checks are shard, ray, jupyterlab" in capsys.readouterr().err
    assert test_install.main(["--skip", "ray,jupyterlab"]) == 0
    printed = capsys.readouterr().out
    assert "ok    shard:" in printed and "skip  ray:" in printed and "skip  jupyterlab:" in printed
