"""Alpa's ``static_argnums``: arguments bound into the traced function instead of passed to the program.

Alpa's older tests call ``p_train_step(optimizer, batch, model.apply)`` (a function as an argument, found static by
its "auto" rule) and ``parallelize(train_step, static_argnums=(3,))`` for a flag the step branches on. Oracles: the
unparallelized step with the same values (``jax.jit`` of it closed over them), and a count of the user function's
traces (one per distinct static value, as ``jax.jit``'s).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState

import alpa_lab as al

CLUSTER = al.ClusterSpec.local(1, 4)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8)(nn.relu(nn.Dense(16)(x)))


def _setup():
    model = MLP()
    x = jax.random.normal(jax.random.PRNGKey(1), (16, 8))
    batch = {"x": x, "y": jnp.ones((16, 8))}
    params = model.init(jax.random.PRNGKey(0), x)
    return model, params, batch


def _close(a, b):
    for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-5, atol=1e-6)


def test_a_function_argument_is_static_by_alpas_auto_rule():
    model, params, batch = _setup()
    state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))

    def train_step(state, batch, apply_fn):
        def loss(p):
            return jnp.mean((apply_fn(p, batch["x"]) - batch["y"]) ** 2)

        return state.apply_gradients(grads=al.grad(loss)(state.params))

    step = al.parallelize(train_step, method=al.ShardParallel(devices=jax.devices()[:4]))
    new = step(state, batch, model.apply)
    expected = jax.jit(functools.partial(train_step, apply_fn=model.apply))(state, batch)
    _close(new.params, expected.params)
    plan = step.current_plan
    assert len(plan.inputs) == len(jax.tree_util.tree_leaves((state, batch)))  # the function is not an input
    executable = step.get_executable(state, batch, model.apply)
    _close(executable(state, batch, model.apply).params, expected.params)  # Alpa's fast call, static argument and all
    assert step.get_last_executable().plan is plan
    # the same function again (a new bound-method object, equal to the first) reuses the plan
    assert step.plan(state, batch, model.apply) == plan


def test_named_static_flags_trace_once_per_value():
    calls = []

    def step_fn(w, x, scale, train):
        calls.append((scale, train))
        y = jnp.tanh(x @ w)
        return y * scale if train else y

    step = al.parallelize(step_fn, cluster=CLUSTER, static_argnums=(2, 3))
    w, x = jnp.ones((8, 8)) * 0.1, jnp.ones((16, 8))
    for scale, train in ((2.0, True), (2.0, False), (3.0, True), (2.0, True)):
        np.testing.assert_allclose(np.asarray(step(w, x, scale, train)), np.asarray(step_fn(w, x, scale, train)), rtol=1e-6)
    traced = [c for c in calls if not isinstance(c[0], jax.core.Tracer)]
    assert sorted(set(traced)) == [(2.0, False), (2.0, True), (3.0, True)]
    assert len(step.current_plan.inputs) == 2  # w and x
    with pytest.raises(ValueError, match="static_argnums names argument 3 but the call passes 3 arguments"):
        step(w, x, 2.0)


def test_a_static_argument_before_the_batch_keeps_the_batch_named():
    """``batch_argnums`` count the user's arguments: the batch at position 2 after a static function at 0 is still
    the one cut into micro-batches."""
    model, params, batch = _setup()

    def train_step(apply_fn, params, batch):
        def loss(p):
            return jnp.mean((apply_fn(p, batch["x"]) - batch["y"]) ** 2)

        grads = al.grad(loss)(params)
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)

    step = al.parallelize(train_step, cluster=al.ClusterSpec.local(2, 4), microbatches=2, layers=2, batch_argnums=(2,))
    new = step(model.apply, params, batch)
    _close(new, jax.jit(functools.partial(train_step, model.apply))(params, batch))
    assert sorted(step.current_plan.split_inputs) == ["[1]['x']", "[1]['y']"]  # the program's argument 1: the batch


def test_runs_refuse_a_step_with_static_arguments():
    model, params, batch = _setup()

    def train_step(params, batch, apply_fn):
        grads = al.grad(lambda p: jnp.mean(apply_fn(p, batch["x"]) ** 2))(params)
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)

    step = al.parallelize(train_step, cluster=CLUSTER)
    step(params, batch, model.apply)
    with pytest.raises(ValueError, match=r"a training run runs the step on \(state, batch\) of arrays, but this step takes "
                                         r"static arguments \(argument 2 of its last call\): close over them"):
        step.train(params, [batch], steps=2)
    with pytest.raises(ValueError, match="static_argnums must be 'auto' or argument positions"):
        al.parallelize(train_step, static_argnums=(-1,))


def test_a_programs_fingerprint_holds_its_literal_values_not_their_python_types():
    """Two traces differing only in a bound value (3.0 against 2.0) are two programs; a weakly typed Python int
    argument against an int32 array (a TrainState's step before and after a step) is one program (its literal 1
    comes as a Python int or a 0-d array)."""
    from alpa_lab.graph.trace import trace

    def scaled(x, scale):
        return x * scale

    x = np.ones((4, 4), np.float32)
    fingerprints = {s: trace(functools.partial(scaled, scale=s), x).fingerprint for s in (2.0, 3.0)}
    assert fingerprints[2.0] != fingerprints[3.0]
    assert trace(functools.partial(scaled, scale=2.0), x).fingerprint == fingerprints[2.0]

    def count(step, x):
        return step + 1, x * 2

    assert trace(count, 0, x).fingerprint == trace(count, np.int32(0), x).fingerprint


def test_a_python_bool_is_static_and_arguments_may_be_given_by_name():
    """Alpa's "auto" rule makes a Python bool argument static: Alpa's BERT and MoE tests call
    ``train_step(state, batch, deterministic)`` on a step that branches on it (Flax's ``Dropout(deterministic=...)``).
    Numbers stay traced (a new learning rate does not plan again). Arguments given by name go to their places, as
    ``jax.jit`` takes them; a keyword-only parameter cannot be placed, and says so. Oracle: the function itself."""
    calls = []

    def step_fn(x, batch, deterministic=True, scale=3.0):
        calls.append(deterministic)
        if deterministic:
            return x * scale
        return x + batch * scale

    step = al.parallelize(step_fn, method=al.ShardParallel())
    x, b = jnp.arange(32.0).reshape(8, 4), jnp.ones((8, 4))
    for args, kwargs in (((x, b, False), {}), ((x, b), {"deterministic": False}), ((x, b), {}), ((x, b, True), {}),
                         ((x, b), {"scale": 5.0, "deterministic": False}), ((), {"batch": b, "x": x})):
        np.testing.assert_allclose(np.asarray(step(*args, **kwargs)), np.asarray(step_fn(*args, **kwargs)), rtol=1e-6)
    assert sorted(set(c for c in calls if isinstance(c, bool))) == [False, True]  # one trace per flag value
    assert len(step.current_plan.inputs) == 2  # x and batch: the flag is bound, the default scale a constant
    step(x, b, False, 7.0)
    assert len(step.current_plan.inputs) == 3  # a number passed stays an argument of the program
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        step(x, b, bogus=1)

    def keyword_only(x, *, flag):
        return x

    with pytest.raises(TypeError, match="takes 'flag' by keyword only.*functools.partial"):
        al.parallelize(keyword_only)(x, flag=True)
