"""Test set-up: 8 simulated CPU devices, set before JAX is first imported."""

import atexit
import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# calibrations are kept per run: a user's saved calibration must not change what the tests plan
os.environ["ALPA_LAB_CACHE"] = tempfile.mkdtemp(prefix="alpa_lab_cache_")
atexit.register(shutil.rmtree, os.environ["ALPA_LAB_CACHE"], ignore_errors=True)  # a test run leaves no folder behind

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)


import pytest  # noqa: E402


@pytest.fixture(scope="module")
def references():
    """Per example model, ``STEPS`` steps of the independent reference (``test_pipeline.accumulated_step``):
    plain JAX on one device, gradient accumulation over the same micro-batches. Shared by the
    in-process pipeline tests and the Ray runtime tests."""
    from alpa_lab.models import tiny_example
    from test_pipeline import MICROBATCHES, MODELS, STEPS, accumulated_step

    out = {}
    for name in MODELS:
        ex = tiny_example(name)
        step = accumulated_step(ex, MICROBATCHES)
        states, state = [], ex.state
        for _ in range(STEPS):
            state, loss = step(state, ex.batch)
            states.append((state, loss))
        out[name] = states
    return out
