"""Rematerialisation in the planner (issue 11 part 4): ``jax.checkpoint`` in the user's step, and
the ``remat=True`` option that checkpoints every layer as Alpa's benchmarks did.

Oracles: the program itself (which ops JAX re-runs: a checkpointed step has the forward ops of
each layer twice, the second copy after the backward starts), the bytes of the tensors a layer
takes in (all that eq. 5 may keep per micro-batch under remat), the plain step's forward FLOPs
(what the backward must pay again), and plain JAX with gradient accumulation for numerics
(the tolerances of ``test_pipeline``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import alpa_lab as al
from alpa_lab.graph.markers import auto_layers
from alpa_lab.models import tiny_example
from alpa_lab.passes.inter_op import InterOpError
from alpa_lab.passes.pipeline import PipelineProblem
from alpa_lab.passes.stages import BACKWARD, FORWARD
from tests.test_pipeline import MICROBATCHES, STATE_ATOL, accumulated_step, assert_close

LOCAL = al.ClusterSpec.local(hosts=1, devices_per_host=4)
LAYERS = 4


def sgd_step(loss):
    """A training step of ``loss(ws, x)``: one SGD update of the weights ``ws``, and the loss."""

    def step(ws, x):
        value, grads = al.value_and_grad(loss)(ws, x)
        return [w - 0.1 * g for w, g in zip(ws, grads)], value

    return step


def chain_step(checkpoint: bool, boundaries: bool = True, policy=None):
    """Four tanh layers, with hand-placed boundaries between them unless not ``boundaries``; with
    ``checkpoint`` each layer is ``jax.checkpoint``-ed (with ``policy``)."""

    def layer(w, x):
        h = jnp.tanh(x @ w)
        return jnp.tanh(h @ w.T) + x

    body = jax.checkpoint(layer, policy=policy) if checkpoint else layer

    def loss(ws, x):
        for i, w in enumerate(ws):
            if i and boundaries:
                x = al.mark_stage_boundary(x)
            x = body(w, x)
        return jnp.mean(x**2)

    return sgd_step(loss)


CHAIN_ARGS = ([jnp.full((64, 64), 0.01) * (i + 1) for i in range(LAYERS)], jnp.ones((32, 64)))


def per_layer(problem: PipelineProblem):
    """(phase, layer) -> FLOPs; layer -> saved bytes (forward outputs the backward reads)."""
    g, sl = problem.graph, problem.slicing
    flops: dict[tuple[str, int], float] = {}
    for op in g.ops:
        key = (sl.phase[op.index], sl.layer[op.index])
        flops[key] = flops.get(key, 0.0) + op.flops
    saved = dict.fromkeys(range(sl.num_layers), 0)
    for i in problem.saved:
        saved[sl.layer[i]] += sum(g.vars[v].nbytes for v in g.ops[i].outputs)
    return flops, saved


def boundary_bytes(problem: PipelineProblem) -> dict[int, int]:
    """layer -> bytes of the boundary markers that open it (the layer's inputs)."""
    g, sl = problem.graph, problem.slicing
    out = dict.fromkeys(range(sl.num_layers), 0)
    for op in g.ops:
        if op.primitive == "pipeline_marker" and op.params["kind"] == "boundary" and sl.phase[op.index] == FORWARD:
            if op.params["name"] != "loss":
                out[sl.layer[op.index]] += sum(g.vars[v].nbytes for v in op.outputs)
    return out


def test_checkpoint_in_the_step_moves_the_recompute_to_the_backward():
    plain = PipelineProblem.build(al.trace(chain_step(False), *CHAIN_ARGS), LOCAL)
    remat = PipelineProblem.build(al.trace(chain_step(True), *CHAIN_ARGS), LOCAL)
    assert remat.slicing.num_layers == plain.slicing.num_layers == LAYERS
    f_plain, s_plain = per_layer(plain)
    f_remat, s_remat = per_layer(remat)
    inputs = boundary_bytes(remat)
    for lay in range(LAYERS):
        # the backward re-runs the layer's forward: it pays the plain forward's FLOPs again (the
        # forward itself may shrink a little: residuals only the backward read are not made there)
        extra = f_remat[(BACKWARD, lay)] - f_plain[(BACKWARD, lay)]
        assert extra == pytest.approx(f_plain[(FORWARD, lay)], rel=0.05), lay
        assert f_remat[(FORWARD, lay)] <= f_plain[(FORWARD, lay)]
        if 0 < lay < LAYERS - 1:  # the last layer also keeps the loss's own residuals
            assert s_remat[lay] == inputs[lay], lay  # only the layer's input stays for the backward
            assert s_plain[lay] > 2 * s_remat[lay], lay
    # every re-run op is in the layer of the tensors it reads, none in another layer's backward
    g, sl = remat.graph, remat.slicing
    for op in g.ops:
        if sl.phase[op.index] == BACKWARD and "rematted_computation" in op.label:
            producers = [g.vars[v].producer for v in op.inputs if g.vars[v].producer is not None]
            forward_layers = {sl.layer[p] for p in producers if sl.phase[p] == FORWARD}
            assert forward_layers <= {sl.layer[op.index]}, op.name


def test_the_remat_option_checkpoints_every_layer_like_the_users_checkpoint():
    """``remat=True`` on hand-placed boundaries gives the program a user's per-layer checkpoint gives."""
    with auto_layers(None, remat=True):
        option = PipelineProblem.build(al.trace(chain_step(False), *CHAIN_ARGS), LOCAL)
    by_hand = PipelineProblem.build(al.trace(chain_step(True), *CHAIN_ARGS), LOCAL)
    (f_option, s_option), (f_hand, s_hand) = per_layer(option), per_layer(by_hand)
    last = LAYERS - 1  # the loss: recomputed too under the option
    assert {k: v for k, v in f_option.items() if k[1] != last} == {k: v for k, v in f_hand.items() if k[1] != last}
    # the option also checkpoints the loss after the last layer, which the hand-written one leaves out
    assert [s_option[lay] for lay in range(LAYERS - 1)] == [s_hand[lay] for lay in range(LAYERS - 1)]
    assert s_option[LAYERS - 1] <= s_hand[LAYERS - 1]


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_remat_plans_keep_fewer_activations_and_pay_in_the_backward(name):
    ex = tiny_example(name)
    plans = {}
    for remat in (False, True):
        step = al.parallelize(ex.train_step, cluster=LOCAL, microbatches=MICROBATCHES, layers=LAYERS, remat=remat)
        step.plan(*ex.args)
        plans[remat] = step.current_plan.pin_stages([[0, 1], [2, 3]], submeshes=[(1, 2), (1, 2)])
    for plain, remat in zip(plans[False].stages, plans[True].stages):
        assert remat.activation_memory < 0.7 * plain.activation_memory
        assert remat.weight_memory == pytest.approx(plain.weight_memory, rel=0.01)  # the ILP may shard a small weight otherwise
        assert remat.backward_time > plain.backward_time  # the recompute
    assert plans[True].memory_per_device < plans[False].memory_per_device


def test_remat_makes_a_model_fit_that_does_not_fit_without_it():
    """Eq. 5 with remat: a device too small for a stage's activations of 4 micro-batches in flight fits
    once only the layers' inputs are kept (the planner's own figures set the capacity)."""
    ex = tiny_example("gpt")

    def planned(remat: bool, cluster: al.ClusterSpec):
        step = al.parallelize(ex.train_step, cluster=cluster, microbatches=MICROBATCHES, layers=LAYERS, remat=remat, schedule="gpipe")
        return step.plan(*ex.args)

    one = al.ClusterSpec.local(hosts=1, devices_per_host=1)
    need = {remat: planned(remat, one).memory_per_device for remat in (False, True)}
    assert need[True] < need[False]
    small = dataclasses.replace(one, device_memory=(need[True] + need[False]) / 2)
    with pytest.raises(InterOpError):
        planned(False, small)
    assert planned(True, small).memory_per_device <= small.device_memory


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_remat_trains_like_plain_jax(name):
    ex = tiny_example(name)
    step = al.parallelize(ex.train_step, cluster=LOCAL, microbatches=MICROBATCHES, layers=LAYERS, remat=True)
    step.plan(*ex.args)
    step.use(step.current_plan.pin_stages([[0, 1], [2, 3]], submeshes=[(1, 2), (1, 2)]))
    reference = accumulated_step(ex, MICROBATCHES)
    state, ref_state = ex.state, ex.state
    for k in range(2):
        state, loss = step(state, ex.batch)
        ref_state, ref_loss = reference(ref_state, ex.batch)
        assert_close(loss, ref_loss, f"{name} step {k} loss")
        assert_close(state, ref_state, f"{name} step {k} state", atol=STATE_ATOL)


def test_remat_option_errors_are_specific():
    ex = tiny_example("mlp")
    with pytest.raises(ValueError, match="single-mesh plan has no layers"):
        al.parallelize(ex.train_step, remat=True)
    with pytest.raises(ValueError, match="remat must be True or False"):
        al.parallelize(ex.train_step, microbatches=2, remat="yes")


@pytest.mark.parametrize("named", [True, False])
def test_a_boundary_inside_a_checkpointed_layer_cuts_as_outside(named):
    """``nn.remat(Block)`` with the block's boundary inside it: the boundary's copy that JAX re-runs in the backward
    is not a mirror, so every weight's gradient and update stay in its own layer, as without the checkpoint."""

    def step_fn(checkpoint: bool):
        def layer(i, w, x):
            if i:
                x = al.mark_stage_boundary(x, name=f"b{i}" if named else "")
            return jnp.tanh(x @ w) + x

        def loss(ws, x):
            for i, w in enumerate(ws):
                def body(w, x, i=i):
                    return layer(i, w, x)

                x = (jax.checkpoint(body) if checkpoint else body)(w, x)
            return jnp.mean(x**2)

        return sgd_step(loss)

    def update_layers(problem):
        g, sl = problem.graph, problem.slicing
        return sorted({sl.layer[c] for i, v in enumerate(g.invars[:LAYERS]) for c in g.consumers()[v]
                       if sl.phase[c] == "apply"})

    plain = PipelineProblem.build(al.trace(step_fn(False), *CHAIN_ARGS), LOCAL)
    remat = PipelineProblem.build(al.trace(step_fn(True), *CHAIN_ARGS), LOCAL)
    assert remat.slicing.num_layers == plain.slicing.num_layers == LAYERS
    assert update_layers(remat) == update_layers(plain) == list(range(LAYERS))
    f_plain, _ = per_layer(plain)
    f_remat, _ = per_layer(remat)
    for lay in range(LAYERS):
        assert f_remat[(BACKWARD, lay)] - f_plain[(BACKWARD, lay)] == pytest.approx(f_plain[(FORWARD, lay)], rel=0.05)
    # every backward op reads gradients of its own or later layers only (no cycle between stages)
    g, sl = remat.graph, remat.slicing
    for op in g.ops:
        if sl.phase[op.index] == BACKWARD:
            for v in op.inputs:
                p = g.vars[v].producer
                if p is not None and sl.phase[p] == BACKWARD:
                    assert sl.layer[p] >= sl.layer[op.index], op.name


def test_automatic_layering_keeps_the_users_checkpoint():
    """A step whose layers are ``jax.checkpoint``-ed and cut by automatic layering (no hand-placed boundaries)
    keeps its recompute: the re-run of the program checkpoints those ops again (with their policy)."""

    def step_fn(checkpoint: bool, policy=None):
        return chain_step(checkpoint, boundaries=False, policy=policy)

    def traced(step):
        with auto_layers(LAYERS):
            return al.trace(step, *CHAIN_ARGS)

    plain, kept = (PipelineProblem.build(traced(step_fn(c)), LOCAL) for c in (False, True))
    f_plain, s_plain = per_layer(plain)
    f_kept, s_kept = per_layer(kept)
    assert sum(v for (p, _), v in f_kept.items() if p == BACKWARD) == pytest.approx(
        sum(v for (p, _), v in f_plain.items() if p != "apply"), rel=0.05)  # the backward re-runs the forward
    assert sum(s_kept.values()) < 0.5 * sum(s_plain.values())
    # a policy that saves the matmuls re-runs only the rest
    dots = PipelineProblem.build(traced(step_fn(True, jax.checkpoint_policies.dots_saveable)), LOCAL)
    f_dots, _ = per_layer(dots)
    backward = {name: sum(v for (p, _), v in f.items() if p == BACKWARD) for name, f in (("dots", f_dots), ("all", f_kept))}
    assert backward["dots"] < backward["all"]
    # and the re-run computes what the step computes
    ref = jax.jit(step_fn(False))(*CHAIN_ARGS)
    from alpa_lab.graph.evaluate import as_function

    out = jax.jit(as_function(traced(step_fn(True))))(*CHAIN_ARGS)
    for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref)):
        assert jnp.allclose(a, b, rtol=1e-5, atol=1e-6)


def _remat_bodies(step, args, layers=None) -> tuple[int, int]:
    """(checkpoint calls, distinct bodies among them) in the step's jaxpr, traced as ``trace`` traces it."""
    from alpa_lab.graph import markers

    with auto_layers(layers, remat=True), markers.segment_labels():
        jaxpr = jax.make_jaxpr(lambda *a: step(*a))(*args).jaxpr  # a new function: JAX caches traces by identity
    bodies = [eqn.params["jaxpr"] for eqn in jaxpr.eqns if eqn.primitive.name in ("checkpoint", "remat", "remat2")]
    return len(bodies), len({id(b) for b in bodies})


def _traced_unshared(step, args, monkeypatch):
    """The step traced with every checkpointed segment its own body (the reference for sharing)."""
    from alpa_lab.graph import markers

    with monkeypatch.context() as m:
        m.setattr(markers, "_segment_key", lambda *a, **k: None)
        with auto_layers(None, remat=True):
            return al.trace(step, *args)


def _same_program(a, b) -> None:
    assert a.fingerprint == b.fingerprint  # ops, wiring, shapes, parameters
    assert [(op.label, op.flops) for op in a.ops] == [(op.label, op.flops) for op in b.ops]
    assert a.checkpoints == b.checkpoints


def test_equal_layers_share_one_checkpointed_body_with_their_own_labels(monkeypatch):
    """Under ``remat``, equal layers call one checkpointed function (JAX traces, differentiates and
    transposes it once): the traced program, every op's module path included, is the one that
    tracing each layer on its own gives, and it computes what plain JAX computes."""
    ex = tiny_example("gpt")
    with auto_layers(LAYERS, remat=True):
        shared = al.trace(ex.train_step, *ex.args)
    with monkeypatch.context() as m:
        from alpa_lab.graph import markers

        m.setattr(markers, "_segment_key", lambda *a, **k: None)
        with auto_layers(LAYERS, remat=True):
            unshared = al.trace(ex.train_step, *ex.args)
    _same_program(shared, unshared)
    for block in ("Block_0", "Block_1"):  # each block's ops keep their own path
        assert any(f"/{block}/" in op.label and "transpose" in op.label for op in shared.ops), block
    calls, bodies = _remat_bodies(ex.train_step, ex.args, LAYERS)
    assert calls >= LAYERS and bodies < calls


@pytest.mark.parametrize("differ", ["literal", "parameter", "nothing"])
def test_layers_that_differ_in_a_constant_or_a_parameter_keep_their_own_body(differ, monkeypatch):
    """Where sharing could lose: layers of equal shapes and ops that differ only in a literal (the
    scale) or an op parameter (which side of the weight is contracted) must not share a body. Oracles:
    plain JAX's step (numerics, rtol 1e-5) and the unshared trace (program, labels)."""

    def layer(i, w, x):
        if differ == "literal":
            return jnp.tanh(x @ w) * (1.0 + i)
        if differ == "parameter":
            return jnp.tanh(jnp.einsum("bi,ij->bj" if i % 2 else "bi,ji->bj", x, w))
        return jnp.tanh(x @ w) + x

    def loss(ws, x):
        for i, w in enumerate(ws):
            if i:
                x = al.mark_stage_boundary(x)
            with jax.named_scope(f"layer_{i}"):
                x = layer(i, w, x)
        return jnp.mean(x**2)

    step = sgd_step(loss)
    with auto_layers(None, remat=True):
        graph = al.trace(step, *CHAIN_ARGS)
    _same_program(graph, _traced_unshared(step, CHAIN_ARGS, monkeypatch))
    assert {f"layer_{i}" for i in range(LAYERS)} <= {p for op in graph.ops for p in op.label.split("/")}
    from alpa_lab.graph.evaluate import as_function

    ref = jax.jit(step)(*CHAIN_ARGS)
    out = jax.jit(as_function(graph))(*CHAIN_ARGS)
    for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    calls, bodies = _remat_bodies(step, CHAIN_ARGS)
    # the literal differs in every layer; the contraction alternates (layers 1 and 3 differ only in the loss
    # that follows the last): only the 'nothing' stack shares
    assert calls == LAYERS and bodies == (calls if differ != "nothing" else 3)
