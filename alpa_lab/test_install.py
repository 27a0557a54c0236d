"""Check an installation: ``python -m alpa_lab.test_install`` (Alpa's ``python -m alpa.test_install``).

After ``pip install``, the first thing to know is whether the parts that need more than Python work
here: XLA's sharded programs on this machine's devices, a Ray cluster of mesh workers, and the
JupyterLab extension. Each check runs the real thing:

1. **shard**: Alpa's check model (six dense layers, SGD with momentum) trained one step with
   ``ShardParallel(num_micro_batches=2)`` on this process's devices, against the plain JAX step;
2. **ray**: the same step as a two-layer pipeline (``PipeshardParallel``) on the mesh workers of
   ``init("ray")`` (a local Ray on 127.0.0.1 with simulated CPU devices, or the cluster ``RAY_ADDRESS``
   names), against the plain step; a Ray the check started is stopped afterwards, and a session the process
   already had is used and left as it was;
3. **jupyterlab**: JupyterLab's ``labextension list`` shows the ``alpa-lab`` extension enabled and OK.

The new train states (parameters, optimizer state, step) and losses must agree with the plain step's to 1e-4, relative
and absolute, as in Alpa's check. Each check prints one line, ``ok``, ``skip`` or ``FAIL`` with the error;
the exit status is 1 when one fails. ``--skip ray,jupyterlab`` leaves checks out. ``python -m unittest
alpa_lab.test_install`` runs all three as unit tests, under Alpa's test names.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
import unittest

import alpa_lab as al  # first: it gives this process its simulated CPU devices  # isort: skip
import jax  # isort: skip

from alpa_lab.testing import assert_allclose, get_mlp_train_state_and_step  # isort: skip

__all__ = ["CHECKS", "InstallationTest", "labextension_status", "main"]

EXTENSION = "alpa-lab"
"""The JupyterLab extension's package name (labextension/package.json)."""


def _check_model() -> tuple:
    """(state, batch, train_step) of Alpa's check model: six dense layers of 256 with biases, a regression batch of
    256 (``alpa_lab.testing``'s MLP, SGD with momentum; its step returns the new state and the loss)."""
    return get_mlp_train_state_and_step(batch_size=256, hidden_size=256, num_layers=6)


def labextension_status(name: str = EXTENSION) -> tuple[bool, str]:
    """(installed, what ``jupyter labextension list`` says of ``name``): enabled and OK, or why not."""
    try:
        # JupyterLab's own module, not the `jupyter` launcher, which looks for `jupyter-labextension` on PATH
        out = subprocess.run([sys.executable, "-m", "jupyterlab.labextensions", "list"], capture_output=True, text=True,
                             timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"JupyterLab's `labextension list` did not run ({e}): pip install jupyterlab"
    text = re.sub(r"\x1b\[[0-9;]*m", "", out.stdout + out.stderr)  # colours; the list goes to stderr in some versions
    if out.returncode != 0:
        last = next((line for line in reversed(text.splitlines()) if line.strip()), "no output")
        return False, f"JupyterLab's `labextension list` failed (exit {out.returncode}: {last.strip()}): pip install jupyterlab"
    entries = [line.split() for line in text.splitlines() if line.split()[:1] == [name]]
    if not entries:
        return False, (f"JupyterLab does not list the {name} extension: install alpa_lab from its wheel (which carries the "
                       "prebuilt extension), or run `make labextension` in a checkout")
    words = entries[0]
    if "enabled" not in words or "OK" not in words:
        return False, f"JupyterLab lists the {name} extension but not as enabled and OK: {' '.join(words)}"
    return True, " ".join(words)


class InstallationTest(unittest.TestCase):
    """The checks, as Alpa names them (``test_1_shard_parallel``, ``test_2_pipeline_parallel``), and ours."""

    def test_1_shard_parallel(self) -> None:
        state, batch, train_step = _check_model()
        expected = train_step(state, batch)
        actual = al.parallelize(train_step, method=al.ShardParallel(num_micro_batches=2))(state, batch)
        assert_allclose(expected, actual)

    def test_2_pipeline_parallel(self) -> None:
        existing = al.get_global_cluster()  # a session this process already runs: used, and left to its owner
        cluster = existing if existing is not None else al.init(cluster="ray")
        if cluster is None:
            self.fail("this process called alpa_lab.init('local'), so its steps run here, not on Ray: run the check in a "
                      "fresh Python (python -m alpa_lab.test_install)")
        try:
            layers = min(cluster.num_devices, 2)
            state, batch, train_step = _check_model()
            expected = train_step(state, batch)
            method = al.PipeshardParallel(num_micro_batches=2, layer_option=al.AutoLayerOption(layer_num=layers))
            actual = al.parallelize(train_step, method=method)(state, batch)
            assert_allclose(expected, actual)
        finally:
            if existing is None:
                al.shutdown()

    def test_3_jupyterlab_extension(self) -> None:
        ok, said = labextension_status()
        if not ok:
            self.fail(said)


CHECKS = {
    "shard": ("one mesh (ShardParallel, 2 micro-batches) equals the plain step", "test_1_shard_parallel"),
    "ray": ("pipeline on a Ray cluster's mesh workers equals the plain step", "test_2_pipeline_parallel"),
    "jupyterlab": (f"JupyterLab has the {EXTENSION} extension, enabled and OK", "test_3_jupyterlab_extension"),
}
"""name -> (what it checks, its test method)."""


def _reason(error: BaseException) -> str:
    """An error in a few lines: its type and the start of its message (numpy's mismatch report, not its arrays)."""
    lines = [line.rstrip() for line in str(error).splitlines() if line.strip()][:4]
    return f"{type(error).__name__}: " + "\n        ".join(lines or ["(no message)"])


def main(argv: list[str] | None = None) -> int:
    """Run the checks, one line each; 0 when none fails, 1 otherwise (each failure says why)."""
    ap = argparse.ArgumentParser(prog="python -m alpa_lab.test_install",
                                 description="Check that alpa_lab works here: a step on one mesh, a pipeline on Ray's "
                                             "mesh workers, the JupyterLab extension.")
    ap.add_argument("--skip", default="", help=f"comma-separated checks to leave out: {', '.join(CHECKS)}")
    args = ap.parse_args(argv)
    skip = tuple(s.strip() for s in args.skip.split(",") if s.strip())
    unknown = sorted(set(skip) - set(CHECKS))
    if unknown:
        ap.error(f"unknown check(s) {', '.join(unknown)}: the checks are {', '.join(CHECKS)}")
    devices = jax.devices()
    print(f"alpa_lab {al.__version__}, jax {jax.__version__}: {len(devices)} {devices[0].platform} devices")
    counts = {"ok": 0, "FAIL": 0, "skip": 0}
    for name, (what, method) in CHECKS.items():
        if name in skip:
            counts["skip"] += 1
            print(f"  skip  {name}: {what}")
            continue
        t0 = time.perf_counter()
        try:
            getattr(InstallationTest(method), method)()
        except Exception as e:  # noqa: BLE001 - any error fails the check, and says what it was
            counts["FAIL"] += 1
            print(f"  FAIL  {name}: {what} ({time.perf_counter() - t0:.1f} s)\n        {_reason(e)}")
        else:
            counts["ok"] += 1
            print(f"  ok    {name}: {what} ({time.perf_counter() - t0:.1f} s)")
    if counts["FAIL"]:
        print(f"{counts['FAIL']} check(s) failed (see above), {counts['ok']} passed, {counts['skip']} skipped.")
    elif counts["skip"]:
        print(f"{counts['ok']} check(s) passed, {counts['skip']} skipped.")
    else:
        print("alpa_lab is installed and works here.")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
