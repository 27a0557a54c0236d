"""``python -m alpa_lab.test_install``: the installation check a new user runs first (Alpa's ``alpa.test_install``).

Run for real: the check module in a fresh Python (its own simulated devices, its own local Ray on 127.0.0.1,
stopped by the check), JupyterLab's own ``labextension list``, and a Ray address nothing answers at.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from alpa_lab import test_install

# the check's own Python: this process's device count and Ray address are not its
CLEAN = ("RAY_ADDRESS", "XLA_FLAGS", "ALPA_LAB_CPU_DEVICES")


def _check(*args: str, env: dict | None = None, code: str | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in CLEAN}
    cmd = [sys.executable, "-c", code] if code else [sys.executable, "-m", "alpa_lab.test_install", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=540, env={**base, **(env or {})})


def test_the_installation_check_passes_where_alpa_lab_is_installed():
    """All three checks (one mesh, a pipeline on Ray, the JupyterLab extension) pass in this checkout's venv, which
    ``make test`` built the extension into; each says ok in one line, the exit status is 0, and the Ray the check
    started is stopped before it returns (asked in the same process, before Ray's exit handler could)."""
    out = _check(code="import sys, ray\nfrom alpa_lab import test_install\nrc = test_install.main([])\n"
                      "print('ray left running' if ray.is_initialized() else 'ray stopped')\nsys.exit(rc)")
    lines = out.stdout.splitlines()
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert lines[0].startswith("alpa_lab ") and "8 cpu devices" in lines[0], lines
    for name in test_install.CHECKS:
        assert any(line.strip().startswith(f"ok    {name}:") for line in lines), (name, lines)
    assert lines[-2:] == ["alpa_lab is installed and works here.", "ray stopped"], lines


def test_a_failed_check_says_why_and_the_exit_status_is_1():
    """A Ray address nothing answers at fails the Ray check with the cluster's own error; the others still run."""
    out = _check("--skip", "shard, jupyterlab", env={"RAY_ADDRESS": "127.0.0.1:1"})
    lines = out.stdout.splitlines()
    assert out.returncode == 1, out.stdout + out.stderr[-3000:]
    fail = next(i for i, line in enumerate(lines) if line.strip().startswith("FAIL  ray:"))
    assert lines[fail + 1].strip().startswith("RayClusterError: no Ray cluster answers at '127.0.0.1:1'"), lines
    assert lines[-1] == "1 check(s) failed (see above), 0 passed, 2 skipped.", lines


def test_an_extension_jupyterlab_does_not_have_is_reported_with_what_to_do():
    ok, said = test_install.labextension_status("alpa-lab-not-installed")
    assert not ok
    assert "does not list the alpa-lab-not-installed extension" in said and "wheel" in said
    ok, said = test_install.labextension_status()  # and ours, which `make test` built and linked, is enabled and OK
    assert ok and said.split()[0] == "alpa-lab" and "\x1b" not in said, said


def test_checks_can_be_left_out_and_an_unknown_one_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        test_install.main(["--skip", "ray,gpu"])
    assert e.value.code == 2
    assert "unknown check(s) gpu: the checks are shard, ray, jupyterlab" in capsys.readouterr().err
    assert test_install.main(["--skip", "ray, jupyterlab"]) == 0
    printed = capsys.readouterr().out
    assert "ok    shard:" in printed and "skip  ray:" in printed and "skip  jupyterlab:" in printed
    assert printed.splitlines()[-1] == "1 check(s) passed, 2 skipped."
