"""Check an installation: ``python -m alpa_lab.test_install`` (Alpa's ``python -m alpa.test_install``).

After ``pip install``, the first thing to know is whether the parts that need more than Python work
here: XLA's sharded programs on this machine's devices, a Ray cluster of mesh workers, and the
JupyterLab extension. Each check runs the real thing and compares it with an independent answer:

1. **one mesh**: Alpa's check model (six dense layers, SGD) trained one step with
   ``ShardParallel(num_micro_batches=2)`` on this process's devices, against the plain JAX step;
2. **pipeline on Ray**: the same step as a two-layer pipeline (``PipeshardParallel``) on the mesh
   workers of ``init("ray")`` (a local Ray on 127.0.0.1 with simulated CPU devices, or the cluster
   ``RAY_ADDRESS`` names), against the plain step; the local Ray is stopped afterwards;
3. **JupyterLab**: ``jupyter labextension list`` shows the ``alpa-lab`` extension enabled and OK.

The states must agree to 1e-4 (relative and absolute, as Alpa's check). Each check prints one line;
the exit status is 1 when one fails, and its message says what to do. ``python -m unittest
alpa_lab.test_install`` runs the same checks as unit tests; ``--skip ray,jupyterlab`` leaves checks out.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import unittest
from typing import Any

import alpa_lab as al  # first: it gives this process its simulated CPU devices  # isort: skip
import jax  # isort: skip
import jax.numpy as jnp  # isort: skip
import optax  # isort: skip
from flax import linen as nn  # isort: skip
from flax.training.train_state import TrainState  # isort: skip

from alpa_lab.testing import assert_allclose  # isort: skip

__all__ = ["CHECKS", "InstallationTest", "create_train_state_and_batch", "labextension_status", "main", "suite"]

EXTENSION = "alpa-lab"
"""The JupyterLab extension's package name (labextension/package.json)."""


def create_train_state_and_batch(batch_size: int, hidden_size: int) -> tuple[TrainState, dict[str, jax.Array]]:
    """Alpa's check model: six dense layers of ``hidden_size`` with biases, SGD, a regression batch."""

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            for _ in range(6):
                x = nn.Dense(hidden_size, use_bias=True)(x)
            return x

    key = jax.random.PRNGKey(0)
    batch = {"x": jax.random.normal(key, (batch_size, hidden_size), jnp.float32),
             "y": jax.random.normal(jax.random.PRNGKey(1), (batch_size, hidden_size), jnp.float32)}
    model = Model()
    params = model.init(key, batch["x"])
    return TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(learning_rate=1e-3)), batch


def train_step(state: TrainState, batch: dict[str, jax.Array]) -> TrainState:
    """One SGD step on the mean squared error; ``al.grad`` marks the gradient (a plain ``jax.grad`` outside a plan)."""

    def loss_func(params: Any) -> jax.Array:
        out = state.apply_fn(params, batch["x"])
        return jnp.mean((out - batch["y"]) ** 2)

    grads = al.grad(loss_func)(state.params)
    return state.apply_gradients(grads=grads)


def labextension_status(name: str = EXTENSION) -> tuple[bool, str]:
    """(installed, what ``jupyter labextension list`` says of ``name``): enabled and OK, or why not."""
    try:
        # JupyterLab's own module, not the `jupyter` launcher, which looks for `jupyter-labextension` on PATH
        out = subprocess.run([sys.executable, "-m", "jupyterlab.labextensions", "list"], capture_output=True, text=True,
                             timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"`jupyter labextension list` did not run ({e}): install JupyterLab (pip install jupyterlab)"
    text = out.stdout + out.stderr  # it prints the list on stderr in some versions
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith(name + " ")]
    if not lines:
        return False, (f"JupyterLab does not list the {name} extension: install alpa_lab from its wheel (which carries the "
                       "prebuilt extension), or run `make labextension` in a checkout")
    line = lines[0]
    if "enabled" not in line or "OK" not in line:
        return False, f"JupyterLab lists the extension but not as enabled and OK: {line!r}"
    return True, line


class InstallationTest(unittest.TestCase):
    """The checks, as Alpa names them (``test_1_shard_parallel``, ``test_2_pipeline_parallel``), and ours."""

    def test_1_shard_parallel(self) -> None:
        state, batch = create_train_state_and_batch(256, 256)
        expected = train_step(state, batch)
        actual = al.parallelize(train_step, method=al.ShardParallel(num_micro_batches=2))(state, batch)
        assert_allclose(expected.params, actual.params)

    def test_2_pipeline_parallel(self) -> None:
        al.init(cluster="ray")
        try:
            layers = min(al.get_global_cluster().num_devices, 2)
            state, batch = create_train_state_and_batch(256, 256)
            expected = train_step(state, batch)
            method = al.PipeshardParallel(num_micro_batches=2, layer_option=al.AutoLayerOption(layer_num=layers))
            actual = al.parallelize(train_step, method=method)(state, batch)
            assert_allclose(expected.params, actual.params)
        finally:
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


def suite(skip: tuple[str, ...] = ()) -> unittest.TestSuite:
    """The checks not in ``skip``, in order."""
    s = unittest.TestSuite()
    for name, (_, method) in CHECKS.items():
        if name not in skip:
            s.addTest(InstallationTest(method))
    return s


def main(argv: list[str] | None = None) -> int:
    """Run the checks, one line each; 0 when all pass, 1 otherwise (each failure says why)."""
    ap = argparse.ArgumentParser(prog="python -m alpa_lab.test_install", description=__doc__.split("\n\n")[0])
    ap.add_argument("--skip", default="", help=f"comma-separated checks to leave out: {', '.join(CHECKS)}")
    args = ap.parse_args(argv)
    skip = tuple(s for s in args.skip.split(",") if s)
    unknown = sorted(set(skip) - set(CHECKS))
    if unknown:
        ap.error(f"unknown check(s) {', '.join(unknown)}: the checks are {', '.join(CHECKS)}")
    devices = jax.devices()
    print(f"alpa_lab {al.__version__}, jax {jax.__version__}: {len(devices)} {devices[0].platform} devices")
    failed = 0
    for name, (what, method) in CHECKS.items():
        if name in skip:
            print(f"  skip  {name}: {what}")
            continue
        t0 = time.perf_counter()
        result = unittest.TestResult()
        InstallationTest(method).run(result)
        problems = result.failures + result.errors
        seconds = time.perf_counter() - t0
        if problems:
            failed += 1
            message = problems[0][1].strip().splitlines()[-1].removeprefix("AssertionError: ")
            print(f"  FAIL  {name}: {what} ({seconds:.1f} s)\n        {message}")
        else:
            print(f"  ok    {name}: {what} ({seconds:.1f} s)")
    print("alpa_lab is installed and works here." if not failed else f"{failed} check(s) failed (see above).")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
