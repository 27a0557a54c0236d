"""Alpa's ``manual_remat`` and ``automatic_remat``: a loss function rematerialized per layer, with no stages cut.

Oracles: the plain function's numbers (gradients to 1e-6 absolute, losses to rtol 1e-5), the number of
``jax.checkpoint`` calls in the traced program (one per piece), and XLA's own allocation (``memory_analysis``)
beside the plan's eq. 5 memory: remat must lower both.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import alpa_lab as al


class MLP(nn.Module):
    layers: int = 6
    marks: bool = True
    width: int = 32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for i in range(self.layers):
            if i and self.marks:
                al.mark_pipeline_boundary()
            x = jnp.tanh(nn.Dense(self.width)(x))
        return nn.Dense(4)(x)


def setup(marks: bool, batch: int = 16, width: int = 32, layers: int = 6):
    model = MLP(layers=layers, marks=marks, width=width)
    x = jnp.linspace(-1, 1, batch * 8).reshape(batch, 8)
    params = model.init(jax.random.PRNGKey(0), x)

    def loss(p, x):
        return jnp.mean(model.apply(p, x) ** 2)

    return loss, params, x


def checkpoints(f, *args) -> int:
    """``jax.checkpoint`` calls at the top of ``f``'s program (named remat or checkpoint by JAX's versions)."""
    return sum(e.primitive.name in ("checkpoint", "remat", "remat2") for e in jax.make_jaxpr(f)(*args).jaxpr.eqns)


def markers(f, *args) -> int:
    return str(jax.make_jaxpr(jax.grad(f))(*args)).count("pipeline_marker")


def assert_same_gradients(f, g, *args) -> None:
    for a, b in zip(jax.tree_util.tree_leaves(jax.jit(jax.grad(f))(*args)), jax.tree_util.tree_leaves(jax.grad(g)(*args))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_manual_remat_checkpoints_each_piece_between_boundaries_and_cuts_nothing():
    loss, params, x = setup(marks=True)
    f = al.manual_remat(loss)
    assert checkpoints(loss, params, x) == 0 and checkpoints(f, params, x) == 6  # six pieces, five boundaries
    assert markers(f, params, x) == 0  # the boundaries said where to rematerialize: no stage is cut there
    assert_same_gradients(f, loss, params, x)
    np.testing.assert_allclose(float(f(params, x)), float(loss(params, x)), rtol=1e-6)  # eagerly too
    assert al.manual_remat()(loss)(params, x) == f(params, x)  # Alpa's decorator with options


@pytest.mark.parametrize("layer_num", [2, 3])
def test_automatic_remat_checkpoints_the_layers_it_asks_for(layer_num):
    loss, params, x = setup(marks=False)
    f = al.automatic_remat(loss, layer_num=layer_num)
    assert checkpoints(f, params, x) == layer_num
    assert markers(f, params, x) == 0
    assert_same_gradients(f, loss, params, x)


def test_automatic_remat_auto_and_with_the_users_boundaries():
    loss, params, x = setup(marks=False)
    auto = al.automatic_remat(loss, layer_num="auto")
    assert 2 <= checkpoints(auto, params, x) < 7  # about the square root of the pieces, more than one
    assert_same_gradients(auto, loss, params, x)
    marked, params, x = setup(marks=True)
    assert checkpoints(al.automatic_remat(marked), params, x) == 6  # the user's layers win


@pytest.mark.parametrize("decorate", ["manual", "automatic", "jax.checkpoint"])
def test_remat_lowers_the_planned_and_the_compiled_memory_on_one_mesh(decorate):
    """ShardParallel with ``jax.grad`` of the decorated loss: the same loss as without remat, and both the plan's memory
    (eq. 5) and XLA's allocation for the program lower than without it."""
    # activations (8 layers of 1024 x 64 over 8 devices) well above the weights, as where remat is used
    loss, params, x = setup(marks=decorate == "manual", batch=1024, width=64, layers=8)
    remat = {"manual": al.manual_remat, "automatic": lambda f: al.automatic_remat(f, layer_num=3),
             "jax.checkpoint": jax.checkpoint}[decorate](loss)

    def step_of(f):
        def step(p, x):
            value, g = jax.value_and_grad(f)(p, x)
            return jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, p, g), value
        return step

    figures = {}
    for name, f in (("plain", loss), ("remat", remat)):
        step = al.parallelize(step_of(f), method=al.ShardParallel())
        _, value = step(params, x)
        np.testing.assert_allclose(float(value), float(loss(params, x)), rtol=1e-5)
        figures[name] = (step.current_plan.memory_per_device, step.get_last_executable().get_total_allocation_size())
    assert figures["remat"][0] < figures["plain"][0] and figures["remat"][1] < figures["plain"][1], figures


def test_a_rematerialized_loss_pipelines_and_trains_like_jax():
    loss, params, x = setup(marks=False, batch=32)
    f = al.automatic_remat(loss, layer_num=4)

    def step_of(f, grad):
        def step(p, x):
            value, g = grad(f)(p, x)
            return jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, p, g), value
        return step

    step = al.parallelize(step_of(f, al.value_and_grad), method=al.PipeshardParallel(
        num_micro_batches=2, layer_option=al.AutoLayerOption(layer_num=2), stage_option="uniform"))
    ref = jax.jit(step_of(loss, jax.value_and_grad))
    a = b = params
    for _ in range(2):
        (a, la), (b, lb) = step(a, x), ref(b, x)
        np.testing.assert_allclose(float(la), float(lb), rtol=1e-5)
    assert len(step.current_plan.stages) == 2


def test_bad_remat_options_are_refused():
    loss, _, _ = setup(marks=False)
    for bad in (0, -1, 1.5, True, "all"):
        with pytest.raises(ValueError, match="positive integer or 'auto'"):
            al.automatic_remat(loss, layer_num=bad)
    with pytest.raises(ValueError, match="static_argnums"):
        al.manual_remat(loss, static_argnums=(1,))
    with pytest.raises(TypeError, match="decorates a function"):
        al.manual_remat(3)
