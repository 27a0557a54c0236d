"""Pipeline markers (``alpa_lab.graph.markers``): identity ops that survive differentiation.

Checks: exact numerics against plain JAX (jit, vmap, lower/compile), the markers the
traced train step carries (the boundary in the forward pass and its mirror in the
backward pass, a gradient marker on every gradient leaf), the sharding rule, and a plan
run sharded on a 2x2 mesh against the unsharded step.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import alpa_lab as al
from alpa_lab.graph.markers import LOSS, pipeline_marker_p
from alpa_lab.sharding.rules import is_follower, strategies_for
from alpa_lab.sharding.spec import ShardingSpec


def params_and_batch():
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    params = {
        "w1": jax.random.normal(k[0], (16, 32)) * 0.3,
        "b1": jnp.zeros(32),
        "w2": jax.random.normal(k[1], (32, 8)) * 0.3,
    }
    x = jax.random.normal(k[2], (8, 16))
    y = jax.random.normal(k[3], (8, 8))
    return params, x, y


def loss_fn(params, x, y, marked=True):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    if marked:
        h = al.mark_stage_boundary(h, name="layer1")
    out = h @ params["w2"]
    return jnp.mean((out - y) ** 2)


def marked_loss(params, x, y):
    return loss_fn(params, x, y, marked=True)


def plain_loss(params, x, y):
    return loss_fn(params, x, y, marked=False)


def train_step(params, x, y):
    loss, grads = al.value_and_grad(marked_loss)(params, x, y)
    new = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)
    return new, loss


def assert_tree_equal(a, b):
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb
    for u, v in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


# ----- numerics ------------------------------------------------------------------------------
def test_mark_stage_boundary_is_identity():
    x = jnp.arange(6.0).reshape(2, 3)
    y = jnp.ones(4, jnp.int32)
    assert al.mark_stage_boundary(x) is not None
    np.testing.assert_array_equal(al.mark_stage_boundary(x), x)
    a, b = al.mark_stage_boundary(x, y, name="two")
    np.testing.assert_array_equal(a, x)
    np.testing.assert_array_equal(b, y)
    assert b.dtype == jnp.int32
    np.testing.assert_array_equal(jax.jit(lambda v: al.mark_stage_boundary(v, name="j"))(x), x)


def test_value_and_grad_matches_jax_exactly():
    params, x, y = params_and_batch()
    got = jax.jit(al.value_and_grad(marked_loss))(params, x, y)
    want = jax.jit(jax.value_and_grad(plain_loss))(params, x, y)
    assert_tree_equal(got, want)
    # eager too, and grad / argnums / has_aux variants
    assert_tree_equal(al.value_and_grad(marked_loss)(params, x, y), jax.value_and_grad(plain_loss)(params, x, y))
    assert_tree_equal(jax.jit(al.grad(marked_loss))(params, x, y), jax.jit(jax.grad(plain_loss))(params, x, y))
    assert_tree_equal(
        jax.jit(al.grad(marked_loss, argnums=(0, 1)))(params, x, y),
        jax.jit(jax.grad(plain_loss, argnums=(0, 1)))(params, x, y),
    )

    def with_aux(p, a, b, fn):
        v = fn(p, a, b)
        return v, {"double": 2 * v}

    assert_tree_equal(
        jax.jit(al.value_and_grad(lambda *a: with_aux(*a, marked_loss), has_aux=True))(params, x, y),
        jax.jit(jax.value_and_grad(lambda *a: with_aux(*a, plain_loss), has_aux=True))(params, x, y),
    )
    assert_tree_equal(
        jax.jit(al.grad(lambda *a: with_aux(*a, marked_loss), has_aux=True))(params, x, y),
        jax.jit(jax.grad(lambda *a: with_aux(*a, plain_loss), has_aux=True))(params, x, y),
    )


def test_vmap_jvp_and_compile():
    params, x, y = params_and_batch()
    xs = jnp.stack([x, x + 1.0, x * 0.5])
    got = jax.vmap(al.value_and_grad(marked_loss), in_axes=(None, 0, None))(params, xs, y)
    want = jax.vmap(jax.value_and_grad(plain_loss), in_axes=(None, 0, None))(params, xs, y)
    for u, v in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(u, v, rtol=1e-6, atol=1e-6)
    # batch dim on a non-leading axis passes through the marker
    z = jnp.arange(12.0).reshape(3, 4)
    np.testing.assert_array_equal(jax.vmap(al.mark_stage_boundary, in_axes=1, out_axes=1)(z), z)
    # forward-mode: tangents pass through; a symbolic-zero tangent (an int operand) is fine
    t = jnp.ones_like(z)
    _, tangent = jax.jvp(lambda a: al.mark_stage_boundary(a, name="fwd") * 2.0, (z,), (t,))
    np.testing.assert_array_equal(tangent, 2.0 * t)
    out = jax.jvp(lambda a: al.mark_stage_boundary(a, jnp.arange(3))[0], (z,), (t,))[1]
    np.testing.assert_array_equal(out, t)
    # second order goes through the marker too
    def f(a):
        return jnp.sum(jnp.sin(al.mark_stage_boundary(a)) ** 2)

    np.testing.assert_allclose(
        jax.hessian(f)(jnp.arange(3.0)), jax.hessian(lambda a: jnp.sum(jnp.sin(a) ** 2))(jnp.arange(3.0)), rtol=1e-6
    )
    compiled = jax.jit(train_step).lower(params, x, y).compile()
    assert_tree_equal(compiled(params, x, y), jax.jit(train_step)(params, x, y))


def test_bad_kind_rejected():
    from alpa_lab.graph.markers import mark

    with pytest.raises(ValueError):
        mark([jnp.ones(2)], "stage")


# ----- tracing -------------------------------------------------------------------------------
def test_trace_has_boundary_mirror_and_gradient_markers():
    params, x, y = params_and_batch()
    graph = al.trace(train_step, params, x, y)
    markers = [op for op in graph.ops if op.primitive == "pipeline_marker"]
    assert all(op.bind is pipeline_marker_p for op in markers)
    boundary = [op for op in markers if op.params["kind"] == "boundary" and op.params["name"] != LOSS]
    assert all(op.params["name"] == "layer1" for op in boundary)
    # the loss is marked too: forward once, and its mirror (the cotangent seed) in the backward
    loss = [op for op in markers if op.params["name"] == LOSS]
    assert len(loss) == 2 and graph.vars[loss[1].outputs[0]].shape == ()
    assert loss[0].index < boundary[-1].index and loss[1].index > boundary[0].index
    forward = [op for op in boundary if op.label.startswith("jvp(")]
    backward = [op for op in boundary if op.label.startswith("transpose(")]
    assert len(forward) == 1 and len(backward) == 1, [op.label for op in boundary]
    assert forward[0].index < backward[0].index
    # the mirror carries the cotangent of the boundary's output: same shape
    fvar = graph.vars[forward[0].outputs[0]]
    bvar = graph.vars[backward[0].outputs[0]]
    assert fvar.shape == bvar.shape == (8, 32)

    grads = [op for op in markers if op.params["kind"] == "gradient"]
    assert all(op.params["name"] == "grad" for op in grads)
    assert len(grads) == len(jax.tree_util.tree_leaves(params))
    assert sorted(graph.vars[op.outputs[0]].shape for op in grads) == sorted(
        tuple(p.shape) for p in jax.tree_util.tree_leaves(params)
    )
    # every gradient marker comes after the backward boundary, and feeds the update
    assert all(op.index > backward[0].index for op in grads)
    consumers = {i for op in graph.ops for i in op.inputs}
    assert all(op.outputs[0] in consumers for op in grads)


# ----- sharding rule ------------------------------------------------------------------------
def _mesh22():
    return al.ClusterSpec.local(1, 4).logical_mesh((2, 2))


def test_marker_rule_single_operand_follows_producer():
    graph = al.trace(lambda a: al.mark_stage_boundary(a) * 2.0, jnp.ones((8, 16)))
    op = next(op for op in graph.ops if op.primitive == "pipeline_marker")
    assert is_follower(op)
    strategies = strategies_for(op, graph, _mesh22())
    specs = {s.output_specs[0] for s in strategies}
    assert ShardingSpec.parse("RR") in specs and ShardingSpec.parse("S0S1") in specs
    assert len(strategies) == 9  # each of the 2 mesh axes: unused, on dim 0 or on dim 1
    for s in strategies:
        assert s.input_specs == s.output_specs
        assert s.communication_cost == 0.0 and not s.collectives


def test_mark_stage_boundary_marks_each_leaf_on_its_own():
    """One marker per tensor, so each keeps its own sharding across the boundary."""
    graph = al.trace(lambda a, b: al.mark_stage_boundary(a, b), jnp.ones((8, 16)), jnp.ones(4))
    assert [op.primitive for op in graph.ops] == ["pipeline_marker"] * 2
    assert all(len(op.inputs) == 1 and is_follower(op) for op in graph.ops)


def test_marker_rule_several_operands():
    from alpa_lab.graph.markers import mark

    same = al.trace(lambda a, b: mark([a, b], "boundary"), jnp.ones((8, 16)), jnp.ones((8, 16)))
    op = same.ops[0]
    assert op.primitive == "pipeline_marker" and not is_follower(op)
    strategies = strategies_for(op, same, _mesh22())
    assert len(strategies) == 9
    for s in strategies:
        assert s.input_specs == s.output_specs
        assert len(set(s.output_specs)) == 1  # all operands share one spec

    mixed = al.trace(lambda a, b: mark([a, b], "boundary"), jnp.ones((8, 16)), jnp.ones(4))
    strategies = strategies_for(mixed.ops[0], mixed, _mesh22())
    assert len(strategies) == 1
    (only,) = strategies
    assert only.output_specs == (ShardingSpec.replicated(2), ShardingSpec.replicated(1))
    assert only.input_specs == only.output_specs


# ----- plan and run --------------------------------------------------------------------------
def test_parallelize_runs_marked_step_sharded():
    params, x, y = params_and_batch()
    step = al.parallelize(train_step, cluster=al.ClusterSpec.local(1, 4), mesh_shape=(2, 2))
    got = step(params, x, y)
    want = jax.jit(train_step)(params, x, y)
    la, lb = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    assert len(la) == len(lb) == 4
    for u, v in zip(la, lb):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=2e-4, atol=2e-5)
    assert math.isfinite(float(got[1]))


def test_more_layers_than_the_program_has_room_for_cuts_it_into_as_many_as_it_can_and_says_so():
    """``layers=`` beyond the loss function's op count cut nothing before (one layer, one stage, silently)."""
    from alpa_lab.models import tiny_example

    ex = tiny_example("mlp")
    step = al.parallelize(ex.train_step, cluster=al.ClusterSpec.local(2, 4), microbatches=4, layers=10_000)
    with pytest.warns(UserWarning, match=r"layers=10000 is more than the loss function can be cut into \((\d+) pieces"):
        plan = step.plan(*ex.args)
    assert plan.num_layers > 4 and plan.num_stages >= 2
    state, loss = step(*ex.args)
    np.testing.assert_allclose(float(loss), float(jax.jit(ex.train_step)(*ex.args)[1]), rtol=1e-4)
