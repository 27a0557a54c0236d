"""Flax NNX steps written for ``nnx.jit``, which change the model and optimizer in place.

A parallelized step, like ``jax.jit``, hands back only what the step returns: an NNX step that calls
``optimizer.update(model, grads)`` and returns the loss trained nothing and said nothing (the loss of every
call was the first step's). It is now refused when planned, naming the arrays it would lose and the two ways
that work, which are checked here against ``nnx.jit`` (the oracle) step by step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import alpa_lab as al

X = jnp.linspace(-1.0, 1.0, 32 * 16, dtype=jnp.float32).reshape(32, 16)
Y = jnp.zeros((32, 4), jnp.float32)


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, dropout: float = 0.0):
        self.l1 = nnx.Linear(16, 64, rngs=rngs)
        self.l2 = nnx.Linear(64, 4, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs) if dropout else None

    def __call__(self, x):
        h = nnx.relu(self.l1(x))
        return self.l2(self.drop(h) if self.drop is not None else h)


def make(dropout: float = 0.0):
    model = MLP(nnx.Rngs(0), dropout)
    return model, nnx.Optimizer(model, optax.adam(0.01), wrt=nnx.Param)


def update_in_place(model, optimizer):
    """The step as NNX's guides write it for nnx.jit: changes its arguments, returns the loss."""
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(X) - Y) ** 2))(model)
    optimizer.update(model, grads)
    return loss


def reference_losses(steps: int = 3) -> list[float]:
    model, optimizer = make()
    step = nnx.jit(update_in_place)
    return [float(step(model, optimizer)) for _ in range(steps)]


def test_a_step_that_changes_nnx_objects_in_place_is_refused_by_name():
    model, optimizer = make()
    kernel = np.asarray(model.l1.kernel[...])
    step = al.parallelize(update_in_place, cluster=al.ClusterSpec.local(1, 4))
    with pytest.raises(al.TraceError, match=r"changes Flax NNX objects among its arguments in place \(args\[0\]\.l1\.") as info:
        step(model, optimizer)
    msg = str(info.value)
    assert "nnx.split" in msg and "nnx.merge" in msg and "return the changed objects" in msg
    assert step.current_plan is None and np.array_equal(np.asarray(model.l1.kernel[...]), kernel)  # nothing ran
    with pytest.raises(al.TraceError, match="in place"):
        step.plan(model, optimizer)
    # a dropout's key counter is a change too: lost, every step would draw the first step's mask
    model, optimizer = make(dropout=0.5)
    with pytest.raises(al.TraceError, match=r"args\[0\]\.drop\.rngs"):
        al.parallelize(update_in_place, cluster=al.ClusterSpec.local(1, 4)).plan(model, optimizer)


def test_the_functional_form_the_error_gives_trains_like_nnx_jit():
    model, optimizer = make()
    graphdef, state = nnx.split((model, optimizer))

    def train_step(state):
        model, optimizer = nnx.merge(graphdef, state)
        loss = update_in_place(model, optimizer)
        return nnx.state((model, optimizer)), loss

    step = al.parallelize(train_step, cluster=al.ClusterSpec.local(1, 4))
    losses = []
    for _ in range(3):
        state, loss = step(state)
        losses.append(float(loss))
    np.testing.assert_allclose(losses, reference_losses(), rtol=1e-5)
    assert losses[2] != losses[0]  # it trains


def test_returning_the_changed_objects_trains_like_nnx_jit():
    model, optimizer = make()

    def train_step(model, optimizer):
        loss = update_in_place(model, optimizer)
        return model, optimizer, loss

    step = al.parallelize(train_step, cluster=al.ClusterSpec.local(1, 4))
    losses = []
    for _ in range(3):
        model, optimizer, loss = step(model, optimizer)
        losses.append(float(loss))
    assert isinstance(model, MLP)
    np.testing.assert_allclose(losses, reference_losses(), rtol=1e-5)


def test_a_plain_dict_changed_in_place_keeps_jax_jits_meaning():
    """Not NNX: a step that rescales its batch dict in place changes only its own copy under jax.jit, and the
    caller expects nothing back; it is planned and run as jax.jit runs it."""

    def train_step(params, batch):
        batch["x"] = batch["x"] * 2.0
        return jnp.mean(jnp.tanh(batch["x"] @ params["w"]))

    params = {"w": jnp.full((16, 8), 0.01, jnp.float32)}
    batch = {"x": X}
    got = al.parallelize(train_step, cluster=al.ClusterSpec.local(1, 4))(params, dict(batch))
    np.testing.assert_allclose(float(got), float(jax.jit(train_step)(params, dict(batch))), rtol=1e-6)
