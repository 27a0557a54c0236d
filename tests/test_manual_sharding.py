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
    moved = [r for r in pinned.reshardings if r.consumer == "output []"]
    assert len(moved) == 1 and (moved[0].src, moved[0].dst) == ("RS1", "S1R")
    mesh = pinned.problem.mesh
    cost = resharding(ShardingSpec.parse("RS1"), ShardingSpec.parse("S1R"), (8, 16), 4, mesh).cost
    assert cost > 0 and pinned.objective == pytest.approx(free.objective + cost, rel=1e-9)
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
    with pytest.raises(al.PinError, match=r"result \[\] cannot be returned as 'RS1': it does not fit a tensor of shape \(8, 3\)"):
        al.parallelize(lambda a: a[:, :3] * 2, method=al.ShardParallel(manual_sharding_option=narrow))(a)
    with pytest.raises(al.MethodOptionError, match="one or two distinct strings"):
        al.ManualShardingOption(("x", "x"))
    with pytest.raises(al.MethodOptionError, match="submesh_axis_names"):
        al.ManualShardingOption(("data", "model"), submesh_axis_names=(("data", "model"),))
    with pytest.raises(al.MethodOptionError, match="not supported"):
        al.parallelize(fn, method=al.PipeshardParallel(
            num_micro_batches=2, manual_sharding_option=al.ManualShardingOption(("data", "model"))))(a, a)
