"""Alpa's ``CreateStateParallel`` and ``FollowParallel`` (its tests' flow: ``tests/runtime/test_create_state.py``
and ``test_follow_parallel.py``), and the executables' placement specs they rest on.

Oracles: the unparallelized ``create_state()`` and ``jax.jit`` of the steps (numerics), and the train step's own
plan (``plan.shardings``: where each made leaf must be)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import alpa_lab as al


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64)(x))
        x = nn.relu(nn.Dense(64)(x))
        return nn.Dense(16)(x)


BATCH = {"x": jnp.asarray(np.random.default_rng(0).standard_normal((32, 16)), jnp.float32),
         "y": jnp.asarray(np.random.default_rng(1).standard_normal((32, 16)), jnp.float32)}
MODEL = MLP()


def create_state():
    params = MODEL.init(jax.random.PRNGKey(0), BATCH["x"])
    return train_state.TrainState.create(apply_fn=MODEL.apply, params=params, tx=optax.adam(1e-2))


def train_step(state, batch):
    def loss(p):
        return jnp.mean((state.apply_fn(p, batch["x"]) - batch["y"]) ** 2)

    return state.apply_gradients(grads=al.grad(loss)(state.params))


def eval_step(params, batch):
    return jnp.mean((MODEL.apply(params, batch["x"]) - batch["y"]) ** 2)


def leaves(tree):
    return jax.tree_util.tree_leaves(tree)


def close(a, b, tol=1e-5):
    return all(np.allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol) for x, y in zip(leaves(a), leaves(b)))


@pytest.mark.parametrize("method", ["shard", "pipeshard"])
def test_create_state_makes_the_state_where_the_train_step_reads_it(method):
    m = (al.ShardParallel() if method == "shard" else
         al.PipeshardParallel(num_micro_batches=2, layer_option=al.AutoLayerOption(layer_num=2)))
    p_train = al.parallelize(train_step, method=m)
    p_create = al.parallelize(create_state, method=al.CreateStateParallel(p_train, (BATCH,)))
    state = p_create()
    reference = create_state()
    assert type(state) is type(reference) and len(leaves(state)) == len(leaves(reference))  # (tx is a new object per call)
    assert close(state, reference, 0.0)  # the same values, made on the devices
    plan = p_train.current_plan  # planned for the state's shapes by the first call
    expected = leaves(plan.shardings(state, BATCH)[0][0])
    for x, sharding in zip(leaves(state), expected):
        assert x.sharding == sharding, (x.sharding, sharding)
    made = p_create.get_last_executable()
    placed = leaves(made.get_output_placement_specs())
    state2 = p_train(state, BATCH)
    assert leaves(p_train.get_last_executable().get_input_placement_specs()[0]) == placed
    assert close(state2.params, jax.jit(train_step)(reference, BATCH).params)
    meshes = {s.mesh_ids[0] for s in placed}
    texts = made.get_hlo_text()
    if method == "shard":
        assert meshes == {0} and isinstance(texts, str) and "ENTRY" in texts
    else:  # one program per mesh holding a part of the state, each making only the leaves that mesh's stage reads
        assert len(texts if isinstance(texts, list) else [texts]) == len(meshes)
        for x, spec in zip(leaves(state), placed):
            assert {d.id for d in x.sharding.device_set} == set(plan.stages[spec.mesh_ids[0]].device_ids)


def test_placement_specs_of_a_single_mesh_step():
    p_train = al.parallelize(train_step, method=al.ShardParallel())
    state = create_state()
    p_train(state, BATCH)
    ex = p_train.get_last_executable()
    ins, outs = ex.get_input_placement_specs(), ex.get_output_placement_specs()
    plan = p_train.current_plan
    assert [s.sharding_specs[0] for s in leaves(ins)] == [t.spec for t in plan.inputs]
    assert [s.sharding_specs[0] for s in leaves(outs)] == [t.spec for t in plan.outputs]
    assert all(s.mesh_ids == (0,) for s in leaves(ins) + leaves(outs))
    assert [tuple(s.aval.shape) for s in leaves(ins[1])] == [(32, 16), (32, 16)]
    assert isinstance(leaves(ins)[0], al.PlacementSpec)


def test_follow_parallel_plans_the_evaluation_where_the_train_step_keeps_the_params():
    p_train = al.parallelize(train_step, method=al.ShardParallel())
    p_eval = al.parallelize(eval_step, method=al.FollowParallel(p_train))
    state = reference = create_state()
    for _ in range(3):
        state, reference = p_train(state, BATCH), jax.jit(train_step)(reference, BATCH)
        assert float(p_eval(state.params, BATCH)) == pytest.approx(float(eval_step(reference.params, BATCH)), rel=1e-5)
    followed = leaves(p_train.get_last_executable().get_input_placement_specs()[0].params)
    assert leaves(p_eval.get_last_executable().get_input_placement_specs()[0]) == followed
    assert p_eval.current_plan.mesh_shape == p_train.current_plan.mesh_shape


def test_follow_parallel_with_given_placements_follows_them():
    """``get_input_placement_specs``: placements the user gives, here every parameter replicated; the batch (None)
    is planned freely."""
    p_train = al.parallelize(train_step, method=al.ShardParallel())
    state = create_state()
    p_train(state, BATCH)
    specs = p_train.get_last_executable().get_input_placement_specs()[0].params
    replicated = jax.tree_util.tree_map(
        lambda s: al.PlacementSpec(s.aval, (0,), ("R" * len(s.aval.shape),)), specs, is_leaf=lambda x: isinstance(x, al.PlacementSpec))
    p_eval = al.parallelize(eval_step, method=al.FollowParallel(p_train, get_input_placement_specs=lambda: (replicated, None)))
    assert float(p_eval(state.params, BATCH)) == pytest.approx(float(eval_step(state.params, BATCH)), rel=1e-5)
    got = leaves(p_eval.get_last_executable().get_input_placement_specs()[0])
    assert all(set(s.sharding_specs[0]) == {"R"} for s in got)


def test_bad_uses_are_refused_by_name():
    p_train = al.parallelize(train_step, method=al.ShardParallel())
    with pytest.raises(al.MethodOptionError, match="never run or planned"):
        al.parallelize(eval_step, method=al.FollowParallel(p_train))(create_state().params, BATCH)
    piped = al.parallelize(train_step, method=al.PipeshardParallel(num_micro_batches=2, layer_option=al.AutoLayerOption(layer_num=2)))
    piped(create_state(), BATCH)
    with pytest.raises(al.MethodOptionError, match="follows a single-mesh plan.*pipelined"):
        al.parallelize(eval_step, method=al.FollowParallel(piped))(create_state().params, BATCH)
    p_train(create_state(), BATCH)
    with pytest.raises(al.MethodOptionError, match="do not have this step's arguments' structure"):
        al.parallelize(lambda p: jnp.sum(p["params"]["Dense_0"]["kernel"]), method=al.FollowParallel(p_train))(create_state().params)
    with pytest.raises(al.MethodOptionError, match="must be a function"):
        al.FollowParallel(p_train, get_input_placement_specs=3)
    with pytest.raises(al.MethodOptionError, match="train_step must be a parallelized step"):
        al.parallelize(create_state, method=al.CreateStateParallel(train_step, (BATCH,)))
    with pytest.raises(al.MethodOptionError, match="other_args is the sequence"):
        al.parallelize(create_state, method=al.CreateStateParallel(p_train, BATCH))
    with pytest.raises(ValueError, match="drop cluster="):
        al.parallelize(create_state, method=al.CreateStateParallel(p_train, (BATCH,)), cluster=al.ClusterSpec.local(1, 4))
    with pytest.raises(ValueError, match="the state was never made"):
        al.parallelize(create_state, method=al.CreateStateParallel(p_train, (BATCH,))).get_last_executable()
    with pytest.raises(al.MethodOptionError, match="no planning options of its own"):
        al.CreateStateParallel(p_train, (BATCH,)).options()
