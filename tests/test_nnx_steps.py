"""Flax NNX steps written for ``nnx.jit``, which change the model and optimizer in place.

``nnx.jit`` hands such changes back to the caller's objects; ``jax.jit`` (and any program traced from the step as it
stands) returns only what the step returns, so the changes would be lost and the step would train nothing. A
parallelized step now does what ``nnx.jit`` does: it is traced returning the objects it changed, and each call puts
their new state into the caller's objects. Oracle: ``nnx.jit`` on its own copies of the same model and optimizer,
step by step (losses and weights, rtol 1e-5). Where the state is kept between steps away from the caller (a
training run, mesh workers), the step is refused by name, with the functional forms that run there.
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


def test_a_step_that_changes_nnx_objects_in_place_trains_the_callers_objects_like_nnx_jit():
    model, optimizer = make()
    step = al.parallelize(update_in_place, cluster=al.ClusterSpec.local(1, 4))
    losses = [float(step(model, optimizer)) for _ in range(3)]
    np.testing.assert_allclose(losses, reference_losses(), rtol=1e-5)
    assert losses[2] != losses[0] and step.hands_back_nnx
    ref_model, ref_optimizer = make()
    for _ in range(3):
        nnx.jit(update_in_place)(ref_model, ref_optimizer)
    for mine, ref in ((model.l1.kernel, ref_model.l1.kernel), (model.l2.bias, ref_model.l2.bias)):
        np.testing.assert_allclose(np.asarray(mine[...]), np.asarray(ref[...]), rtol=1e-5, atol=1e-7)
    assert int(optimizer.step[...]) == int(ref_optimizer.step[...]) == 3
    # Alpa's executable (a call without re-planning) hands the changes back too
    before = np.asarray(model.l1.kernel[...])
    loss = step.get_executable(model, optimizer)(model, optimizer)
    np.testing.assert_allclose(float(loss), float(nnx.jit(update_in_place)(ref_model, ref_optimizer)), rtol=1e-5)
    assert not np.array_equal(np.asarray(model.l1.kernel[...]), before)
    # the program is the functional form's: every array of the objects comes back where it went in, as state
    from alpa_lab.graph.analysis import classify_arguments

    kinds = classify_arguments(step.trace(model, optimizer))
    assert set(kinds.values()) == {"param", "optimizer_state"}


def test_a_dropout_key_counter_changed_in_place_advances_as_under_nnx_jit():
    """The dropout's nnx.Rngs counter is state changed in place too: lost, every step would draw the first mask."""
    model, optimizer = make(dropout=0.5)
    step = al.parallelize(update_in_place, cluster=al.ClusterSpec.local(1, 4))
    losses = [float(step(model, optimizer)) for _ in range(3)]
    ref_model, ref_optimizer = make(dropout=0.5)
    ref = [float(nnx.jit(update_in_place)(ref_model, ref_optimizer)) for _ in range(3)]
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    assert int(model.drop.rngs.count[...]) == int(ref_model.drop.rngs.count[...]) == 3


def nnx_step(differentiate):
    """The step of NNX's guides, with the gradient taken by ``differentiate`` (nnx.value_and_grad or ours)."""

    def train_step(model, optimizer, x, y):
        loss, grads = differentiate(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    return train_step


def test_al_value_and_grad_takes_an_nnx_module_as_nnx_value_and_grad_does():
    """The gradient is the State of the module's nnx.Param variables, and the dropout's key counter the loss
    advances is put back into the module (JAX's value_and_grad would refuse its uint32 key)."""
    model, optimizer = make(dropout=0.5)
    step = al.parallelize(nnx_step(al.value_and_grad), cluster=al.ClusterSpec.local(1, 4))
    losses = [float(step(model, optimizer, X, Y)) for _ in range(3)]
    ref_model, ref_optimizer = make(dropout=0.5)
    ref = nnx.jit(nnx_step(nnx.value_and_grad))
    np.testing.assert_allclose(losses, [float(ref(ref_model, ref_optimizer, X, Y)) for _ in range(3)], rtol=1e-5)
    assert int(model.drop.rngs.count[...]) == int(ref_model.drop.rngs.count[...]) == 3


def test_a_pipelined_step_that_changes_nnx_objects_in_place_trains_like_nnx_jit():
    """Two stages, two micro-batches: the update (in place) runs once on the gradients averaged over the
    micro-batches, which for a mean loss is the full batch's gradient nnx.jit takes."""
    model, optimizer = make()
    step = al.parallelize(nnx_step(al.value_and_grad), cluster=al.ClusterSpec.local(2, 2), microbatches=2, layers=2)
    losses = [float(step(model, optimizer, X, Y)) for _ in range(3)]
    assert len(step.current_plan.stages) == 2
    ref_model, ref_optimizer = make()
    ref = nnx.jit(nnx_step(nnx.value_and_grad))
    np.testing.assert_allclose(losses, [float(ref(ref_model, ref_optimizer, X, Y)) for _ in range(3)], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(model.l2.kernel[...]), np.asarray(ref_model.l2.kernel[...]), rtol=1e-5, atol=1e-7)


class BatchNormNet(nnx.Module):
    """BatchNorm's statistics change in place in training. (No bias before it: BatchNorm removes it from the loss,
    so its gradient is rounding noise that Adam scales up, and no two runs would agree on it.)"""

    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(16, 64, use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(64, rngs=rngs)
        self.l2 = nnx.Linear(64, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.bn(self.l1(x))))


def two_stages(model, optimizer, microbatches: int):
    """``nnx_step(al.value_and_grad)`` pipelined on two stages of one host's two devices each."""
    step = al.parallelize(nnx_step(al.value_and_grad), cluster=al.ClusterSpec.local(2, 2), microbatches=microbatches, layers=2)
    step.use(step.plan(model, optimizer, X, Y).pin_stages([[0, 0], [1, 1]], submeshes=[(1, 2), (1, 2)]))
    return step


def test_a_loss_cut_into_pipeline_layers_hands_a_modules_changes_back():
    """Cut into layers, the loss re-runs as the program of its ops, which by itself drops what it changes in the
    modules: the dropout's key counter stayed at 0 (every step the same mask, silently). The changes now come back
    through the re-run. One micro-batch: the same masks as nnx.jit, so the same losses. BatchNorm's running mean
    over two micro-batches is the average of theirs, which for equal halves is the full batch's (after one step,
    from the same weights)."""
    model, optimizer = make(dropout=0.5)
    step = two_stages(model, optimizer, microbatches=1)
    losses = [float(step(model, optimizer, X, Y)) for _ in range(3)]
    assert len(step.current_plan.stages) == 2
    ref_model, ref_optimizer = make(dropout=0.5)
    ref = nnx.jit(nnx_step(nnx.value_and_grad))
    np.testing.assert_allclose(losses, [float(ref(ref_model, ref_optimizer, X, Y)) for _ in range(3)], rtol=1e-5)
    assert int(model.drop.rngs.count[...]) == int(ref_model.drop.rngs.count[...]) == 3

    def make_bn():
        net = BatchNormNet(nnx.Rngs(0))
        return net, nnx.Optimizer(net, optax.adam(0.01), wrt=nnx.Param)

    model, optimizer = make_bn()
    two_stages(model, optimizer, microbatches=2)(model, optimizer, X, Y)
    ref_model, ref_optimizer = make_bn()
    ref(ref_model, ref_optimizer, X, Y)
    assert float(np.abs(np.asarray(model.bn.mean[...])).max()) > 0  # it moved
    np.testing.assert_allclose(np.asarray(model.bn.mean[...]), np.asarray(ref_model.bn.mean[...]), rtol=1e-5, atol=1e-9)


def test_where_the_state_stays_away_from_the_caller_an_in_place_step_is_refused_by_name():
    """A training run keeps its state and passes it from step to step: changes handed to the caller's objects at
    each call cannot reach it. It is refused before anything runs, naming the functional form; and a program traced
    from the step as it stands (as jax.jit would) refuses it, naming the arrays it would lose."""
    from alpa_lab.graph.trace import LostUpdatesError, trace

    model, optimizer = make()
    kernel = np.asarray(model.l1.kernel[...])
    step = al.parallelize(update_in_place, cluster=al.ClusterSpec.local(1, 4))
    step.plan(model, optimizer)
    with pytest.raises(ValueError, match=r"changes Flax NNX objects among its arguments in place .*nnx\.split") as info:
        step.train((model, optimizer), {}, steps=2)
    assert "call it in a loop" in str(info.value)
    with pytest.raises(ValueError, match="changes Flax NNX objects"):
        step.launch(None, (model, optimizer))
    from alpa_lab.notebook.workbench import Workbench  # its Launch makes the run itself

    with pytest.raises(ValueError, match="changes Flax NNX objects"):
        Workbench(step.current_plan, step).launch((model, optimizer), {}, steps=2)
    assert np.array_equal(np.asarray(model.l1.kernel[...]), kernel)  # nothing ran
    with pytest.raises(LostUpdatesError, match=r"in place \(args\[0\]\.l1\.") as info:
        trace(update_in_place, model, optimizer)
    assert "nnx.merge" in str(info.value) and "return the changed objects" in str(info.value)


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
        # offset: X is symmetric about 0, so the mean of tanh(X @ w) alone is rounding (about 1e-8, off by 15%
        # between two summation orders)
        return jnp.mean(jnp.tanh(batch["x"] @ params["w"] + 1.0))

    params = {"w": jnp.full((16, 8), 0.1, jnp.float32)}
    batch = {"x": X}
    got = al.parallelize(train_step, cluster=al.ClusterSpec.local(1, 4))(params, dict(batch))
    want = float(jax.jit(train_step)(params, dict(batch)))
    np.testing.assert_allclose(float(got), want, rtol=1e-6)
    assert abs(want - float(jnp.mean(jnp.tanh(X @ params["w"] + 1.0)))) > 1e-3  # the rescaled batch shows in the loss
