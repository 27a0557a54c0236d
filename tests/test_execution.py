"""Sharded execution equals unsharded execution (the independent reference for numerics).

Every example family, planned on 1x4, 4x1 and 2x2 logical meshes of simulated devices, runs
two training steps under its plan; losses and every leaf of the new state must match
``jax.jit(train_step)`` run unsharded. Tolerance: rtol 2e-4, atol 2e-5 (float32; sharded
reductions sum in another order, and Adam divides by sqrt of second moments).
"""

import jax
import numpy as np
import pytest

import alpa_lab as al
from alpa_lab.models import EXAMPLES, make_mlp_nnx

RTOL, ATOL = 2e-4, 2e-5
MESHES = [(1, 4), (4, 1), (2, 2)]


def assert_trees_close(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=RTOL, atol=ATOL)


def run_both(ex, mesh_shape, steps=2, method="alpa"):
    step = al.parallelize(ex.train_step, cluster=al.ClusterSpec.local(1, 4), mesh_shape=mesh_shape, method=method)
    plan = step.plan(*ex.args)
    ref = jax.jit(ex.train_step)
    state, ref_state = ex.state, ex.state
    for _ in range(steps):
        state, loss = step(state, ex.batch)
        ref_state, ref_loss = ref(ref_state, ex.batch)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=RTOL, atol=ATOL)
    assert_trees_close(state, ref_state)
    return plan, state


@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("name", list(EXAMPLES))
def test_sharded_equals_unsharded(name, mesh_shape):
    config_cls, make = EXAMPLES[name]
    ex = make(config_cls())
    plan, state = run_both(ex, mesh_shape)
    assert plan.mesh_shape == mesh_shape
    # the state comes back in the layout it went in, so steps chain without re-layout
    for leaf, tensor in zip(jax.tree.leaves(state), plan.outputs):
        assert al.ShardingSpec.from_partition_spec(leaf.sharding.spec, leaf.ndim) == al.ShardingSpec.parse(tensor.spec)


def test_nnx_model_runs_sharded():
    run_both(make_mlp_nnx(), (2, 2))


@pytest.mark.parametrize("method", ["data_parallel", "zero2", "zero3", "megatron"])
def test_comparison_methods_run_and_match(method):
    from alpa_lab.models import MLPConfig, make_mlp

    ex = make_mlp(MLPConfig(batch=16, in_dim=32, hidden=64, layers=2, out_dim=16))
    plan, _ = run_both(ex, (1, 4), method=method)
    assert plan.method == method


def test_automatic_mesh_shape_is_the_cheapest_candidate():
    from alpa_lab.models import MLPConfig, make_mlp

    ex = make_mlp(MLPConfig(batch=64, in_dim=64, hidden=256, layers=2, out_dim=64))
    step = al.parallelize(ex.train_step, cluster=al.ClusterSpec.local(1, 4))
    plan = step.plan(*ex.args)
    shapes = [s for s, _ in plan.mesh_candidates]
    assert sorted(shapes) == [(1, 4), (2, 2), (4, 1)]
    assert plan.objective == min(t for _, t in plan.mesh_candidates)
    new_state, loss = step(*ex.args)
    assert np.isfinite(float(loss))
