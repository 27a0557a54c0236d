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
    p_create = al.parallelize(create_state, method=al.CreateStateParallel(p_train, BATCH))
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


def test_follow_parallel_of_a_step_taking_the_whole_state():
    """An evaluation taking (state, batch), as the train step does, follows the whole state."""
    p_train = al.parallelize(train_step, method=al.ShardParallel())
    state = p_train(create_state(), BATCH)

    def evaluate(state, batch):
        return eval_step(state.params, batch)

    p_eval = al.parallelize(evaluate, method=al.FollowParallel(p_train))
    assert float(p_eval(state, BATCH)) == pytest.approx(float(evaluate(state, BATCH)), rel=1e-5)
    assert p_eval.get_last_executable().get_input_placement_specs()[0] == p_train.get_last_executable().get_input_placement_specs()[0]


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
    p_train(create_state(), BATCH)
    with pytest.raises(al.MethodOptionError, match="do not have the structure of this step's arguments.*or \\(state, batch\\)"):
        al.parallelize(lambda p: jnp.sum(p["params"]["Dense_0"]["kernel"]), method=al.FollowParallel(p_train))(create_state().params)
    with pytest.raises(al.MethodOptionError, match="must be a function"):
        al.FollowParallel(p_train, get_input_placement_specs=3)
    with pytest.raises(al.MethodOptionError, match="train_step must be a parallelized step"):
        al.parallelize(create_state, method=al.CreateStateParallel(train_step, (BATCH,)))
    with pytest.raises(ValueError, match="drop cluster=, microbatches="):
        al.parallelize(create_state, method=al.CreateStateParallel(p_train, BATCH), cluster=al.ClusterSpec.local(1, 4), microbatches=2)
    with pytest.raises(ValueError, match="plans on the mesh of the step it follows: drop cluster="):
        al.parallelize(eval_step, method=al.FollowParallel(p_train), mesh_shape=(2, 4))
    with pytest.raises(ValueError, match="the state was never made"):
        al.parallelize(create_state, method=al.CreateStateParallel(p_train, BATCH)).get_last_executable()
    with pytest.raises(al.MethodOptionError, match="no planning options of its own"):
        al.CreateStateParallel(p_train, BATCH).options()


@pytest.mark.parametrize("method", ["shard", "pipeshard"])
def test_a_parallel_plan_saved_and_given_back_as_a_method_runs_as_the_original(tmp_path, method):
    """Alpa's ``executable.get_parallel_plan()`` and ``plan_to_method(plan)`` (its ``test_parallel_plan.py``): the
    plan as data, saved (JSON; pickle works too, as Alpa's test does it) and given to a new step, which runs it
    without planning. Oracles: the first step's objective, placements and results."""
    import pickle

    from alpa_lab.models import tiny_example

    ex = tiny_example("mlp")
    m = (al.ShardParallel() if method == "shard" else
         al.PipeshardParallel(num_micro_batches=2, layer_option=al.AutoLayerOption(layer_num=2), stage_option="uniform"))
    first = al.parallelize(ex.train_step, method=m)
    ex1 = first.get_executable(*ex.args)
    plan = ex1.get_parallel_plan()
    assert plan.problem is None and plan == first.current_plan  # data only
    plan.save(tmp_path / "plan.json")
    for given in (al.Plan.load(tmp_path / "plan.json"), pickle.loads(pickle.dumps(plan))):
        again = al.parallelize(ex.train_step, method=al.plan_to_method(given))
        ex2 = again.get_executable(*ex.args)
        assert again.current_plan == first.current_plan
        assert ex2.auto_sharding_objective == ex1.auto_sharding_objective
        assert ex2.get_input_placement_specs() == ex1.get_input_placement_specs()
        assert close(again(*ex.args), first(*ex.args), 0.0)


def test_plan_to_method_runs_the_plan_given_not_a_new_one():
    """An edited plan (one op pinned to a strategy the ILP did not choose) given back runs as edited: planning
    anew would choose the ILP's strategy again. Bad plans are refused by name."""
    from alpa_lab.models import tiny_example

    ex = tiny_example("mlp")
    first = al.parallelize(ex.train_step, method=al.ShardParallel())
    plan = first.plan(*ex.args)
    op = next(o for o in plan.ops if o.kind == "op" and o.num_strategies > 1)
    other = next(a.strategy for a in plan.explain(op.name).alternatives if not a.chosen)
    edited = al.Plan.from_json(plan.pin(op.name, other).to_json())
    again = al.parallelize(ex.train_step, method=al.plan_to_method(edited))
    again(*ex.args)
    assert {o.name: o.strategy for o in again.current_plan.ops}[op.name] == other != op.strategy
    with pytest.raises(al.MethodOptionError, match="plan_to_method takes a Plan or a PipelinePlan"):
        al.plan_to_method("plan.json")
    other_program = al.parallelize(eval_step, method=al.plan_to_method(edited))
    with pytest.raises(al.PlanFormatError, match="another program"):
        other_program(create_state().params, BATCH)


def test_create_state_takes_several_step_arguments_and_placement_specs_take_a_fresh_state():
    """A step of (state, batch, scale): ``CreateStateParallel.Args(batch, scale)``. A fresh ``TrainState``'s step
    counter is a Python int: its placement spec is an int32 scalar's, as the step traces it."""

    def step3(state, batch, scale):
        def loss(p):
            return scale * jnp.mean((state.apply_fn(p, batch["x"]) - batch["y"]) ** 2)

        return state.apply_gradients(grads=jax.grad(loss)(state.params))

    scale = jnp.float32(0.5)
    p_train = al.parallelize(step3, method=al.ShardParallel())
    specs = p_train.get_executable(create_state(), BATCH, scale).get_input_placement_specs()
    assert specs[0].step.aval == jax.ShapeDtypeStruct((), jnp.int32) and specs[2].aval.shape == ()
    state = al.parallelize(create_state, method=al.CreateStateParallel(p_train, al.CreateStateParallel.Args(BATCH, scale)))()
    assert close(p_train(state, BATCH, scale).params, jax.jit(step3)(create_state(), BATCH, scale).params)


def test_follow_parallel_takes_an_evaluation_batch_of_another_size_and_follows_a_new_plan():
    """Alpa's follow test evaluates twice the training batch: the parameters follow, the batch keeps the
    layout where it fits. After the train step's plan changes (an op pinned), the evaluation follows the new one."""
    p_train = al.parallelize(train_step, method=al.ShardParallel())
    p_eval = al.parallelize(eval_step, method=al.FollowParallel(p_train))
    state = p_train(create_state(), BATCH)
    big = jax.tree_util.tree_map(lambda x: jnp.concatenate([x, x[::-1]]), BATCH)
    assert float(p_eval(state.params, big)) == pytest.approx(float(eval_step(state.params, big)), rel=1e-5)
    followed = leaves(p_train.get_last_executable().get_input_placement_specs()[0].params)
    assert leaves(p_eval.get_last_executable().get_input_placement_specs()[0]) == followed
    plan = p_train.current_plan
    first_weight = next(o for o in plan.ops if o.kind == "input" and o.name.endswith("['kernel']") and o.num_strategies > 1)
    other = next(a.strategy for a in plan.explain(first_weight.name).alternatives if not a.chosen)
    p_train.use(plan.pin(first_weight.name, other))
    state = p_train(state, BATCH)
    assert float(p_eval(state.params, big)) == pytest.approx(float(eval_step(state.params, big)), rel=1e-5)
    now = leaves(p_eval.get_last_executable().get_input_placement_specs()[0])
    assert now == leaves(p_train.get_last_executable().get_input_placement_specs()[0].params) != followed
