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


def _flax_train_state():
    """What a new user writes: a linen MLP, flax's own ``TrainState`` (its ``step`` is the Python int 0),
    and a NumPy float64 batch (JAX makes it float32), with a step taking gradients with ``al.value_and_grad``."""
    import flax.linen as nn
    import optax
    from flax.training import train_state

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(4):
                x = nn.relu(nn.Dense(64)(x))
            return nn.Dense(10)(x)

    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(32, 16)), "y": rng.integers(0, 10, size=(32,))}
    model = MLP()
    params = model.init(jax.random.PRNGKey(0), np.zeros((1, 16), np.float32))
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))

    def train_step(state, batch):
        def loss_fn(params):
            logits = state.apply_fn(params, batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        loss, grads = al.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    return state, batch, train_step


@pytest.mark.parametrize("microbatches", [None, 4], ids=["single_mesh", "pipelined"])
def test_a_flax_train_state_with_python_scalars_runs_and_matches(microbatches):
    """Python scalars in the state (``step=0``) and float64 NumPy data are typed as ``jax.jit`` types them."""
    state, batch, train_step = _flax_train_state()
    assert type(state.step) is int and batch["x"].dtype == np.float64
    step = al.parallelize(train_step, cluster=al.ClusterSpec.local(2, 2), microbatches=microbatches, layers=2)
    ref = jax.jit(train_step)
    ref_state = state
    for _ in range(2):  # the second step's state has an array step (the same key as the int: weak int32)
        state, loss = step(state, batch)
        ref_state, ref_loss = ref(ref_state, batch)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=RTOL, atol=ATOL)
    assert int(state.step) == 2
    assert_trees_close(state.params, ref_state.params)
    assert_trees_close(state.opt_state, ref_state.opt_state)


def test_a_pipelined_step_returns_jax_arrays_as_jit_does():
    """Every result is a ``jax.Array``, a constant one (a fixed metric) and a passed-through argument too."""
    import jax.numpy as jnp

    state, batch, train_step = _flax_train_state()

    def step_with_metrics(state, batch, lr):
        new, loss = train_step(state, batch)
        return new, {"loss": loss, "fixed": jnp.float32(0.5), "lr": lr}

    step = al.parallelize(step_with_metrics, cluster=al.ClusterSpec.local(2, 2), microbatches=4, layers=2)
    _, metrics = step(state, batch, np.float32(0.1))
    _, ref = jax.jit(step_with_metrics)(state, batch, np.float32(0.1))
    for key in ("loss", "fixed", "lr"):
        assert isinstance(metrics[key], jax.Array), (key, type(metrics[key]))
        np.testing.assert_allclose(np.asarray(metrics[key]), np.asarray(ref[key]), rtol=RTOL, atol=ATOL)


def _flax_step(dtype, dropout: float = 0.0):
    """A linen MLP in ``dtype`` (params and compute) with dropout, flax's TrainState and plain SGD, a step
    taking ``(state, batch, key)``; and its loss function, to build references from."""
    import flax.linen as nn
    import jax.numpy as jnp
    import optax
    from flax.training import train_state

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(4):
                x = nn.relu(nn.Dense(64, dtype=dtype, param_dtype=dtype)(x))
                x = nn.Dropout(dropout, deterministic=dropout == 0.0)(x)
            return nn.Dense(10, dtype=dtype, param_dtype=dtype)(x)

    rng = np.random.default_rng(0)
    batch = {"x": jnp.asarray(rng.normal(size=(32, 16)), dtype), "y": jnp.asarray(rng.integers(0, 10, size=(32,)))}
    model = MLP()
    state = train_state.TrainState.create(apply_fn=model.apply, params=model.init(jax.random.PRNGKey(0), batch["x"][:1]),
                                          tx=optax.sgd(0.5))

    def loss_fn(params, batch, key):
        logits = state.apply_fn(params, batch["x"], rngs={"dropout": key}).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    def train_step(state, batch, key):
        loss, grads = al.value_and_grad(lambda p: loss_fn(p, batch, key))(state.params)
        return state.apply_gradients(grads=grads), loss

    return state, batch, train_step, loss_fn


def test_a_bfloat16_pipeline_accumulates_its_gradients():
    """bfloat16 is floating (NumPy's issubdtype says it is not): its gradients are marked and summed over the
    micro-batches. Before, such a step was refused for want of gradient markers, and with the markers alone
    only part of the gradient was applied (parameters 0.14 off after one step whose update is 0.04)."""
    import jax.numpy as jnp

    state, batch, train_step, _ = _flax_step(jnp.bfloat16)
    key = jax.random.PRNGKey(1)
    step = al.parallelize(train_step, cluster=al.ClusterSpec.local(2, 2), microbatches=4, layers=2)
    new, loss = step(state, batch, key)
    ref, ref_loss = jax.jit(train_step)(state, batch, key)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-2)
    for a, b, before in zip(jax.tree.leaves(new.params), jax.tree.leaves(ref.params), jax.tree.leaves(state.params)):
        assert a.dtype == jnp.bfloat16
        # within 2 bfloat16 ulps of 0.5 (sums in another order); the update itself is up to 0.04
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=8e-3)
        assert not np.array_equal(np.asarray(b, np.float32), np.asarray(before, np.float32))


@pytest.mark.parametrize("typed", [False, True], ids=["uint32_key", "typed_key"])
def test_dropout_with_a_prng_key_plans_and_runs(typed):
    """Flax's dropout makes typed PRNG keys (``key<fry>``) inside the step, whatever key it is given.
    Single mesh: equals jax.jit. Pipelined: each micro-batch draws its own masks from the step's key, so the
    reference is the micro-batches' mean loss and mean gradient, each taken with that key."""
    state, batch, train_step, loss_fn = _flax_step(np.float32, dropout=0.3)
    key = jax.random.key(1) if typed else jax.random.PRNGKey(1)
    single = al.parallelize(train_step, cluster=al.ClusterSpec.local(2, 2))
    new, loss = single(state, batch, key)
    ref, ref_loss = jax.jit(train_step)(state, batch, key)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=RTOL, atol=ATOL)
    assert_trees_close(new.params, ref.params)

    piped = al.parallelize(train_step, cluster=al.ClusterSpec.local(2, 2), microbatches=4, layers=2)
    new, loss = piped(state, batch, key)
    micro = [jax.tree.map(lambda x, m=m: x[m * 8:(m + 1) * 8], batch) for m in range(4)]
    losses, grads = zip(*(jax.jit(jax.value_and_grad(loss_fn))(state.params, mb, key) for mb in micro))
    np.testing.assert_allclose(float(loss), float(np.mean(losses)), rtol=RTOL, atol=ATOL)
    mean_grads = jax.tree.map(lambda *g: sum(g) / 4, *grads)
    assert_trees_close(new.params, state.apply_gradients(grads=mean_grads).params)
    assert float(loss) != pytest.approx(float(ref_loss), rel=1e-3)  # other masks than the whole batch's


def test_a_python_scalar_argument_is_weakly_typed_as_jit_types_it():
    """``params - lr * params`` with a Python float ``lr`` keeps bfloat16 parameters bfloat16, as under jax.jit."""
    import jax.numpy as jnp

    params = {"w": jnp.ones((8, 8), jnp.bfloat16)}

    def scale(params, lr):
        return jax.tree.map(lambda x: x - lr * x, params)

    out = al.parallelize(scale, cluster=al.ClusterSpec.local(1, 4))(params, 0.1)
    assert out["w"].dtype == jax.jit(scale)(params, 0.1)["w"].dtype == jnp.bfloat16


def test_a_step_closing_over_a_typed_key_plans_and_runs():
    """A typed key the step closes over is a constant of the program (it has no NumPy form to keep)."""
    import jax.numpy as jnp

    key = jax.random.key(3)
    params, batch = {"w": jnp.full((16, 8), 0.1)}, {"x": jnp.ones((32, 16))}

    def step_fn(params, batch):
        def loss_fn(p):
            mask = jax.random.bernoulli(key, 0.5, (batch["x"].shape[0], 8))
            return jnp.mean(jnp.where(mask, batch["x"] @ p["w"], 0.0) ** 2)

        loss, grads = al.value_and_grad(loss_fn)(params)
        return jax.tree.map(lambda a, g: a - 0.1 * g, params, grads), loss

    new, loss = al.parallelize(step_fn, cluster=al.ClusterSpec.local(1, 4))(params, batch)
    ref, ref_loss = jax.jit(step_fn)(params, batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=RTOL, atol=ATOL)
    assert_trees_close(new, ref)
