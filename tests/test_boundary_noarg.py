"""``mark_stage_boundary()`` without arguments (issue 11 part 5): Alpa's ``mark_pipeline_boundary()``.

The reference is the tensor boundary: the same model with ``x = mark_stage_boundary(x)`` at the
same points. The argument-less form must give the same program (the same traced graph: same
fingerprint, same ops with the same labels), the same layers (every op in the same phase and
layer, forward and backward), and a pipeline plan that trains to the same numbers, which are
also those of plain JAX (gradient accumulation over the same micro-batches, rtol 1e-4 /
atol 1e-5 as in ``test_pipeline``).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import alpa_lab as al
from alpa_lab.graph.markers import auto_layers
from alpa_lab.models.gpt import Block, MLPBlock
from alpa_lab.passes.stages import BACKWARD, FORWARD, slice_program

RTOL, ATOL = 1e-4, 1e-5
MICROBATCHES = 4
STEPS = 3


def boundary(x: jax.Array, how: str) -> jax.Array:
    """The cut, as the user writes it: on the tensor, or argument-less; ``"none"``: no cut."""
    if how == "tensor":
        return al.mark_stage_boundary(x)
    if how == "noarg":
        al.mark_stage_boundary()
    if how == "alpa":  # Alpa's name for it, as an Alpa user types it
        al.mark_pipeline_boundary()
    return x


class MLP(nn.Module):
    how: str
    layers: int = 4

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for i in range(self.layers):
            if i:
                x = boundary(x, self.how)
            x = nn.relu(nn.Dense(32)(x))
        return nn.Dense(8)(x)


class Transformer(nn.Module):
    """GPT blocks (``alpa_lab.models.gpt.Block``) with a cut between blocks, tied embeddings."""

    how: str
    layers: int = 3
    hidden: int = 32
    vocab: int = 64

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        embed = nn.Embed(self.vocab, self.hidden, name="wte")
        x = embed(tokens) + nn.Embed(tokens.shape[1], self.hidden, name="wpe")(jnp.arange(tokens.shape[1]))[None]
        for i in range(self.layers):
            if i:
                x = boundary(x, self.how)
            x, _ = Block(self.hidden, 4, True, lambda: MLPBlock(self.hidden, 2 * self.hidden), name=f"Block_{i}")(x)
        return embed.attend(nn.LayerNorm(name="ln_f")(x))


def mlp_loss(model, params, batch):
    return jnp.mean((model.apply({"params": params}, batch["x"]) - batch["y"]) ** 2)


def lm_loss(model, params, batch):
    logits = model.apply({"params": params}, batch["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


def example(name: str, how: str):
    """(train step, (state, batch), loss function) of model ``name`` with cuts written ``how``."""
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    if name == "mlp":
        model, loss = MLP(how), mlp_loss
        batch = {"x": jax.random.normal(k[0], (16, 16)), "y": jax.random.normal(k[1], (16, 8))}
        params = model.init(k[2], batch["x"])["params"]
    else:
        model, loss = Transformer(how), lm_loss
        ids = jax.random.randint(k[0], (8, 9), 0, 64)
        batch = {"tokens": ids[:, :-1], "labels": ids[:, 1:]}
        params = model.init(k[2], batch["tokens"])["params"]
    opt = optax.adam(1e-2)

    def loss_fn(params, batch):
        return loss(model, params, batch)

    def train_step(state, batch):
        params, opt_state = state
        value, grads = al.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value

    def reference_step(state, batch):
        """Plain JAX: gradients accumulated over the micro-batches, one update."""
        params, opt_state = state
        n = batch[next(iter(batch))].shape[0] // MICROBATCHES
        parts = [jax.tree_util.tree_map(lambda x: x[i * n : (i + 1) * n], batch) for i in range(MICROBATCHES)]
        outs = [jax.value_and_grad(loss_fn)(params, mb) for mb in parts]
        value = sum(o[0] for o in outs) / MICROBATCHES
        grads = jax.tree_util.tree_map(lambda *g: sum(g) / MICROBATCHES, *[o[1] for o in outs])
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value

    return train_step, ((params, opt.init(params)), batch), reference_step


def layers_of(graph, sl) -> list[tuple]:
    """Every op with where it runs: (name, primitive, label, phase, layer)."""
    return [(op.name, op.primitive, op.label, sl.phase[op.index], sl.layer[op.index]) for op in graph.ops]


# ----- the cut -------------------------------------------------------------------------------
@pytest.mark.parametrize("auto", [None, 8], ids=["single-mesh", "pipelined"])
@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_cuts_where_the_tensor_boundary_cuts(name, auto):
    """Same program, same layers, forward and backward (also where automatic layering would cut)."""
    graphs = {}
    for how in ("tensor", "noarg", "alpa"):
        step, args, _ = example(name, how)
        with auto_layers(auto):
            graphs[how] = al.trace(step, *args)
    tensor, noarg = graphs["tensor"], graphs["noarg"]
    assert noarg.fingerprint == tensor.fingerprint == graphs["alpa"].fingerprint
    sl_t, sl_n = slice_program(tensor), slice_program(noarg)
    expected = 4 if name == "mlp" else 3
    assert sl_t.num_layers == sl_n.num_layers == expected
    assert layers_of(noarg, sl_n) == layers_of(tensor, sl_t)
    for phase in (FORWARD, BACKWARD):  # each layer has a forward and a backward
        assert {sl_n.layer[i] for i, p in enumerate(sl_n.phase) if p == phase} == set(range(expected))
    # and the forward contractions fall one layer (or block) after another
    dots = [sl_n.layer[op.index] for op in noarg.ops if op.primitive == "dot_general" and sl_n.phase[op.index] == FORWARD]
    assert dots == sorted(dots) and dots[0] == 0 and dots[-1] == expected - 1


def test_a_cut_inside_a_jitted_helper():
    def block(h, w):
        h = jnp.tanh(h @ w)
        al.mark_stage_boundary()
        return jnp.tanh(h @ w)

    def step(w, x, how):
        def loss_fn(w):
            h = jax.jit(block)(x, w) if how == "noarg" else jnp.tanh(al.mark_stage_boundary(jnp.tanh(x @ w)) @ w)
            return jnp.mean(h**2)

        value, g = al.value_and_grad(loss_fn)(w)
        return w - 0.1 * g, value

    w, x = jnp.eye(8) * 0.5, jnp.ones((4, 8))
    sl = {how: slice_program(al.trace(lambda w, x, how=how: step(w, x, how), w, x)) for how in ("noarg", "tensor")}
    assert sl["noarg"].num_layers == sl["tensor"].num_layers == 2
    for how, s in sl.items():
        assert sorted({(p, lay) for p, lay in zip(s.phase, s.layer) if p != "apply"}) == [
            (BACKWARD, 0), (BACKWARD, 1), (FORWARD, 0), (FORWARD, 1)
        ], how


# ----- outside a planned trace, and where it cannot cut --------------------------------------------
def test_outside_a_planned_trace_it_does_nothing():
    assert al.mark_stage_boundary() is None  # eagerly
    for name in ("mlp", "transformer"):
        step, args, _ = example(name, "noarg")
        plain, _, _ = example(name, "none")
        runs = (jax.jit, lambda f: f) if name == "mlp" else (jax.jit,)  # eagerly too (the transformer: slow)
        for run in runs:  # the very same numbers
            got, want = run(step)(*args), run(plain)(*args)
            for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_outside_the_loss_function_is_refused():
    def step(w, x):
        al.mark_stage_boundary()
        value, g = al.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(w)
        return w - g, value

    with pytest.raises(al.TraceError, match="outside the loss function given to alpa_lab.value_and_grad"):
        al.trace(step, jnp.ones((4, 4)), jnp.ones((2, 4)))


def test_in_a_program_without_a_gradient_it_does_nothing():
    """An evaluation step through a model with boundaries in it (Alpa's test MLP) has no backward to mirror the
    cut in: traced and planned on one mesh, the markers are no-ops and the result is the unparallelized one's."""
    model = MLP("alpa")
    x = jnp.linspace(-1, 1, 16 * 12).reshape(16, 12)
    params = model.init(jax.random.PRNGKey(0), x)

    def evaluate(params, x):
        return jnp.mean(model.apply(params, x) ** 2)

    graph = al.trace(evaluate, params, x)
    assert sum(op.primitive == "pipeline_marker" for op in graph.ops) == 3
    got = al.parallelize(evaluate, method=al.ShardParallel())(params, x)
    np.testing.assert_allclose(float(got), float(evaluate(params, x)), rtol=1e-6)


@pytest.mark.parametrize("method", ["shard", "data"])
def test_on_one_mesh_a_model_with_boundaries_trains_under_jax_grad(method):
    """A plan without stages has nothing to cut: a model written with ``mark_pipeline_boundary()`` (for a pipelined
    plan) trains under plain ``jax.grad`` with ``ShardParallel``/``DataParallel``, as in Alpa, to the numbers of the
    model without boundaries under ``jax.jit`` (rtol 1e-5 over three steps)."""
    model, plain = MLP("alpa"), MLP("none")
    x = jnp.linspace(-1, 1, 16 * 12).reshape(16, 12)
    y = jnp.cos(jnp.arange(16 * 8, dtype=jnp.float32).reshape(16, 8))
    params = model.init(jax.random.PRNGKey(0), x)

    def step_of(net):
        def step(params, x, y):
            loss, grads = jax.value_and_grad(lambda p: jnp.mean((net.apply(p, x) - y) ** 2))(params)
            return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), loss
        return step

    how = al.ShardParallel() if method == "shard" else al.DataParallel()
    ours, ref = al.parallelize(step_of(model), method=how), jax.jit(step_of(plain))
    a = b = params
    for i in range(STEPS):
        (a, la), (b, lb) = ours(a, x, y), ref(b, x, y)
        np.testing.assert_allclose(float(la), float(lb), rtol=1e-5, err_msg=f"step {i}")
    assert_close(a, b, "parameters after three steps")
    # a pipelined plan of the same step still says what to change (test_alpa_session: jax.grad around a boundary)
    with pytest.raises(al.TraceError, match="inside a gradient that jax.grad"):
        al.parallelize(step_of(model), microbatches=2)(params, x, y)


def test_inside_a_checkpointed_body_is_refused():
    def body(h):
        h = jnp.tanh(h)
        al.mark_stage_boundary()
        return jnp.tanh(h)

    def step(w, x):
        value, g = al.value_and_grad(lambda w: jnp.mean(jax.checkpoint(body)(x @ w)))(w)
        return w - g, value

    with pytest.raises(al.TraceError, match=r"inside (checkpoint|remat).*mark the tensors that cross"):
        al.trace(step, jnp.ones((4, 4)), jnp.ones((2, 4)))


# ----- the plan trains like the tensor boundaries' plan ------------------------------------------
def assert_close(a, b, what: str) -> None:
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=RTOL, atol=ATOL, err_msg=f"{what}: {jax.tree_util.keystr(path)}")


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_the_plan_trains_like_the_tensor_boundaries_plan(name):
    cluster = al.ClusterSpec.local(hosts=2, devices_per_host=4)
    runs, plans = {}, {}
    for how in ("tensor", "noarg"):
        step_fn, args, reference_step = example(name, how)
        step = al.parallelize(step_fn, cluster=cluster, microbatches=MICROBATCHES)
        layers = step.plan(*args).num_layers
        plans[how] = step.current_plan.pin_stages([[0, layers // 2 - 1], [layers // 2, layers - 1]])
        step.use(plans[how])
        state, batch = args
        runs[how] = []
        for _ in range(STEPS):
            state, loss = step(state, batch)
            runs[how].append((state, loss))
    assert [st.layers for st in plans["noarg"].stages] == [st.layers for st in plans["tensor"].stages]
    assert [st.plan.ops for st in plans["noarg"].stages] == [st.plan.ops for st in plans["tensor"].stages]
    state, batch = args
    ref = jax.jit(reference_step)
    for k in range(STEPS):
        state, loss = ref(state, batch)
        for how in ("tensor", "noarg"):
            assert_close(runs[how][k][1], loss, f"{how} step {k} loss")
            assert_close(runs[how][k][0], state, f"{how} step {k} state")


def test_flags_passed_to_the_loss_function_stay_python_values():
    """As with jax.value_and_grad, a bool argument of the loss function can steer Python control flow."""

    def step(w, x, how):
        def loss_fn(w, x, square):
            h = jnp.tanh(x @ w)
            h = boundary(h, how)
            h = h @ w
            return jnp.mean(h**2 if square else h)

        value, g = al.value_and_grad(loss_fn)(w, x, True)
        return w - 0.1 * g, value

    w, x = jnp.eye(8) * 0.5, jnp.ones((4, 8))
    graphs = {how: al.trace(lambda w, x, how=how: step(w, x, how), w, x) for how in ("tensor", "noarg")}
    assert graphs["noarg"].fingerprint == graphs["tensor"].fingerprint
    assert slice_program(graphs["noarg"]).num_layers == 2
