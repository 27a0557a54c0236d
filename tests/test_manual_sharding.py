"""Alpa's ``ShardParallel(manual_sharding_option=ManualShardingOption(...))``: pjit-style shardings of the arguments and
results, which the ILP plans around.

Oracles: XLA's compiled program (the per-device parameter shapes), the results' own shardings on the devices, the
unsharded program's numbers (rtol 1e-6), and the resharding cost model for a result returned in another layout than
its op gives.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax.training import train_state
from jax.sharding import PartitionSpec as P

import alpa_lab as al
from alpa_lab.sharding.resharding import resharding
from alpa_lab.sharding.spec import ShardingSpec


def fn(a, b):
    return a + b, a @ b.T


def parameter_shapes(hlo: str) -> list[str]:
    entry = hlo.split("ENTRY", 1)[1]
    return re.findall(r"= (\w+\[[\d,]*\])\{[^}]*\} parameter\(\d+\)", entry)


def test_arguments_and_results_are_laid_out_as_asked():
    a = jnp.linspace(-1, 1, 8 * 16).reshape(8, 16)
    b = jnp.cos(3 * a)
    option = al.ManualShardingOption(("data", "model"), in_axis_resources=(P(None, "model"), al.UNSPECIFIED),
                                      out_axis_resources=(P("model"), None))
    step = al.parallelize(fn, method=al.ShardParallel(manual_sharding_option=option))
    total, prod = step(a, b)
    plan = step.current_plan
    assert plan.mesh_shape == (1, 8)  # Alpa's: hosts x devices of the cluster; 'data' has one device here
    assert dict(plan.pins) == {"[0]": "RS1", "output [0]": "S1R", "output [1]": "RR"}
    assert [t.spec for t in plan.inputs][0] == "RS1" and [t.spec for t in plan.outputs] == ["S1R", "RR"]
    # XLA's program takes the first argument as 8 x 2 tiles (columns over the 8 devices)
    assert parameter_shapes(step.get_executable(a, b).get_hlo_text())[0] == "f32[8,2]"
    assert total.addressable_shards[0].data.shape == (1, 16) and prod.addressable_shards[0].data.shape == (8, 8)
    np.testing.assert_allclose(np.asarray(total), np.asarray(a + b), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(prod), np.asarray(a @ b.T), rtol=1e-5, atol=1e-6)  # sums split over devices


def test_a_result_in_another_layout_pays_its_resharding():
    """``a + b`` follows its operands' layout (columns split); returning it with rows split is a resharding the plan
    lists and its objective pays, priced as the cost model prices that resharding."""
    a = jnp.ones((8, 16))
    cols = al.ManualShardingOption(("data", "model"), in_axis_resources=(P(None, "model"), P(None, "model")))
    rows = al.ManualShardingOption(("data", "model"), in_axis_resources=(P(None, "model"), P(None, "model")),
                                   out_axis_resources=P("model"))  # one result: bare
    plans = {}
    for name, option in (("free", cols), ("rows", rows)):
        step = al.parallelize(lambda a, b: a + b * 2, method=al.ShardParallel(manual_sharding_option=option))
        np.testing.assert_allclose(np.asarray(step(a, a)), 3.0)
        plans[name] = step.current_plan
    free, pinned = plans["free"], plans["rows"]
    assert free.outputs[0].spec == "RS1" and pinned.outputs[0].spec == "S1R"
    # the result has the argument's shape, so it is taken for a new state the next step reads back (as every plan
    # takes it): returned rows split, it goes back to the argument's columns split once a step too
    moved = [(r.producer, r.consumer, r.src, r.dst) for r in pinned.reshardings]
    assert moved == [("add_0", "output []", "RS1", "S1R"), ("output []", "[0]", "S1R", "RS1")]
    mesh = pinned.problem.mesh
    cost = resharding(ShardingSpec.parse("RS1"), ShardingSpec.parse("S1R"), (8, 16), 4, mesh).cost
    back = resharding(ShardingSpec.parse("S1R"), ShardingSpec.parse("RS1"), (8, 16), 4, mesh).cost
    assert cost > 0 and pinned.objective == pytest.approx(free.objective + cost + back, rel=1e-9)
    assert al.Plan.from_json(pinned.to_json()).outputs[0].spec == "S1R"  # plans are JSON; the pin goes with it
    assert pinned.unpin("output []").outputs[0].spec == "RS1"  # and can be freed


def test_resources_are_a_prefix_of_the_arguments_tree():
    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8)(nn.relu(nn.Dense(64)(x)))

    model, x, y = MLP(), jnp.ones((32, 16)), jnp.ones((32, 8))
    state = train_state.TrainState.create(apply_fn=model.apply, params=model.init(jax.random.PRNGKey(0), x), tx=optax.sgd(0.1))

    def train_step(state, batch):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((state.apply_fn(p, batch["x"]) - batch["y"]) ** 2))(state.params)
        return state.apply_gradients(grads=grads), loss

    # the state replicated (None stands for its whole subtree), the batch split over 'model' by rows
    option = al.ManualShardingOption(("data", "model"), in_axis_resources=(None, P("model")))
    step = al.parallelize(train_step, method=al.ShardParallel(manual_sharding_option=option))
    new, loss = step(state, {"x": x, "y": y})
    plan = step.current_plan
    specs = {t.path: t.spec for t in plan.inputs}
    assert specs["[1]['x']"] == "S1R" and specs["[1]['y']"] == "S1R"
    assert all(set(spec) <= {"R", "-"} for path, spec in specs.items() if path.startswith("[0]"))  # "-": a scalar
    ref_state, ref_loss = jax.jit(train_step)(state, {"x": x, "y": y})
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    for got, want in zip(jax.tree_util.tree_leaves(new.params), jax.tree_util.tree_leaves(ref_state.params)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    # JAX's own UNSPECIFIED, as Alpa's tests import it, is the planner's choice too
    from jax._src.sharding_impls import UNSPECIFIED

    both = al.ManualShardingOption(("data", "model"), in_axis_resources=(UNSPECIFIED, P("model")))
    assert set(dict(al.parallelize(train_step, method=al.ShardParallel(manual_sharding_option=both)).plan(
        state, {"x": x, "y": y}).pins)) == {"[1]['x']", "[1]['y']"}


def test_bad_manual_shardings_say_what_to_change():
    a = jnp.ones((8, 16))

    def run(**kw):
        option = al.ManualShardingOption(("data", "model"), **kw)
        return al.parallelize(fn, method=al.ShardParallel(manual_sharding_option=option))(a, a)

    with pytest.raises(al.MethodOptionError, match="names mesh axis 'batch'"):
        run(in_axis_resources=(P("batch"), None))
    with pytest.raises(al.MethodOptionError, match="3 entries for a tensor of rank 2"):
        run(in_axis_resources=(P(None, None, "model"), None))
    with pytest.raises(al.MethodOptionError, match="structure of the step's arguments"):
        run(in_axis_resources=(None, None, None))
    narrow = al.ManualShardingOption(("data", "model"), out_axis_resources=P(None, "model"))
    with pytest.raises(al.MethodOptionError, match=r"for \[\]: .* splits dimension 1 \(of 3\) 8 ways"):
        al.parallelize(lambda a: a[:, :3] * 2, method=al.ShardParallel(manual_sharding_option=narrow))(a)
    plan = al.parallelize(lambda a: a[:, :3] * 2, method=al.ShardParallel()).plan(a)  # a result pinned by hand
    with pytest.raises(al.PinError, match=r"result \[\] cannot be returned as 'RS1': it does not fit a tensor of shape \(8, 3\)"):
        plan.pin("output []", "RS1")
    with pytest.raises(al.PinError, match="the step has no result"):
        plan.pin("output [7]", "RR")
    with pytest.raises(al.MethodOptionError, match="one or two distinct strings"):
        al.ManualShardingOption(("x", "x"))
    with pytest.raises(al.MethodOptionError, match=r"submesh_axis_names\[1\]=.*one or two distinct strings"):
        al.ManualShardingOption(None, submesh_axis_names=(("data", "model"), "model"))
    with pytest.raises(al.MethodOptionError, match=r"mesh_axis_names=.*got None"):
        al.ManualShardingOption()
    stages_only = al.ManualShardingOption(None, (("data", "model"),), in_axis_resources=(P("data"), None))
    with pytest.raises(al.MethodOptionError, match="names only pipeline stages' axes"):
        al.parallelize(fn, method=al.ShardParallel(manual_sharding_option=stages_only))(a, a)
    with pytest.raises(al.MethodOptionError, match="enable_auto_sharding=False.*ManualShardingOption"):
        al.parallelize(fn, method=al.ShardParallel(auto_sharding_option=al.AutoShardingOption(False)))(a, a)


def _four_layer_step():
    """Alpa's tests/pipeline_parallel/test_manual_sharding.py: four dense layers, a boundary after the second, the
    step returning the new parameters (a tuple of arrays) alone."""
    def step(params, batch):
        x, tgt = batch

        def loss_fn(params):
            w0, b0, w1, b1, w2, b2, w3, b3 = params
            z = jax.nn.relu(jax.nn.relu(x @ w0 + b0) @ w1 + b1)
            al.mark_pipeline_boundary()
            v = jax.nn.softmax(jax.nn.relu(z @ w2 + b2) @ w3 + b3)
            return jnp.mean((v - tgt) ** 2)

        grads = al.grad(loss_fn)(params)
        return jax.tree_util.tree_map(lambda p, g: p - g, params, grads)

    hiddens = [6, 8, 10, 12, 14]
    key = jax.random.PRNGKey(0)
    params = tuple(jax.random.normal(jax.random.fold_in(key, i), shape) * 0.3 for i, shape in enumerate(
        s for k in range(4) for s in ((hiddens[k], hiddens[k + 1]), (hiddens[k + 1],))))
    batch = (jax.random.normal(jax.random.fold_in(key, 9), (64, 6)), jnp.ones((64, 14)) / 14)
    return step, params, batch


def test_a_pipelines_stages_hold_their_arguments_as_asked():
    """Alpa's test_manual_sharding (pipeline): ``submesh_axis_names`` names each stage's mesh axes and
    ``in_axis_resources`` the arguments' layouts in them; Alpa's test runs them with auto-sharding off
    (``AutoShardingOption(False)``), which here plans the rest around them. Oracles: the parameter shapes of each
    stage's compiled forward (Alpa's expected ones: stage 0's first weight split by columns over its "model" axis,
    stage 1's target split by rows over its "data" axis, each micro-batch 32 rows), and ``jax.jit`` of the step
    (rtol 1e-5)."""
    step_fn, params, batch = _four_layer_step()
    mp_start, mp_end, bias, dp = P(None, "model"), P("model", None), P("model"), P("data", None)
    resources = ((mp_start, bias, mp_end, None, None, None, None, None), (None, dp))
    option = al.ManualShardingOption(None, (("dummy", "model"), ("dummy", "data")), resources)
    method = al.PipeshardParallel(
        devices=jax.local_devices()[:4], num_micro_batches=2, layer_option="manual", manual_sharding_option=option,
        stage_option=al.ManualStageOption([[0], [1]], [(1, 2)] * 2, [(1, 2)] * 2, [{}] * 2),
        default_auto_sharding_option=al.AutoShardingOption(False))
    step = al.parallelize(step_fn, method=method)
    texts = step.get_executable(params, batch).get_hlo_text()
    assert sorted(parameter_shapes(texts[0])) == sorted(["f32[6,4]", "f32[4]", "f32[4,10]", "f32[10]", "f32[32,6]"])
    assert {"f32[10,12]", "f32[12]", "f32[12,14]", "f32[14]", "f32[16,14]"} <= set(parameter_shapes(texts[1]))
    pins = dict(step.current_plan.pins)
    assert pins["[0][0]"] == "RS1" and pins["[0][1]"] == "S1" and pins["[0][2]"] == "S1R" and pins["[1][1]"] == "S1R"
    new = step(params, batch)
    for a, b in zip(new, jax.jit(step_fn)(params, batch)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_bad_pipeline_manual_shardings_say_what_to_change():
    step_fn, params, batch = _four_layer_step()
    stages = al.ManualStageOption([[0], [1]], [(1, 2)] * 2, [(1, 2)] * 2, [{}] * 2)

    def run(option):
        method = al.PipeshardParallel(devices=jax.local_devices()[:4], num_micro_batches=2, layer_option="manual",
                                      stage_option=stages, manual_sharding_option=option)
        return al.parallelize(step_fn, method=method).plan(params, batch)

    with pytest.raises(al.MethodOptionError, match="names 3 stages' mesh axes but the pipeline has 2 stages"):
        run(al.ManualShardingOption(None, (("a", "b"),) * 3, ((P(None, "b"),) + (None,) * 7, None)))
    with pytest.raises(al.MethodOptionError, match="a pipeline's results are each stage's own"):
        run(al.ManualShardingOption(("a", "b"), in_axis_resources=None, out_axis_resources=None))
    with pytest.raises(al.MethodOptionError, match=r"for \[0\]\[0\] on stage 0: .* names mesh axis 'model'"):
        run(al.ManualShardingOption(("a", "b"), in_axis_resources=((P(None, "model"),) + (None,) * 7, None)))
    # one name for every stage's axes: the batch's target split over axis "b" where stage 1 reads it
    plan = run(al.ManualShardingOption(("a", "b"), in_axis_resources=((None,) * 8, (None, P("b")))))
    assert dict(plan.pins)["[1][1]"] == "S1R"


def test_lists_nnx_results_constants_and_states():
    """Resources in lists (not mistaken for the per-leaf bookkeeping), an NNX step's results (not the module state it
    hands back), a constant result (replicated, as pjit's None), and a new state returned in its argument's layout
    (pinning the result pins the argument, priced once)."""
    a = jnp.linspace(-1, 1, 8 * 16).reshape(8, 16)

    def f(xs, c):
        return jnp.sum(xs[0]["x"] + xs[0]["y"] + c, axis=0)

    option = al.ManualShardingOption(("data", "model"), in_axis_resources=([None], P(None, "model")))
    pins = dict(al.parallelize(f, method=al.ShardParallel(manual_sharding_option=option)).plan([{"x": a, "y": a}], a).pins)
    assert pins == {"[0][0]['x']": "RR", "[0][0]['y']": "RR", "[1]": "RS1"}

    from flax import nnx

    model = nnx.Linear(16, 4, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    def nnx_step(model, optimizer, x):  # written for nnx.jit: the objects change in place, the losses are returned
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        optimizer.update(model, grads)
        return loss, loss * 2

    option = al.ManualShardingOption(("data", "model"), out_axis_resources=(None, None))
    step = al.parallelize(nnx_step, method=al.ShardParallel(manual_sharding_option=option))
    loss, twice = step(model, optimizer, a)
    assert float(twice) == pytest.approx(2 * float(loss))
    assert sorted(k for k in dict(step.current_plan.pins) if k.startswith("output ")) == ["output [3][0]", "output [3][1]"]

    option = al.ManualShardingOption(("data", "model"), out_axis_resources=(None, None))
    const = al.parallelize(lambda x: (x * 2, 1.0), method=al.ShardParallel(manual_sharding_option=option))
    assert float(const(a)[1]) == 1.0

    def update(w, s):
        return jnp.tanh(w.T).T * s, jnp.sum(w)

    w = jnp.linspace(-1, 1, 16 * 16).reshape(16, 16)
    plans = {}
    for name, out in (("free", al.UNSPECIFIED), ("pinned", (P(None, "model"), None))):
        option = al.ManualShardingOption(("data", "model"), in_axis_resources=(P(None, "model"), None), out_axis_resources=out)
        step = al.parallelize(update, method=al.ShardParallel(manual_sharding_option=option), donate_argnums=())
        plans[name] = step.plan(w, jnp.float32(2.0))
    assert plans["pinned"].outputs[0].spec == "RS1" == plans["free"].outputs[0].spec
    assert plans["pinned"].objective == pytest.approx(plans["free"].objective, rel=1e-9)  # the same layout, paid once


def test_explain_and_conflicts_see_a_results_layout():
    a = jnp.ones((8, 16))
    option = al.ManualShardingOption(("data", "model"), in_axis_resources=(P(None, "model"), P(None, "model")),
                                     out_axis_resources=P("model"))
    step = al.parallelize(lambda a, b: a + b * 2, method=al.ShardParallel(manual_sharding_option=option))
    plan = step.plan(a, a)
    moved = next(r for r in plan.reshardings if r.consumer == "output []")
    chosen = next(alt for alt in plan.explain(moved.producer).alternatives if alt.chosen)
    assert chosen.resharding_cost >= moved.cost > 0  # what returning it in the pinned layout costs is on the op
    # with all-gather and all-to-all forbidden the result cannot be moved: the result's pin is the one named
    forbid = al.AutoShardingOption(allow_all_gather=False, allow_all_to_all=False)
    option = al.ManualShardingOption(("data", "model"), in_axis_resources=P(None, "model"), out_axis_resources=P("model"))
    with pytest.raises(al.PinError, match=r"output \[\]"):
        al.parallelize(lambda a: a * 2, method=al.ShardParallel(auto_sharding_option=forbid, manual_sharding_option=option))(a)


def test_bad_partition_specs_name_the_entry():
    a = jnp.ones((8, 12))

    def run(spec):
        option = al.ManualShardingOption(("data", "model"), in_axis_resources=spec)
        return al.parallelize(lambda a: a * 2, method=al.ShardParallel(manual_sharding_option=option))(a)

    with pytest.raises(al.MethodOptionError, match=r"splits dimension 1 \(of 12\) 8 ways"):
        run(P(None, "model"))
    with pytest.raises(al.MethodOptionError, match="over a mesh axis twice"):
        run(P("model", "model"))
    with pytest.raises(al.MethodOptionError, match="UNCONSTRAINED|for dimension 0"):
        run(P(P.UNCONSTRAINED, None))
    with pytest.raises(al.PinError, match="a pipeline's results cannot be pinned"):
        al.parallelize(lambda a: a * 2, microbatches=2).plan(a, pins={"output []": "RR"})
